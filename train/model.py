"""Load the base model (optionally 4-bit for QLoRA) and wrap it with a PEFT LoRA adapter; pick the precision and
the attention kernel that this machine can run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mlbench_kit.errors import MLBenchError
from mlbench_kit.train_config import TrainConfig

from .loss import LinearLoss


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


FA2_MIN_CAPABILITY = (8, 0)  # FlashAttention-2 runs on Ampere (sm80) and newer
FA3_CAPABILITY_MAJOR = 9  # FlashAttention-3 (flash_attn_interface, the "hopper" build) runs on sm90 only


def choose_attention(requested: str, capability: tuple[int, int] | None, installed: frozenset[str]) -> str:
    """The attention implementation to load, from plain facts (a pure function):

    ``capability``: the CUDA device's compute capability, None without a GPU; ``installed``: the flash kernels
    transformers can load (``flash_attention_2``, ``flash_attention_3``). auto picks FA3 on Hopper when it is
    installed, else FA2 on Ampere or newer when installed (packed rows then run varlen, with no [L, L] mask),
    else flex_attention on Ampere or newer (packed rows as a BlockMask: 1.31x SDPA's dense mask alone, 1.86x with
    ``compile``, for CodeLlama-7b LoRA at 8k on an H100, bench/results/2026-11-25-gpu-levers-h100.md), else sdpa
    (CPU, where flex has no backward). An explicit request that this machine cannot run is an error, not a
    silent fallback."""
    ampere = capability is not None and capability >= FA2_MIN_CAPABILITY
    fa2 = ampere and "flash_attention_2" in installed
    fa3 = capability is not None and capability[0] == FA3_CAPABILITY_MAJOR and "flash_attention_3" in installed
    if requested == "auto":
        return ("flash_attention_3" if fa3 else "flash_attention_2" if fa2 else "flex_attention" if ampere
                else "sdpa")
    where = f"compute capability {capability[0]}.{capability[1]}" if capability else "no CUDA GPU"
    if requested == "flash_attention_2" and not fa2:
        why = "flash-attn is not installed" if "flash_attention_2" not in installed else f"this machine has {where}"
        raise MLBenchError(f"attn_implementation is flash_attention_2, which needs a CUDA GPU of compute capability "
                           f"8.0+ (Ampere or newer) and flash-attn: {why}", "attn_implementation",
                           "pip install 'mlbench-kit[flash]' on such a GPU, or use auto / sdpa")
    if requested == "flex_attention" and capability is None:
        raise MLBenchError("attn_implementation is flex_attention, which has no backward pass on CPU (torch "
                           f"{torch.__version__.split('+')[0]}): training would fail at its first step",
                           "attn_implementation", "use auto / sdpa on CPU; flex_attention on a CUDA GPU")
    if requested == "flash_attention_3" and not fa3:
        why = ("flash-attn-3 (flash_attn_interface) is not installed" if "flash_attention_3" not in installed
               else f"this machine has {where}")
        raise MLBenchError(f"attn_implementation is flash_attention_3, which runs on Hopper (compute capability "
                           f"9.x) with flash-attn-3 installed: {why}", "attn_implementation",
                           "use auto (FA2 or sdpa elsewhere), flash_attention_2 or sdpa")
    return requested


def resolve_attention(requested: str) -> str:
    """:func:`choose_attention` for this machine. Installed kernels are what transformers itself would load
    (``transformers.utils.import_utils.is_flash_attn_{2,3}_available`` of 5.19: the flash-attn / flash-attn-3
    distributions, and a CUDA build of torch)."""
    from transformers.utils import import_utils as iu
    capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    installed = frozenset(name for name, ok in (("flash_attention_2", iu.is_flash_attn_2_available()),
                                                ("flash_attention_3", iu.is_flash_attn_3_available())) if ok)
    return choose_attention(requested, capability, installed)


def nf4_config(dtype: torch.dtype) -> Any:
    """QLoRA's quantization: NF4 with double quantization, computing (and stored) in ``dtype``."""
    from transformers import BitsAndBytesConfig
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=dtype, bnb_4bit_quant_storage=dtype)


def load_base(cfg: TrainConfig, precision: str, attention: str, device_map: Any = None) -> Any:
    """The frozen base model: full precision weights in ``precision``, or NF4 with that compute dtype (QLoRA)."""
    from transformers import AutoModelForCausalLM
    dtype = DTYPES[precision]
    kwargs: dict[str, Any] = {"dtype": dtype, "attn_implementation": attention}
    if cfg.quantization == "nf4":
        kwargs["quantization_config"] = nf4_config(dtype)
        kwargs["device_map"] = device_map or ({"": torch.cuda.current_device()} if torch.cuda.is_available()
                                              else {"": "cpu"})
    assert cfg.model is not None  # TrainConfig.check refuses a config without one
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
    if cfg.liger_kernels:
        apply_liger(model)
    no_reentrant = {"use_reentrant": False}
    if cfg.quantization:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=cfg.gradient_checkpointing,
                                                gradient_checkpointing_kwargs=no_reentrant)
    if cfg.gradient_checkpointing:  # again after PEFT's k-bit preparation, which knows no every_n_layers
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=no_reentrant,
                                            every_n_layers=cfg.gradient_checkpointing_every_n_layers)
        model.enable_input_require_grads()
    model.config.use_cache = False
    peft_cfg = LoraConfig(r=lc.r, lora_alpha=lc.alpha, lora_dropout=lc.dropout, target_modules=list(lc.target_modules),
                          task_type="CAUSAL_LM")
    return get_peft_model(model, peft_cfg)


LIGER_PIN = "liger-kernel==0.8.5"  # the version measured (bench/results/2026-11-25-gpu-levers-h100.md)


def apply_liger(model: Any) -> None:
    """Liger-Kernel's Triton RMSNorm, SwiGLU MLP and RoPE on a loaded base model, before LoRA wraps it (its
    instance patch rebinds the modules' forwards, so the LoRA layers inside the MLP still run). Its loss kernels
    stay off: the recipe's own chunked or fused linear loss computes the loss. Triton's kernels need CUDA."""
    if next(model.parameters()).device.type != "cuda" and not torch.cuda.is_available():
        raise MLBenchError("liger_kernels: true needs a CUDA GPU (Liger's kernels are Triton kernels)",
                           "liger_kernels", "set liger_kernels: false on CPU")
    try:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError as exc:
        raise MLBenchError(f"liger_kernels: true, but liger-kernel is not importable ({exc})", "liger_kernels",
                           f"pip install '{LIGER_PIN}' (or set liger_kernels: false)") from None
    kind = getattr(model.config, "model_type", None)
    if kind not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        raise MLBenchError(f"Liger-Kernel has no kernels for model type {kind!r}", "liger_kernels",
                           "set liger_kernels: false for this model")
    _apply_liger_kernel_to_instance(model=model, rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=False)


def decoder_layers(model: Any) -> list[Any]:
    """The model's repeated decoder layers (transformers' ``GradientCheckpointingLayer``s), in order."""
    from transformers.modeling_layers import GradientCheckpointingLayer
    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def checkpointed_layers(model: Any) -> int:
    """How many decoder layers rerun their forward in the backward pass (activation checkpointing is on)."""
    return sum(bool(layer.gradient_checkpointing) for layer in decoder_layers(model))


def compile_layers(model: Any) -> int:
    """``torch.compile`` each decoder layer in place (``nn.Module.compile``), before any wrapping for DDP, FSDP2
    or DeepSpeed, as torchtune does: the layers share one compiled graph, the rest of the model stays eager.
    Returns the number of layers compiled."""
    layers = decoder_layers(model)
    if not layers:
        raise MLBenchError("compile: this model has no transformers decoder layers to compile", "compile",
                           "set compile: false")
    for layer in layers:
        layer.compile()
    return len(layers)


@dataclass(frozen=True)
class Levers:
    """The speed levers as applied to a model, not only as configured (``apply_levers``)."""

    checkpointed_layers: int
    decoder_layers: int
    compiled_layers: int
    linear_loss: LinearLoss | None

    def record(self) -> dict[str, Any]:
        """What ``metrics.jsonl``'s start record and the bench's results say of them."""
        return {"checkpointed_layers": self.checkpointed_layers, "decoder_layers": self.decoder_layers,
                "compiled_layers": self.compiled_layers,
                "loss_impl": "fused_linear" if self.linear_loss else "logits"}


def apply_levers(model: Any, cfg: TrainConfig) -> Levers:
    """The config's speed levers on a model that :func:`add_lora` made (which already set its checkpointing):
    the fused linear loss and per-layer compile, before any wrapping for DDP, FSDP2 or DeepSpeed."""
    linear_loss = LinearLoss(model, cfg.loss_chunk_tokens) if cfg.fused_linear_loss else None
    return Levers(checkpointed_layers(model), len(decoder_layers(model)),
                  compile_layers(model) if cfg.compile else 0, linear_loss)
