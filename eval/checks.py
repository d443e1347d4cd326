"""Parameter and output-type checks: ``compat`` (the benchmark's, exactly) and ``strict`` (holes closed)."""

from __future__ import annotations

import ast
import builtins
import re
import shlex
import subprocess
import symtable
from dataclasses import dataclass

from mlbench_kit.dataset import runs_as_shell  # the benchmark's rule: in the core, the agent's run.sh needs it
from mlbench_kit.pyast import compile_python


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


_SEPARATORS = ("&&", "||", ";", "|", "&")  # shell words that end a command's options


def _is_option(tok: str) -> bool:
    """``--name``, ``-n`` or ``--name=value``; ``-1`` and ``-1e-3`` are numbers."""
    return tok.startswith("-") and _num(tok) is None


def option_values(tokens: list[str]) -> dict[str, list[str]]:
    """``--name value`` / ``--name=value`` / ``-n value`` pairs (name without dashes, ``_`` == ``-``)."""
    out: dict[str, list[str]] = {}
    dest: list[str] | None = None  # the option being read and how many values it had before (one pass: linear)
    start = 0
    for tok in [*tokens, "&&"]:  # a separator at the end closes the last option
        if dest is not None and (_is_option(tok) or tok in _SEPARATORS):
            if len(dest) == start:
                dest.append("true")  # a flag
            dest = None
        if _is_option(tok):
            name, eq, val = tok.lstrip("-").partition("=")
            values = out.setdefault(name.replace("_", "-").lower(), [])
            if eq:
                values.append(val)
            else:
                dest, start = values, len(values)
        elif dest is not None and tok not in _SEPARATORS:
            dest.append(tok)
    return out


_NUMBER = re.compile(r"(?<![\d.])[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def number_in(text: str, value: float) -> bool:
    """A number literal of this value occurs in ``text`` (``1e-3`` == ``0.001``; ``1`` is not in ``10``)."""
    return any(_num(m) == value or _num(m.lstrip("+-")) == value for m in _NUMBER.findall(text))


def _words(name: str) -> list[str]:
    return [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w]


def related(key: str, option: str) -> bool:
    """Whether a loose parameter label can name an option: one contains the other, a word of one (3+ letters)
    is in the other (``layer_number`` ~ ``repr_layers``, ``resolution size`` ~ ``loadSize``, ``number of
    points`` ~ ``num_points``), or one is the other's initials (``learning rate`` ~ ``lr``)."""
    a, b = _words(key), _words(option)
    if not a or not b:
        return False
    ja, jb = "".join(a), "".join(b)
    if ja in jb or jb in ja:
        return True
    if any(len(x) >= 3 and len(y) >= 3 and (x.startswith(y) or y.startswith(x)) for x in a for y in b):
        return True
    if any(len(x) >= 3 and x in jb for x in a) or any(len(y) >= 3 and y in ja for y in b):
        return True
    return "".join(w[0] for w in a) == jb or "".join(w[0] for w in b) == ja


def _whole(text: str, value: str) -> bool:
    return re.search(rf"(?<![A-Za-z0-9]){re.escape(value)}(?![A-Za-z0-9])", text, re.IGNORECASE) is not None


def _owned(tokens: list[str]) -> list[tuple[str | None, str]]:
    """Each token's text and the option it is a value of (None: an option name, a positional, a command)."""
    out: list[tuple[str | None, str]] = []
    owner = None
    for tok in tokens:
        if tok in _SEPARATORS:
            owner = None
            out.append((None, tok))
        elif _is_option(tok):
            name, eq, val = tok.lstrip("-").partition("=")
            owner = None if eq else name
            out.append((name, val) if eq else (None, tok))
        else:
            out.append((owner, tok))
    return out


def _norm(name: str) -> str:
    return name.strip().lstrip("-").replace("_", "-").replace(" ", "-").lower()


def param_hits_strict(output: str, arguments: dict[str, str]) -> dict[str, bool]:
    """Per parameter, the benchmark's substring check with its holes closed (its keys are loose labels, the
    values are what counts):

    - shell outputs are read as shell words, so a value in a ``# comment`` does not count;
    - a value written as options (``--seed 42``) must be those options' values in the output;
    - when an option of the key's name is given, the value must be that option's value (numbers compare
      numerically; a string may be a whole part of it, ``PEMS`` of ``PEMS-SF``, or of a related option's
      value, ``traffic`` of ``--data_path traffic.csv`` for ``data``);
    - any other number must occur as a number literal of equal value (``1e-3`` == ``0.001``; ``1`` is not in
      ``10``), and not as the bare value of an option the key cannot name (``--epochs 0.001`` does not give
      ``lr: 0.001``; ``--repr_layers 25`` gives ``layer_number: 25``);
    - any other string must occur case-insensitively, as in the benchmark; an empty value always holds.
    """
    tokens = _shell_tokens(output) if runs_as_shell(output) else None
    opts = option_values(tokens) if tokens is not None else {}
    owned: list[tuple[str | None, str]] = ([(_norm(o) if o else None, t) for o, t in _owned(tokens)]
                                           if tokens is not None else [(None, output)])
    text = (" ".join(tokens) if tokens is not None else output).lower()
    # read once, looked up per argument: the output's cost stays linear in its length, whatever the row's arguments
    by_owner: dict[str, list[str]] = {}
    for owner, t in owned:
        if owner:
            by_owner.setdefault(owner, []).append(t.lower())
    numbers = _numbers(owned)
    hits = {}
    for k, v in arguments.items():
        v = str(v).strip()
        key = _norm(k)
        num = _num(v.strip("'\""))
        given = _shell_tokens(v) if v.startswith("-") and num is None else None
        if not v:
            hits[k] = True
        elif given and given[0].startswith("-") and tokens is not None:
            want = option_values(given)
            flag = len(given) == 1 and "=" not in given[0]  # ``-u``: the option's presence is the value
            hits[k] = all(name in opts and (flag or _same_value(" ".join(vals), " ".join(opts[name]))
                                            or all(any(_same_value(x, y) for y in opts[name]) for x in vals))
                          for name, vals in want.items())
        elif key in opts:
            own = opts[key]
            if num is not None:
                hits[k] = any(_same_value(x, v) for x in own) or _same_value(" ".join(own), v)
            else:
                hits[k] = any(_whole(x, v.strip("'\"")) for x in [*own, " ".join(own)]) or any(
                    v.lower() in t for owner, ts in by_owner.items() if owner != key and related(key, owner)
                    for t in ts)
        elif num is not None:
            free, owners = numbers.get(num, (False, set()))
            hits[k] = free or any(related(key, owner) for owner in owners)
        else:
            hits[k] = v.lower() in text
    return hits


def _numbers(owned: list[tuple[str | None, str]]) -> dict[float, tuple[bool, set[str]]]:
    """Each number literal's value in the output (as :func:`number_in` reads them): whether it occurs where any
    key may claim it (outside an option's value, or inside a value that is not itself a number), and else the
    options whose bare value it is (a key claims those only if it can name the option)."""
    out: dict[float, tuple[bool, set[str]]] = {}
    for owner, t in owned:
        free = owner is None or _num(t) is None
        for m in _NUMBER.findall(t):
            for x in {_num(m), _num(m.lstrip("+-"))}:
                if x is None:
                    continue
                was_free, owners = out.setdefault(x, (False, set()))
                if free:
                    out[x] = (True, owners)
                elif not was_free and owner is not None:
                    owners.add(owner)
    return out


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


def _undefined_names(tree: ast.Module, code: str) -> set[str]:
    """Names the module reads as globals and never binds anywhere (nor are builtins): the paper counts "the use
    of undefined variables" among syntax errors (E4). Empty when a star import could bind anything."""
    if any(isinstance(n, ast.ImportFrom) and any(a.name == "*" for a in n.names) for n in ast.walk(tree)):
        return set()
    used, bound = set(), set(dir(builtins))
    tables = [symtable.symtable(code, "temp.py", "exec")]
    while tables:
        t = tables.pop()
        tables.extend(t.get_children())
        top = t.get_type() == "module"
        for sym in t.get_symbols():
            if top or sym.is_global():
                if sym.is_referenced():
                    used.add(sym.get_name())
                if sym.is_assigned() or sym.is_imported() or (top and sym.is_namespace()):
                    bound.add(sym.get_name())
    return {n for n in used - bound if not n.startswith("__")}


def syntax_error(output: str, as_shell: bool) -> str | None:
    """Why ``output`` itself is not a valid program (E4), from a real parse rather than from anything it printed:
    ``bash -n`` for a shell command; for Python code, the compiler, then names read but never defined.
    ``None`` when it parses."""
    if as_shell:
        try:
            r = subprocess.run(["bash", "-n"], input=(output + "\n").encode(), capture_output=True, timeout=10,
                               check=False, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
        except (OSError, subprocess.TimeoutExpired):
            return None
        return r.stderr.decode(errors="replace").strip()[:300] or "bash -n failed" if r.returncode else None
    try:
        tree = compile_python(output, "temp.py")
        undefined = _undefined_names(tree, output)
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        return f"{type(exc).__name__}: {exc}"[:300]
    return f"undefined names: {', '.join(sorted(undefined)[:5])}" if undefined else None
