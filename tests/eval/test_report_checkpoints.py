"""`mlbench report` names what each run scored (base, SFT, a learned adapter's method and round) from the runs' own
files, beside the paper's quoted rows; report.html reads only the generations it may, and skips lines that are not
records. The eval folders are the stored fixture `mlbench eval` wrote (tests/eval/data); the infer and learn files
beside them are written by the stages' own writers (infer's run record, learn's resolved config and claim, rft's
publishing of its last round)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from conftest import REPO_ROOT

from mlbench_kit.config import save_resolved, to_dict
from mlbench_kit.hf import TRAIN_META
from mlbench_kit.infer.adapters import adapter_identity
from mlbench_kit.io import claim_run_folder, write_json_atomic
from mlbench_kit.learn_config import LearnConfig

DATA = Path(__file__).parent / "data"
PAPER = REPO_ROOT / "configs/report/paper-rows.yaml"


def _adapter(folder: Path, learned: dict | None = None) -> Path:
    """An adapter folder as `mlbench train` leaves it (PEFT's config, the weights, train's record)."""
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({"r": 8, "base_model_name_or_path": "tiny"}))
    (folder / "adapter_model.safetensors").write_bytes(b"weights of " + str(folder).encode())
    meta = {"base_model": "tiny", "max_context_tokens": 1024}
    write_json_atomic(folder / TRAIN_META, {**meta, **({"learned": learned} if learned else {})})
    return folder


def _learn_run(out: Path, method: str, rounds: int = 2) -> None:
    """An `mlbench learn` folder's own files: its resolved config and its claim (learn/run.py writes both)."""
    cfg = LearnConfig(method=method, model="tiny", adapter=str(out.parent / "sft"), prep_dir="prep", out=str(out))
    cfg.rft.rounds = rounds
    out.mkdir(parents=True)
    claim_run_folder(out / "learn.json", {k: v for k, v in to_dict(cfg).items() if k != "out"})
    save_resolved(cfg, out / "config.yaml")


def _scored(root: Path, name: str, adapter: Path | None) -> Path:
    """Infer's folder for ``adapter`` (its generations and run record) and the eval of it (the stored fixture)."""
    infer = root / "infer" / name
    infer.mkdir(parents=True)
    (infer / "task3.jsonl").write_text((DATA / "gens-ada3bd0.jsonl").read_text())
    claim_run_folder(infer / "infer.json", {"model": {"name": "tiny"}, "adapter": adapter_identity(adapter)
                                            if adapter else None, "backend": "hf", "split": "test"})
    ev = root / "eval" / name
    ev.mkdir(parents=True)
    summary = json.loads((DATA / "summary-ada3bd0.json").read_text())
    summary["generations"] = str(infer / "task3.jsonl")
    (ev / "summary.json").write_text(json.dumps(summary))
    (ev / "results.jsonl").write_text((DATA / "results-ada3bd0.jsonl").read_text())
    return ev


@pytest.fixture
def runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    monkeypatch.chdir(tmp_path)  # the folder the runs are in, as `mlbench report runs/...` is run
    sft = _adapter(tmp_path / "train" / "adapter")
    _learn_run(tmp_path / "learn-rft", "rft", rounds=2)
    round1 = _adapter(tmp_path / "learn-rft" / "round-1" / "train" / "adapter")
    _adapter(tmp_path / "learn-rft" / "round-2" / "train" / "adapter")
    from mlbench_kit.learn.rft import RFTRecipe  # the published adapter: rft's own last step
    rft_cfg = LearnConfig(method="rft", model="tiny", adapter=str(sft), out=str(tmp_path / "learn-rft"))
    rft_cfg.rft.rounds = 2
    published = RFTRecipe(rft_cfg)._publish(tmp_path / "learn-rft" / "round-2" / "train" / "adapter")
    _learn_run(tmp_path / "learn-grpo", "grpo")
    grpo = _adapter(tmp_path / "learn-grpo" / "adapter", {"method": "grpo", "from_adapter": str(sft), "steps": 30})
    return {"base": _scored(tmp_path, "base", None), "sft": _scored(tmp_path, "sft", sft),
            "rft": _scored(tmp_path, "rft", published), "rft-r1": _scored(tmp_path, "rft-r1", round1),
            "grpo": _scored(tmp_path, "grpo", grpo)}


def test_the_report_names_base_sft_and_each_learned_method_and_round_beside_the_paper_rows(
        runs: dict[str, Path], tmp_path: Path) -> None:
    from mlbench_kit.cli import main
    out = tmp_path / "report"
    assert main(["report", *(f"{n}={d}" for n, d in runs.items()), "--reference", str(PAPER), "--out",
                 str(out)]) == 0
    md = (out / "report.md").read_text()
    table = md.split("## Pass@k by setting")[1].split("\n## ")[0]
    assert "| run | task | seeds | samples | checkpoint | Pass@1 |" in table
    for name, label in (("base", "base"), ("sft", "SFT"), ("rft", "rft round 2 of 2"), ("rft-r1", "rft round 1 of 2"),
                        ("grpo", "grpo, 30 steps")):
        assert f"| {name} | 3 | 1 | 6 | {label} |" in table, (name, table)
    assert "| CodeLlama-ID (paper) *(quoted)* | 3 |  |  |  | 0.177 |" in table  # the paper's rows, as today
    assert "mlbench learn`'s `config.yaml`" in md
    got = {r["run"]: r["value"] for r in csv.DictReader((out / "report.csv").open()) if r["metric"] == "checkpoint"}
    assert got == {"base": "base", "sft": "SFT", "rft": "rft round 2 of 2", "rft-r1": "rft round 1 of 2",
                   "grpo": "grpo, 30 steps"}
    page = (out / "report.html").read_text()
    columns = json.loads(page.split('id="rows">')[1].split("</script>")[0])["columns"]
    assert "rft · task 3 · rft round 2 of 2" in columns and "sft · task 3 · SFT" in columns


def test_without_the_runs_files_the_report_has_no_checkpoint_column(runs: dict[str, Path], tmp_path: Path) -> None:
    # generations moved (no infer.json at hand): nothing is guessed, and the table is as it was
    from mlbench_kit.cli import main
    for name in runs:
        (tmp_path / "infer" / name / "infer.json").unlink()
    out = tmp_path / "report"
    assert main(["report", f"base={runs['base']}", f"rft={runs['rft']}", "--out", str(out)]) == 0
    md = (out / "report.md").read_text()
    assert "| run | task | seeds | samples | Pass@1 |" in md and "checkpoint" not in md


def test_a_learn_folder_s_files_that_lie_are_not_a_learned_checkpoint(runs: dict[str, Path], tmp_path: Path) -> None:
    from mlbench_kit.eval.report.data import load_settings
    # a config.yaml naming no known method, then one that is not a mapping: the adapter is what its own record says
    (tmp_path / "learn-grpo" / "config.yaml").write_text("method: '<b>sleep</b>'\n")
    assert load_settings([f"g={runs['grpo']}"])[0].checkpoint == "adapter"
    (tmp_path / "learn-grpo" / "config.yaml").write_text("- a list\n")
    assert load_settings([f"g={runs['grpo']}"])[0].checkpoint == "adapter"
    (tmp_path / "infer" / "sft" / "infer.json").write_text("[1, 2]")
    assert load_settings([f"s={runs['sft']}"])[0].checkpoint == "–"


def test_report_html_shows_no_answer_from_a_generations_file_outside_the_runs(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A summary.json is data: the generations file it names is read only inside the working folder or beside the
    eval folder. Before, any path it named was read and its texts embedded in the page."""
    from mlbench_kit.cli import main
    work, elsewhere = tmp_path / "work", tmp_path / "private"
    ev, elsewhere_gens = work / "runs" / "eval" / "a", elsewhere / "notes.jsonl"
    ev.mkdir(parents=True)
    elsewhere.mkdir()
    gens = [json.loads(x) for x in (DATA / "gens-ada3bd0.jsonl").open()]
    gens[0]["output"] = ["SECRET-TEXT-OUTSIDE"] * len(gens[0]["output"])
    elsewhere_gens.write_text("".join(json.dumps(g) + "\n" for g in gens))
    summary = json.loads((DATA / "summary-ada3bd0.json").read_text())
    (ev / "results.jsonl").write_text((DATA / "results-ada3bd0.jsonl").read_text())
    monkeypatch.chdir(work)
    for named in (str(elsewhere_gens), "../../../../private/notes.jsonl"):  # absolute, and relative climbing out
        summary["generations"] = named
        (ev / "summary.json").write_text(json.dumps(summary))
        out = work / "report"
        assert main(["report", f"a={ev}", "--out", str(out)]) == 0
        page = (out / "report.html").read_text()
        assert "SECRET-TEXT-OUTSIDE" not in page, named
        assert "answer texts not at hand" in page  # said on the page; every verdict still shown
        assert page.count('"passed": true') + page.count('"passed": false') > 0
    # the same file beside the eval folder (a run's infer/ and eval/ side by side) is read
    beside = work / "runs" / "eval" / "gens.jsonl"
    beside.write_text(elsewhere_gens.read_text())
    summary["generations"] = str(beside)
    (ev / "summary.json").write_text(json.dumps(summary))
    assert main(["report", f"a={ev}", "--out", str(work / "report")]) == 0
    page = (work / "report" / "report.html").read_text()
    assert "SECRET-TEXT-OUTSIDE" in page and "answer texts not at hand" not in page
    # and a link beside it to the file outside is not followed
    beside.unlink()
    beside.symlink_to(elsewhere_gens)
    assert main(["report", f"a={ev}", "--out", str(work / "report")]) == 0
    assert "SECRET-TEXT-OUTSIDE" not in (work / "report" / "report.html").read_text()


def test_report_html_skips_and_counts_lines_that_are_not_records(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture) -> None:
    """A results.jsonl or generations line that is JSON but not an object (``[1]``, ``5``, ``"x"``, ``null``) made
    the page's writer crash (AttributeError) after report.md was written; now it is skipped and counted."""
    from mlbench_kit.cli import main
    ev = tmp_path / "a"
    ev.mkdir()
    gens = (DATA / "gens-ada3bd0.jsonl").read_text()
    (tmp_path / "gens.jsonl").write_text('[1, 2]\n' + gens + '"text"\n')
    summary = json.loads((DATA / "summary-ada3bd0.json").read_text())
    summary["generations"] = str(tmp_path / "gens.jsonl")
    summary["per_sample"].append(7)
    (ev / "summary.json").write_text(json.dumps(summary))
    results = (DATA / "results-ada3bd0.jsonl").read_text().rstrip("\n").split("\n")  # records may hold U+2028
    (ev / "results.jsonl").write_text("\n".join([results[0], "5", "null", *results[1:], "[]"]) + "\n")
    out = tmp_path / "report"
    assert main(["report", f"a={ev}", "--out", str(out)]) == 0
    page = (out / "report.html").read_text()
    assert "skipped 6 line(s) that are not records (3 of results.jsonl, 3 of the generations and the summary" in page
    assert "skipped 6 line(s)" in capsys.readouterr().err
    data = json.loads(page.split('id="rows">')[1].split("</script>")[0])
    assert len(data["rows"]) == 6  # every real row still shown
    answers = [a for r in data["rows"] for c in r["cells"] if c for a in c]
    assert len(answers) == len(results) and all(a["answer"] is not None for a in answers)


def test_report_skips_lines_and_records_nested_too_deeply_and_names_a_summary_that_is(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """JSON nested 100,000 deep raises RecursionError, not ValueError: in a results.jsonl or generations line, or
    the agent summary.json beside the generations, the report's writer ended in a traceback (after report.md was
    written); now such a line is skipped and counted, such a summary ignored, and an eval folder's summary.json
    nested so is one error naming it."""
    from mlbench_kit.cli import main
    nested = "[" * 100_000 + "]" * 100_000
    ev, gens_dir = tmp_path / "a", tmp_path / "agent"
    ev.mkdir()
    gens_dir.mkdir()
    (gens_dir / "generations.jsonl").write_text((DATA / "gens-ada3bd0.jsonl").read_text() + nested + "\n")
    (gens_dir / "summary.json").write_text(nested)
    summary = json.loads((DATA / "summary-ada3bd0.json").read_text())
    summary["generations"] = str(gens_dir / "generations.jsonl")
    (ev / "summary.json").write_text(json.dumps(summary))
    (ev / "results.jsonl").write_text((DATA / "results-ada3bd0.jsonl").read_text() + nested + "\n")
    out = tmp_path / "report"
    assert main(["report", f"a={ev}", "--out", str(out)]) == 0
    page = (out / "report.html").read_text()
    assert "skipped 2 line(s) that are not records (1 of results.jsonl, 1 of the generations" in page
    capsys.readouterr()
    (ev / "summary.json").write_text(nested)
    assert main(["report", f"a={ev}", "--out", str(out)]) == 2
    assert f"{ev / 'summary.json'}: summary.json is not JSON (nested too deeply)" in capsys.readouterr().err


def test_report_html_reads_no_results_jsonl_that_is_a_link_and_says_so(tmp_path: Path) -> None:
    """A results.jsonl that is a link (here to a file outside the folder holding other verdicts) is not followed:
    the page shows no verdicts from it and says why."""
    from mlbench_kit.cli import main
    ev = tmp_path / "a"
    ev.mkdir()
    summary = json.loads((DATA / "summary-ada3bd0.json").read_text())
    summary["generations"] = str(DATA / "gens-ada3bd0.jsonl")
    (ev / "summary.json").write_text(json.dumps(summary))
    elsewhere = tmp_path / "elsewhere.jsonl"
    elsewhere.write_text((DATA / "results-ada3bd0.jsonl").read_text())
    (ev / "results.jsonl").symlink_to(elsewhere)
    out = tmp_path / "report"
    assert main(["report", f"a={ev}", "--out", str(out)]) == 0
    page = (out / "report.html").read_text()
    assert "a: verdicts not shown: its results.jsonl is a link or over" in page
    assert '"passed": true' not in page and '"passed":true' not in page


def test_an_adapter_name_the_os_refuses_is_no_checkpoint(runs: dict[str, Path], tmp_path: Path) -> None:
    from mlbench_kit.eval.report.data import load_settings
    record = tmp_path / "infer" / "sft" / "infer.json"
    ident = json.loads(record.read_text())
    for name in ("/" + "x" * 5000 + "/adapter", "/tmp/\u0000/adapter"):  # is_file() raises ENAMETOOLONG on the 1st
        ident["adapter"] = {"name": name}
        record.write_text(json.dumps(ident))
        assert load_settings([f"s={runs['sft']}"])[0].checkpoint in ("–", "adapter"), name
