"""Checkpoints that survive preemption: complete-or-ignored folders, every rank's shard, and a signal flag.

Layout: ``OUT/checkpoints/step-0000100/`` holds the trainable weights and the optimizer state, both gathered
in full from every rank (torch.distributed.checkpoint's state-dict API, which works alike for one process,
DDP and FSDP2), the scheduler, each rank's RNG states, ``trainer_state.json`` (step, epoch, position in the
epoch) and ``adapter/`` (the PEFT adapter). It is written as ``step-*.tmp`` and renamed once
``COMPLETE`` is in it, so a run killed mid-save leaves a folder ``--resume auto`` ignores.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
from pathlib import Path
from typing import Any

import torch

from mlbench_kit.io import write_json_atomic

PREEMPTED_EXIT = 75  # EX_TEMPFAIL: a checkpoint was saved on a signal; re-run with --resume auto
_STEP = re.compile(r"^step-(\d+)$")


class Preemption:
    """SIGTERM/SIGUSR1 (what Slurm sends before a time limit or preemption) only set a flag here; the loop
    asks :meth:`agreed` at a step boundary, where all ranks take the same decision."""

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGUSR1)) -> None:
        self.flag = False
        self.signum: int | None = None
        for s in signals:
            signal.signal(s, self._handle)

    def _handle(self, signum: int, _frame: Any) -> None:
        self.flag, self.signum = True, signum

    def agreed(self, accelerator: Any) -> bool:
        t = torch.tensor([1.0 if self.flag else 0.0], device=accelerator.device)
        if accelerator.num_processes > 1:
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return bool(t.item())


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    """The newest ``step-N`` folder that has ``COMPLETE``; unfinished ``.tmp`` folders are ignored."""
    if not ckpt_dir.is_dir():
        return None
    done = [(int(m.group(1)), p) for p in ckpt_dir.iterdir()
            if (m := _STEP.match(p.name)) and (p / "COMPLETE").is_file()]
    return max(done)[1] if done else None


def trainable_state(accelerator: Any, model: Any) -> dict[str, torch.Tensor]:
    """Every LoRA tensor in full, gathered from all ranks (collective: every rank must call it).

    Under FSDP2 each parameter is a DTensor shard; ``full_tensor()`` all-gathers it, so no rank's part is
    lost (saving only rank 0's local shard is the known failure this avoids). Under DeepSpeed ZeRO-3,
    accelerate's own gather is used."""
    from accelerate.utils import DistributedType
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        full = accelerator.get_state_dict(model)
        return {k: v for k, v in full.items() if "lora_" in k} if full is not None else {}
    unwrapped = accelerator.unwrap_model(model)
    out = {}
    for name, p in unwrapped.named_parameters():
        if not p.requires_grad:
            continue
        t = p.full_tensor() if hasattr(p, "full_tensor") else p.data
        out[name] = t.detach().to("cpu", copy=True)
    return out


def save_adapter(accelerator: Any, model: Any, path: Path, tokenizer: Any, meta: dict[str, Any],
                 state: dict[str, torch.Tensor] | None = None) -> None:
    """The PEFT adapter (loadable by transformers and vLLM), tokenizer and chat template, and training meta.
    Collective unless the gathered ``state`` is passed in."""
    if state is None:
        state = trainable_state(accelerator, model)
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model)
        tmp = path.with_name(path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        unwrapped.save_pretrained(tmp, state_dict=state, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        write_json_atomic(tmp / "mlbench_train.json", meta)
        shutil.rmtree(path, ignore_errors=True)
        tmp.rename(path)
    accelerator.wait_for_everyone()


def _rng_state() -> dict[str, Any]:
    import random

    import numpy as np
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    import random

    import numpy as np
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(accelerator: Any, model: Any, optimizer: Any, scheduler: Any, ckpt_dir: Path, step: int,
                    trainer_state: dict[str, Any], tokenizer: Any, meta: dict[str, Any], keep: int) -> Path:
    """Collective: every rank calls it. Trainable weights and the optimizer state are gathered in full (so a
    resume may even use another number of processes); RNG states are saved per rank."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    final = ckpt_dir / f"step-{step:07d}"
    tmp = ckpt_dir / f"step-{step:07d}.tmp"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    trainable = trainable_state(accelerator, model)
    optim = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    torch.save(_rng_state(), tmp / f"rng-{accelerator.process_index}.pt")
    if accelerator.is_main_process:
        save_file({k: v.contiguous() for k, v in trainable.items()}, tmp / "trainable.safetensors")
        torch.save(optim, tmp / "optimizer.pt")
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
    accelerator.wait_for_everyone()
    save_adapter(accelerator, model, tmp / "adapter", tokenizer, meta, state=trainable)
    if accelerator.is_main_process:
        write_json_atomic(tmp / "trainer_state.json", {**trainer_state, "world_size": accelerator.num_processes})
        (tmp / "COMPLETE").write_text("ok\n")
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        done = sorted(p for p in ckpt_dir.iterdir() if _STEP.match(p.name) and (p / "COMPLETE").is_file())
        for old in done[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator: Any, model: Any, optimizer: Any, scheduler: Any, path: Path) -> dict[str, Any]:
    """Restore trainable weights, optimizer, scheduler and this rank's RNG; returns the trainer state."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)

    state = json.loads((path / "trainer_state.json").read_text())
    full = StateDictOptions(full_state_dict=True, strict=False)
    set_model_state_dict(model, load_file(path / "trainable.safetensors"), options=full)
    set_optimizer_state_dict(model, optimizer, torch.load(path / "optimizer.pt", weights_only=False), options=full)
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=False))
    rng = path / f"rng-{accelerator.process_index}.pt"
    if rng.is_file() and state.get("world_size") == accelerator.num_processes:
        _set_rng_state(torch.load(rng, weights_only=False))
    return state
