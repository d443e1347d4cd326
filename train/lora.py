"""LoRA / QLoRA fine-tuning recipe for ML-Bench prompts, one script for every setup.

    accelerate launch train/lora.py --config configs/train/codellama-7b-instruct.yaml --task 3 --split ood
    accelerate launch --config_file configs/accelerate/fsdp2.yaml train/lora.py ...   # multi-GPU / multi-node
    mlbench train ...                                                                  # the same, one process

Reads data_prep's records, trains on answer + EOS only, saves checkpoints that a preempted or killed run
resumes from exactly (``--resume auto``, the default), and writes ``OUT/adapter/`` (PEFT format). On SIGTERM or
SIGUSR1 all ranks agree at the next step, save, write ``OUT/PREEMPTED`` and exit 75 (a launcher may report its
own status instead): run the same command again to continue.
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, "") and sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    # Run as a file (accelerate launch train/lora.py): drop train/ from the import path so its modules
    # (config.py, data.py, ...) cannot shadow other packages; they are imported from the installed namespace.
    sys.path.pop(0)

from mlbench_kit.errors import MLBenchError
from mlbench_kit.io import AppendLog, claim_run_folder, write_json_atomic
from mlbench_kit.train.config import SHORTCUTS, data_file, load_train_config, save_resolved
from mlbench_kit.train.distributed import enable_fsdp_on_cpu


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="configs/train/<model>.yaml")
    for key in SHORTCUTS:
        typ = {"task": int, "lr": float, "epochs": int, "max_steps": int, "seed": int, "max_seq_len": int,
               "grad_accum": int, "micro_batch_size": int}.get(key, str)
        p.add_argument(f"--{key.replace('_', '-')}", dest=key, type=typ, help=f"sets {SHORTCUTS[key]}")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any other config key, dotted (e.g. --set lora.r=64 --set quantization=nf4)")
    p.add_argument("--resume", default="auto", help="auto (newest complete checkpoint, default), none, or a path")


def run(args: argparse.Namespace) -> int:
    """Entry point shared by `accelerate launch train/lora.py` and `mlbench train`."""
    import torch
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from tqdm import tqdm

    from mlbench_kit.data_prep.truncate import load_tokenizer
    from mlbench_kit.infer.adapters import fingerprint
    from mlbench_kit.train.checkpoint import (PREEMPTED_EXIT, Preemption, latest_checkpoint, load_checkpoint,
                                              save_checkpoint)
    from mlbench_kit.train.data import collate, epoch_batches, load_examples, split_eval, token_losses
    from mlbench_kit.train.model import add_lora, load_base

    cfg = load_train_config(args.config, {k: getattr(args, k, None) for k in SHORTCUTS}, args.set)
    out = Path(cfg["output_dir"])
    final_adapter = out / "adapter"
    trackers = _trackers(cfg)
    accelerator = Accelerator(mixed_precision="bf16" if torch.cuda.is_available() else "no",
                              log_with=trackers or None, project_dir=str(out), cpu=not torch.cuda.is_available())
    enable_fsdp_on_cpu(accelerator)
    main = accelerator.is_main_process
    if (final_adapter / "adapter_config.json").is_file() and args.resume != "none":
        if main:
            print(f"train: already finished: {final_adapter}", file=sys.stderr)
        return 0
    if main:
        claim_run_folder(out / "run.json", {"config": cfg})
        save_resolved(cfg, out / "config.yaml")
    set_seed(cfg["seed"])

    tok = load_tokenizer(cfg["model"])
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    examples, notes = load_examples(data_file(cfg), tok, cfg["template"], cfg["data"]["max_seq_len"])
    train_set, eval_set = split_eval(examples, cfg["data"]["eval_fraction"], cfg["seed"])
    model = add_lora(load_base(cfg), cfg)
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    n_4bit = sum(type(m).__module__.startswith("bitsandbytes") and type(m).__name__ == "Linear4bit"
                 for m in model.modules())
    o, d = cfg["optim"], cfg["data"]
    world, rank = accelerator.num_processes, accelerator.process_index

    def my_batches(epoch: int) -> list[list[list[int]]]:
        batches = epoch_batches(train_set, d["batching"], d["micro_batch_size"], d["max_seq_len"], cfg["seed"], epoch)
        per_rank = len(batches) // world  # equal step counts on every rank
        if per_rank == 0:
            raise MLBenchError(f"{len(batches)} micro-batches cannot feed {world} processes", str(data_file(cfg)),
                               "use fewer processes or a smaller micro_batch_size")
        return batches[rank::world][:per_rank]

    steps_per_epoch = math.ceil(len(my_batches(0)) / o["grad_accum"])
    total = o["max_steps"] if o["max_steps"] > 0 else steps_per_epoch * o["epochs"]
    from transformers import get_scheduler
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=o["lr"],
                                  weight_decay=o["weight_decay"])
    scheduler = get_scheduler(o["scheduler"], optimizer, num_warmup_steps=int(o["warmup_ratio"] * total),
                              num_training_steps=total)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    meta = {"base_model": cfg["model"], "base_fingerprint": fingerprint(_config_dict(cfg["model"])),
            "template": cfg["template"], "task": d["task"], "split": d["split"], "seed": cfg["seed"],
            "data_file": str(data_file(cfg))}

    state = {"step": 0, "epoch": 0, "micro": 0, "tokens": 0, "target_tokens": 0}
    ckpt_dir = out / "checkpoints"
    resume_from = latest_checkpoint(ckpt_dir) if args.resume == "auto" else (
        None if args.resume == "none" else Path(args.resume))
    if main:
        (out / "PREEMPTED").unlink(missing_ok=True)
    if resume_from is not None:
        state = load_checkpoint(accelerator, model, optimizer, scheduler, resume_from)
        if main:
            print(f"train: resumed from {resume_from} (step {state['step']})", file=sys.stderr)
    if trackers:
        accelerator.init_trackers("tb", config={"task": d["task"], "split": d["split"], "lr": o["lr"]})
    preempt = Preemption()
    log = AppendLog(out / "metrics.jsonl") if main else None
    if main and state["step"] == 0:
        log.append({"event": "start", "train_samples": len(train_set), "eval_samples": len(eval_set),
                    "trainable_params": n_trainable, "linear_4bit_modules": n_4bit, "world_size": world,
                    "distributed": _distribution(accelerator, model), "steps": total, "notes": notes})
    bar = tqdm(total=total, initial=state["step"], desc="train", unit="step", disable=not main, file=sys.stderr)
    t0, tokens0 = time.perf_counter(), state["tokens"]

    def save() -> Path:
        return save_checkpoint(accelerator, model, optimizer, scheduler, ckpt_dir, state["step"], state, tok,
                               {**meta, "steps": state["step"]}, cfg["checkpoint"]["keep"])

    while state["step"] < total:
        mine = my_batches(state["epoch"])
        while state["micro"] < len(mine) and state["step"] < total:
            group = mine[state["micro"]: state["micro"] + o["grad_accum"]]
            batches = [collate(train_set, rows, tok.pad_token_id) for rows in group]
            counts = torch.tensor([sum(int((b["labels"] != -100).sum()) for b in batches),
                                   sum(int((b["input_ids"] != tok.pad_token_id).sum()) for b in batches)],
                                  dtype=torch.float64, device=accelerator.device)
            if world > 1:
                torch.distributed.all_reduce(counts)
            n_target = counts[0].item()
            model.train()
            loss_sum = 0.0
            for b in batches:
                b = {k: v.to(accelerator.device) for k, v in b.items()}
                logits = model(input_ids=b["input_ids"], position_ids=b["position_ids"],
                               attention_mask=b.get("attention_mask"), use_cache=False).logits
                summed = token_losses(logits, b["labels"]).sum()
                # token-level mean over the whole optimizer step on all ranks (gradients are averaged over ranks)
                accelerator.backward(summed * world / max(n_target, 1.0))
                loss_sum += summed.item()
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), o["max_grad_norm"])
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            total_loss = torch.tensor([loss_sum], dtype=torch.float64, device=accelerator.device)
            if world > 1:
                torch.distributed.all_reduce(total_loss)
            state["micro"] += len(group)
            state["step"] += 1
            state["tokens"] += int(counts[1].item())
            state["target_tokens"] += int(n_target)
            loss = total_loss.item() / max(n_target, 1.0)
            tps = (state["tokens"] - tokens0) / max(time.perf_counter() - t0, 1e-9)
            if main and state["step"] % cfg["logging"]["every_steps"] == 0:
                rec = {"step": state["step"], "epoch": state["epoch"], "loss": loss, "lr": scheduler.get_last_lr()[0],
                       "grad_norm": _scalar(grad_norm),
                       "tokens": state["tokens"], "tokens_per_s": tps,
                       "non_pad_share": counts[1].item() / max(1, world * sum(b["input_ids"].numel() for b in batches))}
                log.append(rec)
                if trackers:
                    accelerator.log({k: v for k, v in rec.items() if isinstance(v, (int, float))}, step=state["step"])
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tps:.0f}")
            if preempt.agreed(accelerator):
                path = save()
                if main:
                    log.append({"event": "preempted", "step": state["step"], "signal": preempt.signum,
                                "checkpoint": str(path)})
                    # launchers (torchrun's agent) exit 1 on a signal whatever we return: the marker is what a
                    # job script checks before requeueing
                    (out / "PREEMPTED").write_text(f"{path}\n")
                    print(f"train: signal {preempt.signum}: saved {path}; exit {PREEMPTED_EXIT}, resume with the "
                          "same command", file=sys.stderr)
                accelerator.end_training()
                return PREEMPTED_EXIT
            if state["step"] % cfg["checkpoint"]["every_steps"] == 0 and state["step"] < total:
                save()
        if state["micro"] >= len(mine):
            ev = evaluate(accelerator, model, eval_set, tok.pad_token_id)
            if main and ev is not None:
                log.append({"event": "eval", "epoch": state["epoch"], "step": state["step"], "eval_loss": ev})
                if trackers:
                    accelerator.log({"eval_loss": ev}, step=state["step"])
            state["epoch"] += 1
            state["micro"] = 0
    bar.close()
    last = save()
    if main:
        # the final checkpoint's adapter is the result: publish a copy rather than gather the shards again
        tmp = final_adapter.with_name(final_adapter.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(last / "adapter", tmp)
        shutil.rmtree(final_adapter, ignore_errors=True)
        tmp.rename(final_adapter)
        summary = {"steps": state["step"], "tokens": state["tokens"], "target_tokens": state["target_tokens"],
                   "seconds_this_process": time.perf_counter() - t0, "adapter": str(final_adapter),
                   "trainable_params": n_trainable, "world_size": world}
        write_json_atomic(out / "train_summary.json", summary)
        log.append({"event": "done", **summary})
        log.close()
        if cfg["merge"]:
            merge_weights(cfg["model"], final_adapter, out / "merged")
        print(f"train: done, {state['step']} steps; adapter: {final_adapter}", file=sys.stderr)
    accelerator.end_training()
    return 0


def evaluate(accelerator: Any, model: Any, examples: list, pad_id: int) -> float | None:
    """Mean answer-token loss on the held-out examples (sharded over ranks)."""
    import torch

    from mlbench_kit.train.data import collate, token_losses
    if not examples:
        return None
    model.eval()
    sums = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
    world, rank = accelerator.num_processes, accelerator.process_index
    rounds = -(-len(examples) // world)  # every rank runs as many forwards (FSDP forwards are collective)
    with torch.no_grad():
        for r in range(rounds):
            i = r * world + rank
            b = {k: v.to(accelerator.device) for k, v in collate(examples, [[i % len(examples)]], pad_id).items()}
            logits = model(input_ids=b["input_ids"], position_ids=b["position_ids"],
                           attention_mask=b["attention_mask"], use_cache=False).logits
            if i < len(examples):  # the padding forwards are not counted
                sums[0] += token_losses(logits, b["labels"]).sum()
                sums[1] += (b["labels"][:, 1:] != -100).sum()
    if accelerator.num_processes > 1:
        torch.distributed.all_reduce(sums)
    return (sums[0] / sums[1].clamp(min=1)).item()


def merge_weights(base: str, adapter: Path, out: Path) -> None:
    """Full weights with the adapter folded in (for servers without LoRA support)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mlbench_kit.train.model import compute_dtype
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=compute_dtype()), adapter)
    model.merge_and_unload().save_pretrained(out)
    AutoTokenizer.from_pretrained(adapter).save_pretrained(out)


def _distribution(accelerator: Any, model: Any) -> str:
    """What actually happened to the model: FSDP2 shows as DTensor parameters."""
    if any(hasattr(p, "full_tensor") for p in model.parameters()):
        return "FSDP2"
    return str(accelerator.distributed_type).rsplit(".", 1)[-1]


def _scalar(x: Any) -> float | None:
    if x is None:
        return None
    return float(x.full_tensor() if hasattr(x, "full_tensor") else x)


def _config_dict(model: str) -> dict[str, Any]:
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(model).to_dict()


def _trackers(cfg: dict[str, Any]) -> list[str]:
    import importlib.util
    out = []
    if cfg["logging"]["tensorboard"] and importlib.util.find_spec("tensorboard"):
        out.append("tensorboard")
    if cfg["logging"]["wandb"]:
        if not importlib.util.find_spec("wandb"):
            raise MLBenchError("logging.wandb is on but wandb is not installed", "logging.wandb",
                               "pip install wandb, or set logging.wandb: false")
        out.append("wandb")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except MLBenchError as exc:
        print(f"error: {exc.render()}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
