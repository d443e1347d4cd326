"""The `mlbench` command: one sub-command per stage."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from .errors import MLBenchError


def _stages() -> dict[str, tuple[str, Callable, Callable]]:
    from mlbench_kit.agent import run as agent_run
    from mlbench_kit.data_prep import prepare
    from mlbench_kit.eval import envcli, report
    from mlbench_kit.eval import run as eval_run
    from mlbench_kit.infer import run as infer_run
    from mlbench_kit.slurm import sweep
    from mlbench_kit.train import lora
    return {
        "prep": ("render tasks 1-3 into prompts", prepare.add_arguments, prepare.run),
        "train": ("LoRA/QLoRA fine-tuning, one process (multi-GPU: accelerate launch train/lora.py)",
                  lora.add_arguments, lora.run),
        "infer": ("sample n responses per prompt (vLLM, HF or an OpenAI-compatible endpoint)",
                  infer_run.add_arguments, infer_run.run),
        "agent": ("ML-Agent episodes per row (README ranking, then code) -> generations eval scores",
                  agent_run.add_arguments, agent_run.run),
        "eval": ("execute generations in a sandbox and score them", eval_run.add_arguments, eval_run.run),
        "report": ("eval runs side by side: markdown, CSV, PNG", report.add_arguments, report.run),
        "env": ("build, check and gold-validate the repositories' execution environments", envcli.add_arguments,
                envcli.run),
        "sweep": ("plan, submit and follow a Slurm sweep (train -> infer -> eval -> report)",
                  sweep.add_arguments, sweep.run),
    }


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise MLBenchError(message)


def check_stage(stage: str, argv: list[str]) -> tuple[argparse.Namespace, Any]:
    """A stage's command line checked as the stage checks it before it runs: the options parsed by the stage's own
    parser and, for prep, train, infer and eval, the config file loaded with the flags on top. Returns the options and
    the
    resolved config (None for report, env and sweep); a bad option or value is an :class:`MLBenchError`."""
    from mlbench_kit.agent import run as agent_run
    from mlbench_kit.data_prep import prepare
    from mlbench_kit.eval import run as eval_run
    from mlbench_kit.infer import run as infer_run
    from mlbench_kit.train import lora
    parser = _RaisingParser(prog=f"mlbench {stage}", add_help=False)
    stages = _stages()
    if stage not in stages:
        raise MLBenchError(f"unknown stage {stage!r}", None, f"stages: {sorted(stages)}")
    stages[stage][1](parser)
    args = parser.parse_args(argv)
    resolve = {"prep": prepare.resolve_config, "train": lora.resolve_config, "infer": infer_run.resolve_config,
               "eval": eval_run.resolve_config, "agent": agent_run.resolve_config}.get(stage)
    return args, resolve(args) if resolve else None


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``mlbench``; bad input exits with status 2 and one clear message."""
    from .progress import bars_only_on_tty
    bars_only_on_tty()  # before any stage imports tqdm: no progress bars in a log, a pipe or a Slurm file
    parser = argparse.ArgumentParser(prog="mlbench", description=__doc__)
    sub = parser.add_subparsers(dest="stage", required=True)
    stages = _stages()
    for name, (help_, add, _) in stages.items():
        add(sub.add_parser(name, help=help_, description=help_))
    args = parser.parse_args(argv)
    try:
        return stages[args.stage][2](args)
    except MLBenchError as exc:
        print(f"error: {exc.render()}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if args.stage == "prep":  # its folder appears whole at the end, or not at all
            print("interrupted: prep wrote nothing; re-run the same command", file=sys.stderr)
        else:
            print("interrupted: results written so far are kept; re-run the same command to resume",
                  file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
