"""The README's main command, end to end on the embedded sample: fine-tuning must measurably help."""

from __future__ import annotations

import csv
import os
import subprocess

from conftest import REPO_ROOT


def test_demo_runs_every_stage_and_the_adapter_beats_the_base(tmp_path):
    run = tmp_path / "demo"
    r = subprocess.run(["bash", "scripts/demo.sh"], cwd=REPO_ROOT, env={**os.environ, "RUN": str(run)},
                       capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, r.stderr[-4000:]
    for f in ("prep/test/task3.jsonl", "train/adapter/adapter_model.safetensors", "infer-lora/task3.jsonl",
              "eval-lora/results.jsonl", "report/report.md", "report/report.png"):
        assert (run / f).is_file(), f
    rows = {x["run"]: x for x in csv.DictReader((run / "report" / "report.csv").open())}
    base, lora = rows["base"], rows["lora"]
    assert float(lora["type_accuracy"]) > float(base["type_accuracy"])
    assert float(lora["param_hit_precision"]) > float(base["param_hit_precision"])
    assert "demo done" in r.stdout
