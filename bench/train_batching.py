"""Non-pad share of tokens per micro-batch for packing, length-grouped and naive padding, on the real test rows'
token lengths (tasks 1-3), and CPU tokens/s of packing vs naive padding on a tiny Llama. Ratios in one run.

    NLTK_DATA=../shared/mlbench/nltk_data python bench/train_batching.py [--shared ../shared/mlbench]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from mlbench_kit.hf import load_tokenizer
from mlbench_kit.train.data import collate, epoch_batches, load_examples
from mlbench_kit.train.loss import token_losses

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from tiny import build_llama, build_tokenizer  # noqa: E402  (examples/tiny.py)


def share(examples, mode: str, micro: int, max_len: int) -> float:
    batches = epoch_batches(examples, mode, micro, max_len, seed=0, epoch=0)
    real = sum(len(examples[i]) for b in batches for row in b for i in row)
    if mode == "packing":  # each packed row is a fixed max_len sequence: count the unfilled tail as padding
        return real / (sum(len(b) for b in batches) * max_len)
    padded = sum(len(b) * max(sum(len(examples[i]) for i in row) for row in b) for b in batches)
    return real / padded


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shared", default=str(Path(__file__).resolve().parents[2] / "shared" / "mlbench"))
    p.add_argument("--max-len", type=int, default=8192)
    a = p.parse_args()
    rows = [json.loads(x) for x in open(Path(a.shared) / "full.jsonl")]
    tmp = Path(tempfile.mkdtemp())
    tok_dir = build_tokenizer([r["instruction"] + r["oracle"] + r["output"] for r in rows], tmp / "tok", 1500)
    prep = tmp / "prep"
    subprocess.run([sys.executable, "-m", "mlbench_kit.cli", "prep", "--data", str(Path(a.shared) / "full.jsonl"),
                    "--splits", "full", "--readmes", str(Path(a.shared) / "readmes"), "--template", "llama-inst",
                    "--tokenizer", str(tok_dir), "--max-context-tokens", str(a.max_len), "--no-hf", "--out", str(prep)],
                   check=True, capture_output=True)
    tok = load_tokenizer(str(tok_dir))
    print(f"non-pad share per micro-batch, real 260 rows, max_len {a.max_len} (micro-batch 4 for padded modes):")
    for t in (1, 2, 3):
        ex, _ = load_examples(prep / "full" / f"task{t}.jsonl", tok, "llama-inst", a.max_len)
        res = {m: share(ex, m, 1 if m == "packing" else 4, a.max_len) for m in ("packing", "grouped", "padding")}
        print(f"  task {t}: " + ", ".join(f"{m} {v:.1%}" for m, v in res.items()))
    # tokens/s on CPU: same examples, packing (1 x 1024) vs naive padding (4 per batch)
    model_dir = build_llama(tok_dir, tmp / "model")
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    ex, _ = load_examples(prep / "full" / "task3.jsonl", tok, "llama-inst", 1024)
    speeds = {}
    for mode, micro in (("packing", 1), ("padding", 4)):
        batches = epoch_batches(ex, mode, micro, 1024, seed=0, epoch=0)[:40]
        n, t0 = 0, time.perf_counter()
        for rows_ in batches:
            b = collate(ex, rows_, tok.pad_token_id)
            token_losses(model(**b, use_cache=False).logits, b["labels"]).sum().backward()
            n += sum(len(ex[i]) for row in rows_ for i in row)
        speeds[mode] = n / (time.perf_counter() - t0)
    print(f"CPU tiny Llama, forward+backward real tokens/s: packing {speeds['packing']:.0f}, "
          f"padding {speeds['padding']:.0f}, ratio {speeds['packing'] / speeds['padding']:.2f}x")


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
