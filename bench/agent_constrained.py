"""Constrained decoding of ML-Agent's JSON steps (issue 40 item 2): format errors and exits with ``decoding: free``
and ``decoding: json`` on the same rows, episodes and seeds, one vLLM engine for both arms.

Each arm runs `mlbench_kit.agent.run.run_episodes` into its own folder (the agent's ordinary transcripts); the
summary is read back from them. Prints one JSON line: per arm, turns, format-error turns (by step), replies cut at
the token cap, exits, ranked README names the harness dropped as not offered (the plan's ``fallback``), files asked
for that were refused, answers written, seconds.

    python bench/agent_constrained.py --model ~/.cache/mlbench/models/SmolLM2-135M-Instruct \\
        --data ../shared/mlbench/full.jsonl --tarballs ../shared/mlbench/repos --repos External-Attention-pytorch \\
        --limit 3 --config configs/agent/real-cpu.yaml --episodes 2 --max-turns 6 --out runs/agent-constrained
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from mlbench_kit.agent.run import checkouts, make_encoder, make_engine, run_episodes, select_rows
from mlbench_kit.cli import stage_config
from mlbench_kit.engine import context_length
from mlbench_kit.hf import load_tokenizer, model_positions


def arm_summary(out: Path) -> dict[str, Any]:
    """What one arm's transcripts say: turns, format errors (by step), cut replies, exits, unoffered names."""
    s: dict[str, Any] = {"episodes": 0, "turns": 0, "format_errors": 0, "format_errors_by_step": {},
                         "truncated": 0, "exits": {}, "plan_fallbacks": 0, "files_refused": 0, "answers": 0}
    for f in sorted((out / "transcripts").rglob("*.jsonl")):
        for r in (json.loads(x) for x in f.read_text().splitlines()):
            if "end" in r:
                s["episodes"] += 1
                s["exits"][r["end"]["exit"]] = s["exits"].get(r["end"]["exit"], 0) + 1
                s["answers"] += bool(r["end"].get("answer"))
                continue
            s["turns"] += 1
            s["truncated"] += bool(r.get("truncated"))
            if "error" in r:
                s["format_errors"] += 1
                by = s["format_errors_by_step"]
                by[r["step"]] = by.get(r["step"], 0) + 1
            action = r.get("action") or {}
            s["plan_fallbacks"] += "fallback" in action
            s["files_refused"] += action.get("kind") == "file" and str(r.get("observation", "")).startswith("refused")
    s["format_error_rate"] = round(s["format_errors"] / max(1, s["turns"]), 3)
    return s


def main() -> None:
    """The options are `mlbench agent`'s, parsed and resolved by its own path (`--config`, flags, `--set`); this
    bench's defaults first."""
    argv = sys.argv[1:]
    if not argv or argv[0] in ("-h", "--help"):
        sys.exit(__doc__)
    base = stage_config("agent", ["--config", "configs/agent/real-cpu.yaml", "--limit", "3", *argv])
    base.require_inputs(None)
    model = str(base.model)
    rows = select_rows(base)
    out = Path(str(base.out))
    repos = checkouts(base, {s.repo for s in rows}, out)
    tok = load_tokenizer(model, "--model", fast=False)
    encode, _ = make_encoder(tok, base.template)
    positions = model_positions(model)
    max_len = context_length(base.max_model_len, positions, positions or 4096, "max_model_len")
    engine = make_engine(base, tok, max_len)
    ident = {"model": model, "adapter": None, "backend": "vllm"}
    result: dict[str, Any] = {"model": model, "rows": [list(s.key) for s in rows], "argv": argv}
    try:
        for decoding in ("free", "json"):
            cfg = replace(base, decoding=decoding)
            shutil.rmtree(out / decoding, ignore_errors=True)
            t0 = time.perf_counter()
            run_episodes(cfg, rows, repos, lambda: engine, encode, max_len, out / decoding, ident)
            result[decoding] = {**arm_summary(out / decoding), "seconds": round(time.perf_counter() - t0, 1)}
    finally:
        engine.close()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
