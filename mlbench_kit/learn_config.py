"""`mlbench learn`'s options as one typed config (``configs/learn/*.yaml``): learning from execution verdicts.

Four methods share the inputs (a base model, the SFT adapter to start from, prep records of a *training* split,
the ML-Bench rows the checker needs, the environments) and the reward (:class:`RewardConfig`, strict by default):

- ``data``: a training split's generations and their eval results -> SFT records of passing answers and
  preference pairs (pass vs fail on the same prompt);
- ``rft``: rejection-sampling fine-tuning (expert iteration): rounds of sample k -> execute -> keep passing -> SFT;
- ``dpo``: DPO on the pass/fail pairs (TRL's ``DPOTrainer``), the SFT adapter as policy and reference;
- ``grpo``: GRPO online (TRL's ``GRPOTrainer``), a group of samples per prompt rewarded by execution.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from .agent_config import AgentSampling
from .config import Check, option
from .errors import MLBenchError
from .records import TASKS

METHODS = ("data", "rft", "dpo", "grpo")


@dataclass
class RewardConfig:
    """What an answer earns. ``pass``: 1 when the checker passes it, else 0. ``shaped``: that, plus partial credit
    for the share of required parameters it sets, its output type and a parseable answer (each weight 0 turns its
    term off). Answers the checker could not run (an environment fault) earn no reward at all (None: left out of
    the update), never 0."""

    mode: Literal["strict", "compat"] = option(
        "strict", "checker mode of the verdicts (compat passes a process still running at the time limit, so a "
        "model rewarded in compat can learn to sleep: use it only to reproduce the paper's checker)",
        flag="--reward-mode")
    kind: Literal["pass", "shaped"] = option("pass", "pass: the binary verdict; shaped: plus partial credit",
                                             flag="--reward-kind")
    params_weight: float = option(0.25, "shaped: weight of the share of the row's parameters the answer sets")
    type_weight: float = option(0.25, "shaped: weight of the output-type check (bash vs Python)")
    format_weight: float = option(0.0, "shaped: weight of an answer that parses to non-empty code")

    def check(self, at: Check) -> None:
        if min(self.params_weight, self.type_weight, self.format_weight) < 0:
            raise MLBenchError("reward weights are >= 0", at("params_weight"))


@dataclass
class LearnSampling(AgentSampling):
    """How learning samples answers (rft's rounds, grpo's groups): the benchmark's sampling (the agent's fields),
    256 new tokens per answer. Its fields are no options of `mlbench learn` (its ``--seed`` is the training seed):
    the config file's ``sampling:`` or ``--set sampling.KEY=VALUE`` sets them."""

    max_new_tokens: int = option(256, "new tokens per sample")
    seed: int = option(42, "sampling seed")


@dataclass
class RftConfig:
    """Rejection-sampling fine-tuning: ``rounds`` x (sample ``k`` per training prompt with the current adapter ->
    execute -> keep the passing answers -> SFT from the base model on them, with the gold answers when
    ``include_gold``)."""

    rounds: int = option(2, "rounds of sample -> execute -> SFT", flag=True)
    k: int = option(5, "samples per training prompt and round", flag=True)
    include_gold: bool = option(True, "train on the gold answers too (else on passing samples alone)")
    max_per_row: int = option(4, "distinct passing answers kept per row and round")
    train_config: str = option("configs/train/smollm2-135m-cpu.yaml", "`mlbench train` config of each round's SFT")
    train_set: list[str] = option(help="`--set KEY=VALUE` overrides of each round's training", factory=list)
    infer_config: str | None = option(None, "`mlbench infer` config of the sampling (engine; the sampling "
                                      "section here wins)")


@dataclass
class DpoConfig:
    """DPO on pass/fail pairs (TRL): the policy starts from the SFT adapter, the reference is a frozen copy of it."""

    beta: float = option(0.1, "DPO's beta (strength of the pull towards the reference)")
    loss_type: str = option("sigmoid", "TRL's loss_type (sigmoid: the DPO paper's)")
    max_pairs_per_row: int = option(4, "pairs per prompt (distinct passing x distinct failing, in sample order)")
    gold_as_chosen: bool = option(False, "rows with failing samples but no passing one: the gold answer is chosen")
    lr: float = option(5e-5, "learning rate")
    epochs: float = option(2.0, "passes over the pairs")
    max_steps: int = option(-1, "stop after N optimizer steps (> 0)")
    batch_size: int = option(2, "pairs per micro-batch")
    grad_accum: int = option(2, "micro-batches per optimizer step")
    max_length: int = option(1280, "prompt + answer tokens of a pair (TRL cuts longer ones at the end: keep it "
                             "at prep's budget)")


@dataclass
class GrpoConfig:
    """GRPO online (TRL): ``num_generations`` samples per prompt, each rewarded by executing it in the sandbox."""

    num_generations: int = option(4, "group size: samples per prompt", flag=True)
    prompts_per_step: int = option(1, "prompts per optimizer step")
    max_steps: int = option(30, "optimizer steps", flag=True)
    lr: float = option(1e-5, "learning rate")
    beta: float = option(0.0, "KL penalty towards the start adapter (0: none, as DAPO and Dr. GRPO)")
    loss_type: str = option("dapo", "TRL's loss_type")
    save_steps: int = option(10, "steps between checkpoints (resume from the newest)")
    curriculum: Literal["all", "mixed"] = option(
        "all", "all: every training prompt; mixed: only the rows whose pass rate in --generations/--results (the "
        "start adapter's scored samples of the training split, e.g. an rft round's) is strictly between 0 and 1, "
        "the rows whose groups can hold both a pass and a fail (a group of equal rewards has no gradient)")


@dataclass
class LearnConfig:
    """Everything `mlbench learn` runs (``configs/learn/*.yaml`` set the method's section; inputs come as flags)."""

    method: Literal["data", "rft", "dpo", "grpo"] = option("rft", "data: verdicts -> SFT records and pairs; rft, "
                                                           "dpo, grpo: a learned adapter", flag=True)
    model: str | None = option(None, "base model (folder or hub id)", flag=True)
    adapter: str | None = option(None, "the SFT adapter to start from (dpo, grpo; rft samples its first round "
                                 "with it)", flag=True)
    prep_dir: str | None = option(None, "`mlbench prep --out` folder: the training split's prompts", flag=True)
    split: str = option("id_train", "the training split (a folder of prep_dir); never the evaluation split", flag=True)
    eval_split: str | None = option(None, "the split models are evaluated on, checked for leaks and never read "
                                    "for learning (default: test, else full, of prep_dir)", flag=True)
    task: int = option(3, "the task", choices=TASKS, flag=True)
    data: str | None = option(None, "ML-Bench rows the checker reads (file, folder or hub id)", flag=True)
    data_split: str | None = option(None, "split of --data holding the training rows (default: full for a local "
                                    "file or folder, the training split for a hub id)", flag=True)
    envs: str | None = option(None, "environments YAML (`mlbench env build`)", flag=True)
    backend: Literal["bwrap", "podman", "docker", "apptainer"] = option("bwrap", "the sandbox answers run in",
                                                                        flag=True)
    workers: int = option(2, "executions at once", flag=True)
    timeout: float | None = option(None, "time limit per execution (default: the benchmark's)", flag=True)
    parser: Literal["compat", "fenced"] = option("compat", "code parser for the model's replies (infer's)", flag=True)
    generations: str | None = option(None, "data, dpo, grpo's mixed curriculum: the training split's generations "
                                     "(`mlbench infer` task file)", flag=True)
    results: str | None = option(None, "data, dpo, grpo's mixed curriculum: their `mlbench eval` folder "
                                 "(results.jsonl), in the reward's mode", flag=True)
    out: str | None = option(None, "output folder", flag=True)
    seed: int = option(0, "training seed", flag=True)
    quantization: Literal["nf4"] | None = option(None, "dpo, grpo: nf4 loads the base in 4 bits (QLoRA)", flag=True)
    reward: RewardConfig = field(default_factory=RewardConfig)
    sampling: LearnSampling = field(default_factory=LearnSampling)
    rft: RftConfig = field(default_factory=RftConfig)
    dpo: DpoConfig = field(default_factory=DpoConfig)
    grpo: GrpoConfig = field(default_factory=GrpoConfig)

    def check(self, at: Check) -> None:
        if self.grpo.num_generations < 2:
            raise MLBenchError("grpo.num_generations must be at least 2 (advantages compare a group)",
                               at("grpo.num_generations"))
        if self.workers < 1:
            raise MLBenchError("workers must be at least 1", at("workers"))
        for key, value in (("rft.rounds", self.rft.rounds), ("rft.k", self.rft.k),  # each at its own line
                           ("rft.max_per_row", self.rft.max_per_row),
                           ("grpo.prompts_per_step", self.grpo.prompts_per_step),
                           ("grpo.max_steps", self.grpo.max_steps), ("grpo.save_steps", self.grpo.save_steps),
                           ("dpo.batch_size", self.dpo.batch_size), ("dpo.grad_accum", self.dpo.grad_accum),
                           ("sampling.max_new_tokens", self.sampling.max_new_tokens)):
            if value < 1:
                raise MLBenchError(f"{key} must be at least 1, got {value}", at(key))
        if self.timeout is not None and self.timeout <= 0:
            raise MLBenchError("timeout must be positive", at("timeout"))
        for key in ("split", "eval_split"):
            name = getattr(self, key)
            if name is not None and (not re.fullmatch(r"[\w.-]+", name) or set(name) == {"."}):
                raise MLBenchError(f"{key} is a split's name (a folder of prep_dir), got {name!r}", at(key))
        if self.eval_split is not None and self.eval_split == self.split:
            raise MLBenchError(f"the training split {self.split!r} is the evaluation split", at("split"),
                               "learn on a training split (id_train, ood_train)")

    def require_inputs(self, source: str | None = None) -> None:
        """What the method needs; one error names all that is missing (``source``: the config file, if any)."""
        need = ["prep_dir", "out"] + {"data": ["generations", "results"],
                                      "rft": ["model", "data", "envs"],
                                      "dpo": ["model", "adapter"],
                                      "grpo": ["model", "data", "envs"]}[self.method]
        if (self.method == "dpo" and self.generations is None) or (self.method == "grpo" and
                                                                    self.grpo.curriculum == "mixed"):
            need += ["generations", "results"]
        missing = [f"--{k.replace('_', '-')}" for k in need if getattr(self, k) is None]
        if missing:
            raise MLBenchError(f"mlbench learn --method {self.method} needs {', '.join(missing)}", source,
                               "see docs/learn.md for each method's inputs")

    def training_prompts(self) -> Path:
        """The training split's prompt file."""
        return Path(str(self.prep_dir)) / self.split / f"task{self.task}.jsonl"

    def eval_prompts(self) -> Path:
        """The evaluation split's prompt file (only read by the leak check)."""
        root = Path(str(self.prep_dir))
        names = [self.eval_split] if self.eval_split else ["test", "full"]
        for name in names:
            p = root / name / f"task{self.task}.jsonl"
            if p.is_file():
                return p
        raise MLBenchError(f"no evaluation split to check for leaks: none of {names} in {root}", "--eval-split",
                           "name the split your models are evaluated on (its prep folder must exist)")

    def rows_split(self) -> str:
        """The split of ``data`` that holds the training rows."""
        if self.data_split:
            return self.data_split
        return "full" if Path(str(self.data)).exists() else self.split

