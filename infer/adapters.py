"""Identify models and adapters, and refuse an adapter the engine cannot serve or that belongs to another base."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from mlbench_kit.engine import adapter_config
from mlbench_kit.errors import MLBenchError
from mlbench_kit.hf import TRAIN_META, fingerprint


def model_identity(model: str) -> dict[str, Any]:
    """Path (or hub id) plus a digest of its config, so a report can tell two checkpoints apart."""
    p = Path(model)
    if not (p / "config.json").is_file():
        return {"name": model, "local": False}
    cfg = (p / "config.json").read_bytes()
    weights = sorted((f.name, f.stat().st_size) for f in p.iterdir() if f.suffix in (".safetensors", ".bin"))
    digest = hashlib.sha256(cfg + json.dumps(weights).encode()).hexdigest()[:16]
    return {"name": str(p.resolve()), "local": True, "sha": digest, "fingerprint": fingerprint(json.loads(cfg))}


def adapter_identity(adapter: str | Path) -> dict[str, Any]:
    p = Path(adapter)
    cfg = adapter_config(p)
    weights = p / "adapter_model.safetensors"
    sha = hashlib.sha256(weights.read_bytes()).hexdigest()[:16] if weights.is_file() else None
    return {"name": str(p.resolve()), "sha": sha, "r": cfg.get("r"), "base": cfg.get("base_model_name_or_path")}


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
