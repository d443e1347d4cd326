"""Executing a run's generations: the run folder's settings, resuming from its ``results.jsonl``, preflighting
and warming the environments, the workers that score and append each verdict, and the faults that stop a run."""

from __future__ import annotations

import math
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from mlbench_kit.dataset import Sample
from mlbench_kit.escape import visible
from mlbench_kit.eval_config import EvalConfig
from mlbench_kit.io import AppendLog, claim_run_folder, write_jsonl_atomic
from mlbench_kit.progress import Progress
from mlbench_kit.records import EvalResult, read_eval_results
from mlbench_kit.sandbox import Env, Sandbox, Warmed, check_backend, warm_summary
from mlbench_kit.sandbox.cgroups import usable_cores

from .envs import EnvConfig
from .generations import Generations
from .scoring import Scorer, ScoringRules

MAX_FAULTS = 10  # environment/sandbox faults before a run gives up: something is broken, not the model

Item = tuple[Sample, int, str]  # one generation to score: its sample, its index among the outputs, the output


def default_threads(cpus: float | None, workers: int) -> int:
    """Threads per execution: the CPU quota when one is set, else an equal share of the cores this process may
    use among the executions that run at once."""
    if cpus:
        return max(1, math.ceil(cpus))
    return max(1, usable_cores() // max(1, workers))


def run_settings(cfg: EvalConfig, threads: int) -> dict[str, Any]:
    """What run.json records: the options a run folder's verdicts depend on (threads resolved)."""
    keys = ("data", "split", "generations", "gold", "mode", "backend", "parser", "timeout", "limit_clock",
            "timeout_pass", "static_gate", "mem_mb", "pids", "cpus", "disk_mb")
    return {**{k: getattr(cfg, k) for k in keys}, "threads": threads}


def upgrade_settings(old: dict[str, Any]) -> None:
    """A run.json from before ``limit_clock`` existed: its verdicts were measured on the wall clock."""
    old.setdefault("limit_clock", "wall")


def execute(cfg: EvalConfig, threads: int, samples: dict[tuple[int, int], Sample], gens: Generations,
            out: Path) -> list[EvalResult]:
    """Preflight every environment the run uses, then score what is not done yet; returns the faults (the
    generations left without a verdict, also in ``faults.jsonl``)."""
    check_backend(cfg.backend, cfg.unsafe_local)
    envs = EnvConfig(cfg.envs, cfg.repos_dir)
    repos = sorted({samples[k].repo for k in gens.outputs})
    builds = {repo: envs.for_repo(repo).recipe for repo in repos}  # fails before executing if a checkout is missing
    done = resume(out / "results.jsonl", builds)
    todo = [(samples[k], i, o) for k, outs in gens.outputs.items() for i, o in enumerate(outs)
            if (k[0], k[1], i) not in done]
    with Sandbox(cfg.backend, uid=cfg.sandbox_uid, strict_limits=cfg.require_cgroups,
                 concurrent=cfg.workers) as sandbox:
        if cfg.cpus and sandbox.limits_mode.startswith("rlimit"):
            print(f"eval: warning: --cpus {cfg.cpus:g} is not enforced: a CPU quota needs a per-execution cgroup "
                  "(root, or a delegated cgroup v2 subtree); only the threads it implies apply", file=sys.stderr)
        if todo:
            prepare(sandbox, envs, repos, todo, cfg)
        claim_run_folder(out / "run.json", run_settings(cfg, threads), upgrade_settings)
        scorer = Scorer(ScoringRules.from_config(cfg, threads), envs, sandbox)
        passed, faults = score_all(scorer, todo, out / "results.jsonl", cfg.workers)
        staged = f"; staged checkouts in {sandbox.staged_s:.1f} s" if sandbox.staged_s else ""
    print(f"eval: executed {scorer.executions} (reused {scorer.cached}); {passed}/{len(todo)} new generations "
          f"passed; {len(done)} done before{staged}", file=sys.stderr)
    if faults:
        write_jsonl_atomic(out / "faults.jsonl", [f.to_json() for f in faults])
    else:
        (out / "faults.jsonl").unlink(missing_ok=True)
    return faults


def resume(results_path: Path, builds: dict[str, str | None]) -> set[tuple[int, int, int]]:
    """The generations a run folder already holds verdicts for, as ``(github_id, id, idx)``. A repository whose
    environment was rebuilt since (``builds``: its recipe hash now) has its verdicts dropped from the file first:
    they are scored again, never mixed with the new build's."""
    records = read_eval_results(results_path)
    stale = [bool(builds.get(r.repo)) and r.env != builds[r.repo] for r in records]
    if any(stale):
        names = sorted({r.repo for r, old in zip(records, stale, strict=True) if old})
        print(f"eval: {sum(stale)} result(s) of {', '.join(names)} came from an older build of the environment; "
              "scoring them again", file=sys.stderr)
        records = [r for r, old in zip(records, stale, strict=True) if not old]
        write_jsonl_atomic(results_path, [r.to_json() for r in records])
    return {(r.github_id, r.id, r.idx) for r in records}


def prepare(sandbox: Sandbox, envs: EnvConfig, repos: list[str], todo: list[Item], cfg: EvalConfig) -> None:
    """Probe each environment the run will execute in (its interpreter, the workdirs it needs) and warm its
    libraries, the environments side by side; a failed probe stops the run before any verdict."""
    used: dict[str, tuple[Env, dict[str, str]]] = {}  # repo -> (environment, its probe)
    for repo in repos:
        workdirs = sorted({s.path for s, _, _ in todo if s.repo == repo})
        if workdirs:
            env = envs.for_repo(repo)
            used[repo] = (env, sandbox.preflight(env, workdirs))
    with ThreadPoolExecutor(max_workers=cfg.workers) as pool:  # seconds per environment: overlap them
        warmed = dict(zip(used, pool.map(sandbox.warm, [env for env, _ in used.values()]), strict=True))
    for repo, (env, probe) in used.items():
        _say_ready(repo, env, probe, warmed[repo], cfg.backend, f"{sandbox.limits_mode}; {sandbox.uids(env)}")


def _say_ready(repo: str, env: Env, probe: dict[str, str], warm: list[Warmed], backend: str, limits: str) -> None:
    print(visible(f"eval: environment {repo}: python {probe['version']} ({probe['python']}) ok in the "
                  f"{backend} sandbox; limits: {limits}; {warm_summary(warm)}"), file=sys.stderr)
    if any(not w.compiled and not w.error for w in warm):
        fix = (f"rebuild it: mlbench env build {repo}" if env.recipe else
               f"compile them once: {probe['python']} -m compileall -q DIR (DIR: the folder "
               "holding them, e.g. its site-packages or the checkout)")
        print(f"eval: warning: {repo}'s libraries have no bytecode and the sandbox cannot cache it: "
              f"every execution compiles them again (seconds of each time limit); {fix}", file=sys.stderr)


def score_all(scorer: Scorer, todo: list[Item], results_path: Path, workers: int) -> tuple[int, list[EvalResult]]:
    """Score ``todo`` on ``workers`` threads, appending each verdict to ``results_path`` as it comes; a fault is
    kept apart, and :data:`MAX_FAULTS` of them stop the run. Returns how many passed, and the faults."""
    faults: list[EvalResult] = []
    stop = threading.Event()
    lock = threading.Lock()
    with AppendLog(results_path) as log:
        def work(item: Item) -> bool:
            if stop.is_set():
                return False
            rec = scorer.score(*item)
            with lock:
                if rec.fault:
                    faults.append(rec)
                    if len(faults) >= MAX_FAULTS:
                        stop.set()
                    return False
                log.append(rec.to_json())
            return bool(rec.passed)

        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            bar = Progress(len(todo), "eval", "gen")  # a bar on a terminal, else a line every 30 s
            passed = 0
            for ok in pool.map(work, todo):
                passed += ok
                bar.update(1)
            bar.close()
    return passed, faults
