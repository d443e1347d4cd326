"""`mlbench report`: settings, seeds, repositories, types, quoted rows — on real eval runs of the sample."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from conftest import REPO_ROOT, run_cli

SAMPLE = REPO_ROOT / "examples" / "sample" / "samples.jsonl"
ENVS = REPO_ROOT / "configs" / "eval" / "sample.yaml"


def _eval(tmp: Path, name: str, task: int, wrong_every: int) -> Path:
    """Gold answers as 5 outputs, every ``wrong_every``-th sample answered with a bare `ls` instead."""
    rows = [json.loads(x) for x in SAMPLE.open()]
    gen = tmp / f"{name}.jsonl"
    with gen.open("w") as fh:
        for i, r in enumerate(rows):
            out = "ls" if i % wrong_every == 0 else r["output"]
            fh.write(json.dumps({"github_id": r["github_id"], "id": r["id"], "task": task, "output": [out] * 5}) + "\n")
    res = run_cli("mlbench", "eval", "--data", SAMPLE, "--generations", gen, "--envs", ENVS, "--out", tmp / name)
    assert res.returncode == 0, res.stderr
    return tmp / name


@pytest.fixture(scope="module")
def evals(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("evals")
    return {"a1-s0": _eval(tmp, "a1-s0", 1, 2), "a1-s1": _eval(tmp, "a1-s1", 1, 4), "a3": _eval(tmp, "a3", 3, 53),
            "b3": _eval(tmp, "b3", 3, 1)}


@pytest.mark.integration
def test_report_groups_settings_and_seeds_and_quotes_reference_rows(evals: dict[str, Path], tmp_path: Path) -> None:
    ref = tmp_path / "ref.yaml"
    ref.write_text("source: test fixture\nrows:\n"
                   "  - {name: published-x, table: 1, task: 3, pass@1: 0.25, pass@5: 0.5}\n")
    out = tmp_path / "report"
    r = run_cli("mlbench", "report", f"a={evals['a1-s0']}", f"a={evals['a1-s1']}", f"a={evals['a3']}",
                f"b={evals['b3']}", "--reference", ref, "--out", out)
    assert r.returncode == 0, r.stderr
    rows = list(csv.DictReader((out / "report.csv").open()))

    def value(run: str, task: str, kind: str, group: str, metric: str) -> float:
        return next(float(x["value"]) for x in rows if (x["run"], x["task"], x["group_kind"], x["group"], x["metric"])
                    == (run, task, kind, group, metric))

    # a on task 1: two seeds, 27/53 and 39/53 samples right -> mean, and the seed range as its bounds
    p1 = [x for x in rows if (x["run"], x["task"], x["group"], x["metric"]) == ("a", "1", "all", "pass@1")][0]
    assert p1["seeds"] == "2" and float(p1["value"]) == pytest.approx((26 / 53 + 39 / 53) / 2, abs=1e-3)
    assert (float(p1["low"]), float(p1["high"])) == pytest.approx((26 / 53, 39 / 53), abs=1e-3)
    assert value("a", "3", "overall", "all", "pass@1") == pytest.approx(52 / 53, abs=1e-3)
    assert value("b", "3", "overall", "all", "pass@5") == 0.0
    # no ".sh "/".py ": Python
    assert value("b", "3", "overall", "all", "type_accuracy") == pytest.approx(12 / 53, abs=1e-3)
    assert value("a", "3", "repo", "toyvision", "pass@1") == 1.0  # the one wrong sample (i=0) is toybench's
    assert value("a", "3", "type", "Python Code", "pass@1") == 1.0
    assert any(x["run"] == "published-x" and x["source"] == "quoted: test fixture, table 1" for x in rows)

    md = (out / "report.md").read_text()
    assert "| a | 1 | 2 | 53 |" in md and "| a | 3 | 1 | 53 |" in md and "| b | 3 | 1 | 53 |" in md
    assert "| published-x *(quoted)* | 3 |  |  | 0.250 | – | 0.500 |" in md
    assert "| toyvision |" in md and "| E1 |" in md and "## Gold ceiling" in md
    for png in ("report.png", "report_repos.png"):
        assert (out / png).stat().st_size > 5000


@pytest.mark.integration
def test_report_refuses_percentages_and_missing_runs(evals: dict[str, Path], tmp_path: Path) -> None:
    ref = tmp_path / "ref.yaml"
    ref.write_text("source: x\nrows:\n  - {name: p, task: 3, pass@1: 33.82}\n")
    r = run_cli("mlbench", "report", str(evals["a3"]), "--reference", ref, "--out", tmp_path / "o")
    assert r.returncode == 2 and "not a rate in [0, 1]" in r.stderr and "unit: percent" in r.stderr
    r = run_cli("mlbench", "report", str(tmp_path / "nothing"), "--out", tmp_path / "o")
    assert r.returncode == 2 and "no summary.json" in r.stderr
    r = run_cli("mlbench", "report", str(tmp_path / "nothing"), str(evals["a3"]), "--skip-missing", "--out",
                tmp_path / "o")
    assert r.returncode == 0 and "skipped" in r.stderr


@pytest.mark.integration
def test_report_quotes_the_paper_rows_of_the_measured_tasks(evals: dict[str, Path], tmp_path: Path) -> None:
    paper = REPO_ROOT / "configs" / "report" / "paper-rows.yaml"
    out = tmp_path / "report"
    r = run_cli("mlbench", "report", f"a={evals['a3']}", "--reference", paper, "--out", out)
    assert r.returncode == 0, r.stderr
    md = (out / "report.md").read_text()
    # only task 3 was measured: the paper's 9 task-3 rows, percentages shown as fractions like the measured ones
    assert "| CodeLlama-ID (paper) *(quoted)* | 3 |  |  | 0.177 | 0.235 | 0.308 |" in md
    assert md.count("*(quoted)* | 3 |  |  |") == 9 and "*(quoted)* | 1 |" not in md
    assert "| CodeLlama-ID (paper) *(quoted)* | 3 | Python Code | 0.283 | 0.522 | 0.717 |" in md
    rows = list(csv.DictReader((out / "report.csv").open()))
    assert {x["task"] for x in rows if x["source"].startswith("quoted")} == {"3"}
    r = run_cli("mlbench", "report", f"a={evals['a3']}", "--reference", paper, "--all-reference", "--out", out)
    assert r.returncode == 0 and "*(quoted)* | 1 |" in (out / "report.md").read_text()
    table1 = md.split("## As the paper's Table 1 (percent)")[1]
    assert "| model | Oracle Segment Pass@1 | Oracle Segment Pass@2 | Oracle Segment Pass@5 |" in table1
    assert "| CodeLlama-ID (paper) *(quoted)* | 17.69 | 23.46 | 30.77 |" in table1
    assert f"| a | {100 * 52 / 53:.2f} |" in table1


def test_report_marks_runs_with_faults_or_unscored_samples_incomplete(tmp_path: Path) -> None:
    """Issue 30 item 4: a run whose faults left Pass@k (0.5 -> 1.0 on Docker) was printed with no mark. Every
    format now shows what was not scored beside the Pass@k: md (a column and a line), csv (rows), png (labels)."""
    import shutil

    from mlbench_kit.cli import main
    rows = [json.loads(x) for x in SAMPLE.open()][:2]
    data, gen = tmp_path / "data.jsonl", tmp_path / "gen.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    gen.write_text("".join(json.dumps({"github_id": r["github_id"], "id": r["id"], "output": [r["output"]]}) + "\n"
                           for r in rows))
    assert main(["eval", "--data", str(data), "--generations", str(gen), "--envs", str(ENVS), "--out",
                 str(tmp_path / "ok"), "--no-ci"]) == 0
    shutil.copytree(tmp_path / "ok", tmp_path / "bad")
    summary = json.loads((tmp_path / "bad" / "summary.json").read_text())
    summary["faults"] = 2
    summary["unscored"] = [{"github_id": 1, "id": 2, "scored_outputs": 0, "outputs": 1}]
    (tmp_path / "bad" / "summary.json").write_text(json.dumps(summary))
    out = tmp_path / "report"
    assert main(["report", f"ok={tmp_path / 'ok'}", f"bad={tmp_path / 'bad'}", "--out", str(out)]) == 0
    md = (out / "report.md").read_text()
    line = next(x for x in md.splitlines() if x.startswith("| bad |"))
    assert line.endswith("| INCOMPLETE: 2 faults, 1 unscored sample |"), line
    assert next(x for x in md.splitlines() if x.startswith("| ok |")).endswith("| – |")
    assert "**INCOMPLETE**: bad: INCOMPLETE: 2 faults" in md
    got = {(x["run"], x["metric"]): x["value"] for x in csv.DictReader((out / "report.csv").open())}
    assert got[("bad", "faults")] == "2" and got[("bad", "unscored_samples")] == "1"
    assert got[("ok", "faults")] == "0" and got[("ok", "unscored_samples")] == "0"
