"""LoRA and QLoRA training throughput for the paper's three 7B-class models, through the recipe's own parts.

Each model is built from its exact shape (config only: random weights, no download), saved once, and loaded by
``train/model.py`` (bf16, or NF4 for QLoRA) with LoRA r=16 on all projections and non-reentrant gradient
checkpointing. Sequences are packed (``train/data.py``) from the real task-3 length distribution (the 260 test
rows rendered with the llama-inst template; tokens estimated at 3.3 characters each) into rows of the model's
context (8,192, Llama-2 4,096). Reported per setup: real tokens/s, peak GPU memory, MFU (model FLOPs: 4N for the
frozen base + 6N for LoRA + causal attention over each packed sample's own length; ``train/flops.py``) and HFU
(hardware FLOPs: + the checkpointing recompute, + masked attention blocks a dense-mask kernel computes), both
against the exact GPU's dense bf16 peak (none for a GPU the table does not know), and the attention kernel that
ran (the loaded model's resolved ``config._attn_implementation``) with how packed rows reach it.

    python bench/gpu_train.py                 # on a GPU: the three paper models, LoRA and QLoRA
    python bench/gpu_train.py --models codellama-7b-instruct --levers baseline flex fused-loss ckpt-every-2 \
        no-ckpt compile baseline              # each lever alone, against a baseline timed in the same run
    python bench/gpu_train.py --toy           # on CPU: the same code path at a toy shape (CI)
    python bench/gpu_train.py --restate bench/results/gpu_train_h100_codellama.json   # MFU of a stored result
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import multiprocessing
import shutil
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {  # the released configs' shape-defining fields
    "codellama-7b-instruct": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                  num_attention_heads=32, num_key_value_heads=32, vocab_size=32016,
                                  max_position_embeddings=16384, rope_theta=1e6),
    "deepseek-coder-6.7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                num_attention_heads=32, num_key_value_heads=32, vocab_size=32256,
                                max_position_embeddings=16384, rope_theta=1e5),
    "llama-2-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096),
}
SMALL = {  # a real small Llama (SmolLM2-135M-Instruct's shape): big vocabulary for its width, tied lm_head
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192,
                         tie_word_embeddings=True, rope_theta=1e5),
}
TOY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
           vocab_size=1000, max_position_embeddings=1024)


def task3_lengths(shared: Path, chars_per_token: float = 3.3) -> list[int]:
    """Token lengths of the real test rows' task-3 training examples (prompt + answer + EOS), estimated."""
    from mlbench_kit.data_prep.templates import render
    rows = [json.loads(x) for x in (shared / "full.jsonl").open()]
    out = []
    for r in rows:
        rd = render("llama-inst", r["instruction"], r["oracle"], r["output"], r["type"])
        out.append(math.ceil(len(rd.prompt + rd.answer) / chars_per_token) + 2)
    return out


def select_rows(lengths: list[int], seq_len: int, n: int, packed: bool = True) -> tuple[list[int], list[list[int]]]:
    """The example lengths the bench draws from (``lengths`` x 8, capped at ``seq_len``) and the ``n`` rows it
    times, as example indices: the fullest packed rows (steady-state training) or, unpacked, the longest samples."""
    from mlbench_kit.train.data import pack
    lengths = [min(x, seq_len) for x in lengths] * 8
    if not packed:
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        return lengths, [[i] for i in order[:n]]
    bins = pack(lengths, seq_len)
    bins.sort(key=lambda b: -sum(lengths[i] for i in b))
    return lengths, bins[:n]


def packed_rows(lengths: list[int], seq_len: int, vocab: int, n: int, seed: int = 0, packed: bool = True
                ) -> list[dict[str, torch.Tensor]]:
    """``n`` packed micro-batches (one row of ``seq_len`` at most) of random tokens with these lengths; with
    ``packed=False``, ``n`` micro-batches of one sample each (the longest), the unpacked baseline."""
    from mlbench_kit.train.data import Example, collate
    g = torch.Generator().manual_seed(seed)
    all_lengths, rows = select_rows(lengths, seq_len, n, packed)
    examples = [Example((0, i), torch.randint(3, vocab, (x,), generator=g).tolist(),
                        [-100] * (x // 2) + torch.randint(3, vocab, (x - x // 2,), generator=g).tolist())
                for i, x in enumerate(all_lengths)]
    return [collate(examples, [r], 0) for r in rows]


def utilisation(shape: dict, rows: list[list[int]], seconds: float, attention: str, device_name: str,
                sm_count: int | None = None, memory_gib: float | None = None, lora_r: int = 16,
                recomputed: int | None = None) -> dict:
    """MFU and HFU of timed ``rows`` (each: its samples' lengths) that took ``seconds`` on ``device_name``;
    ``recomputed``: the decoder layers under activation checkpointing (default: all, the recipe's default)."""
    from mlbench_kit.train.flops import ModelShape, gpu_peak, step_flops
    from mlbench_kit.train_config import LoraConfig
    ms = ModelShape.from_config(shape)
    f = step_flops(ms, rows, lora_r, LoraConfig().target_modules, ms.layers if recomputed is None else recomputed,
                   attention)
    peak = gpu_peak(device_name, sm_count, memory_gib) if device_name != "cpu" else None
    return {"model_gflop_per_token": round(f.model / f.tokens / 1e9, 3) if f.tokens else None,
            "model_tflops_per_s": float(f"{f.model / seconds / 1e12:.4g}"),
            "hardware_tflops_per_s": float(f"{f.hardware / seconds / 1e12:.4g}"),
            "gpu": peak.label if peak else None, "peak_tflops": round(peak.flops / 1e12, 1) if peak else None,
            "mfu": round(f.model / seconds / peak.flops, 4) if peak else None,
            "hfu": round(f.hardware / seconds / peak.flops, 4) if peak else None,
            "mfu_note": None if peak else f"no dense bf16 peak known for {device_name!r}: MFU not computed"}


def restate(path: Path, shared: Path, warmup: int = 2) -> list[dict]:
    """MFU/HFU of stored results, from their measured tokens/s: the timed rows are rebuilt (they depend only on
    the real lengths, the sequence length and the number of rows), so the seconds are tokens / tokens_per_s."""
    lengths = task3_lengths(shared)
    out = []
    doc = json.loads(path.read_text())
    for r in doc["results"] if isinstance(doc, dict) else doc:  # results since 2026-11-25 carry their versions
        if "error" in r:
            continue
        shape = SHAPES[r["model"]]
        all_lengths, rows = select_rows(lengths, r["seq_len"], r["steps"] + warmup, r.get("packed", True))
        timed = [[all_lengths[i] for i in row] for row in rows[warmup:]]
        tokens = sum(map(sum, timed))
        u = utilisation(shape, timed, tokens / r["tokens_per_s"], r["attention"], r["device"])
        out.append({k: r[k] for k in ("model", "mode", "attention", "tokens_per_s")} |
                   {"old_mfu_6n": r["mfu"], **u, "attention_packed": _packed_path(r["attention"], timed)})
    return out


def _packed_path(attention: str, rows: list[list[int]]) -> str:
    from mlbench_kit.train.flops import PACKED_PATH
    return PACKED_PATH.get(attention, "unknown") if any(len(r) > 1 for r in rows) else "unpacked"


LEVERS = {  # one change each against the recipe's defaults (the baseline), as TrainConfig fields
    "baseline": {},
    "flex": {"attn_implementation": "flex_attention"},  # packed rows as a BlockMask (no backward on CPU)
    "ckpt-every-2": {"gradient_checkpointing_every_n_layers": 2},
    "no-ckpt": {"gradient_checkpointing": False},
    "fused-loss": {"fused_linear_loss": True},
    "compile": {"compile": True},
    "liger": {"liger_kernels": True},  # Liger-Kernel's Triton RMSNorm, SwiGLU and RoPE (CUDA)
}


def lever_change(lever: str) -> dict:
    """A lever's TrainConfig change; ``a+b`` combines levers (``fused-loss+ckpt-every-2``)."""
    change: dict = {}
    for part in lever.split("+"):
        if part not in LEVERS:
            raise SystemExit(f"unknown lever {part!r} in {lever!r}: choose from {', '.join(LEVERS)} (join with +)")
        change |= LEVERS[part]
    return change


def versions() -> dict:
    """The stack that ran: the bench's numbers belong to these versions."""
    from importlib import metadata
    out = {"python": sys.version.split()[0], "torch_cuda": torch.version.cuda}
    for name in ("torch", "transformers", "peft", "accelerate", "triton", "bitsandbytes", "liger-kernel",
                 "flash-attn"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def _peak_rss_gib() -> float | None:
    """This process's peak resident memory; each run has a process of its own (``main``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return round(int(line.split()[1]) / 2**20, 2)
    return None


def run_one(name: str, shape: dict, mode: str, folder: Path, lengths: list[int], steps: int, warmup: int,
            device: str, loss_chunk: int = 4096, packed: bool = True, attention: str = "auto",
            lever: str = "baseline", seq_len: int | None = None) -> dict:
    """One timed setup through the recipe's own parts (``train/model.py``, ``train/loss.py``): load, LoRA (or
    QLoRA), the ``lever``'s change, ``warmup`` untimed steps, then ``steps`` timed ones."""
    from mlbench_kit.train.flops import rows_from_positions
    from mlbench_kit.train.loss import micro_batch_losses
    from mlbench_kit.train.model import (
        DTYPES,
        add_lora,
        apply_levers,
        load_base,
        resolve_attention,
        resolve_precision,
    )
    from mlbench_kit.train_config import TrainConfig
    change = lever_change(lever)
    fields = {"gradient_checkpointing": True, "loss_chunk_tokens": loss_chunk, "attn_implementation": attention}
    cfg = TrainConfig(model=str(folder), quantization="nf4" if mode == "qlora" else None, **(fields | change))
    precision = resolve_precision("auto")
    attention = resolve_attention(cfg.attn_implementation)
    model = add_lora(load_base(cfg, precision, attention), cfg)
    if mode == "lora":
        model.to(device)
    params = sum(p.numel() for p in model.parameters())
    ran = str(getattr(model.config, "_attn_implementation", attention))  # what transformers resolved, not asked
    levers = apply_levers(model, cfg)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-4)
    seq_len = seq_len or min(shape["max_position_embeddings"], 8192)
    rows = packed_rows(lengths, seq_len, shape["vocab_size"], steps + warmup, packed=packed)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    model.train()
    # the recipe's precision path: accelerate runs the forward under autocast in bf16/fp16 (accelerator.py,
    # prepare_model). Without it QLoRA's fp32 norms (prepare_model_for_kbit_training) put activations in fp32
    amp = device == "cuda" and precision != "fp32"
    autocast = torch.autocast("cuda", dtype=DTYPES[precision]) if amp else contextlib.nullcontext()
    tokens, t0, timed = 0, None, []
    for i, b in enumerate(rows):
        if i == warmup:
            if device == "cuda":
                torch.cuda.synchronize()
            t0, tokens = time.perf_counter(), 0
        if i >= warmup:
            timed += rows_from_positions(b["position_ids"], b.get("attention_mask"))
        b = {k: v.to(device) for k, v in b.items() if k != "real_tokens"}
        with autocast:
            losses = micro_batch_losses(model, b, loss_chunk, levers.linear_loss)
        loss = losses.sum() / (b["labels"] != -100).sum()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        tokens += b["input_ids"].numel()
    if device == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    tps = tokens / dt
    gpu, sms, gib = "cpu", None, None
    if device == "cuda":
        p = torch.cuda.get_device_properties(torch.cuda.current_device())
        gpu, sms, gib = p.name, p.multi_processor_count, p.total_memory / 2**30
    res = {"model": name, "mode": mode, "lever": lever, "change": change, "packed": packed, "loss_chunk": loss_chunk,
           "device": gpu, "sm_count": sms, "precision": precision, "autocast": amp,
           "attention_requested": cfg.attn_implementation, "attention": ran,
           "attention_packed": _packed_path(ran, timed), **levers.record(), "seq_len": seq_len, "steps": steps,
           "tokens_per_s": round(tps, 1), "params": params,
           "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
           "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device == "cuda" else None,
           "peak_rss_gib": _peak_rss_gib() if device == "cpu" else None,
           **utilisation(shape, timed, dt, ran, gpu, sms, gib, recomputed=levers.checkpointed_layers),
           "final_loss": round(loss.item(), 4)}
    return res


def build(shape: dict, folder: Path, device: str) -> None:
    """A random model of ``shape`` saved to ``folder`` (bf16 on GPU)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(**shape, torch_dtype="bfloat16" if device == "cuda" else "float32")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(folder, safe_serialization=True)
    del model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(SHAPES), choices=[*SHAPES, *SMALL])
    ap.add_argument("--modes", nargs="+", default=["lora", "qlora"], choices=["lora", "qlora"])
    ap.add_argument("--levers", nargs="+", default=["baseline"], metavar="LEVER[+LEVER]",
                    help=f"runs, each one change against the recipe's defaults, timed in this order (a name may "
                         f"repeat: a second baseline at the end shows the machine's drift); a+b combines levers. "
                         f"Levers: {', '.join(LEVERS)}")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--toy", action="store_true", help="a toy shape (CPU, CI)")
    ap.add_argument("--seq-len", type=int, help="packed row length (default: the model's positions, at most 8,192)")
    ap.add_argument("--loss-chunk", type=int, default=4096, help="cross-entropy chunk (tokens); >= seq_len: none")
    ap.add_argument("--unpacked", action="store_true", help="one sample per micro-batch (the baseline to packing)")
    ap.add_argument("--attention", default="auto", help="auto (the recipe's choice), sdpa, flex_attention, ...")
    ap.add_argument("--shared", default=str(ROOT.parent / "shared" / "mlbench"))
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--restate", type=Path, help="recompute MFU/HFU of a stored results JSON from its tokens/s")
    a = ap.parse_args()
    if a.restate:
        print(json.dumps(restate(a.restate, Path(a.shared)), indent=2))
        return
    for lever in a.levers:
        lever_change(lever)  # an unknown name stops here, before a 7B model is built
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(json.dumps({"versions": versions()}), flush=True)
    lengths = task3_lengths(Path(a.shared))
    shapes = {"toy": TOY} if a.toy else {m: (SHAPES | SMALL)[m] for m in a.models}
    results = []
    for name, shape in shapes.items():
        folder = Path(tempfile.mkdtemp(prefix=f"bench-{name}-"))
        try:
            build(shape, folder, device)
            for mode in a.modes:
                for lever in a.levers:
                    # a fresh process each: peak memory (the GPU's, or the CPU's resident set, which the
                    # allocator never gives back) and compiled code are the run's own
                    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
                        try:
                            r = pool.submit(run_one, name, shape, mode, folder, lengths, a.steps, a.warmup,
                                            device, a.loss_chunk, not a.unpacked, a.attention, lever,
                                            a.seq_len).result()
                        except Exception as exc:  # noqa: BLE001 - an OOM or a lever that fails is a result
                            r = {"model": name, "mode": mode, "lever": lever, "change": lever_change(lever),
                                 "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
                    results.append(r)
                    print(json.dumps(r), flush=True)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    print(table(results), file=sys.stderr)
    if a.out:
        Path(a.out).write_text(json.dumps({"versions": versions(), "results": results}, indent=2))


def table(results: list[dict]) -> str:
    """The results as a Markdown table; each run's tokens/s and peak memory also as a ratio to the first
    baseline of its model and mode in the same run."""
    base: dict[tuple[str, str], dict] = {}
    for r in results:
        if r["lever"] == "baseline" and "error" not in r:
            base.setdefault((r["model"], r["mode"]), r)
    lines = ["| model | mode | lever | tokens/s | × baseline | peak GiB | × baseline | MFU | HFU "
             "| attention (packed rows) | recomputed layers | loss | device |", "|" + "---|" * 13]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['mode']} | {r['lever']} | failed: {r['error'][:120]} |" + " |" * 9)
            continue
        b = base.get((r["model"], r["mode"]))
        mem_key = "peak_mem_gib" if r["peak_mem_gib"] is not None else "peak_rss_gib"
        mem = r[mem_key]
        speed = f"{r['tokens_per_s'] / b['tokens_per_s']:.2f}" if b else "-"
        mem_ratio = f"{mem / b[mem_key]:.2f}" if b and mem and b[mem_key] else "-"
        lines.append(f"| {r['model']} | {r['mode']} | {r['lever']} | {r['tokens_per_s']:.0f} | {speed} | "
                     f"{mem}{'' if mem_key == 'peak_mem_gib' else ' (RSS)'} | {mem_ratio} | {r['mfu']} | {r['hfu']} | "
                     f"{r['attention']} ({r['attention_packed']}) | {r['checkpointed_layers']} | {r['loss_impl']} | "
                     f"{r['gpu'] or r['device']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
