"""LoRA / QLoRA fine-tuning recipe for ML-Bench prompts, one script for every setup.

    accelerate launch train/lora.py --config configs/train/codellama-7b-instruct.yaml --task 3 --split ood
    accelerate launch --config_file configs/accelerate/fsdp2.yaml train/lora.py ...            # FSDP2
    accelerate launch --config_file configs/accelerate/deepspeed-zero3.yaml train/lora.py ...  # ZeRO-3
    mlbench train ...                                                                           # one process

Reads data_prep's records, trains on answer + EOS only, saves checkpoints that a preempted or killed run
resumes from exactly (``--resume auto``, the default), and writes ``OUT/adapter/`` (PEFT format). On SIGTERM or
SIGUSR1 all ranks agree after the current micro-batch, save, write ``OUT/PREEMPTED`` and exit 75 (a launcher may
report its own status instead): run the same command again to continue.

The recipe reads top to bottom: ``setup()`` builds the pieces (accelerator, data, model, optimizer, state),
``train()`` runs optimizer steps (micro-batches accumulated, gradients synchronised on the last one only),
``save_checkpoint()`` and ``publish()`` write results, ``cleanup()`` ends the run.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, TextIO

if __package__ in (None, "") and sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    # Run as a file (accelerate launch train/lora.py): drop train/ from the import path so its modules
    # (config.py, data.py, ...) cannot shadow other packages; they are imported from the installed namespace.
    sys.path.pop(0)

from mlbench_kit.progress import Progress, bars_only_on_tty, hold_library_logs

if __name__ == "__main__":
    bars_only_on_tty()  # before transformers, peft and accelerate import tqdm: no library bars in a log
    hold_library_logs()  # what they log while imported waits for the run's log (train/cli.py replays it there)

import importlib.util

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from peft import PeftModel
from transformers import AutoConfig, AutoModelForCausalLM, get_scheduler

from mlbench_kit.config import rename_old_keys, save_resolved, with_old_names
from mlbench_kit.errors import MLBenchError
from mlbench_kit.flags import add_options
from mlbench_kit.hf import fingerprint, load_tokenizer, model_positions
from mlbench_kit.io import AppendLog, atomic_dir, claim_run_folder, honour_umask, write_json_atomic
from mlbench_kit.stages import stage
from mlbench_kit.train.checkpoint import (
    PREEMPTED_EXIT,
    Preemption,
    TrainState,
    check_resumable,
    is_deepspeed,
    latest_checkpoint,
    load_checkpoint,
    rank_position,
    regroup,
    rng_state,
    save_checkpoint,
)
from mlbench_kit.train.cli import run
from mlbench_kit.train.data import collate, epoch_batches, load_examples, split_eval, varlen_kwargs
from mlbench_kit.train.distributed import deepspeed_on_cpu_kwargs, deepspeed_requested, enable_fsdp_on_cpu
from mlbench_kit.train.flops import PACKED_PATH, ModelShape, detect_gpu_peak, rows_from_positions, step_flops
from mlbench_kit.train.loss import micro_batch_losses
from mlbench_kit.train.model import (
    DTYPES,
    add_lora,
    apply_levers,
    load_base,
    nf4_config,
    resolve_attention,
    resolve_precision,
)
from mlbench_kit.train_config import (
    TrainConfig,
)


class LoRAFinetuneRecipe:
    """One LoRA/QLoRA run under accelerate: single process, DDP, FSDP2 or DeepSpeed ZeRO-2/3."""

    def __init__(self, cfg: TrainConfig, resume: str = "auto") -> None:
        self.cfg, self.resume = cfg, resume
        self.out = cfg.out
        # the recipe's own lines (progress, resumed, done): the terminal, while libraries write to the run's log
        self.term: TextIO = sys.stderr
        # where the run lives is not part of it: a checkpoint copied to another folder resumes there
        same = cfg.identity()
        self.config_sha = _sha(same)
        # the same config as a run made before data.max_seq_len became data.max_context_tokens recorded it
        self.config_sha_before_rename = _sha(with_old_names(TrainConfig, same))
        self.final_adapter = self.out / "adapter"

    def run_settings(self) -> dict[str, Any]:
        """What the run folder's ``run.json`` holds: the run's identity (no speed levers) and where it lives."""
        return {"config": self.cfg.identity() | {"output_dir": self.cfg.output_dir}}

    @property
    def base_model(self) -> str:
        """The model to fine-tune (TrainConfig.check refuses a config without one)."""
        assert self.cfg.model is not None
        return self.cfg.model

    def _event(self, rec: dict[str, Any]) -> None:
        """One line of metrics.jsonl: only the main process holds the log."""
        if self.log is not None:
            self.log.append(rec)

    # -- setup ---------------------------------------------------------------------------------------------------

    def finished(self) -> bool:
        """Whether this run folder already holds the finished adapter (``--resume none`` trains again)."""
        return (self.final_adapter / "adapter_config.json").is_file() and self.resume != "none"

    def setup(self) -> None:
        """Build everything, in order: accelerator, resume point, tokenizer, data, model, optimizer, state, logs."""
        self.accelerator = self._setup_accelerator()
        self.main = self.accelerator.is_main_process
        self.world, self.rank = self.accelerator.num_processes, self.accelerator.process_index
        if self.main:
            claim_run_folder(self.out / "run.json", self.run_settings(),
                             upgrade=lambda old: rename_old_keys(TrainConfig, old.get("config")))
            save_resolved(self.cfg, self.out / "config.yaml")
        set_seed(self.cfg.seed)
        self._setup_resume()
        self.tok = self._setup_tokenizer()
        self.model_config = AutoConfig.from_pretrained(self.base_model)
        self.seq_len, positions, self.context_note = context_budget(self.cfg, self.model_config)
        _check_prep_budget(self.cfg, positions)
        self.train_set, self.eval_set, self.notes = self._setup_data()
        self.steps_per_epoch = math.ceil(len(self._epoch_batches(0)) / self.grad_accum)
        o = self.cfg.optim
        self.total_steps = o.max_steps if o.max_steps > 0 else self.steps_per_epoch * o.epochs
        self.model = self._setup_model()
        self.optimizer, self.scheduler = self._setup_optimizer()
        self._prepare()
        self.state = self._setup_state()
        self.preempt = Preemption()
        self.log = self._setup_logging()

    def _setup_accelerator(self) -> Any:
        """The accelerator (and the precision, attention kernel and trackers it was made for)."""
        self.precision = resolve_precision(self.cfg.precision)
        self.attention = resolve_attention(self.cfg.attn_implementation)
        self.trackers = _trackers(self.cfg)
        cuda = torch.cuda.is_available()
        accelerator = Accelerator(
            **deepspeed_on_cpu_kwargs(cuda),
            mixed_precision={"bf16": "bf16", "fp16": "fp16", "fp32": "no"}[self.precision],
            gradient_accumulation_steps=self.cfg.optim.grad_accum, log_with=self.trackers or None,
            project_dir=str(self.out), cpu=not cuda and not deepspeed_requested(),
            # one scheduler step per optimizer step: by default accelerate steps it once per process, for loops
            # whose dataloader it split, which would run the LR schedule world_size times too fast here
            step_scheduler_with_optimizer=False)
        enable_fsdp_on_cpu(accelerator)
        return accelerator

    def _setup_resume(self) -> None:
        """Which checkpoint to resume, and the gradient accumulation that keeps its micro-batches per optimizer
        step when this launch has another number of processes (refused where that is impossible)."""
        self.ckpt_dir = self.out / "checkpoints"
        self.resume_from = latest_checkpoint(self.ckpt_dir) if self.resume == "auto" else (
            None if self.resume == "none" else Path(self.resume))
        self.grad_accum, self.resume_note = self.cfg.optim.grad_accum, None
        if self.resume_from is None:
            return
        old = TrainState.read(self.resume_from / "trainer_state.json")
        check_resumable(old, (self.config_sha, self.config_sha_before_rename), str(self.resume_from))
        self.grad_accum = regroup(old.world_size, old.grad_accum or self.cfg.optim.grad_accum, self.world,
                                  is_deepspeed(self.accelerator), str(self.resume_from))
        if self.grad_accum != self.cfg.optim.grad_accum:
            self.accelerator.gradient_accumulation_steps = self.grad_accum  # accelerate divides each backward by it
        if old.world_size != self.world:
            per_step = old.world_size * (old.grad_accum or self.cfg.optim.grad_accum)
            self.resume_note = (f"resumed {old.world_size} processes' checkpoint on {self.world}: grad_accum "
                                f"{self.grad_accum} keeps {per_step} micro-batches per optimizer step")

    def _setup_tokenizer(self) -> Any:
        tok = load_tokenizer(self.base_model, "--model")
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token  # padding is masked and never counted, so EOS is safe here
        return tok

    def _setup_data(self) -> tuple[list, list, list[str]]:
        """``(training examples, held-out examples, notes)`` from the prep records (+ ``data.extra``)."""
        examples, notes = load_examples(self.cfg.data_file(), self.tok, self.cfg.template, self.seq_len)
        if self.context_note:
            notes.append(self.context_note)
        train_set, eval_set = split_eval(examples, self.cfg.data.eval_fraction, self.cfg.seed)
        for extra in self.cfg.data.extra:  # added to training only: the held-out set stays the split's own rows
            more, more_notes = load_examples(Path(extra), self.tok, self.cfg.template, self.seq_len)
            train_set += more
            notes += [f"{extra}: {len(more)} extra training records"] + more_notes
        return train_set, eval_set, notes

    def _all_batches(self, epoch: int) -> list[list[list[int]]]:
        """Every rank's micro-batches of ``epoch``, in order: rank r takes r, r + world, ..."""
        d = self.cfg.data
        return epoch_batches(self.train_set, d.batching, d.micro_batch_size, self.seq_len, self.cfg.seed, epoch)

    def _epoch_batches(self, epoch: int) -> list[list[list[int]]]:
        """This rank's micro-batches of ``epoch`` (every rank gets as many, so collectives line up)."""
        batches = self._all_batches(epoch)
        per_rank = len(batches) // self.world
        if per_rank == 0:
            raise MLBenchError(f"{len(batches)} micro-batches cannot feed {self.world} processes",
                               str(self.cfg.data_file()), "use fewer processes or a smaller micro_batch_size")
        return batches[self.rank::self.world][:per_rank]

    def _setup_model(self) -> Any:
        """The base model with LoRA adapters and the speed levers on (and its facts for the logs)."""
        model = add_lora(load_base(self.cfg, self.precision, self.attention), self.cfg)
        self.levers = apply_levers(model, self.cfg)
        self.shape = ModelShape.from_config(self.model_config)
        self.device_name, self.peak = detect_gpu_peak()
        self.n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        self.n_4bit = sum(type(m).__module__.startswith("bitsandbytes") and type(m).__name__ == "Linear4bit"
                          for m in model.modules())
        return model

    def _setup_optimizer(self) -> tuple[Any, Any]:
        """AdamW over the trainable (LoRA) parameters and its learning-rate schedule."""
        o = self.cfg.optim
        optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=o.lr,
                                      weight_decay=o.weight_decay)
        scheduler = get_scheduler(o.scheduler, optimizer, num_warmup_steps=int(o.warmup_ratio * self.total_steps),
                                  num_training_steps=self.total_steps)
        return optimizer, scheduler

    def _prepare(self) -> None:
        if is_deepspeed(self.accelerator):
            # no dataloader goes through prepare(), so the engine's batch sizes, accumulation and clipping are
            # set here; the engine then steps optimizer and scheduler once per optimizer step, not per micro-batch
            ds = self.accelerator.state.deepspeed_plugin.deepspeed_config
            rows = 1 if self.cfg.data.batching == "packing" else self.cfg.data.micro_batch_size
            ds["train_micro_batch_size_per_gpu"] = rows
            ds["gradient_accumulation_steps"] = self.grad_accum
            ds["train_batch_size"] = rows * self.grad_accum * self.world
            ds["gradient_clipping"] = self.cfg.optim.max_grad_norm
            ds.setdefault("zero_allow_untested_optimizer", True)
        self.model, self.optimizer, self.scheduler = self.accelerator.prepare(self.model, self.optimizer,
                                                                              self.scheduler)
        self.attention_ran = _attention(self.accelerator, self.model)

    def _setup_state(self) -> TrainState:
        """The training state: fresh, or the resumed checkpoint's (weights and optimizer loaded into place)."""
        d = self.cfg.data
        self.meta = {"base_model": self.cfg.model, "base_fingerprint": fingerprint(self.model_config.to_dict()),
                     "template": self.cfg.template, "task": d.task, "split": d.split, "seed": self.cfg.seed,
                     "data_file": str(self.cfg.data_file()), "precision": self.precision,
                     "max_context_tokens": self.seq_len}
        resume_from = self.resume_from
        if self.main:
            (self.out / "PREEMPTED").unlink(missing_ok=True)
        if resume_from is None:
            return TrainState(world_size=self.world, grad_accum=self.grad_accum, config_sha=self.config_sha)
        s = load_checkpoint(self.accelerator, self.model, self.optimizer, self.scheduler, resume_from)
        # the position is per rank: carry the global one over to this number of processes
        s.micro = rank_position(s.micro, s.world_size, self.world, len(self._all_batches(s.epoch)))
        s.world_size, s.grad_accum, s.config_sha = self.world, self.grad_accum, self.config_sha
        if self.main:
            print(f"train: resumed from {resume_from} (step {s.step})", file=self.term, flush=True)
            if self.resume_note:
                print(f"train: {self.resume_note}", file=self.term, flush=True)
                self.notes.append(self.resume_note)
        return s

    def _setup_logging(self) -> AppendLog | None:
        """The trackers started and ``metrics.jsonl`` opened (main process only), with the run's first record."""
        if self.trackers:
            o, d = self.cfg.optim, self.cfg.data
            self.accelerator.init_trackers("tb", config={"task": d.task, "split": d.split, "lr": o.lr})
        if not self.main:
            return None
        log = AppendLog(self.out / "metrics.jsonl")
        if self.resume_from is not None:
            log.append({"event": "resumed", "step": self.state.step, "checkpoint": str(self.resume_from),
                         "world_size": self.world, "grad_accum": self.grad_accum, "note": self.resume_note})
        if self.state.step == 0:
            log.append({"event": "start", "train_samples": len(self.train_set),
                         "eval_samples": len(self.eval_set), "trainable_params": self.n_trainable,
                         "linear_4bit_modules": self.n_4bit, "world_size": self.world,
                         "distributed": _distribution(self.accelerator, self.model), "precision": self.precision,
                         **self._attention_record(), **self.levers.record(),
                         "loss_chunk_tokens": self.cfg.loss_chunk_tokens, "max_context_tokens": self.seq_len,
                         "device": self.device_name, "gpu": self.peak.label if self.peak else None,
                         "peak_tflops": self.peak.flops / 1e12 if self.peak else None,
                         "steps": self.total_steps, "notes": self.notes})
        return log

    def _attention_record(self) -> dict[str, str]:
        """The kernel that runs (the loaded model's resolved ``config._attn_implementation``, not the request) and
        how packed rows reach it: varlen (FA2/FA3 from position ids), a flex BlockMask, or a dense
        block-diagonal mask that sdpa/eager compute every block of."""
        ran = self.attention_ran
        packed = PACKED_PATH.get(ran, "unknown") if self.cfg.data.batching == "packing" else "unpacked"
        return {"attention": ran, "attention_requested": self.cfg.attn_implementation, "attention_packed": packed}

    # -- training ------------------------------------------------------------------------------------------------

    def train(self) -> int:
        """Run optimizer steps until the configured number; 0 when done, PREEMPTED_EXIT after a signal."""
        s = self.state
        # a bar on a terminal, else a line every 30 s (no \r in a log); the main process only
        bar = Progress(self.total_steps if self.main else 0, "train", "step", stream=self.term, initial=s.step)
        self._t0, self._tokens0, self._flops = time.perf_counter(), s.tokens, [0.0, 0.0]
        try:
            return self._loop(bar)
        finally:
            bar.close()

    def _loop(self, bar: Any) -> int:
        s = self.state
        while s.step < self.total_steps:
            mine = self._epoch_batches(s.epoch)
            while s.micro < len(mine) and s.step < self.total_steps:
                rng = rng_state()  # a save mid-step resumes from this step's start, RNG included
                group = mine[s.micro: s.micro + self.grad_accum]
                stats = self._train_step(group)
                if stats is None:  # a signal mid-step: every rank stopped after the same micro-batch
                    self._save_preempted(rng)
                    return PREEMPTED_EXIT
                s.micro += len(group)
                s.step += 1
                self._log_step(stats)
                bar.update(1, f"loss {stats['loss']:.4f}, {stats['tokens_per_s']:.0f} tok/s")
                if self.preempt.agreed(self.accelerator):
                    self._save_preempted(rng_state())
                    return PREEMPTED_EXIT
                if s.step % self.cfg.checkpoint.every_steps == 0 and s.step < self.total_steps:
                    self.save_checkpoint(rng_state())
            if s.micro >= len(mine):
                self._end_epoch()
        return 0

    def _train_step(self, group: list[list[list[int]]]) -> dict[str, Any] | None:
        """One optimizer step over the micro-batches of ``group``: the loss is the token mean over all of them on
        all ranks. Gradients are synchronised (all-reduce, reduce-scatter, ZeRO reduction) on the last
        micro-batch only. None when preemption was agreed before the step finished."""
        acc, model = self.accelerator, self.model
        batches = [collate(self.train_set, rows, self.tok.pad_token_id) for rows in group]
        flops = step_flops(self.shape, [r for b in batches for r in rows_from_positions(b["position_ids"],
                                                                                         b.get("attention_mask"))],
                           self.cfg.lora.r, self.cfg.lora.target_modules, self.levers.checkpointed_layers,
                           self.attention_ran)
        counts = torch.tensor([sum(int((b["labels"] != -100).sum()) for b in batches),
                               sum(int(b["real_tokens"]) for b in batches),
                               sum(b["input_ids"].numel() for b in batches), flops.model, flops.hardware],
                              dtype=torch.float64, device=acc.device)
        if self.world > 1:
            torch.distributed.all_reduce(counts)
        n_target = max(counts[0].item(), 1.0)
        # accelerate (and DeepSpeed's engine) divide each backward by grad_accum: undo it, so the sum over the
        # step's micro-batches, averaged over ranks by the gradient reduction, is the token mean
        scale = self.world * self.grad_accum / n_target
        model.train()
        loss_sum = torch.zeros((), dtype=torch.float64, device=acc.device)
        varlen = PACKED_PATH.get(self.attention_ran) == "varlen"
        for i, b in enumerate(batches):
            last = i == len(batches) - 1
            acc.sync_gradients = last
            extra = varlen_kwargs(b["position_ids"], acc.device) if varlen and "attention_mask" not in b else {}
            b = {k: v.to(acc.device) for k, v in b.items() if k != "real_tokens"}
            with acc.no_sync(model) if not last else contextlib.nullcontext():
                summed = micro_batch_losses(model, b, self.cfg.loss_chunk_tokens, self.levers.linear_loss,
                                            **extra).sum()
                acc.backward(summed * scale)
            loss_sum += summed.detach()
            if not last and self.preempt.agreed(acc):
                self.optimizer.zero_grad(set_to_none=True)
                return None
        grad_norm = acc.clip_grad_norm_(model.parameters(), self.cfg.optim.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.world > 1:
            torch.distributed.all_reduce(loss_sum)
        s = self.state
        s.tokens += int(counts[1].item())
        s.target_tokens += int(counts[0].item())
        self._flops[0] += counts[3].item()
        self._flops[1] += counts[4].item()
        dt = max(time.perf_counter() - self._t0, 1e-9)
        # per GPU: the FLOPs of all ranks over the time, against one GPU's peak times the number of GPUs
        peak = self.peak.flops * self.world if self.peak else None
        return {"loss": loss_sum.item() / n_target, "grad_norm": _scalar(grad_norm),
                "non_pad_share": counts[1].item() / max(1.0, counts[2].item()),
                "tokens_per_s": (s.tokens - self._tokens0) / dt,
                "model_tflops_per_s": self._flops[0] / dt / 1e12, "hardware_tflops_per_s": self._flops[1] / dt / 1e12,
                "mfu": self._flops[0] / dt / peak if peak else None,
                "hfu": self._flops[1] / dt / peak if peak else None}

    def _log_step(self, stats: dict[str, Any]) -> None:
        s = self.state
        if self.main and s.step % self.cfg.logging.every_steps == 0:
            rec = {"step": s.step, "epoch": s.epoch, "loss": stats["loss"], "lr": self.scheduler.get_last_lr()[0],
                   "grad_norm": stats["grad_norm"], "tokens": s.tokens, "tokens_per_s": stats["tokens_per_s"],
                   "non_pad_share": stats["non_pad_share"], "model_tflops_per_s": stats["model_tflops_per_s"],
                   "hardware_tflops_per_s": stats["hardware_tflops_per_s"], "mfu": stats["mfu"], "hfu": stats["hfu"]}
            self._event(rec)
            if self.trackers:
                self.accelerator.log({k: v for k, v in rec.items() if isinstance(v, (int, float))}, step=s.step)

    def _end_epoch(self) -> None:
        ev = evaluate(self.accelerator, self.model, self.eval_set, self.tok.pad_token_id, self.cfg.loss_chunk_tokens,
                      self.levers.linear_loss)
        if self.main and ev is not None:
            self._event({"event": "eval", "epoch": self.state.epoch, "step": self.state.step, "eval_loss": ev})
            if self.trackers:
                self.accelerator.log({"eval_loss": ev}, step=self.state.step)
        self.state.epoch += 1
        self.state.micro = 0

    # -- results ---------------------------------------------------------------------------------------------------

    def save_checkpoint(self, rng: dict[str, Any], on_saved: Any = None) -> Path:
        """A complete checkpoint of the current step (collective); ``on_saved(path)`` runs on the main process
        before the checkpoint's last barrier."""
        return save_checkpoint(self.accelerator, self.model, self.optimizer, self.scheduler, self.ckpt_dir,
                               self.state, rng, self.tok, {**self.meta, "steps": self.state.step},
                               self.cfg.checkpoint.keep, on_saved)

    def _save_preempted(self, rng: dict[str, Any]) -> None:
        def mark(path: Path) -> None:
            self._event({"event": "preempted", "step": self.state.step, "signal": self.preempt.signum,
                         "checkpoint": str(path)})
            # launchers (torchrun's agent) exit 1 on a signal whatever we return: the marker is what a job script
            # checks before requeueing. Written before the last barrier: after it, another node's ranks may exit
            # and srun --kill-on-bad-exit then kills this one before it could write anything
            (self.out / "PREEMPTED").write_text(f"{path}\n")

        path = self.save_checkpoint(rng, on_saved=mark)
        if self.main:
            print(f"train: signal {self.preempt.signum}: saved {path}; exit {PREEMPTED_EXIT}, resume with the "
                  "same command", file=self.term, flush=True)

    def publish(self) -> None:
        """Save the last checkpoint, publish its adapter as ``OUT/adapter`` and write the run's summary."""
        last = self.save_checkpoint(rng_state())
        if not self.main:
            return
        # the final checkpoint's adapter is the result: publish a copy rather than gather the shards again
        with atomic_dir(self.final_adapter) as tmp:
            shutil.copytree(last / "adapter", tmp, dirs_exist_ok=True)
        s = self.state
        summary = {"steps": s.step, "tokens": s.tokens, "target_tokens": s.target_tokens,
                   "seconds_this_process": time.perf_counter() - self._t0, "adapter": str(self.final_adapter),
                   "trainable_params": self.n_trainable, "world_size": self.world}
        write_json_atomic(self.out / "train_summary.json", summary)
        self._event({"event": "done", **summary})
        if self.cfg.merge:
            how = merge_weights(self.base_model, self.final_adapter, self.out / "merged", self.precision,
                                self.cfg.quantization)
            self._event({"event": "merged", "path": str(self.out / "merged"), "how": how})
        print(f"train: done, {s.step} steps; adapter: {self.final_adapter}", file=self.term, flush=True)

    def cleanup(self) -> None:
        log = getattr(self, "log", None)  # None too when setup stopped before it
        if log is not None:
            log.close()
        self.accelerator.end_training()


def evaluate(accelerator: Any, model: Any, examples: list, pad_id: int, chunk: int = 4096,
             linear_loss: Any = None) -> float | None:
    """Mean answer-token loss on the held-out examples (sharded over ranks), through the training loss's path."""
    if not examples:
        return None
    model.eval()
    sums = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
    world, rank = accelerator.num_processes, accelerator.process_index
    rounds = -(-len(examples) // world)  # every rank runs as many forwards (FSDP/ZeRO-3 forwards are collective)
    with torch.no_grad():
        for r in range(rounds):
            i = r * world + rank
            b = collate(examples, [[i % len(examples)]], pad_id)
            b = {k: v.to(accelerator.device) for k, v in b.items() if k != "real_tokens"}
            losses = micro_batch_losses(model, b, chunk, linear_loss)
            if i < len(examples):  # the padding forwards are not counted
                sums[0] += losses.sum()
                sums[1] += (b["labels"][:, 1:] != -100).sum()
    if accelerator.num_processes > 1:
        torch.distributed.all_reduce(sums)
    return (sums[0] / sums[1].clamp(min=1)).item()


def merge_weights(base: str, adapter: Path, out: Path, precision: str = "bf16", quantization: str | None = None
                  ) -> str:
    """Full weights with the adapter folded in (for servers without LoRA support); returns how it merged.

    On the GPU when there is one (a 7B merge on the CPU of a GPU job takes minutes of the allocation for nothing).
    A QLoRA adapter was trained against the NF4-dequantized weights, not the bf16 ones: it is merged into the
    base loaded in NF4 exactly as training loaded it and dequantized (``PreTrainedModel.dequantize``, transformers'
    bitsandbytes 4-bit quantizer), so the merged model computes what training computed. Serving a QLoRA adapter on
    the bf16 base instead (``mlbench infer --adapter``) adds each weight's quantization error."""
    dtype = DTYPES[precision]
    device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    kwargs: dict[str, Any] = {"dtype": dtype, "device_map": {"": device}}
    if quantization == "nf4":
        kwargs["quantization_config"] = nf4_config(dtype)
    model = AutoModelForCausalLM.from_pretrained(base, **kwargs)
    if quantization == "nf4":
        model = model.dequantize(dtype=dtype)
    PeftModel.from_pretrained(model, adapter).merge_and_unload().save_pretrained(out)
    load_tokenizer(str(adapter), "--adapter", fast=False).save_pretrained(out)
    honour_umask(out)
    return f"{'NF4-dequantized' if quantization else precision} base, merged on {device}"


def context_budget(cfg: TrainConfig, model_config: Any) -> tuple[int, int | None, str | None]:
    """``(tokens per example, the model's positions, a note when the config asked for more)``:
    ``data.max_context_tokens`` capped at the model's positions (:func:`mlbench_kit.hf.model_positions`)."""
    positions = model_positions(model_config)
    asked = cfg.data.max_context_tokens
    if positions and asked > positions:
        return positions, positions, f"data.max_context_tokens {asked} capped at the model's {positions} positions"
    return asked, positions, None


def _sha(config: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]


def _check_prep_budget(cfg: TrainConfig, positions: int | None) -> None:
    """Records cut for a longer context than the model has would all be too long: say so before training."""
    manifest = Path(cfg.data.prep_dir) / "manifest.json"
    if cfg.data.path or not positions or not manifest.is_file():
        return
    written = json.loads(manifest.read_text())
    budget = written.get("max_context_tokens", written.get("max_tokens"))  # max_tokens: prep before the rename
    if budget and budget > positions:
        raise MLBenchError(f"prep cut the README context for {budget} tokens, but {cfg.model} has {positions} "
                           "positions", str(manifest),
                           f"re-run `mlbench prep --max-context-tokens {positions}` with this model's tokenizer")


def _distribution(accelerator: Any, model: Any) -> str:
    """What actually happened to the model: FSDP2 shows as DTensor parameters."""
    if any(hasattr(p, "full_tensor") for p in model.parameters()):
        return "FSDP2"
    return str(accelerator.distributed_type).rsplit(".", 1)[-1]


def _attention(accelerator: Any, model: Any) -> str:
    """The attention kernel the model really runs."""
    return str(getattr(accelerator.unwrap_model(model).config, "_attn_implementation", "unknown"))


def _scalar(x: Any) -> float | None:
    if x is None:
        return None
    return float(x.full_tensor() if hasattr(x, "full_tensor") else x)


def _trackers(cfg: TrainConfig) -> list[str]:
    out = []
    if cfg.logging.tensorboard and importlib.util.find_spec("tensorboard"):
        out.append("tensorboard")
    if cfg.logging.wandb:
        if not importlib.util.find_spec("wandb"):
            raise MLBenchError("logging.wandb is on but wandb is not installed", "logging.wandb",
                               "pip install wandb, or set logging.wandb: false")
        out.append("wandb")
    return out


def main(argv: list[str] | None = None) -> int:
    bars_only_on_tty()  # `accelerate launch train/lora.py` skips `mlbench`: no library bars in a log here either
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_options(parser, stage("train"))
    try:
        return run(parser.parse_args(argv), LoRAFinetuneRecipe)
    except MLBenchError as exc:
        print(f"error: {exc.render()}", file=sys.stderr)
        return 2


def exit_worker(code: int) -> None:
    """End a process of a multi-process run with the run's own exit status once its work is saved and its
    process group destroyed: skip the interpreter's teardown, where a library's native thread still joinable
    at exit can abort a finished rank (``terminate called without an active exception``, SIGABRT) and turn a
    published adapter into a failed job (seen once under ZeRO-3 in CI). A single process exits normally."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        sys.exit(code)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_worker(main())
