"""Training configuration: one YAML file per model family (``configs/train/``), typed and checked.

Defaults <- the YAML file <- shortcut flags (``--task 3``) <- ``--set a.b=value``; every unknown key or bad value
is one error with its file:line (or flag). The resolved config is saved beside the run as ``config.yaml``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from .config import Check, load, parse_set, to_dict
from .deprecation import renamed_from
from .errors import MLBenchError
from .records import TASKS

SPLIT_DIRS = {"id": "id_train", "ood": "ood_train"}
# the training splits by prep's names (the same as every stage's --split), or short
SPLITS = ("id_train", "ood_train", "id", "ood")


@dataclass
class DataConfig:
    prep_dir: str = "prep"
    task: int = 3
    # the prep split trained on: id_train (or id) / ood_train (or ood); recorded by its short name
    split: Literal["id_train", "ood_train", "id", "ood"] = "id"
    path: str | None = None  # a prep .jsonl file instead of prep_dir/<split>/task<t>.jsonl
    extra: list[str] = field(default_factory=list)  # more prep .jsonl files for training only (never held out)
    eval_fraction: float = 0.05
    # prompt + answer + EOS of one example (a packed row holds several), capped at the model's positions; was
    # max_seq_len (still read, with a warning, for one release)
    max_context_tokens: int = field(default=8192, metadata=renamed_from("max_seq_len"))
    batching: Literal["packing", "grouped", "padding"] = "packing"
    micro_batch_size: int = 1

    def check(self, at: Check) -> None:
        self.split = {"id_train": "id", "ood_train": "ood"}.get(self.split, self.split)  # type: ignore[assignment]
        if self.task not in TASKS:
            raise MLBenchError(f"task must be 1, 2 or 3, got {self.task!r}", at("task"), "--tasks 1|2|3")
        if not 0 <= self.eval_fraction < 1:
            raise MLBenchError("eval_fraction must be in [0, 1)", at("eval_fraction"), "e.g. 0.05")
        if self.max_context_tokens < 16 or self.micro_batch_size < 1:
            raise MLBenchError("max_context_tokens >= 16 and micro_batch_size >= 1 are needed",
                               at("max_context_tokens"))


@dataclass
class LoraConfig:
    r: int = 16
    alpha: int = 32
    dropout: float = 0.05
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                               "up_proj", "down_proj"])

    def check(self, at: Check) -> None:
        if self.r < 1 or not self.target_modules:
            raise MLBenchError("lora.r >= 1 and lora.target_modules are needed", at("r"))


@dataclass
class OptimConfig:
    lr: float = 2e-4
    weight_decay: float = 0.0
    warmup_ratio: float = 0.03
    scheduler: str = "cosine"
    epochs: int = 3
    max_steps: int = -1  # > 0: stop there, whatever the epochs
    grad_accum: int = 8
    max_grad_norm: float = 1.0

    def check(self, at: Check) -> None:
        if self.grad_accum < 1:
            raise MLBenchError("grad_accum must be at least 1", at("grad_accum"))


@dataclass
class CheckpointConfig:
    every_steps: int = 100
    keep: int = 2


@dataclass
class LoggingConfig:
    every_steps: int = 1
    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "mlbench-kit"


@dataclass
class TrainConfig:
    """Everything a LoRA/QLoRA run needs; ``configs/train/*.yaml`` fill it per model."""

    FLAGS: ClassVar[dict[str, str]] = {}  # option -> key (mlbench_kit.stages), set below from SHORTCUTS
    OLD_FLAGS: ClassVar[dict[str, str]] = {}

    model: str | None = None  # hub id or local folder
    family: str | None = None  # codellama | deepseek-coder | llama2 | tiny: names the output folder
    template: Literal["paper", "llama-inst", "chat"] = "llama-inst"  # what prep rendered the records with
    data: DataConfig = field(default_factory=DataConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    quantization: Literal["nf4"] | None = None  # nf4: QLoRA (NF4, double quantization)
    optim: OptimConfig = field(default_factory=OptimConfig)
    gradient_checkpointing: bool = True
    # checkpoint one decoder layer in every n (transformers' every_n_layers): 1 = all; larger trades the memory
    # that full checkpointing frees, when it goes unused, for fewer recomputed layers (selective checkpointing)
    gradient_checkpointing_every_n_layers: int = 1
    # torch.compile each decoder layer (torchtune's per-layer compile): the first steps pay the compile
    compile: bool = False
    # auto: flash_attention_3 on Hopper when installed, else flash_attention_2 on Ampere+ when installed (packed
    # batches then run varlen), else sdpa (train/model.py: choose_attention)
    attn_implementation: Literal["auto", "sdpa", "eager", "flash_attention_2", "flash_attention_3",
                                 "flex_attention"] = "auto"
    # auto: bf16 on GPUs that have it, fp16 with loss scaling on those that do not, fp32 on CPU
    precision: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    loss_chunk_tokens: int = 4096  # cross-entropy in chunks of this many tokens: no full fp32 [T, vocab] logits
    # lm_head inside those chunks (train/loss.py: LinearLoss, a torch-native fused linear cross-entropy): no
    # [T, vocab] logits at all, nor accelerate's fp32 copy of them
    fused_linear_loss: bool = False
    # Liger-Kernel's Triton RMSNorm, SwiGLU and RoPE in place of transformers' (CUDA only; the liger-kernel
    # package, in the gpu extra): fewer kernel launches and saved activations per layer (train/model.py: add_lora)
    liger_kernels: bool = False
    seed: int = 42
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    merge: bool = False  # also write merged full weights at the end
    output_dir: str = "runs/train/{family}-task{task}-{split}-s{seed}"

    def check(self, at: Check) -> None:
        if not self.model:
            raise MLBenchError("no model given", at("model"), "set `model:` in the config or pass --model")
        if self.gradient_checkpointing_every_n_layers < 1:
            raise MLBenchError("gradient_checkpointing_every_n_layers must be at least 1",
                               at("gradient_checkpointing_every_n_layers"),
                               "1 checkpoints every layer; gradient_checkpointing: false checkpoints none")
        if self.loss_chunk_tokens < 1:
            raise MLBenchError("loss_chunk_tokens must be at least 1", at("loss_chunk_tokens"), "e.g. 4096")

    @property
    def out(self) -> Path:
        d = self.data
        return Path(self.output_dir.format(family=self.family, task=d.task, split=d.split, seed=self.seed))

    def data_file(self) -> Path:
        """data.path if given, else ``prep_dir/<id_train|ood_train>/task{t}.jsonl``."""
        d = self.data
        return Path(d.path) if d.path else Path(d.prep_dir) / SPLIT_DIRS[d.split] / f"task{d.task}.jsonl"

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)

    def identity(self) -> dict[str, Any]:
        """What the run computes: the config without where it lives and without the keys that change only how a
        step runs (``SPEED_KEYS``). A run folder and its checkpoints are resumed under the same identity, so a
        run may be resumed with a lever turned on or off, and runs made before the levers existed resume."""
        return {k: v for k, v in self.to_dict().items() if k != "output_dir" and k not in SPEED_KEYS}


# how a step runs, not what it computes (tests hold each to the default's losses and gradients)
SPEED_KEYS = frozenset({"gradient_checkpointing_every_n_layers", "compile", "fused_linear_loss", "liger_kernels"})


# Short command-line options for the keys people change most (option -> key); anything else goes through
# --set a.b=value. `tasks` takes one task here (a run trains on one); `task` is the same option.
SHORTCUTS = {"tasks": "data.task", "task": "data.task", "split": "data.split", "lr": "optim.lr",
             "epochs": "optim.epochs", "max_steps": "optim.max_steps", "seed": "seed", "model": "model",
             "out": "output_dir", "batching": "data.batching", "max_context_tokens": "data.max_context_tokens",
             "prep_dir": "data.prep_dir", "grad_accum": "optim.grad_accum",
             "micro_batch_size": "data.micro_batch_size"}
# Renamed options keep their old spelling for one release (mlbench_kit.deprecation): old -> new.
OLD_FLAGS = {"max_seq_len": "max_context_tokens", "output_dir": "out"}
TrainConfig.FLAGS = {**SHORTCUTS, "set": "set"}
TrainConfig.OLD_FLAGS = OLD_FLAGS


def load_train_config(path: str | Path | None, shortcuts: dict[str, Any], sets: list[str] | None = None
                      ) -> TrainConfig:
    """The config of one run: the file, the shortcut flags, then ``--set``."""
    over = {SHORTCUTS[k]: (v, f"--{k.replace('_', '-')}") for k, v in shortcuts.items()
            if v is not None and k in SHORTCUTS}
    over |= parse_set(sets or [])
    if path is not None and not Path(path).is_file():
        raise MLBenchError("config not found", str(path), "pass one of configs/train/*.yaml")
    return load(TrainConfig, path, over)


