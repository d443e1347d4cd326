"""configs/report/paper-rows.yaml against the paper's own tables, read from the paper's text independently of the
loader; and the loader's handling of percentages, fractions and bad rows."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from conftest import REPO_ROOT

from mlbench_kit.errors import MLBenchError
from mlbench_kit.eval.report.data import load_reference

PAPER_ROWS = REPO_ROOT / "configs" / "report" / "paper-rows.yaml"
# Table 1's column groups, left to right
TABLE1_TASKS = (3, 1, 2)
PER_TYPE_TABLES = {14: 1, 15: 3, 16: 2}


def _table1(text: str) -> dict[tuple[str, str, int], list[str]]:
    """(section, model, task) -> the three printed Pass@1/2/5 cells of Table 1."""
    start = text.index("Models\tOracle Segment")
    end = text.index("Table 1:", start)
    rows, section = {}, None
    for line in text[start:end].splitlines():
        m = re.fullmatch(r"<i>(.*)</i>\s*", line)
        if m:
            section = m.group(1).strip()
            continue
        cells = line.rstrip("\n").split("\t")
        if section and len(cells) == 10 and cells[0] != "Models":
            for j, task in enumerate(TABLE1_TASKS):
                rows[(section, cells[0].strip(), task)] = cells[1 + 3 * j: 4 + 3 * j]
    return rows


def _per_type(text: str, table: int) -> dict[str, dict[str, list[str]]]:
    """model -> {Both/Scripts/Code -> printed Pass@1/2/5} of Tables 14-16."""
    end = text.index(f"Table {table}: Evaluation results")
    start = text.rindex("Models\tPass@1", 0, end)
    out = {}
    for line in text[start:end].splitlines()[2:]:
        cells = line.split("\t")
        if len(cells) == 10:
            v = cells[1:]
            out[cells[0].strip()] = {"Both": v[0::3], "Scripts": v[1::3], "Code": v[2::3]}
    return out


def _mismatches(doc: dict, text: str) -> list[str]:
    t1 = _table1(text)
    per = {t: _per_type(text, t) for t in PER_TYPE_TABLES}
    bad = []
    for row in doc["rows"]:
        section, model = row["paper_row"].split(" / ")
        printed = t1.get((section, model, row["task"]))
        if printed is None:
            bad.append(f"{row['name']} task {row['task']}: no such row in Table 1")
            continue
        for k, cell in zip((1, 2, 5), printed, strict=True):
            if f"{row[f'pass@{k}']:.2f}" != cell:
                bad.append(f"{row['name']} task {row['task']} pass@{k}: {row[f'pass@{k}']} vs printed {cell}")
        pt = row["per_type"]
        if PER_TYPE_TABLES[pt["table"]] != row["task"]:
            bad.append(f"{row['name']}: per-type table {pt['table']} is not task {row['task']}'s")
        cells = per[pt["table"]].get(pt["paper_row"])
        if cells is None:
            bad.append(f"{row['name']}: no row {pt['paper_row']} in table {pt['table']}")
            continue
        for kind, col in (("Bash Script", "Scripts"), ("Python Code", "Code")):
            for k, cell in zip((1, 2, 5), cells[col], strict=True):
                if f"{pt[kind][f'pass@{k}']:.2f}" != cell:
                    bad.append(f"{row['name']} task {row['task']} {kind} pass@{k}: {pt[kind][f'pass@{k}']} vs {cell}")
    return bad


@pytest.fixture(scope="module")
def paper(shared: Path) -> str:
    return (shared / "paper" / "ml-bench-paper.txt").read_text()


def test_every_quoted_number_is_the_papers(paper: str) -> None:
    doc = yaml.safe_load(PAPER_ROWS.read_text())
    # every open-source row of Table 1 that has numbers: 3 models x (3 raw + 2 OOD + 2 ID) settings
    assert len(doc["rows"]) == 21 and doc["unit"] == "percent"
    assert _mismatches(doc, paper) == []


def test_a_wrong_number_is_caught(paper: str) -> None:
    doc = yaml.safe_load(PAPER_ROWS.read_text())
    doc["rows"][4]["pass@5"] = 1.37  # printed 1.36
    doc["rows"][9]["per_type"]["Python Code"]["pass@2"] = 47.38  # printed 47.83
    assert _mismatches(doc, paper) == [
        "DeepSeekCoder (paper) task 1 pass@5: 1.37 vs printed 1.36",
        "CodeLlama-OOD (paper) task 3 Python Code pass@2: 47.38 vs 47.83"]


def test_loader_turns_percent_into_fractions() -> None:
    refs = load_reference(str(PAPER_ROWS))
    ood = next(r for r in refs if r.name == "CodeLlama-OOD (paper)" and r.task == 3)
    assert ood.values == pytest.approx({"pass@1": 0.1576, "pass@2": 0.2153, "pass@5": 0.2846})
    assert ood.per_type["Python Code"]["pass@5"] == pytest.approx(0.6957)
    assert "table 1" in ood.source and "per type: table 15" in ood.source and "arXiv 2311.09835" in ood.source


@pytest.mark.parametrize("body, message, line", [
    ("source: s\nrows:\n  - {name: p, task: 3, pass@1: 33.82}\n", "not a rate in [0, 1]", 3),
    ("source: s\nunit: percent\nrows:\n  - {name: a, task: 3, pass@1: 3}\n  - {name: p, task: 3, pass@1: 133}\n",
     "not a rate in [0, 100]", 5),
    ("source: s\nrows:\n  - {name: p, task: 4, pass@1: 0.3}\n", "task 4 is not one of", 3),
    ("source: s\nrows:\n  - {name: p, task: 3, pas@1: 0.3}\n", "unknown metric 'pas@1'", 3),
    ("source: s\nunit: percents\nrows: []\n", "neither `fraction` nor `percent`", 2),
    ("source: s\nrows:\n  - {name: p, task: 3, per_type: {Code: {pass@1: 2}}}\n", "not a rate in [0, 1]", 3),
])
def test_loader_names_the_bad_row(tmp_path: Path, body: str, message: str, line: int) -> None:
    f = tmp_path / "ref.yaml"
    f.write_text(body)
    with pytest.raises(MLBenchError) as e:
        load_reference(str(f))
    assert message in str(e.value) and f"{f}:{line}" in str(e.value)


def _agent_mismatches(doc: dict, text: str) -> list[str]:
    """agent_rows against Table 3 (agents' Pass@1/2/5) and Table 2's first column (ML-AGENT's Pass@5 per repository),
    read from the paper's text independently of the loader."""
    t3 = text[text.rindex("Agent name\tPass@1", 0, text.index("Table 3:")):text.index("Table 3:")]
    printed3 = {c[0].strip(): c[1:4] for c in (ln.split("\t") for ln in t3.splitlines()[1:]) if len(c) == 4}
    t2 = text[text.rindex("Repos\tML-AGENT", 0, text.index("Table 2:")):text.index("Table 2:")]
    printed2 = {c[0].strip(): c[1] for c in (ln.split("\t") for ln in t2.splitlines()[2:]) if len(c) == 14}
    bad = []
    for row in doc["agent_rows"]:
        cells = printed3.get(row["paper_row"])
        if cells is None:
            bad.append(f"{row['name']}: no row {row['paper_row']!r} in Table 3")
            continue
        for k, cell in zip((1, 2, 5), cells, strict=True):
            if f"{row[f'pass@{k}']:.2f}" != cell.strip():
                bad.append(f"{row['name']} pass@{k}: {row[f'pass@{k}']} vs printed {cell}")
        for repo, rates in (row.get("per_repo") or {}).items():
            if repo in ("table", "paper_row"):
                continue
            if f"{rates['pass@5']:.2f}" != printed2.get(repo):
                bad.append(f"{row['name']} {repo} pass@5: {rates['pass@5']} vs printed {printed2.get(repo)}")
    if len(printed2) != 15 or set(printed2) - set(doc["agent_rows"][0]["per_repo"]):
        bad.append(f"Table 2 rows not all quoted: {sorted(printed2)}")
    return bad


def test_every_quoted_agent_number_is_the_papers(paper: str) -> None:
    doc = yaml.safe_load(PAPER_ROWS.read_text())
    assert [r["agent"] for r in doc["agent_rows"]] == ["ml-agent", "autogen"]
    assert _agent_mismatches(doc, paper) == []
    doc["agent_rows"][0]["per_repo"]["Py-GAN"]["pass@5"] = 12.05  # printed 12.50
    doc["agent_rows"][1]["pass@2"] = 6.60  # printed 6.06
    assert _agent_mismatches(doc, paper) == [
        "ML-Agent, GPT-4 (paper, quarter set) Py-GAN pass@5: 12.05 vs printed 12.50",
        "AutoGen, GPT-4 (paper, quarter set) pass@2: 6.6 vs printed 6.06"]


def test_loader_reads_agent_rows() -> None:
    refs = [r for r in load_reference(str(PAPER_ROWS)) if r.agent]
    ml = refs[0]
    assert (ml.agent, ml.task, ml.setting) == ("ml-agent", None, "agent: ml-agent")
    assert ml.values == pytest.approx({"pass@1": 0.2353, "pass@2": 0.3529, "pass@5": 0.4706})
    assert ml.per_repo["DGL"] == pytest.approx({"pass@5": 0.8}) and "per repository: table 2" in ml.source


def test_an_agent_row_names_its_agent(tmp_path: Path) -> None:
    f = tmp_path / "ref.yaml"
    f.write_text("source: s\nagent_rows:\n  - {name: a, pass@1: 0.5}\n")
    with pytest.raises(MLBenchError, match="needs `agent:`") as e:
        load_reference(str(f))
    assert f"{f}:3" in str(e.value)
