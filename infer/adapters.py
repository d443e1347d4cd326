"""Identify models and adapters, and refuse an adapter the engine cannot serve or that belongs to another base."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from mlbench_kit.errors import MLBenchError
from mlbench_kit.hf import TRAIN_META, fingerprint

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def model_identity(model: str) -> dict[str, Any]:
    """Path (or hub id) plus a digest of its config, so a report can tell two checkpoints apart."""
    p = Path(model)
    if not (p / "config.json").is_file():
        return {"name": model, "local": False}
    cfg = (p / "config.json").read_bytes()
    weights = sorted((f.name, f.stat().st_size) for f in p.iterdir() if f.suffix in (".safetensors", ".bin"))
    digest = hashlib.sha256(cfg + json.dumps(weights).encode()).hexdigest()[:16]
    return {"name": str(p.resolve()), "local": True, "sha": digest, "fingerprint": fingerprint(json.loads(cfg))}


def adapter_config(adapter: str | Path) -> dict[str, Any]:
    cfg = Path(adapter) / "adapter_config.json"
    if not cfg.is_file():
        raise MLBenchError("not a PEFT adapter folder (no adapter_config.json)", str(adapter),
                           "pass the adapter folder written by train/ (its `adapter/` subfolder)")
    return json.loads(cfg.read_text())


def adapter_identity(adapter: str | Path) -> dict[str, Any]:
    p = Path(adapter)
    cfg = adapter_config(p)
    weights = p / "adapter_model.safetensors"
    sha = hashlib.sha256(weights.read_bytes()).hexdigest()[:16] if weights.is_file() else None
    return {"name": str(p.resolve()), "sha": sha, "r": cfg.get("r"), "base": cfg.get("base_model_name_or_path")}


def engine_lora_rank(adapter_r: int, max_lora_rank: int | None, where: str) -> int:
    """The rank the engine is built for: the configured one (checked), else the adapter's rounded up."""
    if max_lora_rank is not None:
        if adapter_r > max_lora_rank:
            raise MLBenchError(f"adapter rank {adapter_r} is above the engine's max_lora_rank {max_lora_rank}", where,
                               f"raise max_lora_rank to at least {adapter_r} (--max-lora-rank), or leave it unset")
        return max_lora_rank
    return next((r for r in VLLM_LORA_RANKS if r >= adapter_r), adapter_r)


def check_base(model: str, adapter: str | Path, allow_mismatch: bool = False) -> None:
    """An adapter trained on another base model produces garbage without an error; stop before that."""
    if allow_mismatch:
        return
    where = str(Path(adapter) / "adapter_config.json")
    meta_file = Path(adapter) / TRAIN_META
    ident = model_identity(model)
    if meta_file.is_file() and ident.get("fingerprint"):
        trained_on = json.loads(meta_file.read_text()).get("base_fingerprint")
        if trained_on and trained_on != ident["fingerprint"]:
            diff = {k: (trained_on.get(k), v) for k, v in ident["fingerprint"].items() if trained_on.get(k) != v}
            raise MLBenchError(f"adapter was trained on another base model (trained vs given: {diff})", where,
                               "pass the base model the adapter was trained on, or --allow-base-mismatch")
        return
    base = adapter_config(adapter).get("base_model_name_or_path")
    if base and Path(base).name.lower() != Path(model).name.lower():
        raise MLBenchError(f"adapter was trained on {base!r}, not {model!r}", where,
                           "pass that base model, or --allow-base-mismatch if it is the same model under another name")
