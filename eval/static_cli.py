"""Static CLI check: find the script a generated command runs, read its argparse options by AST (no import,
no execution), and report unknown options and invalid ``choices`` — the paper's "no argument" errors."""

from __future__ import annotations

import ast
import shlex
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from mlbench_kit.pyast import parse_python


@dataclass
class ScriptOptions:
    """The options a script declares with ``add_argument``."""

    options: set[str] = field(default_factory=set)
    choices: dict[str, list[str]] = field(default_factory=dict)
    dynamic: bool = False  # options built in ways the AST cannot see (e.g. **kwargs, parse_known_args)


@lru_cache(maxsize=512)
def script_options(path: str) -> ScriptOptions | None:
    """Options of ``path`` by AST; ``None`` if the file cannot be parsed or declares no argparse options."""
    try:
        tree = parse_python(Path(path).read_text(encoding="utf-8", errors="replace"), path)
    except (OSError, SyntaxError, ValueError):
        return None
    so = ScriptOptions()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        if node.func.attr == "parse_known_args":
            so.dynamic = True
        if node.func.attr != "add_argument":
            continue
        names = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        if any(not isinstance(a, ast.Constant) for a in node.args):
            so.dynamic = True
        flags = [n for n in names if n.startswith("-")]
        so.options.update(flags)
        for kw in node.keywords:
            if kw.arg == "choices" and isinstance(kw.value, (ast.List, ast.Tuple)):
                vals = [str(e.value) for e in kw.value.elts if isinstance(e, ast.Constant)]
                for f in flags:
                    so.choices[f] = vals
    return so if so.options else None


@dataclass
class CliReport:
    """Problems found in one command, against one script."""

    script: str | None
    unknown_options: list[str]
    invalid_choices: list[str]

    @property
    def ok(self) -> bool:
        return not self.unknown_options and not self.invalid_choices


def check_command(command: str, workdir: Path, root: Path | None = None) -> CliReport | None:
    """Check every ``python X.py ...`` in ``command`` (run from ``workdir``); ``None`` if there is nothing
    to check (no python script, script not found, or options not statically visible). Only scripts inside
    ``root`` (the checkout; default ``workdir``) are read: ``python ../../x.py`` or a symlink out of the
    repository is never followed to a host file."""
    root = (root or workdir).resolve()
    try:
        tokens = shlex.split(command, comments=True)
    except ValueError:
        return None
    for i, tok in enumerate(tokens):
        if not tok.endswith(".py") or i == 0 or not Path(tokens[i - 1]).name.startswith("python"):
            continue
        script = (workdir / tok).resolve()
        if not script.is_relative_to(root):
            return None
        so = script_options(str(script)) if script.is_file() else None
        if so is None or so.dynamic:
            return None
        args = []
        for t in tokens[i + 1:]:
            if t in ("&&", "||", ";", "|", "&"):
                break
            args.append(t)
        unknown, bad = [], []
        for j, a in enumerate(args):
            if not a.startswith("-") or a in ("-h", "--help"):
                continue
            try:
                float(a)
                continue  # a negative number is a value
            except ValueError:
                pass
            name, eq, val = a.partition("=")
            matches = [o for o in so.options if o == name or (name.startswith("--") and o.startswith(name))]
            if not matches:
                unknown.append(name)
                continue
            opt = name if name in so.options else matches[0]
            if opt in so.choices:
                value = val if eq else (args[j + 1] if j + 1 < len(args) else "")
                if value not in so.choices[opt]:
                    bad.append(f"{opt}={value} (choices: {', '.join(so.choices[opt])})")
        return CliReport(str(script.relative_to(workdir.resolve())) if script.is_relative_to(workdir.resolve())
                         else str(script), unknown, bad)
    return None
