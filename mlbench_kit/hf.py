"""Model-side contracts every stage shares: loading a tokenizer, the compute dtype, the one rule that keeps
prep's token counts, training's inputs and inference's prompts token-identical, and the adapter fingerprint."""

from __future__ import annotations

from typing import Any

from .errors import MLBenchError

TRAIN_META = "mlbench_train.json"  # written by train/ beside the adapter: the base model's fingerprint
_FINGERPRINT = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "intermediate_size")


def load_tokenizer(name_or_path: str) -> Any:
    """A fast tokenizer from a local folder or a hub id, with a clear error offline."""
    from transformers import AutoTokenizer
    try:
        tok = AutoTokenizer.from_pretrained(name_or_path)
    except Exception as exc:  # transformers raises many types for a missing or unreachable model
        raise MLBenchError(f"could not load tokenizer ({exc.__class__.__name__}: {str(exc).splitlines()[0][:160]})",
                           name_or_path, "pass a local tokenizer folder, or run with network access to the hub")
    if not getattr(tok, "is_fast", False):
        raise MLBenchError("a fast tokenizer is needed (offsets are used to cut the context)", name_or_path)
    return tok


def compute_dtype() -> Any:
    """bf16 on GPU, fp32 on CPU."""
    import torch
    return torch.bfloat16 if torch.cuda.is_available() else torch.float32


def adds_bos(template: str) -> bool:
    """Whether the tokenizer adds its specials (BOS) to a prompt: always, except for a prompt rendered by a chat
    template, which carries them as text already."""
    return template != "chat"


def prompt_ids(tokenizer: Any, prompt: str, template: str) -> list[int]:
    """The prompt's token ids exactly as training and inference use them."""
    return tokenizer(prompt, add_special_tokens=adds_bos(template))["input_ids"]


def fingerprint(config: dict[str, Any]) -> dict[str, Any]:
    """The shape-defining fields of a model config: two models with equal fingerprints take the same adapters."""
    return {k: config.get(k) for k in _FINGERPRINT}
