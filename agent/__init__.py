"""The agent stage: ML-Agent (the benchmark's baseline agent) on open models; answers are ordinary generations."""
