"""What a ``bash`` episode's ``run.sh`` runs, as the answer ``mlbench eval`` scores.

The benchmark runs an answer as a shell command when its text holds ``'.sh '`` or ``'.py '``, else as Python code
(:func:`mlbench_kit.dataset.runs_as_shell`); OpenHands runs ``bash run.sh``. Scored as its bare text, a run.sh
would be read the benchmark's way, not bash's: a working heredoc run.sh on a Python Code row is a shell command (E1),
and a Python program saved as run.sh passes although bash cannot run it. So the answer is what ``bash run.sh``
runs, in the form the benchmark runs the same way:

- ``python``: run.sh only runs one Python program (besides blank lines, comments, ``set`` options and a ``cd`` to
  the task folder) given as a quoted heredoc (``python - <<'EOF'``; an unquoted one when nothing in it would be
  expanded), as ``python -c CODE``, or as ``python FILE.py`` with no arguments where FILE.py is written by run.sh
  itself (``cat > FILE.py <<'EOF'``) or by the episode (in its layer, not the pristine checkout): the answer is
  that program's source;
- ``shell``: anything else is a shell script, the answer its text. When the benchmark would read that text as
  Python (no ``'.sh '`` nor ``'.py '`` in it), no scorer can run it as bash, so the answer is empty
  (``unscorable``): it fails, as ``bash run.sh`` of such a text would on any row (it is no Python Code, and a Bash
  Script row's type check needs the markers)."""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from posixpath import normpath

from mlbench_kit.dataset import runs_as_shell

_PY = r"python(?:3(?:\.\d+)?)?"
_OPTS = r"(?:\s+-[uBE]+)*"  # options that do not change which program runs
_HEREDOC = r"<<(?P<dash>-?)\s*(?P<q>['\"]?)(?P<tag>[A-Za-z_]\w*)(?P=q)"
_FILE = r"(?P<file>[\w./-]+)"
_RUN_HEREDOC = re.compile(rf"{_PY}{_OPTS}(?:\s+-)?\s*{_HEREDOC}")
_CATS = (re.compile(rf"cat\s*>\s*{_FILE}\s*{_HEREDOC}"), re.compile(rf"cat\s*{_HEREDOC}\s*>\s*{_FILE}"))
_SKIP = re.compile(r"(?:#.*|set(?:\s+[-+][\w]+(?:\s+pipefail)?)*)?")
_EXPANDS = re.compile(r"[$`\\]")


@dataclass(frozen=True)
class RunSh:
    """What a run.sh runs: ``kind`` (``python``, ``shell`` or ``unscorable``) and the answer eval scores."""

    kind: str
    answer: str
    program: str | None = None  # the Python file run (``python FILE.py``), when that is how it runs


def _body(lines: list[str], i: int, tag: str, dash: bool) -> tuple[str | None, int]:
    """The heredoc starting at line ``i`` and the line after its end (None: never closed)."""
    out: list[str] = []
    for j in range(i, len(lines)):
        line = lines[j].lstrip("\t") if dash else lines[j]
        if line == tag:
            return "".join(x + "\n" for x in out), j + 1
        out.append(line)
    return None, len(lines)


def _shell(text: str) -> RunSh:
    return RunSh("shell", text) if runs_as_shell(text) else RunSh("unscorable", "")


def read_runsh(text: str, folder: str, read: Callable[[str], str | None]) -> RunSh:
    """What ``text`` (a run.sh in the task folder ``folder``, relative to the repository) runs. ``read(path)``:
    a file of the episode's own (written in its layer), by its path relative to the repository, or None."""
    lines = text.splitlines()
    files: dict[str, str] = {}
    program: str | None = None
    source: str | None = None
    i = 0
    here = {normpath(f"/sandbox/work/{folder}"), "."}
    while i < len(lines):
        line = lines[i].strip()
        i += 1
        if _SKIP.fullmatch(line):
            continue
        if source is not None:  # something after the program: a shell script
            return _shell(text)
        m = _RUN_HEREDOC.fullmatch(line) or _CATS[0].fullmatch(line) or _CATS[1].fullmatch(line)
        if m is not None:
            body, i = _body(lines, i, m["tag"], m["dash"] == "-")
            if body is None or (not m["q"] and _EXPANDS.search(body)):  # bash would expand it: not this text
                return _shell(text)
            if m.re is _RUN_HEREDOC:
                source = body
            else:
                files[normpath(m["file"])] = body
            continue
        try:
            words = shlex.split(line)
        except ValueError:
            return _shell(text)
        if words[0] == "cd" and len(words) == 2 and normpath(words[1]) in here:
            continue
        if not re.fullmatch(_PY, words[0]):
            return _shell(text)
        args = [w for w in words[1:] if not re.fullmatch(r"-[uBE]+", w)]
        if len(args) == 2 and args[0] == "-c":
            source = args[1]
        elif len(args) == 1 and args[0].endswith(".py") and not args[0].startswith("-"):
            program = normpath(args[0])
            source = files.get(program)
            if source is None and not program.startswith(("/", "..")):
                source = read(normpath(f"{folder}/{program}") if folder else program)
            if source is None:
                return _shell(text)
        else:
            return _shell(text)
    if source is None or set(files) - {program}:  # no program, or files it may read besides
        return _shell(text)
    return RunSh("python", source, program)
