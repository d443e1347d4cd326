"""`mlbench train` and `train/lora.py`'s command line: the options, the resolved config, the run.

Kept apart from the recipe (train/lora.py), which imports torch, transformers, PEFT and accelerate at its top:
`mlbench train --help` and a mistyped option answer at once, and the recipe is imported only to train.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from mlbench_kit.deprecation import deprecated_flag
from mlbench_kit.errors import MLBenchError
from mlbench_kit.hf import check_model_available
from mlbench_kit.records import TASKS
from mlbench_kit.train_config import OLD_FLAGS, SHORTCUTS, SPLITS, TrainConfig, load_train_config

DEFAULT_CONFIG = "configs/train/codellama-7b-instruct.yaml"  # the paper's main open model (the card's command)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``mlbench train`` and ``train/lora.py``: each sets a key of ``--config``'s file
    (:data:`~mlbench_kit.train_config.SHORTCUTS`); ``--set`` any other."""
    p.add_argument("--config", help=f"configs/train/<model>.yaml (default: {DEFAULT_CONFIG})")
    p.add_argument("--tasks", "--task", dest="tasks", type=int, choices=TASKS,
                   help="the task to train on, one per run (data.task; --task is the same option)")
    p.add_argument("--split", choices=SPLITS,
                   help="the prep split to train on: id_train (ID) or ood_train (OOD); id and ood are short for "
                        "them (data.split; default id_train)")
    p.add_argument("--out", help="output folder (output_dir; default "
                                 f"{TrainConfig.output_dir}, filled in)")
    deprecated_flag(p, "--output-dir", "--out")
    helps = {"lr": "learning rate", "epochs": "passes over the data", "max_steps": "stop after N optimizer steps "
             "(> 0; whatever the epochs)", "seed": "seed of the data order, init and sampling",
             "model": "base model: hub id or local folder", "batching": "packing, grouped or padding",
             "max_context_tokens": "prompt + answer + EOS of one example, capped at the model's positions",
             "prep_dir": "`mlbench prep --out` folder holding <split>/task<t>.jsonl",
             "grad_accum": "micro-batches per optimizer step", "micro_batch_size": "rows per micro-batch"}
    types = {"lr": float, "epochs": int, "max_steps": int, "seed": int, "max_context_tokens": int,
             "grad_accum": int, "micro_batch_size": int}
    for key, help_ in helps.items():
        p.add_argument(f"--{key.replace('_', '-')}", dest=key, type=types.get(key, str),
                       help=f"{help_} (sets {SHORTCUTS[key]})")
    for old, new in OLD_FLAGS.items():
        if old != "output_dir":
            deprecated_flag(p, f"--{old.replace('_', '-')}", f"--{new.replace('_', '-')}", type=types.get(new, str))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any other config key, dotted (e.g. --set lora.r=64 --set quantization=nf4)")
    p.add_argument("--resume", default="auto", help="auto (newest complete checkpoint, default), none, or a path")


def default_config() -> Path:
    """``configs/train/codellama-7b-instruct.yaml``: in the working folder, else beside this checkout's code."""
    here = Path(DEFAULT_CONFIG)
    return here if here.is_file() else Path(__file__).resolve().parents[1] / DEFAULT_CONFIG


def preflight(cfg: TrainConfig) -> None:
    """What a run needs before anything is written: a model that can be loaded, then the prep records."""
    check_model_available(str(cfg.model), "--model")
    data = cfg.data_file()
    if not data.is_file():
        d = cfg.data
        raise MLBenchError(f"no prep records for the {d.split} split, task {d.task}", str(data),
                           f"run `mlbench prep --tasks {d.task} --template {cfg.template} --tokenizer {cfg.model} "
                           f"--out {d.prep_dir} ...` first (see docs/prep.md), or pass --prep-dir DIR")


def resolve_config(args: argparse.Namespace) -> TrainConfig:
    """The run's config: ``--config`` (else the default), the shortcut flags, then ``--set``."""
    return load_train_config(args.config or default_config(), {k: getattr(args, k, None) for k in SHORTCUTS},
                             args.set)


def run(args: argparse.Namespace, recipe: Any = None) -> int:
    """Entry point shared by `accelerate launch train/lora.py` (which passes its ``recipe`` class) and `mlbench
    train`."""
    path = args.config or default_config()
    cfg = resolve_config(args)
    if os.environ.get("RANK", "0") == "0":
        print(f"train: config {path}{'' if args.config else ' (the default; --config to choose)'}, model "
              f"{cfg.model}, data {cfg.data_file()}, output {cfg.out}", file=sys.stderr, flush=True)
    preflight(cfg)
    if recipe is None:
        from .lora import LoRAFinetuneRecipe as recipe  # the heavy imports, only now that training starts
    run_ = recipe(cfg, args.resume)
    if run_.finished():
        if os.environ.get("RANK", "0") == "0":
            print(f"train: already finished: {run_.final_adapter}", file=sys.stderr)
        return 0
    run_.setup()
    try:
        code = run_.train()
        if code == 0:
            run_.publish()
        return code
    finally:
        run_.cleanup()
