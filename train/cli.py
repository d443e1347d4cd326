"""`mlbench train` and `train/lora.py`'s command line: the resolved config (the options are generated from
:class:`~mlbench_kit.train_config.TrainConfig`'s declaration, :mod:`mlbench_kit.flags`), the run.

Kept apart from the recipe (train/lora.py), which imports torch, transformers, PEFT and accelerate at its top:
`mlbench train --help` and a mistyped option answer at once, and the recipe is imported only to train.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from mlbench_kit.errors import MLBenchError
from mlbench_kit.flags import config_path, resolve
from mlbench_kit.hf import check_model_available
from mlbench_kit.stages import stage
from mlbench_kit.train_config import TrainConfig


def preflight(cfg: TrainConfig) -> None:
    """What a run needs before anything is written: a model that can be loaded, then the prep records."""
    check_model_available(str(cfg.model), "--model")
    data = cfg.data_file()
    if not data.is_file():
        d = cfg.data
        raise MLBenchError(f"no prep records for the {d.split} split, task {d.task}", str(data),
                           f"run `mlbench prep --tasks {d.task} --template {cfg.template} --tokenizer {cfg.model} "
                           f"--out {d.prep_dir} ...` first (see docs/prep.md), or pass --prep-dir DIR")


def run(args: argparse.Namespace, recipe: Any = None) -> int:
    """Entry point shared by `accelerate launch train/lora.py` (which passes its ``recipe`` class) and `mlbench
    train`."""
    st = stage("train")
    path = config_path(st, args)
    cfg = resolve(st, args)
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
