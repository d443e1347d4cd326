"""The sweep file: models × training splits × tasks × seeds, the options of each stage, cluster resources.

Every mistake is reported with the sweep file's line (``paper.yaml:12: unknown key 'seed'``).
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from mlbench_kit.config import Check, Lines, load, read_yaml, to_dict
from mlbench_kit.errors import MLBenchError
from mlbench_kit.records import TASKS

STAGES = ("prep", "train", "infer", "agent", "eval", "learn", "report")
LEARN_SPLITS = {"id": "id_train", "ood": "ood_train"}  # a tuned cell's split -> the prep split learn trains on

# What the sbatch script holds of a sweep file, each value to its Slurm syntax: a value is data in the script (a
# newline in `partition` would end the #SBATCH block and run the rest as a command when the job starts)
_NAME = re.compile(r"[A-Za-z0-9_.-]+")  # a Slurm partition or account name
_PARTITIONS = re.compile(r"[A-Za-z0-9_.-]+(,[A-Za-z0-9_.-]+)*")  # sbatch --partition takes a list
# sbatch --time: minutes, minutes:seconds, hours:minutes:seconds, days-hours[:minutes[:seconds]], or no limit
_TIME = re.compile(r"\d+(:\d+){0,2}|\d+-\d+(:\d+){0,2}|UNLIMITED|INFINITE|unlimited|infinite")
_MEM = re.compile(r"\d+[KMGT]?")  # sbatch --mem: megabytes, or a K, M, G or T suffix
_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # a shell variable's name
# one sbatch option on its #SBATCH line (a comment to bash: only a line break could end it)
_EXTRA = re.compile(r"--?[A-Za-z][A-Za-z0-9-]*(=[^\x00-\x1f\x7f]*)?")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def check_syntax(value: Any, pattern: re.Pattern[str], what: str, where: str, example: str) -> None:
    """``value`` (a string or a number) must match ``pattern`` whole, else one error naming ``where``."""
    if isinstance(value, bool) or not isinstance(value, (str, int)) or not pattern.fullmatch(str(value)):
        raise MLBenchError(f"{what} {value!r} is not in Slurm's syntax", where, f"e.g. {example}")


@dataclass
class ModelSpec:
    """One model of the sweep: where it is, how to train it, and its own stage options."""

    path: str  # hub id or folder
    train_config: str | None = None
    tokenizer: str | None = None
    prep: dict[str, Any] = field(default_factory=dict)
    train: dict[str, Any] = field(default_factory=dict)
    infer: dict[str, Any] = field(default_factory=dict)
    agent: dict[str, Any] = field(default_factory=dict)  # only with the sweep's own `agent:` section
    eval: dict[str, Any] = field(default_factory=dict)
    learn: dict[str, Any] = field(default_factory=dict)  # only with the sweep's own `learn:` section


@dataclass
class Resources:
    """What one array task of a stage asks Slurm for."""

    nodes: int = 1
    gpus_per_node: int = 0
    cpus: int = 4
    mem: str | int | None = "16G"  # 0: all of the node's memory
    time: str = "01:00:00"
    processes_per_node: int | None = None
    accelerate_config: str | None = None

    def check(self, at: Check) -> None:
        if self.nodes < 1:
            raise MLBenchError("nodes must be a positive integer", at("nodes"))
        if self.gpus_per_node < 0:
            raise MLBenchError("gpus_per_node must be >= 0", at("gpus_per_node"))
        if self.cpus < 1:
            raise MLBenchError("cpus must be a positive integer", at("cpus"))
        check_syntax(self.time, _TIME, "time", at("time"), '"01:30:00" or "2-00:00:00"')
        if self.mem is not None:
            check_syntax(self.mem, _MEM, "mem", at("mem"), '"16G" or 0 (all of the node\'s memory)')


@dataclass
class SlurmConfig:
    partition: str | None = None
    account: str | None = None
    setup: list[str] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)
    signal_before_s: int = 300
    requeue: bool = True
    max_requeues: int = 20
    env: dict[str, Any] = field(default_factory=dict)
    resources: dict[str, Resources] = field(default_factory=dict)

    def check(self, at: Check) -> None:
        if self.signal_before_s <= 0:
            raise MLBenchError("signal_before_s must be a positive integer (seconds)", at("signal_before_s"))
        if self.partition is not None:
            check_syntax(self.partition, _PARTITIONS, "partition", at("partition"), "gpu or gpu,cpu")
        if self.account is not None:
            check_syntax(self.account, _NAME, "account", at("account"), "my-project")
        for key, value in self.env.items():
            check_syntax(key, _ENV_KEY, "env key", at(f"env.{key}"), "NCCL_SOCKET_IFNAME")
            if isinstance(value, (dict, list)) or (isinstance(value, str) and "\x00" in value):
                raise MLBenchError(f"env.{key} must be a string or a number (no NUL byte)", at(f"env.{key}"))
        for i, line in enumerate(self.extra):
            check_syntax(line, _EXTRA, "extra option", at(f"extra.{i}"), "--exclusive or --constraint=a100")
        for stage in self.resources:
            if stage not in STAGES:
                raise MLBenchError(f"unknown stage {stage!r} under resources", at(f"resources.{stage}"),
                                   f"stages: {STAGES}")
        for stage in STAGES:
            if stage not in ("agent", "learn"):  # their defaults: infer's, train's on one node (Sweep.resources)
                self.resources.setdefault(stage, Resources())
        for stage, r in self.resources.items():
            if stage != "train" and r.nodes != 1:
                raise MLBenchError(f"only training spans nodes; {stage} runs on one", at(f"resources.{stage}.nodes"))


@dataclass
class SweepConfig:
    """A sweep file: models x training splits x tasks x seeds, the options of each stage, cluster resources.
    Stage options are written as the stage's long options (``max_context_tokens: 8192`` ->
    ``--max-context-tokens 8192``)."""

    name: str
    models: dict[str, ModelSpec]
    run_dir: str | None = None
    data: str = "super-dainiu/ml-bench"
    tasks: list[int] = field(default_factory=lambda: list(TASKS))
    splits: list[Literal["none", "id", "ood"]] = field(default_factory=lambda: ["none", "id", "ood"])
    seeds: list[int] = field(default_factory=lambda: [42])
    prep: dict[str, Any] = field(default_factory=dict)
    train: dict[str, Any] = field(default_factory=dict)
    infer: dict[str, Any] = field(default_factory=dict)  # defaults: InferConfig's (split: full, as eval's)
    # AgentConfig's options: with this section, each cell also runs `mlbench agent` and scores its generations
    agent: dict[str, Any] | None = None
    eval: dict[str, Any] = field(default_factory=dict)
    # LearnConfig's options: with this section, each tuned cell also runs `mlbench learn` from its SFT adapter, and
    # the learned adapter goes through infer and eval as train's does
    learn: dict[str, Any] | None = None
    report: dict[str, Any] = field(default_factory=dict)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)

    def check(self, at: Check) -> None:
        if not self.name.replace("-", "").replace("_", "").isalnum():
            raise MLBenchError("`name`: letters, digits, - and _", at("name"))
        self.run_dir = self.run_dir or f"runs/sweeps/{self.name}"
        if _CONTROL.search(self.run_dir):
            raise MLBenchError(f"run_dir {self.run_dir!r} holds a control character (a newline, a tab, ...)",
                               at("run_dir"), "a plain path")
        if not self.models:
            raise MLBenchError("`models` must name at least one model", at("models"))
        for name in self.models:
            if not name.replace("-", "").replace("_", "").replace(".", "").isalnum():
                raise MLBenchError(f"model name {name!r}: letters, digits, '.', '-' and '_' only (it names folders)",
                                   at(f"models.{name}"))
        if not self.tasks or any(t not in TASKS for t in self.tasks):
            raise MLBenchError("tasks must be a list of 1, 2, 3", at("tasks"))
        if not self.splits or not self.seeds:
            raise MLBenchError("splits and seeds must not be empty", at("splits" if not self.splits else "seeds"))
        if set(self.splits) - {"none"}:
            for name, m in self.models.items():
                if m.train_config is None:
                    raise MLBenchError(f"model {name!r} needs `train_config` to train the ID/OOD splits",
                                       at(f"models.{name}"),
                                       "e.g. train_config: configs/train/codellama-7b-instruct.yaml")
        for name, m in self.models.items():
            if m.agent and self.agent is None:
                raise MLBenchError(f"model {name!r} has agent options but the sweep has no `agent:` section",
                                   at(f"models.{name}.agent"), "add `agent:` (its options for every model) at the top")
            if m.learn and self.learn is None:
                raise MLBenchError(f"model {name!r} has learn options but the sweep has no `learn:` section",
                                   at(f"models.{name}.learn"), "add `learn:` (its options for every model) at the top")
        if self.learn is not None and set(self.splits) == {"none"}:
            raise MLBenchError("learn starts from a cell's SFT adapter, but the sweep trains none (splits: [none])",
                               at("learn"), "add id (or ood) to splits, or remove the learn section")


@dataclass(frozen=True)
class Cell:
    """One (model, split, task, seed): a train (unless split is none) -> infer -> eval chain."""

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

    cfg: SweepConfig
    source: str
    root: Path
    lines: Lines = field(default_factory=lambda: Lines("sweep"))

    def where(self, stage: str, model: str | None, key: str) -> str:
        """The sweep file's line that set ``key`` of ``stage`` (the model's own options first)."""
        if model is not None and key in getattr(self.models[model], stage, {}):
            return self.lines.at(f"models.{model}.{stage}.{key}")
        if key in (getattr(self.cfg, stage, None) or {}):
            return self.lines.at(f"{stage}.{key}")
        return self.lines.at(f"models.{model}" if model else stage)

    @property
    def name(self) -> str:
        return self.cfg.name

    @property
    def run_dir(self) -> Path:
        return (self.root / str(self.cfg.run_dir)).resolve()

    @property
    def models(self) -> dict[str, ModelSpec]:
        return self.cfg.models

    def cells(self) -> list[Cell]:
        """Every cell, in a fixed order: models, then splits, tasks and seeds as the file lists them."""
        c = self.cfg
        return [Cell(m, s, t, k) for m, s, t, k in itertools.product(c.models, c.splits, c.tasks, c.seeds)]

    @property
    def has_agent(self) -> bool:
        """Whether the sweep runs the agent stage (it has an ``agent:`` section)."""
        return self.cfg.agent is not None

    @property
    def has_learn(self) -> bool:
        """Whether the sweep runs the learn stage after train (it has a ``learn:`` section)."""
        return self.cfg.learn is not None

    def resources(self, stage: str) -> Resources:
        res = self.cfg.slurm.resources
        if stage == "agent":  # its own when the sweep gives them, else infer's
            return res.get("agent", res["infer"])
        if stage == "learn":  # its own when the sweep gives them, else train's on one node (learn is one process)
            return res.get("learn") or dataclasses.replace(res["train"], nodes=1)
        return res[stage]

    def options(self, stage: str, model: str) -> dict[str, Any]:
        """A stage's command-line options: the sweep's, then the model's own on top."""
        return {**(getattr(self.cfg, stage) or {}), **getattr(self.models[model], stage, {})}

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self.cfg)


def load_sweep(path: str | Path, root: str | Path = ".") -> Sweep:
    """Read and validate a sweep file; relative paths in it are relative to ``root`` (the repository root)."""
    p = Path(path)
    if not p.is_file():
        raise MLBenchError("sweep file not found", str(p), "pass one of configs/sweeps/*.yaml")
    raw, lines = read_yaml(p)
    for key in ("name", "models"):
        if key not in raw:
            raise MLBenchError(f"`{key}` is required", str(p))
    cfg = load(SweepConfig, raw=raw, lines=lines)
    root = Path(root).resolve()
    _check_files(cfg, lines, root)
    return Sweep(cfg, str(p), root, lines)


def _check_files(cfg: SweepConfig, lines: Lines, root: Path) -> None:
    """Files the sweep names must exist where the jobs will run."""
    def need(rel: str | None, what: str, key: str) -> None:
        if rel is not None and not (root / rel).is_file():
            raise MLBenchError(f"{what} not found: {rel}", lines.at(key))

    for name, m in cfg.models.items():
        need(m.train_config, "train_config", f"models.{name}.train_config")
    for stage, key in (("infer", "config"), ("eval", "envs"), ("report", "reference"), ("agent", "config"),
                       ("agent", "envs"), ("learn", "config")):
        need((getattr(cfg, stage) or {}).get(key), f"{stage}.{key}", f"{stage}.{key}")
    for key in ("repos_dir", "tarballs"):  # the agent's pristine checkouts
        rel = (cfg.agent or {}).get(key)
        if rel is not None and not (root / str(rel)).is_dir():
            raise MLBenchError(f"agent.{key} not found: {rel}", lines.at(f"agent.{key}"),
                               f"a folder of the checkouts, relative to {root}")
    need(cfg.slurm.resources["train"].accelerate_config, "accelerate_config",
         "slurm.resources.train.accelerate_config")
