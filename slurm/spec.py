"""The sweep file: models × training splits × tasks × seeds, the options of each stage, cluster resources.

Every mistake is reported with the sweep file's line (``paper.yaml:12: unknown key 'seed'``).
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from mlbench_kit.errors import MLBenchError
from mlbench_kit.records import TASKS

SPLITS = ("none", "id", "ood")  # none: the base model, no fine-tuning
STAGES = ("prep", "train", "infer", "eval", "report")

_RESOURCES = {"nodes": 1, "gpus_per_node": 0, "cpus": 4, "mem": "16G", "time": "01:00:00",
              "processes_per_node": None, "accelerate_config": None}
DEFAULTS: dict[str, Any] = {
    "name": None,
    "run_dir": None,
    "data": "super-dainiu/ml-bench",
    "models": {},
    "tasks": list(TASKS),
    "splits": ["none", "id", "ood"],
    "seeds": [42],
    "prep": {},
    "train": {},
    "infer": {"split": "test"},
    "eval": {},
    "report": {},
    "slurm": {"partition": None, "account": None, "setup": [], "extra": [], "signal_before_s": 300,
              "requeue": True, "max_requeues": 20, "env": {},
              "resources": {s: dict(_RESOURCES) for s in STAGES}},
}
_MODEL_KEYS = {"path", "train_config", "tokenizer", "prep", "train", "infer", "eval"}
_PATH_KEYS = ("train_config",)


@dataclass(frozen=True)
class Cell:
    """One (model, split, task, seed): a train (unless split is none) → infer → eval chain."""

    model: str
    split: str
    task: int
    seed: int

    @property
    def key(self) -> str:
        return f"{self.model}.{self.split}.task{self.task}.s{self.seed}"

    @property
    def rel_dir(self) -> str:
        return f"{self.model}/{self.split}/task{self.task}/s{self.seed}"


@dataclass
class Sweep:
    """A validated sweep file, paths resolved against ``root`` (where the jobs run)."""

    cfg: dict[str, Any]
    source: str
    root: Path

    @property
    def name(self) -> str:
        return self.cfg["name"]

    @property
    def run_dir(self) -> Path:
        return (self.root / self.cfg["run_dir"]).resolve()

    @property
    def models(self) -> dict[str, dict[str, Any]]:
        return self.cfg["models"]

    def cells(self) -> list[Cell]:
        """Every cell, in a fixed order: models, then splits, tasks and seeds as the file lists them."""
        c = self.cfg
        return [Cell(m, s, t, k) for m, s, t, k in itertools.product(c["models"], c["splits"], c["tasks"], c["seeds"])]

    def resources(self, stage: str) -> dict[str, Any]:
        return self.cfg["slurm"]["resources"][stage]

    def options(self, stage: str, model: str) -> dict[str, Any]:
        """A stage's command-line options: the sweep's, then the model's own on top."""
        return {**self.cfg[stage], **self.models[model].get(stage, {})}


class _Lines:
    """Line numbers of a YAML file's mapping keys, for file:line errors."""

    def __init__(self, text: str, source: str) -> None:
        self.source, self.lines = source, {}
        try:
            self._walk(yaml.compose(text), ())
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f"{source}:{mark.line + 1}" if mark else source
            raise MLBenchError(f"bad YAML: {getattr(exc, 'problem', exc)}", where) from None

    def _walk(self, node: Any, path: tuple) -> None:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                self.lines[path + (k.value,)] = k.start_mark.line + 1
                self._walk(v, path + (k.value,))

    def at(self, *path: str) -> str:
        for n in range(len(path), 0, -1):
            if path[:n] in self.lines:
                return f"{self.source}:{self.lines[path[:n]]}"
        return self.source


def _strict(path: tuple) -> bool:
    """Mappings whose keys are fixed; the rest (stage options, models, env) are free-form."""
    return path in ((), ("slurm",)) or path[:2] == ("slurm", "resources")


def _merge(base: dict[str, Any], over: dict[str, Any], lines: _Lines, path: tuple = ()) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if k not in base:
            raise MLBenchError(f"unknown key {'.'.join(path + (k,))!r}", lines.at(*path, k),
                               f"known keys here: {sorted(base)}")
        if isinstance(base[k], dict) and not isinstance(v, dict):
            raise MLBenchError(f"{'.'.join(path + (k,))} must be a mapping", lines.at(*path, k))
        if isinstance(v, dict) and _strict(path + (k,)):
            out[k] = _merge(base[k], v, lines, path + (k,))
        elif isinstance(v, dict):
            out[k] = {**base[k], **v}
        else:
            out[k] = v
    return out


def load_sweep(path: str | Path, root: str | Path = ".") -> Sweep:
    """Read and validate a sweep file; relative paths in it are relative to ``root`` (the repository root)."""
    p = Path(path)
    if not p.is_file():
        raise MLBenchError("sweep file not found", str(p), "pass one of configs/sweeps/*.yaml")
    text = p.read_text()
    lines = _Lines(text, str(p))
    raw = yaml.safe_load(text) or {}
    if not isinstance(raw, dict):
        raise MLBenchError("a sweep file is a YAML mapping", str(p))
    cfg = _merge(DEFAULTS, raw, lines)
    root = Path(root).resolve()
    _validate(cfg, lines, root)
    return Sweep(cfg, str(p), root)


def _validate(cfg: dict[str, Any], lines: _Lines, root: Path) -> None:
    def need(ok: bool, what: str, *at: str, fix: str = "") -> None:
        if not ok:
            raise MLBenchError(what, lines.at(*at), fix or None)

    need(isinstance(cfg["name"], str) and cfg["name"].replace("-", "").replace("_", "").isalnum(),
         "`name` is required: letters, digits, - and _", "name")
    cfg["run_dir"] = cfg["run_dir"] or f"runs/sweeps/{cfg['name']}"
    need(isinstance(cfg["models"], dict) and cfg["models"], "`models` must name at least one model", "models")
    for name, m in cfg["models"].items():
        need(isinstance(m, dict) and "path" in m, f"model {name!r} needs `path` (hub id or folder)", "models", name)
        unknown = set(m) - _MODEL_KEYS
        need(not unknown, f"unknown key(s) {sorted(unknown)} in model {name!r}", "models", name,
             fix=f"known keys: {sorted(_MODEL_KEYS)}")
        need(name.replace("-", "").replace("_", "").replace(".", "").isalnum(),
             f"model name {name!r}: letters, digits, '.', '-' and '_' only (it names folders)", "models", name)
        for k in _PATH_KEYS:
            if m.get(k) is not None:
                need((root / m[k]).is_file(), f"{k} not found: {m[k]}", "models", name, k)
        for stage in ("prep", "train", "infer", "eval"):
            need(isinstance(m.get(stage, {}), dict), f"models.{name}.{stage} must be a mapping", "models", name)
    need(all(t in TASKS for t in cfg["tasks"]) and cfg["tasks"], "tasks must be a list of 1, 2, 3", "tasks")
    need(all(s in SPLITS for s in cfg["splits"]) and cfg["splits"], f"splits must be a list of {SPLITS}", "splits")
    need(all(isinstance(s, int) for s in cfg["seeds"]) and cfg["seeds"], "seeds must be a list of integers", "seeds")
    if set(cfg["splits"]) - {"none"}:
        for name, m in cfg["models"].items():
            need(m.get("train_config") is not None, f"model {name!r} needs `train_config` to train the ID/OOD splits",
                 "models", name, fix="e.g. train_config: configs/train/codellama-7b-instruct.yaml")
    for stage in ("prep", "train", "infer", "eval", "report"):
        need(isinstance(cfg[stage], dict), f"`{stage}` must be a mapping of the stage's options", stage)
    for stage, key in (("infer", "config"), ("eval", "envs"), ("report", "reference")):
        if cfg[stage].get(key):
            need((root / cfg[stage][key]).is_file(), f"{stage}.{key} not found: {cfg[stage][key]}", stage, key)
    acc = cfg["slurm"]["resources"]["train"]["accelerate_config"]
    if acc:
        need((root / acc).is_file(), f"accelerate_config not found: {acc}", "slurm", "resources", "train")
    for stage in STAGES:
        r = cfg["slurm"]["resources"][stage]
        need(isinstance(r["nodes"], int) and r["nodes"] >= 1, "nodes must be a positive integer",
             "slurm", "resources", stage)
        need(stage == "train" or r["nodes"] == 1, f"only training spans nodes; {stage} runs on one",
             "slurm", "resources", stage)
        need(isinstance(r["gpus_per_node"], int) and r["gpus_per_node"] >= 0, "gpus_per_node must be >= 0",
             "slurm", "resources", stage)
    need(isinstance(cfg["slurm"]["signal_before_s"], int) and cfg["slurm"]["signal_before_s"] > 0,
         "signal_before_s must be a positive integer (seconds)", "slurm", "signal_before_s")
