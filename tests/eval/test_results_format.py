"""``results.jsonl`` is a public format: eval reads its verdicts back as typed records (``EvalResult``), and a run
folder written before they were typed still reads back line for line, rescores to the same summary and resumes.

``data/*-ada3bd0.*`` were written by the code at commit ada3bd0 (before the split):
``mlbench eval --data examples/sample/samples.jsonl --generations data/gens-ada3bd0.jsonl
--envs configs/eval/sample.yaml --out OUT --no-ci`` (bwrap, compat mode)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import REPO_ROOT

from mlbench_kit.cli import main
from mlbench_kit.eval.execution import resume
from mlbench_kit.records import EvalResult, read_eval_results

SAMPLE = REPO_ROOT / "examples" / "sample" / "samples.jsonl"
ENVS = REPO_ROOT / "configs" / "eval" / "sample.yaml"
DATA = Path(__file__).parent / "data"
OLD_RESULTS, OLD_GENS, OLD_SUMMARY = (DATA / "results-ada3bd0.jsonl", DATA / "gens-ada3bd0.jsonl",
                                      DATA / "summary-ada3bd0.json")


def _old_lines() -> list[str]:
    return OLD_RESULTS.read_text(encoding="utf-8").split("\n")[:-1]


def _eval(out: Path, *extra: str) -> int:
    return main(["eval", "--data", str(SAMPLE), "--generations", str(OLD_GENS), "--envs", str(ENVS),
                 "--out", str(out), "--no-ci", *extra])


def test_every_old_line_reads_back_and_is_written_back_the_same() -> None:
    recs = read_eval_results(OLD_RESULTS)
    assert all(isinstance(r, EvalResult) for r in recs) and len(recs) == 30
    assert [json.dumps(r.to_json(), ensure_ascii=False) for r in recs] == _old_lines()
    # what the fixture covers: failures of each kind, executions reused, logs with non-ASCII text, CLI reports
    assert {r.error_class for r in recs} == {None, "E1", "E2", "E4", "E5"}
    assert any(r.cached for r in recs) and any(r.usage for r in recs) and any(r.cli for r in recs)
    assert any("\u2028" in r.log for r in recs)


def test_an_old_run_folder_rescores_to_the_same_summary(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    shutil.copy(OLD_RESULTS, out / "results.jsonl")
    assert _eval(out, "--rescore") == 0
    old, new = json.loads(OLD_SUMMARY.read_text()), json.loads((out / "summary.json").read_text())
    for s in (old, new):  # where the generations were, and the cores of the machine
        s.pop("generations"), s.pop("threads_per_execution")
    assert new == old
    assert (out / "results.jsonl").read_bytes() == OLD_RESULTS.read_bytes()


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")
def test_an_old_run_folder_resumes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    out.mkdir()
    lines = _old_lines()
    kept = "".join(x + "\n" for x in lines[:-4])
    (out / "results.jsonl").write_text(kept + lines[-4][:30], encoding="utf-8")  # killed mid-write
    assert _eval(out) == 0
    assert f"/4 new generations passed; {len(lines) - 4} done before" in capsys.readouterr().err
    text = (out / "results.jsonl").read_text(encoding="utf-8")
    assert text.startswith(kept)  # the old verdicts are kept as they were, byte for byte

    def same(line: str) -> dict:  # what does not depend on the machine or the moment
        return {k: v for k, v in json.loads(line).items() if k not in ("duration", "usage")}

    redone = sorted(map(same, text[len(kept):].split("\n")[:-1]), key=lambda r: r["idx"])
    assert redone == sorted(map(same, lines[-4:]), key=lambda r: r["idx"])
    assert _eval(out) == 0
    assert "executed 0 (reused 0); 0/0 new generations passed; 30 done before" in capsys.readouterr().err


def test_a_rebuilt_environment_s_verdicts_are_dropped_and_the_rest_kept_as_written(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "results.jsonl"
    shutil.copy(OLD_RESULTS, path)
    done = resume(path, {"toybench": "a-new-recipe-hash", "toyvision": None})  # toybench rebuilt since
    keep = [x for x in _old_lines() if '"repo": "toyvision"' in x]
    assert len(keep) == 5 and path.read_text(encoding="utf-8") == "".join(x + "\n" for x in keep)
    assert done == {(r["github_id"], r["id"], r["idx"]) for r in map(json.loads, keep)}
    assert "25 result(s) of toybench came from an older build of the environment" in capsys.readouterr().err


GOOD = _old_lines()[1]


@pytest.mark.parametrize("bad, message", [
    (json.dumps({k: v for k, v in json.loads(GOOD).items() if k != "idx"}), "not an eval result: missing idx"),
    (GOOD.replace('"passed": true', '"passed": "yes"'), "not an eval result: passed must be bool or null"),
    (GOOD.replace('"passed": true', '"passed": null'), "not a verdict: `passed` must be true or false"),
    (GOOD.replace('"params_ok": true', '"params_ok": 1'), "not an eval result: params_ok must be bool, got 1"),
    (GOOD.replace('"lr": true', '"lr": "x"'), "not an eval result: param_hits.lr must be bool"),
    ("[1, 2]", "not an eval result: a JSON list, not an object"),
])
def test_a_bad_verdict_is_one_error_at_its_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], bad: str,
                                                message: str) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / "results.jsonl").write_text(f"{GOOD}\n{bad}\n{_old_lines()[2]}\n", encoding="utf-8")
    assert _eval(out, "--rescore") == 2
    err = capsys.readouterr().err
    assert f"{out / 'results.jsonl'}:2: {message}" in err and "fix: this file is written by `mlbench eval`" in err
    assert not (out / "summary.json").exists()
