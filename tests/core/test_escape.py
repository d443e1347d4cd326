"""Untrusted text in every output is shown as typed (issue 30 item 7): the console, CSV, markdown, matplotlib."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlbench_kit.escape import csv_cell, html, mathtext_literal, visible


def test_console_errors_show_control_characters_as_escapes(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A run folder named with an OSC title sequence, a screen clear and a CR: the error printed them raw."""
    from mlbench_kit.cli import main
    bad = tmp_path / "x\x1b]0;pwned\x07\x1b[2J\rok\u202e"
    assert main(["report", str(bad), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "no summary.json" in err and "x\\x1b]0;pwned\\x07\\x1b[2J\\rok\\u202e/summary.json" in err
    assert not [c for c in err if (ord(c) < 32 and c != "\n") or 0x7f <= ord(c) <= 0x9f or c == "\u202e"]


def test_helpers() -> None:
    assert visible("a\x1b[31mb\r\n\tc\x85\u2028") == "a\\x1b[31mb\\r\n\\tc\\x85\\u2028"
    assert visible("a\nb", keep="") == "a\\nb"
    assert html("<a href='x'>&amp;</a>") == "&lt;a href='x'&gt;&amp;amp;&lt;/a&gt;"
    assert [csv_cell(c) for c in ("=1+1", "+1", "-1", "@A", "\tx", "\rx", "a=1", "", -1, 0.5)] == \
        ["'=1+1", "'+1", "'-1", "'@A", "'\tx", "'\rx", "a=1", "", -1, 0.5]
    assert mathtext_literal("$x$ a\\$") == "\\$x\\$ a\\\\$"


def test_mathtext_literal_is_drawn_as_typed() -> None:
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.text import Text

    for typed in ("$\\frac{$", "$x$ costs $5", "a\\$b$", "$$", "\\$\\frac$"):
        t = Text(0, 0, mathtext_literal(typed))
        assert t._preprocess_math(t.get_text()) == (typed, False), typed
        fig = Figure()
        fig.text(0, 0, mathtext_literal(typed))
        FigureCanvasAgg(fig).draw()  # a mathtext parse error would raise here


def test_prep_stats_show_a_repository_name_as_typed() -> None:
    """A row's repository name is any plain path component: `<img onerror=…>` or an ESC went raw into stats.md."""
    from mlbench_kit.data_prep.stats import prompt_stats, prompt_stats_markdown
    name = "<img src=x onerror=alert(1)>\x1b[2J|x"
    rec = {"repo": name, "total_tokens": 10, "context_tokens": 5, "context_chars": 20, "truncated": False}
    md = prompt_stats_markdown(prompt_stats({("test", 1): [rec]}), True)
    assert "<img" not in md and "\x1b" not in md
    assert "| test | 1 | &lt;img src=x onerror=alert(1)&gt;\\x1b\\[2J\\|x | 1 |" in md


def test_markdown_forms_no_link_or_image_and_csv_no_spaced_formula() -> None:
    """Issue 41 item 8: report.md kept a row's `javascript:` link and remote image active (a reader's click runs it,
    opening the file reports the visit), and report.csv left ` =cmd|…` unprefixed (spreadsheets trim the space)."""
    import markdown

    from mlbench_kit.markdown import md_text
    hostile = ["[run](javascript:alert(1))", "![seen](https://e.example/t.png)", "\\[x](javascript:y)",
               "[r]\n\n[r]: javascript:z", "<javascript:alert(1)>", "[a][r] [r]: https://e.example/"]
    for h in hostile:
        for md in (md_text(h), f"- {md_text(h)}", f"| a |\n|---|\n| {md_text(h)} |"):
            shown = markdown.markdown(md, extensions=["tables"])
            assert "<a " not in shown and "<img" not in shown, (h, md, shown)
    assert md_text("a\\|b [x]") == "a\\\\\\|b \\[x]"  # a backslash shown as typed; it escapes neither | nor [
    assert [csv_cell(c) for c in (" =cmd|' /C calc'!A0", "\n+1", " \t@SUM(1)", "\u00a0-1", " a=1")] == \
        ["' =cmd|' /C calc'!A0", "'\n+1", "' \t@SUM(1)", "'\u00a0-1", " a=1"]
