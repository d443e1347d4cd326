"""``results.jsonl`` is a public format: eval reads its verdicts back as typed records (``EvalResult``), and a run
folder written before they were typed still reads back line for line, rescores to the same summary and resumes.

``data/*-ada3bd0.*`` were written by the code at commit ada3bd0 (before the split):
``mlbench eval --data examples/sample/samples.jsonl --generations data/gens-ada3bd0.jsonl
--envs configs/eval/sample.yaml --out OUT --no-ci`` (bwrap, compat mode)."""

from __future__ import annotations

import json
from pathlib import Path

from mlbench_kit.records import EvalResult, read_eval_results

DATA = Path(__file__).parent / "data"
OLD_RESULTS, OLD_GENS, OLD_SUMMARY = (DATA / "results-ada3bd0.jsonl", DATA / "gens-ada3bd0.jsonl",
                                      DATA / "summary-ada3bd0.json")


def _old_lines() -> list[str]:
    return OLD_RESULTS.read_text(encoding="utf-8").split("\n")[:-1]


def test_every_old_line_reads_back_and_is_written_back_the_same() -> None:
    recs = read_eval_results(OLD_RESULTS)
    assert all(isinstance(r, EvalResult) for r in recs) and len(recs) == 30
    assert [json.dumps(r.to_json(), ensure_ascii=False) for r in recs] == _old_lines()
    # what the fixture covers: failures of each kind, executions reused, logs with non-ASCII text, CLI reports
    assert {r.error_class for r in recs} == {None, "E1", "E2", "E4", "E5"}
    assert any(r.cached for r in recs) and any(r.usage for r in recs) and any(r.cli for r in recs)
    assert any("\u2028" in r.log for r in recs)
