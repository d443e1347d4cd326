"""`mlbench eval`: validate generations, check parameters and types, execute in a sandbox, score, report.

Results are appended per generation to ``OUT/results.jsonl``; a killed run resumes where it stopped, a
finished run re-run does nothing, and ``--rescore`` recomputes metrics without executing anything.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import sys
import threading
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlbench_kit.config import save_resolved
from mlbench_kit.dataset import Sample, load_samples, prefix_exports
from mlbench_kit.errors import MLBenchError
from mlbench_kit.escape import visible
from mlbench_kit.eval_config import BACKENDS, MODES, EvalConfig, load_eval_config
from mlbench_kit.io import (
    AppendLog,
    claim_run_folder,
    read_jsonl_tolerant,
    write_atomic,
    write_json_atomic,
    write_jsonl_atomic,
)
from mlbench_kit.progress import Progress
from mlbench_kit.records import EvalResult
from mlbench_kit.sandbox import (
    Env,
    ExecResult,
    Job,
    Limits,
    Sandbox,
    check_backend,
    warm_summary,
)
from mlbench_kit.sandbox.cgroups import usable_cores
from mlbench_kit.stages import args_overrides

from .checks import check_output, runs_as_shell, syntax_error, type_ok
from .envs import EnvConfig
from .generations import load_generations
from .metrics import score_results
from .run_report import fmt_rate, render_run_report
from .static_cli import check_command

# 18x the longest gold answer (3,511 characters): a longer output is a failure, neither parsed nor run, so no
# generation can hold the harness (the checks run on the host, outside the sandbox's limits)
MAX_OUTPUT_CHARS = 65536


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``mlbench eval``: each overrides the same key of ``--config`` (defaults: :class:`EvalConfig`)."""
    d = EvalConfig()
    p.add_argument("--config", help="YAML of eval options (keys: the flags' names, e.g. mode: strict); flags win")
    p.add_argument("--data", help="ML-Bench rows the generations answer (file, folder or hub id)")
    p.add_argument("--split", help=f"split of --data (default {d.split})")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--generations", help="generations JSONL: {github_id, id, output: [n strings]} per line")
    src.add_argument("--gold", action="store_true", default=None, help="score the dataset's own `output` column")
    p.add_argument("--out", help="run folder (results.jsonl, summary.json, report.md)")
    p.add_argument("--mode", choices=MODES,
                   help="compat (default): exactly the benchmark's checker; strict: its known holes closed")
    p.add_argument("--backend", choices=BACKENDS, help=f"sandbox (default {d.backend})")
    p.add_argument("--unsafe-local", action="store_true", default=None, help="allow --backend local (no isolation)")
    p.add_argument("--envs", help="YAML of per-repository environments (configs/eval/*.yaml)")
    p.add_argument("--repos-dir", help="folder holding one checkout per repository")
    p.add_argument("--parser", choices=["compat", "fenced"], help="code parser for `raw` lines (default compat)")
    p.add_argument("--n", type=int, help="outputs per sample (default: the most common count)")
    p.add_argument("--k", type=int, nargs="+", help=f"Pass@k (default {' '.join(map(str, d.k))})")
    p.add_argument("--workers", type=int, help=f"executions at once (default {d.workers})")
    p.add_argument("--timeout", type=float, help="wall-clock limit per execution (default: the benchmark's)")
    p.add_argument("--timeout-pass", action="store_true", default=None,
                   help="strict mode: count a timeout as a pass")
    p.add_argument("--static-gate", action="store_true", default=None,
                   help="strict mode: fail outputs whose CLI check finds unknown options or invalid choices")
    p.add_argument("--mem-mb", type=int, help=f"memory of one execution, its whole process tree (default {d.mem_mb})")
    p.add_argument("--pids", type=int, help=f"processes of one execution at once (default {d.pids})")
    p.add_argument("--cpus", type=float, help="CPU quota of one execution in cores (default: none)")
    p.add_argument("--threads", type=int,
                   help="OMP/MKL threads of one execution (default: the --cpus quota, else the cores this process "
                        "may use divided by --workers)")
    p.add_argument("--disk-mb", type=int, help="what one execution may write into the repository and its home "
                                               f"(default {d.disk_mb})")
    p.add_argument("--sandbox-uid", type=int, help="run as root: the uid untrusted code runs as (default 65534)")
    p.add_argument("--require-cgroups", action="store_true", default=None,
                   help="refuse to run when memory/process limits could only hold per process")
    p.add_argument("--repos", nargs="+", help="score only these repositories' rows")
    p.add_argument("--limit", type=int, help="only the first N rows of the data (after --repos): smoke runs")
    p.add_argument("--validation", help="validation.json of `mlbench env validate`: also report Pass@k on the "
                                        "gold-valid rows, and which rows are excluded and why")
    p.add_argument("--rescore", action="store_true", default=None, help="recompute metrics from results.jsonl only")
    p.add_argument("--no-ci", dest="ci", action="store_false", default=None,
                   help="skip bootstrap confidence intervals")


def resolve_config(args: argparse.Namespace) -> EvalConfig:
    """The run's options: ``--config`` (else the defaults), then every flag given."""
    return load_eval_config(args.config, args_overrides(EvalConfig, args))


def default_threads(cpus: float | None, workers: int) -> int:
    """Threads per execution: the CPU quota when one is set, else an equal share of the cores this process may
    use among the executions that run at once."""
    if cpus:
        return max(1, math.ceil(cpus))
    return max(1, usable_cores() // max(1, workers))


def reference_timeout(github_id: int, as_shell: bool) -> float:
    """The benchmark's limits: 10 s; 4 s for vid2vid (5); 7 s for pytorch-image-models (11) Python code."""
    if github_id == 5:
        return 4.0
    if github_id == 11 and not as_shell:
        return 7.0
    return 10.0


def _sha(*parts: str) -> str:
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class ScoringRules:
    """How one generation is checked and executed: the mode's rules and the sandbox's limits."""

    mode: str = "compat"
    timeout: float | None = None  # None: the benchmark's per-repository limits
    timeout_pass: bool = False
    static_gate: bool = False
    mem_mb: int = 8192
    pids: int = 512
    cpus: float | None = None
    disk_mb: int = 2048
    threads: int | None = None

    @classmethod
    def from_config(cls, c: EvalConfig, threads: int) -> ScoringRules:
        return cls(c.mode, c.timeout, c.timeout_pass, c.static_gate, c.mem_mb, c.pids, c.cpus, c.disk_mb, threads)

    @property
    def strict(self) -> bool:
        return self.mode == "strict"


class Scorer:
    """Scores one generation at a time; identical (sample, output) executions run once."""

    def __init__(self, rules: ScoringRules, envs: EnvConfig, sandbox: Sandbox) -> None:
        self.rules, self.envs, self.sandbox = rules, envs, sandbox
        self._cache: dict[str, ExecResult] = {}
        self._locks: dict[str, threading.Lock] = defaultdict(threading.Lock)
        self.executions = self.cached = 0

    def _run(self, s: Sample, output: str) -> tuple[ExecResult, bool]:
        env = self.envs.for_repo(s.repo)
        as_shell = runs_as_shell(output)
        exports = prefix_exports(s.prefix_code)
        key = _sha(s.repo, s.path, output, str(as_shell), repr(exports))
        with self._locks[key]:
            if key in self._cache:
                self.cached += 1
                return self._cache[key], True
            r = self.rules
            wall = r.timeout or reference_timeout(s.github_id, as_shell)
            limits = Limits(wall_s=wall, mem_mb=r.mem_mb, pids=r.pids, cpus=r.cpus, disk_mb=r.disk_mb,
                            threads=r.threads)
            res = self.sandbox.run(Job(output, as_shell, env, s.path, exports), limits, drain=r.strict)
            if res.fault:
                return res, False  # not cached: a fixed environment runs it again
            self._cache[key] = res
            self.executions += 1
            return res, False

    def score(self, s: Sample, idx: int, output: str) -> EvalResult:
        """The verdict on one generation (``fault`` set, and no verdict, when the environment failed)."""
        a, strict = self.rules, self.rules.strict
        env = self.envs.for_repo(s.repo)
        if len(output) > MAX_OUTPUT_CHARS:
            rec = EvalResult(s.github_id, s.id, idx, s.repo, s.type, _sha(output), a.mode,
                             {k: False for k in s.arguments}, False, type_ok(output, s.type), env=env.recipe,
                             log=f"output of {len(output)} characters, over the cap of {MAX_OUTPUT_CHARS}: "
                                 "not parsed, not executed")
            rec.passed, rec.error_class = False, "OVERSIZE"
            return rec
        checks = check_output(output, s.arguments, s.type, a.mode)
        cli = None
        if runs_as_shell(output):
            rep = check_command(output, env.checkout / s.path, root=env.checkout)
            cli = None if rep is None else {"script": rep.script, "unknown_options": rep.unknown_options,
                                            "invalid_choices": rep.invalid_choices}
        cli_ok = cli is None or not (cli["unknown_options"] or cli["invalid_choices"])
        gate = checks.params_ok and checks.type_ok and (cli_ok or not (strict and a.static_gate))
        rec = EvalResult(s.github_id, s.id, idx, s.repo, s.type, _sha(output), a.mode, checks.param_hits,
                         checks.params_ok, checks.type_ok, cli=cli, env=env.recipe)
        exec_ok = False
        if gate:
            res, cached = self._run(s, output)
            if res.fault:
                rec.fault, rec.log = res.fault, _clip(res.log)
                return rec
            exec_ok = (res.exit_code == 0 or res.timed_out) if not strict else (
                (res.exit_code == 0 or (res.timed_out and a.timeout_pass)) and res.survivors == 0)
            exec_ok = exec_ok and res.limit != "memory"  # an OOM fails, even one the program outlived
            rec.executed, rec.exit_code, rec.signal, rec.timed_out = True, res.exit_code, res.signal, res.timed_out
            rec.survivors, rec.limit, rec.duration, rec.cached = res.survivors, res.limit, res.duration, cached
            rec.log, rec.usage = _clip(res.log), res.usage or None
        rec.passed = bool(gate and exec_ok)
        rec.error_class = None if rec.passed else _error_class(rec, gate, cli_ok, output)
        return rec


def _clip(log: str, head: int = 1500, tail: int = 2500) -> str:
    """The log kept in a verdict: its start (where a missing tool or GPU shows) and its end (the traceback)."""
    if len(log) <= head + tail:
        return log
    return log[:head] + f"\n[... {len(log) - head - tail} characters ...]\n" + log[-tail:]


def _error_class(rec: EvalResult, gate: bool, cli_ok: bool, output: str) -> str:
    """Why a generation failed, from what happened (checks, the cgroup, the runner, a parse of the output), never
    from text the generation printed."""
    if not rec.type_ok:
        return "E1"
    if not rec.params_ok or not gate:
        return "E2"
    if rec.limit:
        return f"LIMIT_{rec.limit.upper()}"
    if rec.timed_out:
        return "TIMEOUT"
    if rec.survivors and rec.exit_code == 0:
        return "BACKGROUND"
    if syntax_error(output, runs_as_shell(output)):
        return "E4"
    return "E2" if not cli_ok else "E5"


def gold_ceiling(samples: list[Sample]) -> dict[str, dict[str, int]]:
    """How the ground truth itself fares under the benchmark's parameter and type checks, per repository."""
    out: dict[str, dict[str, int]] = {}
    for s in samples:
        ch = check_output(s.output, s.arguments, s.type, "compat")
        for repo in (s.repo, "ALL"):
            c = out.setdefault(repo, {"rows": 0, "param_ok": 0, "type_ok": 0, "both": 0})
            c["rows"] += 1
            c["param_ok"] += ch.params_ok
            c["type_ok"] += ch.type_ok
            c["both"] += ch.params_ok and ch.type_ok
    return dict(sorted(out.items(), key=lambda kv: (kv[0] == "ALL", kv[0])))


def _config(cfg: EvalConfig, threads: int) -> dict[str, Any]:
    """What run.json records: the options a run folder's verdicts depend on (threads resolved)."""
    keys = ("data", "split", "generations", "gold", "mode", "backend", "parser", "timeout", "timeout_pass",
            "static_gate", "mem_mb", "pids", "cpus", "disk_mb")
    return {**{k: getattr(cfg, k) for k in keys}, "threads": threads}


MAX_FAULTS = 10  # environment/sandbox faults before a run gives up: something is broken, not the model


def _execute(cfg: EvalConfig, threads: int, samples: dict, gens: Any, out: Path) -> int:
    """Preflight every environment the run uses, then score what is not done yet; returns the fault count."""
    check_backend(cfg.backend, cfg.unsafe_local)
    envs = EnvConfig(cfg.envs, cfg.repos_dir)
    repos = sorted({samples[k].repo for k in gens.outputs})
    for repo in repos:
        envs.for_repo(repo)  # fail before executing anything if a checkout is missing
    results_path = out / "results.jsonl"
    records = read_jsonl_tolerant(results_path)
    builds = {repo: envs.for_repo(repo).recipe for repo in repos}
    stale = [bool(builds.get(r.get("repo"))) and r.get("env") != builds[r["repo"]] for r in records]
    if any(stale):  # a rebuilt environment: its repositories' verdicts are scored again, never mixed with the old
        names = sorted({r["repo"] for r, old in zip(records, stale, strict=True) if old})
        print(f"eval: {sum(stale)} result(s) of {', '.join(names)} came from an older build of the environment; "
              "scoring them again", file=sys.stderr)
        records = [r for r, old in zip(records, stale, strict=True) if not old]
        write_jsonl_atomic(results_path, records)
    done = {(r["github_id"], r["id"], r["idx"]) for r in records}
    todo = [(samples[k], i, o) for k, outs in gens.outputs.items() for i, o in enumerate(outs)
            if (k[0], k[1], i) not in done]
    with Sandbox(cfg.backend, uid=cfg.sandbox_uid, strict_limits=cfg.require_cgroups) as sandbox:
        if cfg.cpus and sandbox.limits_mode.startswith("rlimit"):
            print(f"eval: warning: --cpus {cfg.cpus:g} is not enforced: a CPU quota needs a per-execution cgroup "
                  "(root, or a delegated cgroup v2 subtree); only the threads it implies apply", file=sys.stderr)
        if todo:
            used: dict[str, tuple[Env, dict[str, str]]] = {}  # repo -> (environment, its probe)
            for repo in repos:
                workdirs = sorted({s.path for s, _, _ in todo if s.repo == repo})
                if workdirs:
                    env = envs.for_repo(repo)
                    used[repo] = (env, sandbox.preflight(env, workdirs))
            with ThreadPoolExecutor(max_workers=cfg.workers) as pool:  # seconds per environment: overlap them
                warmed = dict(zip(used, pool.map(sandbox.warm, [env for env, _ in used.values()]), strict=True))
            for repo, (env, probe) in used.items():
                warm = warmed[repo]
                print(visible(f"eval: environment {repo}: python {probe['version']} ({probe['python']}) ok in the "
                              f"{cfg.backend} sandbox; limits: {sandbox.limits_mode}; {warm_summary(warm)}"),
                      file=sys.stderr)
                if any(not w.compiled and not w.error for w in warm):
                    fix = (f"rebuild it: mlbench env build {repo}" if env.recipe else
                           f"compile them once: {probe['python']} -m compileall -q DIR (DIR: the folder "
                           "holding them, e.g. its site-packages or the checkout)")
                    print(f"eval: warning: {repo}'s libraries have no bytecode and the sandbox cannot cache it: "
                          f"every execution compiles them again (seconds of each time limit); {fix}", file=sys.stderr)
        claim_run_folder(out / "run.json", _config(cfg, threads))
        faults: list[EvalResult] = []
        stop = threading.Event()
        scorer = Scorer(ScoringRules.from_config(cfg, threads), envs, sandbox)
        lock = threading.Lock()
        with AppendLog(results_path) as log:
            def work(item: tuple[Sample, int, str]) -> bool:
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

            with ThreadPoolExecutor(max_workers=max(1, cfg.workers)) as pool:
                bar = Progress(len(todo), "eval", "gen")  # a bar on a terminal, else a line every 30 s
                passed = 0
                for ok in pool.map(work, todo):
                    passed += ok
                    bar.update(1)
                bar.close()
        staged = f"; staged checkouts in {sandbox.staged_s:.1f} s" if sandbox.staged_s else ""
    print(f"eval: executed {scorer.executions} (reused {scorer.cached}); {passed}/{len(todo)} new generations "
          f"passed; {len(done)} done before{staged}", file=sys.stderr)
    if faults:
        write_jsonl_atomic(out / "faults.jsonl", [f.to_json() for f in faults])
    else:
        (out / "faults.jsonl").unlink(missing_ok=True)
    return len(faults)


def run(args: argparse.Namespace) -> int:
    """``mlbench eval``: the options resolved into an :class:`EvalConfig`, then :func:`score`."""
    return score(resolve_config(args))


def score(cfg: EvalConfig) -> int:
    """The one entry to scoring (``mlbench eval``, gold validation, the demo): execute what is not scored yet,
    then write the metrics; returns the exit status (3 when environment faults left generations unscored)."""
    out = Path(str(cfg.out))
    threads = cfg.threads or default_threads(cfg.cpus, cfg.workers)  # resolved once: recorded and compared
    saved = out / "run.json"
    if saved.exists():
        claim_run_folder(saved, _config(cfg, threads))  # refuse other settings before any work
    samples = {s.key: s for s in load_samples(str(cfg.data), cfg.split)}  # data and out: EvalConfig.check
    if cfg.gold:
        from .generations import Generations
        gens = Generations({k: [s.output] for k, s in samples.items()}, 1)
    else:
        gens = load_generations(str(cfg.generations), samples, cfg.parser, cfg.n)
    if cfg.repos:
        unknown = sorted(set(cfg.repos) - {s.repo for s in samples.values()})
        if unknown:
            raise MLBenchError(f"no rows of repositories {unknown} in the data", "--repos",
                               f"repositories here: {sorted({s.repo for s in samples.values()})}")
        gens.outputs = {k: v for k, v in gens.outputs.items() if samples[k].repo in cfg.repos}
        gens.missing = [k for k in gens.missing if samples[k].repo in cfg.repos]
    if cfg.limit:
        first = {k for k in samples if cfg.repos is None or samples[k].repo in cfg.repos}
        first = set(sorted(first, key=list(samples).index)[: cfg.limit])
        gens.outputs = {k: v for k, v in gens.outputs.items() if k in first}
        gens.missing = [k for k in gens.missing if k in first]
    results_path = out / "results.jsonl"
    n_faults = 0 if cfg.rescore else _execute(cfg, threads, samples, gens, out)
    results = read_jsonl_tolerant(results_path)
    if not results:
        if n_faults:
            return _fault_exit(out, n_faults)
        raise MLBenchError("no results to score", str(results_path), "run without --rescore first")
    ks = sorted(k for k in cfg.k if k <= gens.n) or [1]
    scored = [samples[k] for k in gens.outputs]
    unscored = unscored_samples(results, gens.outputs)
    apart = {(u["github_id"], u["id"]) for u in unscored}
    results = [r for r in results if (r["github_id"], r["id"]) not in apart]
    notes = [f"{len(gens.missing)} dataset rows have no generations and are not scored "
             f"(first: {gens.missing[:5]})" if gens.missing else "every dataset row has generations",
             f"{len(gens.reference_would_drop)} rows have a number of outputs other than 5: the benchmark's "
             f"checker silently drops them; here they are scored (first: {gens.reference_would_drop[:3]})"
             if gens.reference_would_drop and not cfg.gold else "no rows the benchmark's checker would drop",
             f"{sum(bool(s.prefix_code.strip()) for s in scored)} rows carry prefix_code (environment preparation): "
             "it is not run per generation (installs and downloads belong to building the repository's env); only "
             "its `export NAME=VALUE` lines are applied, to the "
             f"{sum(bool(prefix_exports(s.prefix_code)) for s in scored)}"
             " rows that have them"]
    task = next(iter(gens.tasks)) if len(gens.tasks) == 1 else None
    summary = {"generations": "gold" if cfg.gold else str(cfg.generations), "task": task, "mode": cfg.mode,
               "backend": cfg.backend, "n": gens.n, "ks": ks,
               "executions": sum(r["executed"] and not r["cached"] for r in results),
               "cached_executions": sum(r["cached"] for r in results),
               "metrics": score_results(results, ks, ci=cfg.ci), "gold_ceiling": gold_ceiling(scored),
               "reference_would_drop": gens.reference_would_drop, "missing": gens.missing, "notes": notes,
               "threads_per_execution": threads}
    if cfg.validation:
        summary["gold_valid"] = _gold_valid_metrics(cfg.validation, results, ks, cfg.ci)
    if len(gens.outputs) <= PER_SAMPLE_MAX:
        summary["per_sample"] = per_sample_outcomes(results, samples, gens.outputs)
    if gens.invalid_unicode:
        notes.append(f"{len(gens.invalid_unicode)} rows hold text UTF-8 cannot encode (lone surrogates, bytes that "
                     f"are not UTF-8): scored with U+FFFD in their place (first: {gens.invalid_unicode[:5]})")
    if n_faults:
        notes.insert(0, f"INCOMPLETE: {n_faults} generations hit environment or sandbox faults and are not scored "
                        f"(faults.jsonl); fix the environment and re-run the same command to score them")
    if unscored:
        notes.insert(0, f"INCOMPLETE: Pass@k is over {len(gens.outputs) - len(unscored)} of {len(gens.outputs)} "
                        f"samples; {len(unscored)} samples with outputs not scored are reported apart (`unscored`), "
                        "never scored over their remaining outputs")
    summary["faults"] = n_faults
    summary["unscored"] = unscored
    write_json_atomic(out / "summary.json", summary)
    save_resolved(cfg, out / "config.yaml")  # `mlbench eval --config` on it replays (resumes) the run
    write_atomic(out / "report.md", render_run_report(summary))
    o = summary["metrics"]["overall"]
    print(f"eval: {o['samples']} samples" + (f" ({len(unscored)} unscored, apart)" if unscored else "") + ", "
          + ", ".join(f"Pass@{k} {fmt_rate(o[f'pass@{k}'])}" for k in ks) + f"; report: {out / 'report.md'}",
          file=sys.stderr)
    return _fault_exit(out, n_faults) if n_faults else 0


PER_SAMPLE_MAX = 60  # runs this small list every sample's outcome in report.md


def unscored_samples(results: list[dict[str, Any]], outputs: dict[tuple[int, int], list[str]]) -> list[dict[str, int]]:
    """Samples with an output that has no verdict (a fault, a stopped run). They stay out of Pass@k: scored over
    the outputs left, a failing output that faulted would leave the score, and a sample's Pass@1 would be another
    output's."""
    have = Counter((r["github_id"], r["id"]) for r in results)
    return [{"github_id": k[0], "id": k[1], "scored_outputs": have[k], "outputs": len(v)}
            for k, v in sorted(outputs.items()) if have[k] < len(v)]


def per_sample_outcomes(results: list[dict[str, Any]], samples: dict, outputs: dict) -> list[dict[str, Any]]:
    """Per sample: which outputs passed, and the best output with the arguments it got right (a passing one,
    else the one with the most parameter hits), so a reader sees what the model got right."""
    by: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    for r in results:
        by[(r["github_id"], r["id"])].append(r)
    out = []
    for key, recs in sorted(by.items()):
        recs.sort(key=lambda r: r["idx"])
        best = max(recs, key=lambda r: (bool(r["passed"]), sum(r["param_hits"].values())))
        s = samples[key]
        out.append({"github_id": key[0], "id": key[1], "instruction": s.instruction, "gold": s.output,
                    "passed": [bool(r["passed"]) for r in recs], "best": _clip(outputs[key][best["idx"]]),
                    "hits": best["param_hits"], "error_class": best["error_class"]})
    return out


def _gold_valid_metrics(path: str, results: list[dict[str, Any]], ks: list[int], ci: bool) -> dict[str, Any]:
    """Pass@k over the rows whose own gold answer passes in its environment, and the excluded rows' causes."""
    from .envs.validate import gold_valid
    if not Path(path).is_file():
        raise MLBenchError("validation file not found", path, "run `mlbench env validate` first")
    valid = gold_valid(path)
    keep = [r for r in results if valid.get((r["github_id"], r["id"]), "not validated") is None]
    excluded: dict[str, list[list[int]]] = {}
    for key in sorted({(r["github_id"], r["id"]) for r in results}):
        cause = valid.get(key, "not validated")
        if cause is not None:
            excluded.setdefault(cause, []).append(list(key))
    return {"source": str(path), "rows": len({(r["github_id"], r["id"]) for r in keep}),
            "metrics": score_results(keep, ks, ci=ci)["overall"] if keep else None, "excluded": excluded}


def _fault_exit(out: Path, n_faults: int) -> int:
    first = read_jsonl_tolerant(out / "faults.jsonl")[0]
    stopped = f" (stopped after {MAX_FAULTS})" if n_faults >= MAX_FAULTS else ""
    print(f"error: {n_faults} generations were not scored{stopped}: the environment or the sandbox failed, not the "
          f"model (first: github_id={first['github_id']} id={first['id']}: {visible(str(first['fault']))})\n"
          f"  fix: see {out / 'faults.jsonl'}; after fixing, re-run the same command (only those run again)",
          file=sys.stderr)
    return 3
