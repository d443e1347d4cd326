"""mlbench_kit.infer — placeholder package; the stage lands with its issue."""
