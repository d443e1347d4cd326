"""Parameter and output-type checks: ``compat`` (the benchmark's, exactly) and ``strict`` (holes closed)."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass


def runs_as_shell(output: str) -> bool:
    """The benchmark runs an output as a shell command iff it contains ``'.sh '`` or ``'.py '``."""
    return ".sh " in output or ".py " in output


def type_ok(output: str, sample_type: str) -> bool:
    """The benchmark's type check: ``Bash Script`` <=> the output contains ``'.sh '`` or ``'.py '``."""
    return runs_as_shell(output) == (sample_type == "Bash Script")


def param_hits_compat(output: str, arguments: dict[str, str]) -> dict[str, bool]:
    """Per parameter: its value occurs anywhere in the output, case-insensitively (the benchmark's check)."""
    low = output.lower()
    return {k: str(v).lower() in low for k, v in arguments.items()}


def _num(s: str) -> float | None:
    try:
        return float(s)
    except ValueError:
        return None


def _same_value(a: str, b: str) -> bool:
    a, b = a.strip("'\""), b.strip("'\"")
    if a.lower() == b.lower():
        return True
    x, y = _num(a), _num(b)
    return x is not None and y is not None and x == y


def _shell_tokens(output: str) -> list[str] | None:
    try:
        return shlex.split(output, comments=True)
    except ValueError:
        return None


def option_values(tokens: list[str]) -> dict[str, list[str]]:
    """``--name value`` / ``--name=value`` / ``-n value`` pairs (name without dashes, ``_`` == ``-``)."""
    out: dict[str, list[str]] = {}
    for i, tok in enumerate(tokens):
        if not tok.startswith("-") or _num(tok) is not None:
            continue
        name, eq, val = tok.lstrip("-").partition("=")
        key = name.replace("_", "-").lower()
        if eq:
            out.setdefault(key, []).append(val)
            continue
        vals = []
        for nxt in tokens[i + 1:]:
            if nxt.startswith("-") and _num(nxt) is None:
                break
            if nxt in ("&&", "||", ";", "|", "&"):
                break
            vals.append(nxt)
        out.setdefault(key, []).extend(vals or ["true"])
    return out


def param_hits_strict(output: str, arguments: dict[str, str]) -> dict[str, bool]:
    """Per parameter, for shell outputs: the value must belong to the option of that name (numbers compare
    numerically: ``1e-3`` == ``0.001``); keys like ``argument1`` (positional) need a whole-token match.
    For Python code: the value must appear as a whole literal token (numbers numerically)."""
    tokens = _shell_tokens(output) if runs_as_shell(output) else None
    hits = {}
    if tokens is not None:
        opts = option_values(tokens)
        for k, v in arguments.items():
            key = k.lstrip("-").replace("_", "-").lower()
            if key in opts:
                hits[k] = any(_same_value(x, v) for x in opts[key])
            else:
                hits[k] = re.fullmatch(r"argument\d*", key) is not None and any(_same_value(t, v) for t in tokens)
        return hits
    words = re.findall(r"[\w.+-]+|\"[^\"]*\"|'[^']*'", output)
    for k, v in arguments.items():
        hits[k] = any(_same_value(w, v) for w in words)
    return hits


@dataclass(frozen=True)
class StaticChecks:
    """What the benchmark checks before executing anything."""

    param_hits: dict[str, bool]
    type_ok: bool

    @property
    def params_ok(self) -> bool:
        return all(self.param_hits.values())


def check_output(output: str, arguments: dict[str, str], sample_type: str, mode: str) -> StaticChecks:
    """Run the parameter and type checks of ``mode`` (``compat`` or ``strict``)."""
    hits = param_hits_compat(output, arguments) if mode == "compat" else param_hits_strict(output, arguments)
    return StaticChecks(hits, type_ok(output, sample_type))
