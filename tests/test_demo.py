"""The README's main command, end to end on the embedded sample: fine-tuning must measurably help."""

from __future__ import annotations

import csv
import json
import os
import subprocess

import pytest
from conftest import REPO_ROOT


def _overall(run, name: str, metric: str) -> float:
    rows = csv.DictReader((run / "report" / "report.csv").open())
    return next(float(x["value"]) for x in rows if x["run"] == name and x["group_kind"] == "overall"
                and x["metric"] == metric)


@pytest.mark.integration
def test_demo_runs_every_stage_and_the_adapter_beats_the_base(tmp_path):
    run = tmp_path / "demo"
    r = subprocess.run(["bash", "scripts/demo.sh"], cwd=REPO_ROOT, env={**os.environ, "RUN": str(run)},
                       capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, r.stderr[-4000:]
    for f in ("prep/test/task3.jsonl", "train-id/adapter/adapter_model.safetensors",
              "train-ood/adapter/adapter_model.safetensors", "infer-id/task3.jsonl", "infer-ood/task3.jsonl",
              "eval-id/results.jsonl", "report/report.md", "report/report.png", "report/report_repos.png"):
        assert (run / f).is_file(), f
    # ID/OOD like the paper: the OOD adapter trained on the other repository only; the test split is ID
    repos = lambda split: {json.loads(x)["github_id"] for x in (run / "prep" / split / "task3.jsonl").open()}  # noqa: E731
    assert repos("ood_train") == {102} and repos("id_train") == repos("test") == {101}
    for metric in ("type_accuracy", "param_hit_precision"):
        assert _overall(run, "id-tuned", metric) > _overall(run, "base", metric), metric
    assert "ood-tuned" in (run / "report" / "report.md").read_text()
    assert "demo done" in r.stdout
