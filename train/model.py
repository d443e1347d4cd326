"""Load the base model (optionally 4-bit for QLoRA) and wrap it with a PEFT LoRA adapter."""

from __future__ import annotations

from typing import Any

import torch

from mlbench_kit.errors import MLBenchError


def compute_dtype() -> torch.dtype:
    """bf16 on GPU, fp32 on CPU."""
    return torch.bfloat16 if torch.cuda.is_available() else torch.float32


def load_base(cfg: dict[str, Any], device_map: Any = None) -> Any:
    from transformers import AutoModelForCausalLM
    kwargs: dict[str, Any] = {"dtype": compute_dtype(), "attn_implementation": cfg["attn_implementation"]}
    if cfg["quantization"] == "nf4":
        from transformers import BitsAndBytesConfig
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=compute_dtype(), bnb_4bit_quant_storage=compute_dtype())
        kwargs["device_map"] = device_map or ({"": torch.cuda.current_device()} if torch.cuda.is_available()
                                              else {"": "cpu"})
    try:
        return AutoModelForCausalLM.from_pretrained(cfg["model"], **kwargs)
    except OSError as exc:
        raise MLBenchError(f"could not load the model ({str(exc).splitlines()[0][:160]})", cfg["model"],
                           "pass a local model folder, or run with network access to the hub") from None


def add_lora(model: Any, cfg: dict[str, Any]) -> Any:
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    lc = cfg["lora"]
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [m for m in lc["target_modules"] if m not in present]
    if missing:
        raise MLBenchError(f"LoRA target modules {missing} are not in this model", "lora.target_modules",
                           f"modules it has include: {sorted(m for m in present if m.endswith('proj'))[:12]}")
    if cfg["quantization"]:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=cfg["gradient_checkpointing"])
    elif cfg["gradient_checkpointing"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    model.config.use_cache = False
    peft_cfg = LoraConfig(r=lc["r"], lora_alpha=lc["alpha"], lora_dropout=lc["dropout"],
                          target_modules=list(lc["target_modules"]), task_type="CAUSAL_LM")
    return get_peft_model(model, peft_cfg)
