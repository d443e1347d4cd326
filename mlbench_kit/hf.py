"""Model-side contracts every stage shares: the model's facts (where it loads from, its tokenizer, its context
length), the compute dtype, the one rule that keeps prep's token counts, training's inputs and inference's prompts
token-identical, and the adapter fingerprint.

Every stage reads a model's context length with :func:`model_positions` and loads its tokenizer with
:func:`load_tokenizer`; nothing else reads ``max_position_embeddings`` or calls ``AutoTokenizer``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from .errors import MLBenchError
from .io import read_json

TRAIN_META = "mlbench_train.json"  # written by train/ beside the adapter: the base model's fingerprint
_FINGERPRINT = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "intermediate_size")


def _hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the hub's host answers a TCP connection (offline, transformers retries for about a minute)."""
    import socket
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return False
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    try:
        with socket.create_connection((url.hostname or "", url.port or 443), timeout=timeout):
            return True
    except OSError:
        return False


def check_model_available(name: str, flag: str = "--model") -> str:
    """Where ``name`` will load from: ``local`` (a folder), ``cache`` (the hub cache) or ``hub``. A model that is
    in neither place while the hub cannot be reached is one clear error at once, instead of a minute of retries
    and a stack trace."""
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file() and not (path / "tokenizer_config.json").is_file():
            raise MLBenchError("this folder holds no model (no config.json or tokenizer_config.json)", name,
                               f"pass {flag} a folder saved with save_pretrained, or a hub id")
        return "local"
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise MLBenchError("no such model folder", name, f"pass {flag} an existing folder, or a hub id (org/name)")
    from huggingface_hub import try_to_load_from_cache
    try:
        if isinstance(try_to_load_from_cache(name, "config.json"), str):
            return "cache"
    except Exception:  # not a valid repo id: the hub check below says so
        pass
    if not _hub_reachable():
        raise MLBenchError("this model is not in the hub cache, and the hub cannot be reached (offline)", name,
                           f"download it where there is network (`hf download {name} --local-dir DIR`) and pass "
                           f"{flag} DIR")
    return "hub"


def load_tokenizer(name_or_path: str, flag: str = "--tokenizer", fast: bool = True) -> Any:
    """The tokenizer of a local folder or a hub id, with a clear error when it cannot be loaded. ``fast``: refuse
    a slow (Python) tokenizer; prep and training need a fast one (offsets cut the context), inference does not."""
    from transformers import AutoTokenizer
    try:
        tok = AutoTokenizer.from_pretrained(str(name_or_path))
    except Exception as exc:  # transformers raises many types for a missing or unreachable model
        raise MLBenchError(f"could not load the tokenizer ({exc.__class__.__name__}: "
                           f"{(str(exc).splitlines() or [''])[0][:160]})", str(name_or_path),
                           f"pass {flag} a local tokenizer or model folder, or run with network access to the hub"
                           ) from None
    if fast and not getattr(tok, "is_fast", False):
        raise MLBenchError("a fast tokenizer is needed (offsets are used to cut the context)", str(name_or_path))
    return tok


# The config keys a model's context length goes by, in the order they are read: ``max_position_embeddings``
# (Llama, Mistral, Qwen, ...), then the older names some architectures use instead (GPT-2's ``n_positions``, ...).
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length")


def model_positions(model: Any, local_only: bool = False) -> int | None:
    """The model's context length in tokens (its positions), or None where that is unknown.

    ``model`` is a loaded config (a ``PretrainedConfig`` or its dict), a model folder or a hub id. A folder
    without ``config.json`` (a tokenizer alone), an API model's name, or a hub id that cannot be reached gives
    None; with ``local_only`` nothing is fetched (a hub id not in the cache gives None). The one place every stage
    reads it: prep caps ``max_context_tokens`` with it and cuts prompts to positions - ``max_new_tokens``, training
    caps ``max_context_tokens``, inference caps vLLM's ``max_model_len``, and ``sweep plan`` checks prep's room for
    new tokens against it."""
    if isinstance(model, (str, Path)):
        path = Path(model).expanduser()
        if path.is_dir() and not (path / "config.json").is_file():
            return None  # a tokenizer-only folder: no model config to read
        config_file = path / "config.json" if path.is_dir() else _cached_config(str(model))
        if config_file is None and local_only:
            return None  # a hub id that is not in the cache
        if config_file is not None:
            # config.json is read as data first: importing transformers costs seconds (`sweep plan`'s start)
            try:
                known = _positions(read_json(config_file))
            except MLBenchError:
                known = None
            if known is not None:
                return known
        from transformers import AutoConfig
        try:
            model = AutoConfig.from_pretrained(str(model), local_files_only=local_only)
        except Exception:  # an API model name, no network, not in the cache: unknown here
            return None
    return _positions(model)


def _positions(config: Any) -> int | None:
    """The first of :data:`POSITION_KEYS` that ``config`` (a dict or a config object) sets to a positive int."""
    for key in POSITION_KEYS:
        value = config.get(key) if isinstance(config, dict) else getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _cached_config(name: str) -> Path | None:
    """``config.json`` of hub id ``name`` in the local hub cache, or None (not cached, or not a hub id)."""
    from huggingface_hub import try_to_load_from_cache
    try:
        found = try_to_load_from_cache(name, "config.json")
    except Exception:  # not a valid repo id (an API model's name, a missing path)
        return None
    if not isinstance(found, str):
        return None
    # the cache's snapshot file links to its blob in the same repository folder (models--ORG--NAME/blobs/): read
    # that, and nothing a link points to outside the folder
    repo_dir = Path(found).parents[2].resolve()
    target = Path(found).resolve()
    return target if target.is_relative_to(repo_dir) else None


def compute_dtype() -> Any:
    """bf16 on GPU, fp32 on CPU."""
    import torch
    return torch.bfloat16 if torch.cuda.is_available() else torch.float32


def load_causal_lm(model: str, adapters: dict[str, str] | None = None) -> tuple[Any, str]:
    """``(model, device)`` for transformers generation: the base model in :func:`compute_dtype`, with each PEFT
    adapter of ``adapters`` (name -> folder) loaded under its name, on CUDA where there is one, in eval mode.
    One loader for infer's and the agent's ``hf`` engines."""
    import torch
    from transformers import AutoModelForCausalLM

    # a transformers model, or the PeftModel wrapping it: Any, as the two libraries type them apart
    lm: Any = AutoModelForCausalLM.from_pretrained(model, dtype=compute_dtype())
    if adapters:
        from peft import PeftModel
        (first, path), *rest = adapters.items()
        lm = PeftModel.from_pretrained(lm, path, adapter_name=first)
        for name, folder in rest:
            lm.load_adapter(folder, adapter_name=name)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    lm.to(device).eval()
    return lm, device


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
