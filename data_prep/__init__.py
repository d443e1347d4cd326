"""mlbench_kit.data_prep — load ML-Bench, attach README context, render tasks 1–3 into prompts."""
