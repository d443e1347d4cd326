"""mlbench_kit.train: the LoRA/QLoRA recipe (``train/lora.py``) and its parts: config, data (tokenize, pack,
batch), model (base, LoRA, precision, attention), checkpoint (state, preemption), distributed (CPU paths)."""
