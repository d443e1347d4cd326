"""Untrusted text (a dataset row, a generation, a log, a run's name) made safe for the reader it is written for: one
helper per kind of reader, used wherever such text leaves the toolkit.

- :func:`visible`: a terminal or a text viewer; control characters are shown as escapes, never acted on.
- :func:`html`: markdown (report.md, validation.md); raw HTML is shown as text, never rendered.
- :func:`inert_links`: markdown too; no link, image or link definition is ever formed (``javascript:`` links,
  remote images that report a reader's visit).
- :func:`csv_cell`: a spreadsheet opening report.csv; a cell is never a formula (OWASP's CSV injection rule).
- :func:`mathtext_literal`: a matplotlib label; ``$…$`` is shown as typed, never parsed as mathtext.
"""

from __future__ import annotations

import re
from typing import Any

# C0/C1 controls, DEL, line/paragraph separators and bidirectional overrides: a terminal or a viewer would act on
# them (CR rewrites a line, ESC starts a sequence, U+202E reverses text)
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def visible(text: str, keep: str = "\n") -> str:
    """``text`` with every control character but those in ``keep`` shown as an escape (``\\x1b``, ``\\r``,
    ``\\u202e``): what a terminal, a log or a viewer shows is what the text holds."""
    def esc(m: re.Match[str]) -> str:
        c = m.group()
        if c in keep:
            return c
        return {"\r": "\\r", "\t": "\\t", "\n": "\\n"}.get(c) or (
            f"\\x{ord(c):02x}" if ord(c) < 256 else f"\\u{ord(c):04x}")
    return _CONTROL.sub(esc, text)


def html(text: str) -> str:
    """``text`` for markdown outside code spans: ``&``, ``<`` and ``>`` as entities, so a row's ``<script>`` or
    ``<img onerror=…>`` is shown as typed by every markdown renderer, never run or drawn."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def inert_links(text: str) -> str:
    """``text`` for markdown outside code spans with every ``[`` escaped (and ``\\`` first, so an escape in the
    text cannot undo it): ``[x](javascript:…)``, ``![x](https://…)`` and ``[x]: url`` then show as typed, never as
    a link, an image or a link definition. Autolinks (``<javascript:…>``) are :func:`html`'s."""
    return text.replace("\\", "\\\\").replace("[", "\\[")


_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def csv_cell(value: Any) -> Any:
    """A CSV cell a spreadsheet cannot run: a string starting with ``= + - @``, a tab or a carriage return, also after
    leading whitespace (`` =cmd|…``: spreadsheets trim it), gets a leading apostrophe (OWASP); numbers are left as
    numbers."""
    if isinstance(value, str) and (value.startswith(_FORMULA_START) or value.lstrip().startswith(_FORMULA_START)):
        return "'" + value
    return value


def mathtext_literal(text: str) -> str:
    """``text`` for a matplotlib label, shown as typed: every ``$`` escaped (``\\$``), so none starts mathtext (a
    ``$\\frac$`` in a run's name made ``mlbench report`` fail while drawing); matplotlib shows ``\\$`` as ``$``."""
    return text.replace("$", r"\$")
