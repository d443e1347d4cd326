"""Training configuration: one YAML file per model family (``configs/train/``), typed and checked.

Defaults <- the YAML file <- shortcut flags (``--task 3``) <- ``--set a.b=value``; every unknown key or bad value
is one error with its file:line (or flag). The resolved config is saved beside the run as ``config.yaml``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from .config import Check, option, to_dict
from .errors import MLBenchError
from .records import TASKS

SPLIT_DIRS = {"id": "id_train", "ood": "ood_train"}


@dataclass
class DataConfig:
    prep_dir: str = option("prep", "`mlbench prep --out` folder holding <split>/task<t>.jsonl", flag=True)
    task: int = option(3, "the task to train on, one per run", choices=TASKS, flag="--tasks", alias=("--task",))
    # recorded by its short name
    split: Literal["id_train", "ood_train", "id", "ood"] = option(
        "id", "the prep split to train on: id_train (ID) or ood_train (OOD); id and ood are short for them", flag=True)
    path: str | None = option(None, "a prep .jsonl file instead of prep_dir/<split>/task<t>.jsonl")
    extra: list[str] = option(help="more prep .jsonl files for training only (never held out)", factory=list)
    eval_fraction: float = option(0.05, "share of the records held out for the eval loss")
    # a packed row holds several examples; was max_seq_len (still read, with a warning, for one release)
    max_context_tokens: int = option(8192, "prompt + answer + EOS of one example, capped at the model's positions",
                                     flag=True, old=("max_seq_len",))
    batching: Literal["packing", "grouped", "padding"] = option("packing", "how records become micro-batches",
                                                                flag=True)
    micro_batch_size: int = option(1, "rows per micro-batch", flag=True)

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
    r: int = option(16, "LoRA rank")
    alpha: int = option(32, "LoRA scale numerator (the update is scaled by alpha / r)")
    dropout: float = option(0.05, "dropout on the LoRA input")
    target_modules: list[str] = option(help="the linear layers that get adapters", factory=lambda: [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])

    def check(self, at: Check) -> None:
        if self.r < 1 or not self.target_modules:
            raise MLBenchError("lora.r >= 1 and lora.target_modules are needed", at("r"))


@dataclass
class OptimConfig:
    lr: float = option(2e-4, "learning rate", flag=True)
    weight_decay: float = option(0.0, "AdamW weight decay")
    warmup_ratio: float = option(0.03, "share of the steps spent warming the learning rate up")
    scheduler: str = option("cosine", "transformers' learning-rate schedule name")
    epochs: int = option(3, "passes over the data", flag=True)
    max_steps: int = option(-1, "stop after N optimizer steps (> 0; whatever the epochs)", flag=True)
    grad_accum: int = option(8, "micro-batches per optimizer step", flag=True)
    max_grad_norm: float = option(1.0, "gradient clipping norm")

    def check(self, at: Check) -> None:
        if self.grad_accum < 1:
            raise MLBenchError("grad_accum must be at least 1", at("grad_accum"))


@dataclass
class CheckpointConfig:
    every_steps: int = option(100, "optimizer steps between checkpoints")
    keep: int = option(2, "checkpoints kept (the newest)")


@dataclass
class LoggingConfig:
    every_steps: int = option(1, "optimizer steps between log lines")
    tensorboard: bool = option(True, "TensorBoard logs (when tensorboard is installed)")
    wandb: bool = option(False, "Weights & Biases logs (needs wandb)")
    wandb_project: str = option("mlbench-kit", "Weights & Biases project")


@dataclass
class TrainConfig:
    """Everything a LoRA/QLoRA run needs; ``configs/train/*.yaml`` fill it per model."""

    model: str | None = option(None, "base model: hub id or local folder", flag=True)
    family: str | None = option(None, "codellama | deepseek-coder | llama2 | tiny: names the output folder")
    template: Literal["paper", "llama-inst", "chat"] = option("llama-inst", "what prep rendered the records with")
    data: DataConfig = field(default_factory=DataConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    quantization: Literal["nf4"] | None = option(None, "nf4: QLoRA (NF4, double quantization)")
    optim: OptimConfig = field(default_factory=OptimConfig)
    gradient_checkpointing: bool = option(True, "recompute activations in the backward pass")
    # larger trades the memory that full checkpointing frees, when it goes unused, for fewer recomputed layers
    gradient_checkpointing_every_n_layers: int = option(
        1, "checkpoint one decoder layer in every n (transformers' every_n_layers; 1: all)")
    compile: bool = option(False, "torch.compile each decoder layer (torchtune's per-layer compile): the first "
                           "steps pay the compile")
    # auto: flash_attention_3 on Hopper when installed, else flash_attention_2 on Ampere+ when installed (packed
    # batches then run varlen), else sdpa (train/model.py: choose_attention)
    attn_implementation: Literal["auto", "sdpa", "eager", "flash_attention_2", "flash_attention_3",
                                 "flex_attention"] = option("auto", "attention kernel (auto: the fastest installed "
                                                                    "one this GPU runs, else sdpa)")
    precision: Literal["auto", "bf16", "fp16", "fp32"] = option(
        "auto", "auto: bf16 on GPUs that have it, fp16 with loss scaling on those that do not, fp32 on CPU")
    loss_chunk_tokens: int = option(4096, "cross-entropy in chunks of this many tokens: no full fp32 [T, vocab] "
                                    "logits")
    # train/loss.py: LinearLoss, a torch-native fused linear cross-entropy
    fused_linear_loss: bool = option(False, "lm_head inside those chunks: no [T, vocab] logits at all, nor "
                                     "accelerate's fp32 copy of them")
    # the liger-kernel package, in the gpu extra; train/model.py: add_lora
    liger_kernels: bool = option(False, "Liger-Kernel's Triton RMSNorm, SwiGLU and RoPE in place of transformers' "
                                 "(CUDA only): fewer kernel launches and saved activations per layer")
    seed: int = option(42, "seed of the data order, init and sampling", flag=True)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    merge: bool = option(False, "also write merged full weights at the end")
    output_dir: str = option("runs/train/{family}-task{task}-{split}-s{seed}", "output folder ({family}, {task}, "
                             "{split} and {seed} are filled in)", flag="--out", old=("--output-dir",))

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

