"""Markdown table cells, shown safely: the run's report (``eval/run_report.py``) and ``mlbench report``
(``eval/report/``) write them."""

from __future__ import annotations

import re

from .escape import html, inert_links, visible


def _cell(text: str, limit: int | None) -> str:
    text = text.strip().replace("\r\n", "\n").replace("\n", " ; ")
    text = visible(text, keep="").replace("|", "\\|")
    return text[:limit] if limit else text


def md_text(text: str, limit: int | None = None) -> str:
    """``text`` as one markdown table cell: newlines as `` ; ``, ``|`` escaped, every control character shown as
    an escape (``\\x1b``), raw HTML shown as text (``&lt;``), no link or image (:func:`~.escape.inert_links`), cut
    to ``limit`` characters."""
    return html(_cell(inert_links(text), limit))


def md_code(text: str, limit: int | None = None) -> str:
    """``text`` as an inline code span inside a table cell (fenced by more backticks than it holds); padded with a
    space inside the fence only where CommonMark needs one (the text starts or ends with a backtick), so that the
    source reads `like this`, not ` like this `. Empty text is ``–``."""
    text = _cell(text, limit)  # a code span shows HTML as typed already
    if not text.strip():
        return "–"
    ticks = "`" * (max((len(r) for r in re.findall("`+", text)), default=0) + 1)
    pad = " " if text[0] == "`" or text[-1] == "`" or (text[0] == " " and text[-1] == " ") else ""
    return f"{ticks}{pad}{text}{pad}{ticks}"


def fmt_rate(v: float | None, rng: tuple | list | None = None) -> str:
    """A rate to 3 places, with its interval in brackets when given; ``–`` when there is none."""
    if v is None:
        return "–"
    return f"{v:.3f}" + (f" [{rng[0]:.2f}, {rng[1]:.2f}]" if rng else "")
