"""`mlbench report`: settings, seeds, repositories, types, quoted rows — on real eval runs of the sample."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import REPO_ROOT, assert_shared_modes, chromium_or_skip, dump_dom, run_cli

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
def test_report_groups_settings_and_seeds_and_quotes_reference_rows(evals: dict[str, Path], tmp_path: Path,
                                                                   umask_022: None) -> None:
    ref = tmp_path / "ref.yaml"
    ref.write_text("source: test fixture\nrows:\n"
                   "  - {name: published-x, table: 1, task: 3, pass@1: 0.25, pass@5: 0.5}\n")
    out = tmp_path / "report"
    r = run_cli("mlbench", "report", f"a={evals['a1-s0']}", f"a={evals['a1-s1']}", f"a={evals['a3']}",
                f"b={evals['b3']}", "--reference", ref, "--out", out)
    assert r.returncode == 0, r.stderr
    assert_shared_modes(*(out / n for n in ("report.md", "report.csv", "report.png")))
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
def test_report_against_a_baseline_pairs_the_rows_both_scored(evals: dict[str, Path], tmp_path: Path) -> None:
    r = run_cli("mlbench", "report", f"bad={evals['b3']}", f"good={evals['a3']}", f"t1={evals['a1-s0']}",
                "--baseline", "bad", "--out", tmp_path / "o")
    assert r.returncode == 0, r.stderr
    md = (tmp_path / "o" / "report.md").read_text()
    section = md.split("## Against the baseline: bad")[1].split("\n## ")[0]
    # every b3 answer is `ls` (fails), a3's pass but one sample's: the gain, its interval above 0, on the 53 rows
    good = next(ln for ln in section.splitlines() if ln.startswith("| good · task 3 |"))
    assert "| 53 | +98.1 \\[+94.3, +100.0] better |" in good and good.count("better") == 4, good  # @1, 2, 5, unbiased
    assert "t1 ·" not in section  # task 1 has no baseline setting: not compared
    r = run_cli("mlbench", "report", f"bad={evals['b3']}", "--baseline", "gold", "--out", tmp_path / "o2")
    assert r.returncode == 2 and "no run named 'gold'" in r.stderr and "bad" in r.stderr
    assert not (tmp_path / "o2").exists()


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


def _gold_k1(tmp: Path) -> Path:
    """The sample's own answers, one output each, Pass@1 only: every output passes (no error class)."""
    r = run_cli("mlbench", "eval", "--data", SAMPLE, "--gold", "--k", "1", "--envs", ENVS, "--out", tmp / "gold")
    assert r.returncode == 0, r.stderr
    return tmp / "gold"


def _tables(md: str) -> list[list[str]]:
    """Each markdown table of ``md`` as its lines (header, separator, rows)."""
    tables, cur = [], []
    for line in md.splitlines() + [""]:
        if line.startswith("|"):
            cur.append(line)
        elif cur:
            tables.append(cur)
            cur = []
    return tables


@pytest.mark.integration
def test_report_md_has_no_doubled_heading_no_empty_table_no_spaced_code(tmp_path: Path) -> None:
    """Only Pass@1 and no failed output: headings say Pass@1 once, the error classes are one line, not a header over
    nothing; paths are code spans without padding spaces (in mlbench report's and in eval's own report.md)."""
    gold = _gold_k1(tmp_path)
    out = tmp_path / "report"
    r = run_cli("mlbench", "report", f"gold={gold}", "--out", out)
    assert r.returncode == 0, r.stderr
    problems = []
    for name, md in (("mlbench report", (out / "report.md").read_text()), ("eval", (gold / "report.md").read_text())):
        heads = [x for x in md.splitlines() if x.startswith("#")]
        problems += [f"{name}: doubled heading {h!r}" for h in heads if "Pass@1 / Pass@1" in h]
        problems += [f"{name}: a table without rows {t[0]!r}" for t in _tables(md) if len(t) <= 2]
        if "None: every output passed." not in md.split("## Error classes")[1]:
            problems.append(f"{name}: no one-line 'none' for the error classes")
        spans = [m.group(2) for m in re.finditer(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", md)]
        assert spans
        problems += [f"{name}: padded code span {x!r}" for x in spans if x.startswith(" ") and x.endswith(" ")]
    assert not problems, "\n".join(problems)
    md = (out / "report.md").read_text()
    assert "## Pass@1 per repository" in md and "| toybench | 1.000 |" in md
    assert f"- gold: `{gold}`" in md


def _figures(settings: list, ks: list[int], out: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The figures `write_plots` saves, by file name, kept for inspection (drawn as saved)."""
    from matplotlib.figure import Figure

    from mlbench_kit.eval.report.render import write_plots
    saved: dict[str, Any] = {}
    orig = Figure.savefig

    def keep(fig: Figure, fname: Any, *a: Any, **kw: Any) -> None:
        orig(fig, fname, *a, **kw)
        saved[Path(fname).name] = fig

    monkeypatch.setattr(Figure, "savefig", keep)
    write_plots(settings, ks, out)
    return saved


def _bar_problems(fig: Any, ax: Any, series: dict[str, list], horizontal: bool) -> list[str]:
    """What is wrong with ``ax``'s bars, for each series of ``series`` (legend label -> the settings' (value,
    interval) per bar): a bar without a whisker from its interval's low to high end at its centre; a bar of 0
    without a thick line over its width at the axis and a "0.00" label; a legend over the axes or a bar."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.container import BarContainer, ErrorbarContainer
    FigureCanvasAgg(fig).draw()  # closed by write_plots: drawn again, as saved (same size and dpi)
    renderer = fig.canvas.get_renderer()
    bars = {c.get_label().lower(): c for c in ax.containers if isinstance(c, BarContainer)}
    assert {m.lower() for m in series} <= set(bars), (sorted(series), sorted(bars))
    along, across = (1, 0) if horizontal else (0, 1)  # the bars' position axis, their value axis
    whiskers = [seg for c in ax.containers if isinstance(c, ErrorbarContainer)
                for coll in c.lines[2] for seg in coll.get_segments()]
    marks = [np.column_stack([ln.get_xdata(), ln.get_ydata()]) for ln in ax.lines
             if ln.get_linewidth() >= 2 and ln.get_visible()]
    texts = [(t.get_text(), t.get_position()) for t in ax.texts]
    problems, n_zero = [], 0
    for label, got in series.items():
        for patch, (v, rng) in zip(bars[label.lower()].patches, got, strict=True):
            box = patch.get_bbox()
            lo, hi = (box.y0, box.y1) if horizontal else (box.x0, box.x1)
            centre = (lo + hi) / 2
            if rng is not None:
                ends = [sorted(pt[across] for pt in seg) for seg in whiskers
                        if all(abs(pt[along] - centre) < 1e-9 for pt in seg)]
                if not any(np.allclose(e, rng, atol=1e-6) for e in ends):
                    problems.append(f"{label} {v}: no whisker {rng} (whiskers there: {ends})")
            if v == 0:
                n_zero += 1
                if not any(lo - 1e-9 <= m[:, along].min() and m[:, along].max() <= hi + 1e-9
                           and not m[:, across].any() for m in marks):
                    problems.append(f"{label}: a bar of 0 without a mark at the axis")
                if not any(t == "0.00" and lo <= pos[along] <= hi for t, pos in texts):
                    problems.append(f"{label}: a bar of 0 without its 0.00 label")
    assert n_zero, "the fixture has bars of 0"
    legend = ax.get_legend().get_window_extent(renderer)
    if legend.overlaps(ax.get_window_extent(renderer)):
        problems.append("the legend sits over the axes")
    if any(legend.overlaps(b) for c in bars.values() for p in c.patches
           if (b := p.get_window_extent(renderer)).width > 0 and b.height > 0):
        problems.append("the legend covers a bar")
    return problems


@pytest.mark.integration
def test_report_plots_show_intervals_zero_bars_and_keep_the_legend_off_the_bars(
        evals: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """report.png: each Pass@k bar has its interval (bootstrap CI of one seed, min-max of two) as a whisker; b's
    Pass@k of 0 is a visible mark with "0.00", not an empty slot; the legend is outside the axes. report_repos.png
    the same per repository."""
    from mlbench_kit.eval.report.data import load_settings
    settings = load_settings([f"a={evals['a1-s0']}", f"a={evals['a1-s1']}", f"a={evals['a3']}", f"b={evals['b3']}"])
    ks = [1, 2, 5]
    figs = _figures(settings, ks, tmp_path, monkeypatch)
    assert set(figs) == {"report.png", "report_repos.png"}
    fig = figs["report.png"]
    ax = fig.axes[0]
    series = {f"Pass@{k}": [s.metric(f"pass@{k}") for s in settings] for k in ks}
    assert all(rng for got in series.values() for _, rng in got)  # the intervals are in the data
    problems = _bar_problems(fig, ax, series, horizontal=False)
    right = fig.axes[1]  # parameter hits and type accuracy: no intervals, the same legend rule
    if right.get_legend().get_window_extent(fig.canvas.get_renderer()).overlaps(
            right.get_window_extent(fig.canvas.get_renderer())):
        problems.append("the legend sits over the right-hand axes")
    fig = figs["report_repos.png"]
    repos = sorted({g for s in settings for summ in s.summaries for g in summ["metrics"]["per_repo"]})
    series = {s.label: [s.metric("pass@1", ("per_repo", g)) for g in repos] for s in settings}
    problems += [f"repos: {x}" for x in _bar_problems(fig, fig.axes[0], series, horizontal=True)]
    assert not problems, "\n".join(problems)


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


HOSTILE = "<img src=x onerror=alert(1)>\x1b[2J\rA$\\frac{$x[y](javascript:alert(1))![t](https://e.example/t.png)"


def test_report_shows_untrusted_text_as_typed_in_every_format(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 30 item 7: a row's instruction and a run's or a repository's name are untrusted text. report.csv held a
    formula (`=HYPERLINK(…)`), report.md raw HTML and control characters, and a `$…$` in a name made `mlbench report`
    fail while drawing the plots (matplotlib parsed it as mathtext)."""
    import shutil

    from matplotlib.figure import Figure

    from mlbench_kit.cli import main
    rows = [json.loads(x) for x in SAMPLE.open()][:2]
    rows[0]["instruction"] = HOSTILE
    data, gen = tmp_path / "data.jsonl", tmp_path / "gen.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    gen.write_text("".join(json.dumps({"github_id": r["github_id"], "id": r["id"], "output": [r["output"] + " <b>"]})
                           + "\n" for r in rows))
    assert main(["eval", "--data", str(data), "--generations", str(gen), "--envs", str(ENVS), "--out",
                 str(tmp_path / "ok"), "--no-ci"]) == 0
    md = (tmp_path / "ok" / "report.md").read_text()
    assert "<img" not in md and "&lt;img src=x onerror=alert(1)&gt;\\x1b\\[2J\\rA$" in md
    assert "\x1b" not in md and "\r" not in md and "`python train.py" in md and " <b>`" in md  # a code span as typed
    # a repository's name from a summary (a hand-edited or foreign run folder) and run names chosen on the command line
    shutil.copytree(tmp_path / "ok", tmp_path / "b")
    summary = json.loads((tmp_path / "b" / "summary.json").read_text())
    per_repo = summary["metrics"]["per_repo"]
    per_repo["=cmd|'/C calc'!A0 <b>$\\x$"] = per_repo.pop(next(iter(per_repo)))
    (tmp_path / "b" / "summary.json").write_text(json.dumps(summary))
    out = tmp_path / "report"
    names = ["=HYPERLINK(\"http://evil\")", "@SUM(1)", "+1", "-1", "$\\frac{$"]
    drawn: list[Figure] = []
    orig = Figure.savefig

    def keep(fig: Figure, *a: Any, **kw: Any) -> None:
        orig(fig, *a, **kw)  # drawn: a label matplotlib cannot parse fails here
        drawn.append(fig)

    monkeypatch.setattr(Figure, "savefig", keep)
    assert main(["report", "--out", str(out), "--", *(f"{n}={tmp_path / 'ok'}" for n in names),
                 f"b{HOSTILE}={tmp_path / 'b'}"]) == 0
    cells = [c for row in csv.reader((out / "report.csv").open()) for c in row]
    assert not [c for c in cells if c[:1] in ("=", "+", "-", "@", "\t", "\r")], "a cell a spreadsheet would run"
    assert {"'" + n for n in names[:4]} <= set(cells) and "'=cmd|'/C calc'!A0 <b>$\\x$" in cells
    assert "0.0" in cells and "1" in cells  # numbers stay numbers
    report = (out / "report.md").read_text()
    assert "<img" not in report and "<b>" not in report and "\x1b" not in report and "\r" not in report
    assert "&lt;b&gt;" in report
    import markdown  # issue 41 item 8: no link or image from a row's text, as a markdown renderer reads the files
    for text in (md, report):
        shown = markdown.markdown(text, extensions=["tables"])
        assert "javascript:" in shown and 'href="javascript' not in shown and "e.example/t.png" in shown
        assert 'src="https://e.example' not in shown  # the report's own plots are its only images
    # every label is shown as typed: no text of the figures is mathtext
    texts = [t for fig in drawn for t in fig.findobj(lambda o: hasattr(o, "_preprocess_math"))]
    assert any("frac" in t.get_text() for t in texts)
    for t in texts:
        shown, math = t._preprocess_math(t.get_text())
        assert not math, t.get_text()
    assert any(t._preprocess_math(t.get_text())[0] == "$\\frac{$" for t in texts)
    assert any("\\x1b[2J\\rA" in t.get_text() for t in texts)
    assert not [t.get_text() for t in texts if any(ord(c) < 32 and c != "\n" for c in t.get_text())]


PAGE_HOSTILE = ("<script>document.title='pwned'</script><img src=x onerror=\"document.body.setAttribute("
                "'data-pwned','1')\"> <a href=\"javascript:document.body.setAttribute('data-pwned','2')\">x</a>")


def test_report_html_browses_every_row_in_a_headless_browser(tmp_path: Path) -> None:
    """Issue 43 item 6: one self-contained page, every row's answers, verdicts, classes and output tails side by
    side; hostile row text shown as text, executing nothing; the filters (also read from the #fragment) work.
    Two eval folders from the stored fixture (tests/eval/data, written by `mlbench eval`): no eval is run."""
    from mlbench_kit.cli import main
    data = Path(__file__).parent / "data"
    gens = [json.loads(x) for x in (data / "gens-ada3bd0.jsonl").open()]
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        results = [json.loads(x) for x in (data / "results-ada3bd0.jsonl").open()]
        summary = json.loads((data / "summary-ada3bd0.json").read_text())
        g = json.loads(json.dumps(gens))
        if name == "b":  # b: hostile text in row 9001; toyvision's row fails everywhere, with class E2
            summary["per_sample"][0]["instruction"] = PAGE_HOSTILE
            g[0]["output"][1] = PAGE_HOSTILE
            for r in results:
                if r["repo"] == "toyvision":
                    r.update(passed=False, error_class="E2", log="Traceback ... </script><script>alert(1)</script>")
        (tmp_path / f"gens-{name}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in g))
        summary["generations"] = str(tmp_path / f"gens-{name}.jsonl")
        (tmp_path / name / "summary.json").write_text(json.dumps(summary))
        (tmp_path / name / "results.jsonl").write_text("".join(json.dumps(x) + "\n" for x in results))
    out = tmp_path / "report"
    assert main(["report", f"a={tmp_path / 'a'}", f"b={tmp_path / 'b'}", "--out", str(out)]) == 0
    page = out / "report.html"
    raw = page.read_text()
    assert "Content-Security-Policy" in raw and "default-src 'none'" in raw
    assert "<img" not in raw and "</script><script>alert" not in raw and not re.search(r"<[^>]*\s(src|href)=", raw)
    chromium = chromium_or_skip()
    dom, console = dump_dom(chromium, page.as_uri(), tmp_path)
    assert console == [] and 'data-ready="1"' in dom, console or dom[-2000:]
    body = re.search(r"<body[^>]*>", dom)
    assert body and "data-pwned" not in body.group(0) and "<title>mlbench report: every row</title>" in dom
    assert "<img" not in dom and "javascript:" not in re.sub(r"&[a-z]+;|[^<]*", "", dom.split("<main")[1])
    assert dom.count('class="row"') == 6 and '>6 of 6 rows<' in dom
    assert dom.count("&lt;script&gt;document.title='pwned'&lt;/script&gt;&lt;img") == 2  # instruction, answer
    assert "python train.py --dataset cora --model gat --lr 0.05 --epochs 2" in dom and ">a<" in dom and ">b<" in dom
    written = [json.loads(x) for name in ("a", "b") for x in (tmp_path / name / "results.jsonl").open()]
    e5 = len({(r["github_id"], r["id"]) for r in written if r["error_class"] == "E5"})
    assert 0 < e5 < 6
    for fragment, shown in (("#repo=toyvision&verdict=differs", 1), ("#class=E5", e5), ("#verdict=pass", 5),
                            ("#repo=toybench", 5)):
        dom, console = dump_dom(chromium, page.as_uri() + fragment, tmp_path)
        assert console == [] and f">{shown} of 6 rows<" in dom, (fragment, console)
        rows = re.findall(r'<section class="row"( hidden="")?>', dom)
        assert len(rows) == 6 and sum(not h for h in rows) == shown, fragment


def test_the_page_s_data_holds_any_text_a_generation_may_carry() -> None:
    """A lone surrogate (JSON allows it, eval keeps the row) made report.html's write fail after report.md."""
    from mlbench_kit.eval.report.html import _json_in_html
    data = _json_in_html({"answer": "\ud800</script><b>"})
    data.encode("utf-8")  # writable
    assert "</script>" not in data and json.loads(data) == {"answer": "\ud800</script><b>"}
