"""mlbench_kit.learn: learning from execution verdicts: verdicts -> SFT records and preference pairs (data), the
execution reward (reward), rejection-sampling fine-tuning (rft), DPO and GRPO through TRL (trl_recipes)."""
