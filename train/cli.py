"""`mlbench train` and `train/lora.py`'s command line: the resolved config (the options are generated from
:class:`~mlbench_kit.train_config.TrainConfig`'s declaration, :mod:`mlbench_kit.flags`), the run.

Kept apart from the recipe (train/lora.py), which imports torch, transformers, PEFT and accelerate at its top:
`mlbench train --help` and a mistyped option answer at once, and the recipe is imported only to train.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from mlbench_kit.config import save_resolved
from mlbench_kit.errors import MLBenchError
from mlbench_kit.flags import check_config, config_path, resolve
from mlbench_kit.hf import check_model_available
from mlbench_kit.progress import logs_to_file, replay_held_logs
from mlbench_kit.stages import stage
from mlbench_kit.train_config import TrainConfig

TRAIN_LOG = Path("logs") / "train.log"  # under the run's folder


def preflight(cfg: TrainConfig) -> None:
    """What a run needs before anything is written: a model that can be loaded, then the prep records."""
    check_model_available(str(cfg.model), "--model")
    data = cfg.data_file()
    if not data.is_file():
        d = cfg.data
        raise MLBenchError(f"no prep records for the {d.split} split, task {d.task}", str(data),
                           f"run `mlbench prep --tasks {d.task} --template {cfg.template} --tokenizer {cfg.model} "
                           f"--out {d.prep_dir} ...` first (see docs/prep.md), or pass --prep-dir DIR")


def launch_command(cfg_file: Path, args: argparse.Namespace) -> list[str]:
    """accelerate's launcher running the recipe module (``-m mlbench_kit.train.lora``: no checkout path needed) on
    the resolved config, with ``--nproc`` processes and ``--accelerate-config``'s settings."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch"]
    acc: dict[str, Any] = {}
    if args.accelerate_config:
        p = Path(args.accelerate_config)
        if not p.is_file():
            raise MLBenchError("accelerate config not found", str(p), "pass one of configs/accelerate/*.yaml "
                               "(`mlbench configs ls accelerate`)")
        acc = yaml.safe_load(p.read_text()) or {}
        if not isinstance(acc, dict):
            raise MLBenchError("an accelerate config is a YAML mapping", str(p))
        cmd += ["--config_file", str(p)]
    if args.nproc is not None:
        if args.nproc < 1:
            raise MLBenchError(f"--nproc must be at least 1, got {args.nproc}", "--nproc")
        cmd += ["--num_processes", str(args.nproc)]
        if not args.accelerate_config and args.nproc > 1:  # no config: data parallel, as `accelerate launch
            cmd += ["--multi_gpu"]                            # --multi_gpu --num_processes N`
    if "OMP_NUM_THREADS" not in os.environ:
        # accelerate's default is one thread per process (all the cores only for `--cpu`): a CPU run used one core
        cmd += ["--num_cpu_threads_per_process", str(max(1, len(os.sched_getaffinity(0)) // (args.nproc or 1)))]
    if int(acc.get("num_machines") or 1) == 1 and "main_process_port" not in acc:
        cmd += ["--main_process_port", "0"]  # one machine: any free port, so two runs on a node do not collide
    return [*cmd, "-m", "mlbench_kit.train.lora", "--config", str(cfg_file), "--resume", args.resume]


def launch(cfg: TrainConfig, args: argparse.Namespace) -> int:
    """``mlbench train --nproc N`` / ``--accelerate-config FILE``: the same run as ``accelerate launch train/lora.py``,
    launched from here. The resolved config goes to the processes as one file, so they train exactly what this
    command resolved; the launcher's exit status is the command's."""
    with tempfile.TemporaryDirectory(prefix="mlbench-train-") as tmp:
        cfg_file = Path(tmp) / "config.yaml"
        save_resolved(cfg, cfg_file)
        cmd = launch_command(cfg_file, args)
        print(f"train: launching through accelerate: {shlex.join(cmd)}", file=sys.stderr, flush=True)
        return subprocess.run(cmd, check=False).returncode


def run(args: argparse.Namespace, recipe: Any = None) -> int:
    """Entry point shared by `accelerate launch train/lora.py` (which passes its ``recipe`` class) and `mlbench
    train` (which launches the processes itself with ``--nproc``/``--accelerate-config``)."""
    st = stage("train")
    if getattr(args, "check", False):  # `accelerate launch train/lora.py --check` too: validate, run nothing
        return check_config(st, args)
    path = config_path(st, args)
    cfg = resolve(st, args)
    launching = args.nproc is not None or args.accelerate_config is not None
    if launching and recipe is not None:
        raise MLBenchError("--nproc and --accelerate-config are `mlbench train`'s", "--nproc",
                           "under `accelerate launch train/lora.py`, give them to accelerate (--num_processes, "
                           "--config_file)")
    if os.environ.get("RANK", "0") == "0":
        print(f"train: config {path}{'' if args.config else ' (the default; --config to choose)'}, model "
              f"{cfg.model}, data {cfg.data_file()}, output {cfg.out}", file=sys.stderr, flush=True)
    preflight(cfg)
    if launching:
        return launch(cfg, args)
    # the libraries' own output (bitsandbytes' kernels notice, DeepSpeed's accelerator warning, C++ messages) goes
    # to the run's log, as infer's does; the recipe's own lines go to the terminal (run_.term)
    log = Path(str(cfg.out)) / TRAIN_LOG
    main = os.environ.get("RANK", "0") == "0"
    with logs_to_file(log, "train") as con:
        if main:
            con.say(f"train: library logs in {log}")
        if recipe is None:
            from .lora import LoRAFinetuneRecipe as recipe  # the heavy imports, only now that training starts
        replay_held_logs()  # what the libraries said while `accelerate launch train/lora.py` imported them
        run_ = recipe(cfg, args.resume)
        run_.term = con.stream
        if run_.finished():
            if main:
                con.say(f"train: already finished: {run_.final_adapter}")
            return 0
        run_.setup()
        try:
            code = run_.train()
            if code == 0:
                run_.publish()
            return code
        finally:
            run_.cleanup()
