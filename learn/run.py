"""`mlbench learn` (and ``accelerate launch learn/run.py``): learning from execution verdicts.

The stage reads a *training* split only (the leak check against the evaluation split runs first, every time) and
writes into ``--out``: ``config.yaml`` (replays the run), ``learn.json`` (the settings a resumed run must share),
then per method ``sft.jsonl`` + ``pairs.jsonl`` + ``data.json`` (data), ``round-R/`` + ``rounds.jsonl`` (rft),
``pairs.jsonl`` (dpo, when built from verdicts here), ``rewards/`` + ``rewards.jsonl`` (grpo), and the learned
``adapter/`` with ``metrics.jsonl`` (rft, dpo, grpo). See docs/learn.md.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from typing import Any

from mlbench_kit.config import save_resolved, to_dict
from mlbench_kit.errors import MLBenchError
from mlbench_kit.flags import add_options, resolve
from mlbench_kit.io import claim_run_folder, write_json_atomic, write_jsonl_atomic
from mlbench_kit.learn.data import LearningData, curriculum, from_verdicts, training_prompts
from mlbench_kit.learn_config import LearnConfig
from mlbench_kit.progress import bars_only_on_tty
from mlbench_kit.stages import stage


def resolve_config(args: argparse.Namespace) -> LearnConfig:
    """The run's options: ``--config`` (else the defaults), then every flag given, then ``--set``."""
    return resolve(stage("learn"), args)


WRITE_DATA = ("sft.jsonl", "pairs.jsonl", "data.json")  # write_data's files


def write_data(out: Path, data: LearningData) -> None:
    """The ``data`` method's files: SFT records (prep's format), pairs, and the counts."""
    write_jsonl_atomic(out / "sft.jsonl", [r.to_json() for r in data.sft])
    write_jsonl_atomic(out / "pairs.jsonl", data.pairs)
    write_json_atomic(out / "data.json", data.stats)
    s = data.stats
    print(f"learn: {s['passed']}/{s['answers']} answers passed on {s['rows_with_pass']}/{s['rows']} rows -> "
          f"{len(data.sft)} SFT records ({s['sft_gold']} gold), {s['pairs']} pairs", file=sys.stderr)


def learn(cfg: LearnConfig) -> int:
    """Run ``cfg.method``; returns the exit status."""
    cfg.require_inputs()
    prompts = training_prompts(cfg)  # the leak check and the inputs' errors, before anything is written
    if cfg.method in ("dpo", "grpo"):
        from mlbench_kit.learn.trl_recipes import adapter_lineage
        adapter_lineage(cfg)  # the start adapter's record is published with the result: checked before training
    data: LearningData | None = None
    kept: list[dict[str, Any]] = []
    if cfg.method == "grpo":
        prompts, kept = curriculum(cfg, prompts)
    if cfg.method == "data" or (cfg.method == "dpo" and cfg.generations):  # read (and checked) before writing too
        data = from_verdicts(cfg, str(cfg.generations), str(cfg.results), cfg.rft.include_gold, cfg.rft.max_per_row)
        if cfg.method == "dpo" and not data.pairs:
            raise MLBenchError("no preference pairs: no training row has both a passing and a failing answer",
                               str(cfg.results), "sample more answers per row (k), or set dpo.gold_as_chosen")
    out = Path(str(cfg.out))
    if cfg.method == "rft":
        from mlbench_kit.learn.rft import RFTRecipe
        RFTRecipe(cfg).check()
    made = not out.exists()
    ours = [n for n in ("learn.json", "config.yaml", "curriculum.jsonl", *WRITE_DATA) if not (out / n).exists()]
    out.mkdir(parents=True, exist_ok=True)
    claim_run_folder(out / "learn.json", {k: v for k, v in to_dict(cfg).items() if k != "out"})
    save_resolved(cfg, out / "config.yaml")
    try:
        return _run_method(cfg, out, prompts, data, kept)
    except BaseException:
        if "learn.json" in ours and not _progress(out):  # refused before any step ran (a model that does not load)
            for name in ours:  # the files this call wrote, so that the corrected command is not "other settings"
                (out / name).unlink(missing_ok=True)
            if made:
                with contextlib.suppress(OSError):
                    out.rmdir()
        raise


def _progress(out: Path) -> bool:
    """Whether ``out`` holds work of a step: an rft round (its log names the failure), a trainer's checkpoint, a
    reward batch or an adapter."""
    return any(out.glob("round-*")) or any((out / "trainer").glob("checkpoint-*")) or (out / "rewards").exists() \
        or (out / "adapter").exists()


def _run_method(cfg: LearnConfig, out: Path, prompts: dict, data: LearningData | None,
                kept: list[dict[str, Any]]) -> int:
    if kept:
        write_jsonl_atomic(out / "curriculum.jsonl", kept)
        rates = ", ".join(f"{r['pass_rate']:.2f}" for r in kept)
        print(f"learn: grpo.curriculum mixed: {len(kept)} training rows hold both a pass and a fail (pass rates "
              f"{rates})", file=sys.stderr)
    if data is not None:
        write_data(out, data)
        if cfg.method == "data":
            return 0
    if cfg.method == "rft":
        from mlbench_kit.learn.rft import RFTRecipe
        recipe = RFTRecipe(cfg)
        recipe.setup()
        recipe.train()
        return 0
    from mlbench_kit.learn.trl_recipes import DPORecipe, GRPORecipe
    if cfg.method == "dpo":
        dpo = DPORecipe(cfg, out / "pairs.jsonl", {k: r.template for k, r in prompts.items()})
        dpo.setup()
        dpo.train()
    else:
        grpo = GRPORecipe(cfg, prompts)
        grpo.setup()
        grpo.train()
    return 0


def run(args: argparse.Namespace) -> int:
    """``mlbench learn``: the options resolved into a :class:`LearnConfig`, then :func:`learn`."""
    return learn(resolve_config(args))


def main(argv: list[str] | None = None) -> int:
    """``accelerate launch learn/run.py ...`` (or ``python learn/run.py``): the same options as `mlbench learn`."""
    bars_only_on_tty()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_options(parser, stage("learn"))
    try:
        return run(parser.parse_args(argv))
    except MLBenchError as exc:
        print(f"error: {exc.render()}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
