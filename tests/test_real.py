"""The real loop, shrunk: SmolLM2-135M-Instruct as released, real ML-Bench rows, the real environment of a test
repository, every stage of `scripts/real.sh --quick` (docs/real-model.md). It fails if any stage
breaks: the model conversion, prep with the model's chat template, LoRA (the loss must fall), vLLM with the
adapter, parsing, execution in the sandbox, the report."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from conftest import REPO_ROOT, run_session


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


@pytest.mark.integration
def test_real_model_quick_run_end_to_end(tmp_path, shared):
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap not installed (scripts/setup.sh installs it)")
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("VIRTUAL_ENV")}
    env.update(MLBENCH_CACHE=str(tmp_path / "cache"), NLTK_DATA=str(shared / "nltk_data"))
    cmd = ["bash", "scripts/real.sh", "--quick", "--data", str(shared / "full.jsonl"), "--repos", str(shared / "repos"),
           "--run", str(run)]
    r = run_session(cmd, timeout=1500, cwd=REPO_ROOT, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert [ln.split("]")[0] for ln in r.stdout.splitlines() if ln.startswith("real [")] == \
        [f"real [{i}/8" for i in range(1, 9)]

    model = tmp_path / "cache" / "models" / "SmolLM2-135M-Instruct"
    assert json.loads((model / "config.json").read_text())["num_hidden_layers"] == 30
    test = _jsonl(run / "prep" / "test" / "task3.jsonl")
    assert len(test) == 6 and {t["repo"] for t in test} == {"External-Attention-pytorch"}
    assert all(t["template"] == "chat" and t["prompt"].startswith("<|im_start|>system\n") for t in test)

    # the loss falls: the same 18 records in each epoch, so the epochs' mean step losses compare
    steps = [x for x in _jsonl(run / "train-id-task3" / "metrics.jsonl") if "loss" in x and "step" in x]
    by_epoch = {e: [x["loss"] for x in steps if x["epoch"] == e] for e in (0, 1)}
    assert all(by_epoch.values()), steps
    first, last = (sum(v) / len(v) for v in by_epoch.values())
    assert last < first, (first, last)

    gens = {v: _jsonl(run / "infer-task3" / v / "task3.jsonl") for v in ("base", "id-tuned")}
    assert all(len(g) == 6 and all(len(x["output"]) == 2 and len(x["raw"]) == 2 for x in g) for g in gens.values())
    assert sum(bool(o.strip()) for x in gens["id-tuned"] for o in x["output"]) >= 6  # code parsed out of answers

    results = _jsonl(run / "eval-compat" / "task3" / "id-tuned" / "results.jsonl")
    assert len(results) == 12 and all(x["env"] for x in results)
    executed = [x for x in results if x["executed"]]
    assert executed and all(x["exit_code"] is not None for x in executed)  # it ran in the real environment
    summary = json.loads((run / "eval-compat" / "task3" / "id-tuned" / "summary.json").read_text())
    assert summary["gold_valid"]["rows"] >= 1 and not summary.get("faults")

    report = (run / "real-model.md").read_text()
    for part in ("## Results", "| base | 3 | compat |", "| id-tuned | 3 | compat |", "CodeLlama-ID (paper)",
                 "## Time per stage"):
        assert part in report, part
    # a second run finds every stage done
    r = run_session(cmd, timeout=300, cwd=REPO_ROOT, env=env)
    assert r.returncode == 0 and r.stdout.count(" done\n") == 8, r.stdout
