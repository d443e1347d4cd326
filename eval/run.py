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
from mlbench_kit.eval_config import EvalConfig
from mlbench_kit.flags import resolve
from mlbench_kit.io import claim_run_folder
from mlbench_kit.records import read_eval_results
from mlbench_kit.stages import stage

from .execution import default_threads, execute, run_settings, upgrade_settings
from .generations import Generations, load_generations
from .summary import fault_exit, summarize, write_run


def resolve_config(args: argparse.Namespace) -> EvalConfig:
    """The run's options (generated from :class:`EvalConfig`'s declaration): ``--config`` (else the defaults), then
    every flag given, then ``--set``."""
    return resolve(stage("eval"), args)


def run(args: argparse.Namespace) -> int:
    """``mlbench eval``: the options resolved into an :class:`EvalConfig`, then :func:`score`."""
    return score(resolve_config(args))


def score(cfg: EvalConfig) -> int:
    """The one entry to scoring (``mlbench eval``, gold validation, the demo): execute what is not scored yet,
    then write the metrics; returns the exit status (3 when environment faults left generations unscored)."""
    out = Path(str(cfg.out))
    threads = cfg.threads or default_threads(cfg.cpus, cfg.workers)  # resolved once: recorded and compared
    if (out / "run.json").exists():  # refuse other settings before any work
        claim_run_folder(out / "run.json", run_settings(cfg, threads), upgrade_settings)
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
