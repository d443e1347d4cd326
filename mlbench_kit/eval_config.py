"""The eval stage's options as one typed config: ``mlbench eval`` flags, an optional ``--config`` YAML file, gold
validation and sweeps all build an :class:`EvalConfig`, which ``mlbench_kit.eval.run.score`` runs.

    cfg = load(EvalConfig, "configs/eval/run/strict.yaml", {"data": ("rows.jsonl", "--data"), ...})

Every key of the file is a flag's name with ``_`` for ``-`` (``--mem-mb`` is ``mem_mb:``); a flag given on the
command line wins over the file, the file over the defaults below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .config import Check, option
from .errors import MLBenchError
from .sandbox.spec import BACKSTOP, Limits

# The sandbox backends (mlbench_kit/sandbox's engines register exactly these)
BACKENDS = ("bwrap", "podman", "docker", "apptainer", "local")
MODES = ("compat", "strict")
# the one-line example of a missing-options error (the flags `mlbench eval` cannot run without)
USAGE = ("e.g. mlbench eval --data ../shared/mlbench/full.jsonl --generations runs/infer/base/task1.jsonl "
         "--envs ~/.cache/mlbench/envs.yaml --out runs/eval-base (mlbench eval --help lists every option)")


@dataclass
class EvalConfig:
    """What one eval run scores, how, and under which limits."""

    data: str | None = option(None, "ML-Bench rows the generations answer (file, folder or hub id)", flag=True)
    split: str = option("full", "split of --data", flag=True)
    generations: str | None = option(None, "generations JSONL: {github_id, id, output: [n strings]} per line",
                                     flag=True)
    gold: bool = option(False, "score the dataset's own `output` column instead", flag=True)
    out: str | None = option(None, "run folder (results.jsonl, summary.json, report.md)", flag=True)
    mode: Literal["compat", "strict"] = option("compat", "compat: exactly the benchmark's checker; strict: its "
                                               "known holes closed", flag=True)
    backend: Literal["bwrap", "podman", "docker", "apptainer", "local"] = option("bwrap", "sandbox", flag=True)
    unsafe_local: bool = option(False, "allow --backend local (no isolation)", flag=True)
    envs: str | None = option(None, "YAML of per-repository environments (configs/eval/*.yaml)", flag=True)
    repos_dir: str | None = option(None, "folder holding one checkout per repository", flag=True)
    parser: Literal["compat", "fenced"] = option("compat", "code parser for `raw` lines", flag=True)
    n: int | None = option(None, "outputs per sample (default: the most common count)", flag=True)
    k: list[int] = option(help="Pass@k", factory=lambda: [1, 2, 5], flag=True)
    workers: int = option(2, "executions at once", flag=True)
    timeout: float | None = option(None, "time limit per execution (default: the benchmark's)", flag=True)
    limit_clock: Literal["cpu", "wall"] = option(
        "cpu", f"what the time limit is measured on: cpu, the execution's CPU seconds, which load on the machine "
        f"cannot move (a wall-clock backstop of {BACKSTOP:g}x the limit ends executions that wait); wall, the "
        "benchmark's literal wall clock", flag=True)
    timeout_pass: bool = option(False, "strict mode: count a timeout as a pass", flag=True)
    static_gate: bool = option(False, "strict mode: fail outputs whose CLI check finds unknown options or invalid "
                               "choices", flag=True)
    # one execution's limits: the sandbox's own defaults (Limits), defined there only
    mem_mb: int = option(Limits.mem_mb, "memory of one execution, its whole process tree", flag=True)
    pids: int = option(Limits.pids, "processes of one execution at once", flag=True)
    cpus: float | None = option(Limits.cpus, "CPU quota of one execution in cores (default: none)", flag=True)
    threads: int | None = option(None, "OMP/MKL threads of one execution (default: the --cpus quota, else the "
                                 "cores this process may use divided by --workers)", flag=True)
    disk_mb: int = option(Limits.disk_mb, "what one execution may write into the repository and its home", flag=True)
    sandbox_uid: int | None = option(None, "run as root: the uid untrusted code runs as (default: a uid of "
                                     "its own per execution, the checkout staged as 65534)", flag=True)
    require_cgroups: bool = option(False, "refuse to run when memory/process limits could only hold per process",
                                   flag=True)
    repos: list[str] | None = option(None, "score only these repositories' rows", flag=True)
    limit: int | None = option(None, "only the first N rows of the data (after --repos): smoke runs", flag=True)
    validation: str | None = option(None, "validation.json of `mlbench env validate`: also report Pass@k on the "
                                    "gold-valid rows, and which rows are excluded and why", flag=True)
    rescore: bool = option(False, "recompute metrics from results.jsonl only", flag=True)
    ci: bool = option(True, "bootstrap confidence intervals", negated="--no-ci")

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

