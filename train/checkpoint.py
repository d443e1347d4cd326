"""Checkpoints that survive preemption: complete-or-ignored folders, every rank's shard, and a signal flag.

Layout: ``OUT/checkpoints/step-0000100/`` holds the training state, each rank's RNG, ``trainer_state.json``
(:class:`TrainState`: step, epoch, position in the epoch) and ``adapter/`` (the PEFT adapter). It is written as
``step-*.tmp`` and renamed once ``COMPLETE`` is in it, so a run killed mid-save leaves a folder ``--resume auto``
ignores. The training state is saved two ways, by what holds it:

- single process, DDP and FSDP2: the trainable weights and the optimizer state gathered in full through
  torch.distributed.checkpoint's state-dict API, so a resume may use another number of processes: it continues
  at the same global position of the epoch with the same micro-batches per optimizer step (:func:`regroup`,
  :func:`rank_position`);
- DeepSpeed ZeRO-2/3: the engine's own checkpoint (``deepspeed/``), which keeps ZeRO's partitioned optimizer
  state and fp32 master weights per rank; frozen base weights are left out of it.

The LR scheduler (``scheduler.pt``) is saved the same way in both: the recipe steps it, not the engine.
"""

from __future__ import annotations

import enum
import json
import pickle
import re
import shutil
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from mlbench_kit.errors import MLBenchError
from mlbench_kit.hf import TRAIN_META
from mlbench_kit.io import atomic_dir, honour_umask, write_json_atomic

PREEMPTED_EXIT = 75  # EX_TEMPFAIL: a checkpoint was saved on a signal; re-run with --resume auto
_STEP = re.compile(r"^step-(\d+)$")


@dataclass
class TrainState:
    """Where training stands: what a resumed run needs to continue exactly."""

    step: int = 0  # optimizer steps done
    epoch: int = 0
    # micro-batches of this epoch done BY EACH RANK (always at an optimizer step's start): rank r has done global
    # micro-batches r, r + world, ..., so world_size x micro of them, the epoch's first ones, are done in all
    micro: int = 0
    tokens: int = 0  # real (non-padding) tokens seen
    target_tokens: int = 0  # answer tokens trained on
    world_size: int = 1
    grad_accum: int = 0  # micro-batches per rank and optimizer step (0: a checkpoint from before it was recorded)
    config_sha: str = ""  # the run's config (as run.json holds it): a checkpoint resumes only under the same one

    @classmethod
    def read(cls, path: Path) -> TrainState:
        raw = json.loads(path.read_text())
        return cls(**{k: raw[k] for k in asdict(cls()) if k in raw})


class Preemption:
    """SIGTERM/SIGUSR1 (what Slurm sends before a time limit or preemption) only set a flag here; the loop
    asks :meth:`agreed` after every micro-batch, where all ranks take the same decision."""

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGUSR1)) -> None:
        self.flag = False
        self.signum: int | None = None
        for s in signals:
            signal.signal(s, self._handle)

    def _handle(self, signum: int, _frame: Any) -> None:
        self.flag, self.signum = True, signum

    def agreed(self, accelerator: Any) -> bool:
        if accelerator.num_processes == 1:
            return self.flag
        t = torch.tensor([1.0 if self.flag else 0.0], device=accelerator.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return bool(t.item())


def regroup(old_world: int, old_accum: int, world: int, deepspeed: bool, where: str) -> int:
    """``grad_accum`` for ``world`` processes resuming a checkpoint written by ``old_world`` x ``old_accum``: the
    same micro-batches per optimizer step, so the rest of the run is the same optimisation (global batch, LR
    schedule, number of steps). A split that is impossible is one clear error."""
    per_step = old_world * old_accum
    if world == old_world:
        return old_accum
    fix = (f"launch with a number of processes that divides {per_step} (the checkpoint's), e.g. {old_world}, or "
           "start afresh in another --out folder")
    if deepspeed:
        raise MLBenchError(f"checkpoint written by {old_world} processes, this launch has {world}: DeepSpeed's ZeRO "
                           "checkpoint holds one optimizer partition per rank and cannot be re-split", where,
                           f"launch with {old_world} processes, or start afresh in another --out folder")
    if per_step % world:
        raise MLBenchError(f"checkpoint written by {old_world} processes x grad_accum {old_accum} = {per_step} "
                           f"micro-batches per optimizer step; this launch has {world} processes, which cannot "
                           f"split {per_step} evenly", where, fix)
    return per_step // world


def rank_position(micro: int, old_world: int, world: int, epoch_batches: int) -> int:
    """This rank's ``micro`` for ``world`` processes at the global position a checkpoint of ``old_world``
    processes reached: ``old_world x micro`` micro-batches of an epoch of ``epoch_batches`` are done (a finished
    epoch stays finished, whatever tail each world size drops)."""
    if micro >= epoch_batches // old_world:
        return epoch_batches // world
    return micro * old_world // world


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    """The newest ``step-N`` folder that has ``COMPLETE``; unfinished ``.tmp`` folders are ignored."""
    if not ckpt_dir.is_dir():
        return None
    done = [(int(m.group(1)), p) for p in ckpt_dir.iterdir()
            if (m := _STEP.match(p.name)) and (p / "COMPLETE").is_file()]
    return max(done)[1] if done else None


def is_deepspeed(accelerator: Any) -> bool:
    from accelerate.utils import DistributedType
    return accelerator.distributed_type == DistributedType.DEEPSPEED


def trainable_state(accelerator: Any, model: Any) -> dict[str, torch.Tensor]:
    """Every trainable (LoRA) tensor in full, on every rank's call (collective: every rank must call it).

    FSDP2 parameters are DTensor shards: ``full_tensor()`` all-gathers each, so no rank's part is lost. ZeRO-3
    partitions parameters: they are gathered with ``deepspeed.zero.GatheredParameters``, the trainable ones
    only (a few MB for LoRA, never the frozen base)."""
    unwrapped = accelerator.unwrap_model(model)
    params = [(n, p) for n, p in unwrapped.named_parameters() if p.requires_grad]
    if is_deepspeed(accelerator) and any(hasattr(p, "ds_id") for _, p in params):
        import deepspeed
        with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=None):
            return {n: p.data.detach().to("cpu", copy=True) for n, p in params}
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p.data).detach().to("cpu", copy=True)
            for n, p in params}


def save_adapter(accelerator: Any, model: Any, path: Path, tokenizer: Any, meta: dict[str, Any],
                 state: dict[str, torch.Tensor] | None = None) -> None:
    """The PEFT adapter (loadable by transformers and vLLM), tokenizer and chat template, and training meta.
    Collective unless the gathered ``state`` is passed in."""
    if state is None:
        state = trainable_state(accelerator, model)
    if accelerator.is_main_process:
        with atomic_dir(path) as tmp:
            accelerator.unwrap_model(model).save_pretrained(tmp, state_dict=state, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            write_json_atomic(tmp / TRAIN_META, meta)
    accelerator.wait_for_everyone()


def rng_state() -> dict[str, Any]:
    """This process's random states (python, numpy, torch, CUDA), as tensors and plain types only, so that the
    file loads with ``torch.load(weights_only=True)`` (a checkpoint is never unpickled)."""
    import random

    import numpy as np
    version, mt, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "format": 2,
        "python": {"version": int(version), "state": torch.tensor(mt, dtype=torch.int64), "gauss": gauss},
        "numpy": {"kind": str(kind), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    import random

    import numpy as np
    if state.get("format") == 2:
        py, npy = state["python"], state["numpy"]
        random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
        np.random.set_state((npy["kind"], np.asarray(npy["keys"].numpy(), dtype=np.uint32), npy["pos"],
                             npy["has_gauss"], npy["cached_gaussian"]))
    else:  # written before format 2: python's state as tuples, numpy's as an ndarray (see _load_rng)
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def safe_load(path: Path, what: str, safe_globals: list[Any] | None = None) -> Any:
    """``torch.load(path, weights_only=True)``: tensors and plain containers only, never code. A file that needs
    anything else (a pickle that would run code, or an object this version does not write) is one clear error."""
    try:
        if safe_globals:
            with torch.serialization.safe_globals(safe_globals):
                return torch.load(path, weights_only=True, map_location="cpu")
        return torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:  # noqa: BLE001 - UnpicklingError, RuntimeError, EOFError...: all mean "refused"
        first = (str(exc).strip().splitlines() or [exc.__class__.__name__])[0][:200]
        unsafe = ""
        try:
            found = torch.serialization.get_unsafe_globals_in_checkpoint(path)
            unsafe = f"; it needs {', '.join(found[:5])}" if found else ""
        except Exception:  # noqa: BLE001 - a damaged file: the first message says enough
            pass
        raise MLBenchError(f"refused the checkpoint's {what}: it does not load as plain tensors "
                           f"(torch.load weights_only=True){unsafe} ({first})", str(path),
                           "a checkpoint is never unpickled: resume only folders this toolkit wrote, or start "
                           "afresh in another --out folder") from None


def _enum_member(cls: Any, name: Any) -> Any:
    """What ``builtins.getattr`` may do while a DeepSpeed checkpoint loads: return a member of an Enum the
    unpickler already allowed, nothing else. Some Pythons (Debian's 3.11.2; not 3.11.7) pickle an Enum member as
    ``getattr(cls, name)``; the real getattr would reach any attribute of an allowed class, and through those, code."""
    if isinstance(cls, type) and issubclass(cls, enum.Enum) and isinstance(name, str) and name in cls.__members__:
        return cls.__members__[name]
    raise pickle.UnpicklingError(f"getattr({getattr(cls, '__name__', type(cls).__name__)}, {name!r}) is not a "
                                 "member of an allowed Enum")


def _deepspeed_globals() -> list[Any]:
    """The classes a DeepSpeed ZeRO checkpoint holds beside tensors and plain types (found with
    torch.serialization.get_unsafe_globals_in_checkpoint on ZeRO-2 and ZeRO-3 checkpoints of this recipe), and
    :func:`_enum_member` standing in for ``builtins.getattr``."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    return [LossScaler, ZeroStageEnum, fragment_address, (_enum_member, "builtins.getattr")]


@contextmanager
def weights_only_loads(allowed: list[Any], where: Path) -> Iterator[None]:
    """Every ``torch.load`` in the block (a library's included: DeepSpeed loads its checkpoint with
    ``weights_only=False``) runs with ``weights_only=True``, ``allowed`` classes added; a file that needs more is
    one clear error, and nothing in it runs."""
    real = torch.load

    def load(f: Any, *args: Any, **kwargs: Any) -> Any:
        kwargs["weights_only"] = True
        try:
            with torch.serialization.safe_globals(allowed):
                return real(f, *args, **kwargs)
        except pickle.UnpicklingError as exc:
            first = (str(exc).strip().splitlines() or ["UnpicklingError"])[0][:200]
            raise MLBenchError(f"refused a checkpoint file: it does not load as plain tensors and DeepSpeed's state "
                               f"classes (torch.load weights_only=True) ({first})", str(f),
                               "a checkpoint is never unpickled: resume only folders this toolkit wrote, or start "
                               "afresh in another --out folder") from None

    torch.load = load
    try:
        yield
    finally:
        torch.load = real


def _load_rng(path: Path) -> dict[str, Any]:
    """This rank's RNG file. Format 2 holds tensors and plain types; an older file holds numpy's state as an
    ndarray, which loads safely with numpy's array reconstruction allowed (uint32 data, no code)."""
    import numpy as np
    older = [np.ndarray, np.dtype, np.dtypes.UInt32DType]
    core = getattr(np, "_core", None) or np.core
    older.append(core.multiarray._reconstruct)
    state = safe_load(path, "random state", older)
    if not isinstance(state, dict) or not {"python", "numpy", "torch"} <= set(state):
        raise MLBenchError("refused the checkpoint's random state: not the layout this toolkit writes", str(path),
                           "start afresh in another --out folder")
    return state


def save_checkpoint(accelerator: Any, model: Any, optimizer: Any, scheduler: Any, ckpt_dir: Path,
                    state: TrainState, rng: dict[str, Any], tokenizer: Any, meta: dict[str, Any], keep: int,
                    on_saved: Callable[[Path], None] | None = None) -> Path:
    """Collective: every rank calls it. ``rng`` is this rank's random state at ``state``'s step start.

    ``on_saved(final)`` runs on the main process once the checkpoint is complete and BEFORE the last barrier: once
    any rank leaves that barrier it may exit, and a launcher then kills the others (``srun --kill-on-bad-exit``
    across nodes, torchrun's agent on a failed worker), so what must survive (the PREEMPTED marker) is written
    while every rank still waits."""
    from safetensors.torch import save_file

    final = ckpt_dir / f"step-{state.step:07d}"
    tmp = ckpt_dir / f"step-{state.step:07d}.tmp"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    trainable = trainable_state(accelerator, model)
    torch.save(rng, tmp / f"rng-{accelerator.process_index}.pt")
    if accelerator.is_main_process:
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")  # ours: the engine holds no scheduler
    if is_deepspeed(accelerator):
        # the engine saves ZeRO's partitioned optimizer state and fp32 master weights, one file per rank
        model.save_checkpoint(str(tmp / "deepspeed"), tag="state", exclude_frozen_parameters=True)
    else:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )
        optim = get_optimizer_state_dict(model, optimizer,
                                         options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if accelerator.is_main_process:
            save_file({k: v.contiguous() for k, v in trainable.items()}, tmp / "trainable.safetensors")
            torch.save(optim, tmp / "optimizer.pt")
    accelerator.wait_for_everyone()
    save_adapter(accelerator, model, tmp / "adapter", tokenizer, meta, state=trainable)
    if accelerator.is_main_process:
        write_json_atomic(tmp / "trainer_state.json", {**asdict(state), "world_size": accelerator.num_processes})
        (tmp / "COMPLETE").write_text("ok\n")
        honour_umask(tmp)  # every rank's files, safetensors' 0600 ones included
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        done = sorted(p for p in ckpt_dir.iterdir() if _STEP.match(p.name) and (p / "COMPLETE").is_file())
        for old in done[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
        if on_saved is not None:
            on_saved(final)
    accelerator.wait_for_everyone()
    return final


def check_resumable(state: TrainState, config_shas: tuple[str, ...], where: str) -> None:
    """Refuse a checkpoint that does not name one of this run's config hashes (one without a hash included: a
    handed-over folder must not be resumed as this run's)."""
    if not state.config_sha:
        raise MLBenchError("this checkpoint records no config hash, so it cannot be matched to this run", where,
                           "remove it (or the run folder) to start afresh; checkpoints of this version record it")
    if state.config_sha not in config_shas:
        # run.json guards the folder, but a process still saving after the folder was emptied and claimed
        # by another config (a SIGTERM'd run finishing its agreed save) can leave its checkpoint behind
        raise MLBenchError("this checkpoint was made under another config than this run's", where,
                           "remove it (or the run folder) to start afresh, or resume with the config it was "
                           "made with (its run folder's config.yaml)")


def load_checkpoint(accelerator: Any, model: Any, optimizer: Any, scheduler: Any, path: Path) -> TrainState:
    """Restore the training state and this rank's RNG; returns where training stood. Every ``.pt`` file loads with
    ``weights_only=True``: a checkpoint holds tensors and plain types, and is never unpickled."""
    state = TrainState.read(path / "trainer_state.json")
    if is_deepspeed(accelerator):
        with weights_only_loads(_deepspeed_globals(), path / "deepspeed"):  # DeepSpeed asks for weights_only=False
            model.load_checkpoint(str(path / "deepspeed"), tag="state", load_module_strict=False,
                                  load_optimizer_states=True, load_lr_scheduler_states=False)
    else:
        from safetensors.torch import load_file
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )
        full = StateDictOptions(full_state_dict=True, strict=False)
        trainable: dict[str, Any] = load_file(path / "trainable.safetensors")
        set_model_state_dict(model, trainable, options=full)
        set_optimizer_state_dict(model, optimizer, safe_load(path / "optimizer.pt", "optimizer state"),
                                 options=full)
    scheduler.load_state_dict(safe_load(path / "scheduler.pt", "scheduler state"))
    rng = path / f"rng-{accelerator.process_index}.pt"
    if rng.is_file() and state.world_size == accelerator.num_processes:
        _set_rng_state(_load_rng(rng))
    return state
