"""mlbench_kit.train — placeholder package; the stage lands with its issue."""
