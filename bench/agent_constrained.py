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

import argparse
import json
import shutil
import time
from pathlib import Path
from typing import Any

from mlbench_kit.agent.run import checkouts, make_encoder, run_episodes, select_rows
from mlbench_kit.agent_config import AgentConfig
from mlbench_kit.config import load
from mlbench_kit.engine import EngineSpec, make_engine
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
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--split", default="full")
    p.add_argument("--tarballs", required=True)
    p.add_argument("--repos", nargs="+")
    p.add_argument("--limit", type=int, default=3)
    p.add_argument("--config", default="configs/agent/real-cpu.yaml")
    p.add_argument("--episodes", type=int)
    p.add_argument("--max-turns", type=int)
    p.add_argument("--max-new-tokens", type=int, help="per turn")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more config keys (YAML values)")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    import yaml
    over = {key: (getattr(a, flag), f"--{flag.replace('_', '-')}") for flag, key in
            (("episodes", "episodes"), ("max_turns", "limits.max_turns"), ("max_new_tokens", "sampling.max_new_tokens"))
            if getattr(a, flag) is not None}
    for kv in a.set:
        key, _, value = kv.partition("=")
        over[key] = (yaml.safe_load(value), "--set")
    inputs = {k: (getattr(a, k), f"--{k}") for k in ("model", "data", "split", "tarballs", "repos", "limit", "out")}
    base = load(AgentConfig, a.config, {**over, **inputs})
    rows = select_rows(base)
    out = Path(a.out)
    repos = checkouts(base, {s.repo for s in rows}, out)
    tok = load_tokenizer(a.model, "--model", fast=False)
    encode, _ = make_encoder(tok, base.template)
    max_len = base.max_model_len or model_positions(a.model) or 4096
    engine = make_engine(EngineSpec("vllm", a.model, max_model_len=max_len, seed=base.sampling.seed,
                                    enforce_eager=base.enforce_eager))
    ident = {"model": a.model, "adapter": None, "backend": "vllm"}
    result: dict[str, Any] = {"model": a.model, "rows": [list(s.key) for s in rows], "config": a.config,
                              "overrides": {k: v for k, (v, _) in over.items()}}
    try:
        for decoding in ("free", "json"):
            cfg = load(AgentConfig, a.config, {**over, **inputs, "decoding": (decoding, "bench")})
            shutil.rmtree(out / decoding, ignore_errors=True)
            t0 = time.perf_counter()
            run_episodes(cfg, rows, repos, lambda: engine, encode, max_len, out / decoding, ident)
            result[decoding] = {**arm_summary(out / decoding), "seconds": round(time.perf_counter() - t0, 1)}
    finally:
        engine.close()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
