"""mlbench_kit.eval"""
