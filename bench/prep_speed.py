"""Bench data_prep on the real 260 test rows: task-2 windows vs the benchmark's per-row algorithm, and
rendering all three tasks at full scale (the 260 rows repeated to 9,641, the size of the whole benchmark).

    NLTK_DATA=../shared/mlbench/nltk_data python bench/prep_speed.py [--shared ../shared/mlbench] [--tokenizer DIR]

Prints ratios against the reference measured in the same run; exits non-zero if windows ever differ.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

FULL_SCALE = 9641


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shared", default=str(Path(__file__).resolve().parents[1].parent / "shared" / "mlbench"))
    ap.add_argument("--tokenizer", help="also time full-scale rendering with this tokenizer (8,192 budget)")
    ap.add_argument("--ref-rows", type=int, default=260, help="rows for the per-row reference timing")
    args = ap.parse_args()
    shared = Path(args.shared)
    os.environ.setdefault("NLTK_DATA", str(shared / "nltk_data"))

    from mlbench_kit.data_prep.corpus import ReadmeCorpus
    from mlbench_kit.data_prep.render import Renderer
    from mlbench_kit.data_prep.retrieval import reference_top1
    from mlbench_kit.dataset import load_samples
    from mlbench_kit.hf import load_tokenizer

    samples = load_samples(shared / "full.jsonl")
    corpus = ReadmeCorpus(shared / "readmes")
    readmes = [corpus.readme_for(s.repo, s.path).text for s in samples]

    t0 = time.perf_counter()
    # the reference runs on the first ref_rows rows only
    ref = [reference_top1(s.instruction, r) for s, r in zip(samples[: args.ref_rows], readmes, strict=False)]
    t_ref = time.perf_counter() - t0
    ref_rate = len(ref) / t_ref

    t0 = time.perf_counter()
    ours = Renderer(corpus).render_task(samples, 2)
    t_ours = time.perf_counter() - t0
    same = sum(o["context"] == r for o, r in zip(ours, ref, strict=False))  # ref: the first ref_rows
    print(f"task 2 windows identical to the reference: {same}/{len(ref)}")
    print(f"reference (Punkt + BM25Okapi rebuilt per row): {ref_rate:.1f} rows/s ({t_ref:.2f}s for {len(ref)} rows)")
    print(f"mlbench-kit (one index per README, {len(samples)} rows, cold): {len(samples) / t_ours:.1f} rows/s "
          f"-> {len(samples) / t_ours / ref_rate:.1f}x the reference")

    big = [dataclasses.replace(samples[i % len(samples)], id=100000 + i) for i in range(FULL_SCALE)]
    renderer = Renderer(corpus)
    t0 = time.perf_counter()
    times = {}
    for t in (2, 1, 3):
        t1 = time.perf_counter()
        renderer.render_task(big, t)
        times[t] = time.perf_counter() - t1
    t_full = time.perf_counter() - t0
    n = 3 * len(big)
    print(f"full scale task 2: {FULL_SCALE / times[2]:.0f} rows/s -> {FULL_SCALE / times[2] / ref_rate:.0f}x "
          f"the reference's per-row rate")
    est_ref = FULL_SCALE / ref_rate
    print(f"full scale, no tokenizer: {n} records (3 tasks x {FULL_SCALE}) in {t_full:.2f}s; "
          f"the reference's task 2 alone would take ~{est_ref:.0f}s (estimated from the per-row rate above) "
          f"-> {est_ref / t_full:.0f}x")
    if args.tokenizer:
        tok_renderer = Renderer(corpus, tokenizer=load_tokenizer(args.tokenizer), max_context_tokens=8192)
        t0 = time.perf_counter()
        recs = [r for t in (1, 2, 3) for r in tok_renderer.render_task(big, t)]
        dt = time.perf_counter() - t0
        print(f"full scale with tokenizer {args.tokenizer} (8,192 budget): {len(recs)} records in {dt:.1f}s, "
              f"{sum(r['truncated'] for r in recs)} truncated")
    return 0 if same == len(ref) else 1


if __name__ == "__main__":
    sys.exit(main())
