"""Markdown table cells, shown safely: the run's report (``eval/run_report.py``) and ``mlbench report``
(``eval/report/``) write them."""

from __future__ import annotations

import re

# C0/C1 controls, DEL, line/paragraph separators and bidirectional overrides: a terminal or a viewer would act on
# them (CR rewrites a line, ESC starts a sequence, U+202E reverses text)
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def md_text(text: str, limit: int | None = None) -> str:
    """``text`` as one markdown table cell: newlines as `` ; ``, ``|`` escaped, every control character shown as
    an escape (``\\x1b``), cut to ``limit`` characters."""
    text = text.strip().replace("\r\n", "\n").replace("\n", " ; ")
    text = _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 256 else f"\\u{ord(m.group()):04x}",
                        text)
    text = text.replace("|", "\\|")
    return text[:limit] if limit else text


def md_code(text: str, limit: int | None = None) -> str:
    """``text`` as an inline code span inside a table cell (fenced by more backticks than it holds); padded with a
    space inside the fence only where CommonMark needs one (the text starts or ends with a backtick), so that the
    source reads `like this`, not ` like this `. Empty text is ``–``."""
    text = md_text(text, limit)
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
