"""Load the base model (optionally 4-bit for QLoRA) and wrap it with a PEFT LoRA adapter; pick the precision and
the attention kernel that this machine can run."""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from mlbench_kit.errors import MLBenchError

from .config import TrainConfig


def resolve_precision(requested: str) -> str:
    """``bf16``, ``fp16`` or ``fp32``: auto is bf16 on GPUs that support it, fp16 (with loss scaling) on older
    GPUs, fp32 on CPU. Asking for bf16 on a GPU without it is an error, not a silent slowdown."""
    cuda = torch.cuda.is_available()
    if requested == "auto":
        if not cuda:
            return "fp32"
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    if requested == "bf16" and cuda and not torch.cuda.is_bf16_supported():
        raise MLBenchError(f"this GPU ({torch.cuda.get_device_name()}) has no bf16", "precision",
                           "use precision: fp16 (loss scaling) or auto")
    if requested in ("bf16", "fp16") and not cuda:
        return "fp32"
    return requested


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def resolve_attention(requested: str) -> str:
    """auto: FlashAttention-2 when it is installed and a GPU runs it (packed samples then run varlen, with no
    [L, L] mask), else PyTorch's sdpa."""
    if requested != "auto":
        if requested == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
            raise MLBenchError("attn_implementation is flash_attention_2 but flash-attn is not installed",
                               "attn_implementation", "pip install 'mlbench-kit[flash]', or use auto / sdpa")
        return requested
    if torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


def max_positions(config: Any) -> int | None:
    """The model's context length (``max_position_embeddings``), if its config says."""
    return getattr(config, "max_position_embeddings", None)


def load_base(cfg: TrainConfig, precision: str, attention: str, device_map: Any = None) -> Any:
    """The frozen base model: full precision weights in ``precision``, or NF4 with that compute dtype (QLoRA)."""
    from transformers import AutoModelForCausalLM
    dtype = DTYPES[precision]
    kwargs: dict[str, Any] = {"dtype": dtype, "attn_implementation": attention}
    if cfg.quantization == "nf4":
        from transformers import BitsAndBytesConfig
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype, bnb_4bit_quant_storage=dtype)
        kwargs["device_map"] = device_map or ({"": torch.cuda.current_device()} if torch.cuda.is_available()
                                              else {"": "cpu"})
    try:
        return AutoModelForCausalLM.from_pretrained(cfg.model, **kwargs)
    except OSError as exc:
        raise MLBenchError(f"could not load the model ({str(exc).splitlines()[0][:160]})", str(cfg.model),
                           "pass a local model folder, or run with network access to the hub") from None


def add_lora(model: Any, cfg: TrainConfig) -> Any:
    """LoRA on ``cfg.lora.target_modules``; gradient checkpointing is non-reentrant in every case (QLoRA too:
    PEFT's k-bit preparation otherwise falls back to reentrant checkpointing)."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    lc = cfg.lora
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [m for m in lc.target_modules if m not in present]
    if missing:
        raise MLBenchError(f"LoRA target modules {missing} are not in this model", "lora.target_modules",
                           f"modules it has include: {sorted(m for m in present if m.endswith('proj'))[:12]}")
    no_reentrant = {"use_reentrant": False}
    if cfg.quantization:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=cfg.gradient_checkpointing,
                                                gradient_checkpointing_kwargs=no_reentrant)
    elif cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=no_reentrant)
        model.enable_input_require_grads()
    model.config.use_cache = False
    peft_cfg = LoraConfig(r=lc.r, lora_alpha=lc.alpha, lora_dropout=lc.dropout, target_modules=list(lc.target_modules),
                          task_type="CAUSAL_LM")
    return get_peft_model(model, peft_cfg)
