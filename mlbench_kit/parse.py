"""Turn a raw model response into code: a contract shared by infer/ (which stores both) and eval/."""

from __future__ import annotations

import re

PARSERS = ("compat", "fenced")
_FENCE = re.compile(r"```[ \t]*([\w+-]*)[ \t]*\n?(.*?)```", re.DOTALL)


def parse_benchmark(text: str) -> str:
    """The benchmark's parser (``--parser compat``; not eval's ``--mode compat``): the first ```python block,
    else ```bash, else ```shell, else the first unlabelled fence (to the closing fence, or the text itself if
    unclosed), else the whole text."""
    for tag in ("python", "bash", "shell"):
        m = re.search(rf"```{tag}(.*?)```", text, re.DOTALL)
        if m:
            return m.group(1)
    start = text.find("```")
    if start == -1:
        return text
    rest = text[start + 3:]
    end = rest.find("```")
    return rest[:end] if end != -1 else text


def parse_fenced(text: str) -> str:
    """A tidier parser: the first fenced block of any language (tag removed, stripped); several blocks of the
    same shell/python kind are joined with newlines; no fence -> the text stripped of a leading ``$ ``."""
    blocks = _FENCE.findall(text)
    if not blocks:
        lines = [ln[2:] if ln.startswith("$ ") else ln for ln in text.strip().splitlines()]
        return "\n".join(lines).strip()
    first_tag = blocks[0][0].lower()
    same = [body.strip() for tag, body in blocks if tag.lower() == first_tag]
    return "\n".join(same)


def parse_response(text: str, parser: str = "compat") -> str:
    """Extract code from a raw response with the named parser (one of :data:`PARSERS`)."""
    if parser == "compat":
        return parse_benchmark(text)
    if parser == "fenced":
        return parse_fenced(text)
    raise ValueError(f"unknown parser {parser!r}; use one of {PARSERS}")
