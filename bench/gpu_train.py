"""LoRA and QLoRA training throughput for the paper's three 7B-class models, through the recipe's own parts.

Each model is built from its exact shape (config only: random weights, no download), saved once, and loaded by
``train/model.py`` (bf16, or NF4 for QLoRA) with LoRA r=16 on all projections and non-reentrant gradient
checkpointing. Sequences are packed (``train/data.py``) from the real task-3 length distribution (the 260 test
rows rendered with the llama-inst template; tokens estimated at 3.3 characters each) into rows of the model's
context (8,192, Llama-2 4,096). Reported per setup: real tokens/s, peak GPU memory, and MFU counted as
6 x parameters x tokens/s against the GPU's dense bf16 peak.

    python bench/gpu_train.py                 # on a GPU: the three paper models, LoRA and QLoRA
    python bench/gpu_train.py --toy           # on CPU: the same code path at a toy shape (CI)
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import shutil
import sys
import tempfile
import time
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
TOY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
           vocab_size=1000, max_position_embeddings=1024)
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense bf16 FLOP/s


def task3_lengths(shared: Path, chars_per_token: float = 3.3) -> list[int]:
    """Token lengths of the real test rows' task-3 training examples (prompt + answer + EOS), estimated."""
    from mlbench_kit.data_prep.templates import render
    rows = [json.loads(x) for x in (shared / "full.jsonl").open()]
    out = []
    for r in rows:
        rd = render("llama-inst", r["instruction"], r["oracle"], r["output"], r["type"])
        out.append(math.ceil(len(rd.prompt + rd.answer) / chars_per_token) + 2)
    return out


def packed_rows(lengths: list[int], seq_len: int, vocab: int, n: int, seed: int = 0, packed: bool = True
                ) -> list[dict[str, torch.Tensor]]:
    """``n`` packed micro-batches (one row of ``seq_len`` at most) of random tokens with these lengths; with
    ``packed=False``, ``n`` micro-batches of one sample each (the longest), the unpacked baseline."""
    from mlbench_kit.train.data import Example, collate, pack
    g = torch.Generator().manual_seed(seed)
    lengths = [min(x, seq_len) for x in lengths]
    examples = [Example((0, i), torch.randint(3, vocab, (x,), generator=g).tolist(),
                        [-100] * (x // 2) + torch.randint(3, vocab, (x - x // 2,), generator=g).tolist())
                for i, x in enumerate(lengths * 8)]
    if not packed:
        order = sorted(range(len(examples)), key=lambda i: -len(examples[i]))
        return [collate(examples, [[i]], 0) for i in order[:n]]
    bins = pack([len(e) for e in examples], seq_len)
    bins.sort(key=lambda b: -sum(len(examples[i]) for i in b))  # the fullest rows: steady-state training
    return [collate(examples, [b], 0) for b in bins[:n]]


def run_one(name: str, shape: dict, mode: str, folder: Path, lengths: list[int], steps: int, warmup: int,
            device: str, loss_chunk: int = 4096, packed: bool = True, attention: str = "auto") -> dict:
    from mlbench_kit.train.config import TrainConfig
    from mlbench_kit.train.data import token_losses
    from mlbench_kit.train.model import (
        add_lora,
        load_base,
        resolve_attention,
        resolve_precision,
    )
    cfg = TrainConfig(model=str(folder), quantization="nf4" if mode == "qlora" else None, gradient_checkpointing=True)
    precision = resolve_precision("auto")
    attention = resolve_attention("auto") if attention == "auto" else attention
    model = add_lora(load_base(cfg, precision, attention), cfg)
    if mode == "lora":
        model.to(device)
    params = sum(p.numel() for p in model.parameters())
    n_base = _dense_params(shape)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-4)
    seq_len = shape["max_position_embeddings"] if shape["max_position_embeddings"] <= 8192 else 8192
    rows = packed_rows(lengths, seq_len, shape["vocab_size"], steps + warmup, packed=packed)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    model.train()
    tokens, t0 = 0, None
    for i, b in enumerate(rows):
        if i == warmup:
            if device == "cuda":
                torch.cuda.synchronize()
            t0, tokens = time.perf_counter(), 0
        b = {k: v.to(device) for k, v in b.items() if k != "real_tokens"}
        logits = model(input_ids=b["input_ids"], position_ids=b["position_ids"], attention_mask=b.get("attention_mask"),
                       use_cache=False).logits
        loss = token_losses(logits, b["labels"], loss_chunk).sum() / (b["labels"] != -100).sum()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        tokens += b["input_ids"].numel()
    if device == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    tps = tokens / dt
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    peak = next((v for k, v in PEAK_BF16.items() if k in gpu), None)
    res = {"model": name, "mode": mode, "packed": packed, "loss_chunk": loss_chunk, "device": gpu, "precision": precision, "attention": attention,
           "seq_len": seq_len, "steps": steps, "tokens_per_s": round(tps, 1), "params": params,
           "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
           "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device == "cuda" else None,
           "mfu": round(6 * n_base * tps / peak, 4) if peak else None, "loss": round(loss.item(), 4)}
    del model, opt, logits, loss
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return res


def _dense_params(shape: dict) -> int:
    h, i, L, v = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"], shape["vocab_size"]
    kv = h * shape["num_key_value_heads"] // shape["num_attention_heads"]
    return L * (2 * h * h + 2 * h * kv + 3 * h * i + 2 * h) + 2 * v * h + h


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
    ap.add_argument("--models", nargs="+", default=list(SHAPES))
    ap.add_argument("--modes", nargs="+", default=["lora", "qlora"], choices=["lora", "qlora"])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--toy", action="store_true", help="a toy shape (CPU, CI)")
    ap.add_argument("--loss-chunk", type=int, default=4096, help="cross-entropy chunk (tokens); >= seq_len: none")
    ap.add_argument("--unpacked", action="store_true", help="one sample per micro-batch (the baseline to packing)")
    ap.add_argument("--attention", default="auto", help="auto (the recipe's choice), sdpa, flex_attention, ...")
    ap.add_argument("--shared", default=str(ROOT.parent / "shared" / "mlbench"))
    ap.add_argument("--out", help="write the results as JSON here")
    a = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    lengths = task3_lengths(Path(a.shared))
    shapes = {"toy": TOY} if a.toy else {m: SHAPES[m] for m in a.models}
    results = []
    for name, shape in shapes.items():
        folder = Path(tempfile.mkdtemp(prefix=f"bench-{name}-"))
        try:
            build(shape, folder, device)
            for mode in a.modes:
                r = run_one(name, shape, mode, folder, lengths, a.steps, a.warmup, device, a.loss_chunk,
                            not a.unpacked, a.attention)
                results.append(r)
                print(json.dumps(r), flush=True)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    print("\n| model | mode | tokens/s | peak GiB | MFU | device |\n|---|---|---|---|---|---|", file=sys.stderr)
    for r in results:
        print(f"| {r['model']} | {r['mode']} | {r['tokens_per_s']:.0f} | {r['peak_mem_gib']} | {r['mfu']} | "
              f"{r['device']} |", file=sys.stderr)
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
