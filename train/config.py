"""Training configuration: a YAML file per model family, command-line overrides, the resolved copy saved."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from mlbench_kit.errors import MLBenchError

SPLIT_DIRS = {"id": "id_train", "ood": "ood_train"}
BATCHING = ("packing", "grouped", "padding")

DEFAULTS: dict[str, Any] = {
    "model": None,  # hub id or local folder
    "family": None,  # codellama | deepseek-coder | llama2 | tiny
    "template": "llama-inst",  # the prep template the records must have been rendered with
    "data": {"prep_dir": "prep", "task": 3, "split": "id", "path": None, "eval_fraction": 0.05,
             "max_seq_len": 8192, "batching": "packing", "micro_batch_size": 1},
    "lora": {"r": 16, "alpha": 32, "dropout": 0.05,
             "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]},
    "quantization": None,  # null | nf4 (QLoRA: NF4, double quantization, bf16 compute on GPU)
    "optim": {"lr": 2e-4, "weight_decay": 0.0, "warmup_ratio": 0.03, "scheduler": "cosine", "epochs": 3,
              "max_steps": -1, "grad_accum": 8, "max_grad_norm": 1.0},
    "gradient_checkpointing": True,
    "attn_implementation": "sdpa",  # flash_attention_2 on GPUs that have it: packed batches then run varlen
    "seed": 42,
    "checkpoint": {"every_steps": 100, "keep": 2},
    "logging": {"every_steps": 1, "tensorboard": True, "wandb": False, "wandb_project": "mlbench-kit"},
    "merge": False,  # also write merged full weights at the end
    "output_dir": "runs/train/{family}-task{task}-{split}-s{seed}",
}

# Short command-line flags for the keys people change most; anything else goes through --set a.b=value.
SHORTCUTS = {"task": "data.task", "split": "data.split", "lr": "optim.lr", "epochs": "optim.epochs",
             "max_steps": "optim.max_steps", "seed": "seed", "model": "model", "output_dir": "output_dir",
             "batching": "data.batching", "max_seq_len": "data.max_seq_len", "prep_dir": "data.prep_dir",
             "grad_accum": "optim.grad_accum", "micro_batch_size": "data.micro_batch_size"}


def _merge(base: dict[str, Any], over: dict[str, Any], where: str, prefix: str = "") -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if k not in base:
            raise MLBenchError(f"unknown config key {prefix + k!r}", where,
                               f"known keys here: {sorted(base)}")
        out[k] = _merge(base[k], v, where, f"{prefix}{k}.") if isinstance(base[k], dict) and isinstance(v, dict) else v
    return out


def _set(cfg: dict[str, Any], dotted: str, value: Any, where: str) -> None:
    node = cfg
    *parents, last = dotted.split(".")
    for p in parents:
        if not isinstance(node.get(p), dict):
            raise MLBenchError(f"unknown config key {dotted!r}", where)
        node = node[p]
    if last not in node:
        raise MLBenchError(f"unknown config key {dotted!r}", where, f"known keys: {sorted(node)}")
    node[last] = value


def load_train_config(path: str | Path | None, overrides: dict[str, Any], sets: list[str] | None = None
                      ) -> dict[str, Any]:
    """Defaults <- YAML file <- shortcut overrides <- ``--set a.b=value`` (YAML-parsed values); validated."""
    raw: dict[str, Any] = {}
    where = str(path) if path else "--config"
    if path:
        p = Path(path)
        if not p.is_file():
            raise MLBenchError("config not found", str(p), "pass one of configs/train/*.yaml")
        raw = yaml.safe_load(p.read_text()) or {}
    cfg = _merge(DEFAULTS, raw, where)
    for key, value in overrides.items():
        if value is not None:
            _set(cfg, SHORTCUTS[key], value, f"--{key.replace('_', '-')}")
    for item in sets or []:
        if "=" not in item:
            raise MLBenchError(f"--set needs key=value, got {item!r}", "--set")
        k, v = item.split("=", 1)
        _set(cfg, k, yaml.safe_load(v), "--set")
    validate(cfg, where)
    d = cfg["data"]
    cfg["output_dir"] = cfg["output_dir"].format(family=cfg["family"], task=d["task"], split=d["split"],
                                                 seed=cfg["seed"])
    return cfg


def validate(cfg: dict[str, Any], where: str) -> None:
    d = cfg["data"]
    checks = [
        (cfg["model"], "no model given", "set `model:` in the config or pass --model"),
        (d["task"] in (1, 2, 3), f"task must be 1, 2 or 3, got {d['task']!r}", "--task 1|2|3"),
        (d["split"] in SPLIT_DIRS, f"split must be id or ood, got {d['split']!r}", "--split id|ood"),
        (d["batching"] in BATCHING, f"unknown batching {d['batching']!r}", f"use one of {BATCHING}"),
        (cfg["quantization"] in (None, "nf4"), f"unknown quantization {cfg['quantization']!r}", "null or nf4"),
        (0 <= d["eval_fraction"] < 1, "eval_fraction must be in [0, 1)", "e.g. 0.05"),
        (cfg["lora"]["r"] > 0 and cfg["lora"]["target_modules"], "lora.r and lora.target_modules are needed", ""),
    ]
    for ok, what, fix in checks:
        if not ok:
            raise MLBenchError(what, where, fix)


def data_file(cfg: dict[str, Any]) -> Path:
    """data.path if given, else ``prep_dir/<id_train|ood_train>/task{t}.jsonl``."""
    d = cfg["data"]
    if d["path"]:
        return Path(d["path"])
    return Path(d["prep_dir"]) / SPLIT_DIRS[d["split"]] / f"task{d['task']}.jsonl"


def save_resolved(cfg: dict[str, Any], path: Path) -> None:
    from mlbench_kit.io import write_atomic
    write_atomic(path, yaml.safe_dump(cfg, sort_keys=False))
