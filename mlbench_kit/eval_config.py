"""The eval stage's options as one typed config: ``mlbench eval`` flags, an optional ``--config`` YAML file, gold
validation and sweeps all build an :class:`EvalConfig`, which ``mlbench_kit.eval.run.score`` runs.

    cfg = load_eval_config("configs/eval/run/strict.yaml", {"data": ("rows.jsonl", "--data"), ...})

Every key of the file is a flag's name with ``_`` for ``-`` (``--mem-mb`` is ``mem_mb:``); a flag given on the
command line wins over the file, the file over the defaults below.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar, Literal

from .config import Check, load
from .errors import MLBenchError

# The sandbox backends (mlbench_kit/sandbox's engines register exactly these)
BACKENDS = ("bwrap", "podman", "docker", "apptainer", "local")
MODES = ("compat", "strict")
# the one-line example of a missing-options error (the flags `mlbench eval` cannot run without)
USAGE = ("e.g. mlbench eval --data ../shared/mlbench/full.jsonl --generations runs/infer/base/task1.jsonl "
         "--envs ~/.cache/mlbench/envs.yaml --out runs/eval-base (mlbench eval --help lists every option)")


@dataclass
class EvalConfig:
    """What one eval run scores, how, and under which limits."""

    # option name -> key (mlbench_kit.stages): every key is its own option
    FLAGS: ClassVar[dict[str, str]] = {}
    FLAG_SPELLING: ClassVar[dict[str, str]] = {"ci": "--no-ci"}

    data: str | None = None  # ML-Bench rows the generations answer (file, folder or hub id)
    split: str = "full"
    generations: str | None = None  # generations JSONL ({github_id, id, output: [n strings]} per line)
    gold: bool = False  # score the dataset's own `output` column instead
    out: str | None = None  # run folder (results.jsonl, summary.json, report.md)
    mode: Literal["compat", "strict"] = "compat"
    backend: Literal["bwrap", "podman", "docker", "apptainer", "local"] = "bwrap"
    unsafe_local: bool = False  # consent to the local backend (no isolation)
    envs: str | None = None  # environments file (configs/eval/*.yaml)
    repos_dir: str | None = None  # folder holding one checkout per repository
    parser: Literal["compat", "fenced"] = "compat"
    n: int | None = None  # outputs per sample (None: the most common count)
    k: list[int] = field(default_factory=lambda: [1, 2, 5])
    workers: int = 2
    timeout: float | None = None  # time limit per execution (None: the benchmark's)
    # what the time limit is measured on: "cpu", the execution's CPU seconds (load on the machine cannot move it;
    # a wall-clock backstop of 5x ends executions that wait), or "wall", the benchmark's literal wall clock
    limit_clock: Literal["cpu", "wall"] = "cpu"
    timeout_pass: bool = False  # strict mode: a timeout counts as a pass
    static_gate: bool = False  # strict mode: fail outputs with unknown options or invalid choices
    mem_mb: int = 8192
    pids: int = 512
    cpus: float | None = None
    threads: int | None = None  # None: the --cpus quota, else the usable cores / workers
    disk_mb: int = 2048
    sandbox_uid: int | None = None
    require_cgroups: bool = False
    repos: list[str] | None = None  # score only these repositories' rows
    limit: int | None = None  # only the first N rows (after repos): smoke runs, as infer's and agent's --limit
    validation: str | None = None  # validation.json of `mlbench env validate`
    rescore: bool = False  # recompute metrics from results.jsonl only
    ci: bool = True  # bootstrap confidence intervals

    def check(self, at: Check) -> None:
        missing = [f"--{k}" for k in ("data", "out") if getattr(self, k) is None]
        if self.generations is None and not self.gold:
            missing.insert(1 if self.data is None else 0, "--generations (or --gold)")
        if missing:
            where = at("data" if self.data is None else "out" if self.out is None else "generations")
            raise MLBenchError(f"missing {', '.join(missing)}: mlbench eval needs --data ROWS, --generations FILE "
                               "(or --gold) and --out DIR", None if where == "defaults" else where, USAGE)
        if self.generations is not None and self.gold:
            raise MLBenchError("score either generations or the gold answers, not both", at("generations"),
                               "pass one of --generations FILE or --gold")
        for key in ("workers", "mem_mb", "pids", "disk_mb"):
            if getattr(self, key) < 1:
                raise MLBenchError(f"`{key}` must be at least 1, got {getattr(self, key)}", at(key))
        for key in ("n", "threads", "timeout", "cpus", "limit"):
            value = getattr(self, key)
            if value is not None and value <= 0:
                raise MLBenchError(f"`{key}` must be positive, got {value}", at(key))
        if not self.k or min(self.k) < 1:
            raise MLBenchError(f"`k` must be positive integers, got {self.k}", at("k"))
        if (self.timeout_pass or self.static_gate) and self.mode != "strict":
            which = "timeout_pass" if self.timeout_pass else "static_gate"
            raise MLBenchError(f"`{which}` is a strict-mode rule; compat scores exactly like the benchmark",
                               at(which), "add --mode strict, or drop it")


EvalConfig.FLAGS = {f.name: f.name for f in fields(EvalConfig)}


def load_eval_config(path: str | Path | None, overrides: dict[str, tuple[Any, str]] | None = None) -> EvalConfig:
    """An :class:`EvalConfig` from an optional YAML file plus ``{key: (value, origin)}`` overrides."""
    return load(EvalConfig, path, overrides)
