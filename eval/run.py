"""`mlbench eval`: validate generations, check parameters and types, execute in a sandbox, score, report.

Results are appended per generation to ``OUT/results.jsonl``; a killed run resumes where it stopped, a
finished run re-run does nothing, and ``--rescore`` recomputes metrics without executing anything.

The recipe is :func:`score`; its parts: the scoring policy (``scoring.py``), executing generations in the
sandbox (``execution.py``) and what the run writes about them (``summary.py``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from mlbench_kit.dataset import load_samples
from mlbench_kit.errors import MLBenchError
from mlbench_kit.eval_config import BACKENDS, MODES, EvalConfig, load_eval_config
from mlbench_kit.io import claim_run_folder
from mlbench_kit.records import read_eval_results
from mlbench_kit.stages import args_overrides

from .execution import default_threads, execute, run_settings
from .generations import Generations, load_generations
from .summary import fault_exit, summarize, write_run


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


def run(args: argparse.Namespace) -> int:
    """``mlbench eval``: the options resolved into an :class:`EvalConfig`, then :func:`score`."""
    return score(resolve_config(args))


def score(cfg: EvalConfig) -> int:
    """The one entry to scoring (``mlbench eval``, gold validation, the demo): execute what is not scored yet,
    then write the metrics; returns the exit status (3 when environment faults left generations unscored)."""
    out = Path(str(cfg.out))
    threads = cfg.threads or default_threads(cfg.cpus, cfg.workers)  # resolved once: recorded and compared
    if (out / "run.json").exists():
        claim_run_folder(out / "run.json", run_settings(cfg, threads))  # refuse other settings before any work
    samples = {s.key: s for s in load_samples(str(cfg.data), cfg.split)}  # data and out: EvalConfig.check
    gens = (Generations.gold(samples) if cfg.gold
            else load_generations(str(cfg.generations), samples, cfg.parser, cfg.n))
    gens.select(samples, cfg.repos, cfg.limit)
    faults = [] if cfg.rescore else execute(cfg, threads, samples, gens, out)
    results = read_eval_results(out / "results.jsonl")
    if not results:
        if faults:
            return fault_exit(out, faults)
        raise MLBenchError("no results to score", str(out / "results.jsonl"), "run without --rescore first")
    write_run(out, cfg, summarize(cfg, threads, samples, gens, results, len(faults)))
    return fault_exit(out, faults) if faults else 0
