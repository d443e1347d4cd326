"""Lockstep against one request per call (issue 32): ML-Agent episodes per minute on the same vLLM engine.

Both arms run the same rows, episodes and seeds through `mlbench_kit.agent.run.run_episodes` on one engine, each
into its own folder: *lockstep* sends every live episode's turn in one `generate` call per round; *sequential*
sends the same requests one per call. The transcripts must be equal (per-turn seeds), so the ratio compares the
same work. Prints one JSON line: episodes, turns, seconds and episodes per minute of each arm, and the ratio.

    python bench/agent_speed.py --model DIR --data ../shared/mlbench/full.jsonl --tarballs ../shared/mlbench/repos \\
        --repos PyTorch-GAN --limit 4 --config configs/agent/tiny-cpu.yaml --out runs/agent-speed

The real model (bench/results/agent-real.md): ``--model ~/.cache/mlbench/models/SmolLM2-135M-Instruct --config
configs/agent/real-cpu.yaml --episodes 2 --max-turns 4 --max-new-tokens 128``.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

from mlbench_kit.agent.run import checkouts, make_encoder, make_engine, run_episodes, select_rows
from mlbench_kit.cli import stage_config
from mlbench_kit.engine import Engine, context_length
from mlbench_kit.hf import load_tokenizer, model_positions


class OneAtATime:
    """The same engine, one request per call."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def generate(self, requests, params):
        return [g for r in requests for g in self.engine.generate([r], params)]


def _turns(out: Path) -> list[list[dict]]:
    keep = []
    for f in sorted((out / "transcripts").rglob("*.jsonl")):
        recs = [json.loads(x) for x in f.read_text().splitlines()]
        keep.append([{k: r[k] for k in ("turn", "seed", "prompt_sha", "raw")} for r in recs if "turn" in r])
    return keep


def main() -> None:
    """The options are `mlbench agent`'s, parsed and resolved by its own path; this bench's defaults first."""
    argv = sys.argv[1:]
    if not argv or argv[0] in ("-h", "--help"):
        sys.exit(__doc__)
    cfg = stage_config("agent", ["--config", "configs/agent/tiny-cpu.yaml", "--limit", "4", *argv])
    cfg.require_inputs(None)
    model = str(cfg.model)
    rows = select_rows(cfg)
    out = Path(str(cfg.out))
    repos = checkouts(cfg, {s.repo for s in rows}, out)
    tok = load_tokenizer(model, "--model", fast=False)
    encode, _ = make_encoder(tok, cfg.template)
    positions = model_positions(model)
    max_len = context_length(cfg.max_model_len, positions, positions or 4096, "max_model_len")
    engine = make_engine(cfg, tok, max_len)
    ident = {"model": model, "adapter": None, "backend": "vllm"}
    result: dict = {"model": model, "rows": len(rows), "episodes": len(rows) * cfg.episodes, "argv": argv}
    try:
        for name, eng in (("warm-up", engine), ("lockstep", engine), ("sequential", OneAtATime(engine))):
            shutil.rmtree(out / name, ignore_errors=True)
            t0 = time.perf_counter()
            stats = run_episodes(cfg, rows, repos, lambda e=eng: e, encode, max_len, out / name, ident)
            secs = time.perf_counter() - t0
            turns = sum(len(t) for t in _turns(out / name))
            result[name] = {"seconds": round(secs, 2), "rounds": stats["rounds"], "turns": turns,
                            "episodes_per_min": round(60 * result["episodes"] / secs, 2)}
    finally:
        engine.close()
    result["same_transcripts"] = _turns(out / "lockstep") == _turns(out / "sequential")
    result["ratio"] = round(result["lockstep"]["episodes_per_min"] / result["sequential"]["episodes_per_min"], 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
