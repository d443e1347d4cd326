"""The records stages exchange, in one place: prep -> train / infer -> eval -> report.

Each stage reads the files of the stage before it through these types, never through its internals:

- :class:`PrepRecord`: one rendered prompt (``mlbench prep`` writes ``OUT/<split>/task{t}.jsonl``);
- :class:`GenerationRecord`: the n responses to one prompt (``mlbench infer`` writes ``OUT/task{t}.jsonl``);
- :class:`EvalResult`: the verdict on one generation (``mlbench eval`` writes ``OUT/results.jsonl``).

The benchmark's own rows are :class:`mlbench_kit.dataset.Sample`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from .config import Lines, build
from .errors import MLBenchError
from .io import read_jsonl, read_log_lines

TASKS = (1, 2, 3)


def valid_text(text: str) -> str:
    """``text`` with every code point UTF-8 cannot encode (a lone surrogate such as ``"\\ud800"``, which JSON
    allows, or an undecodable byte read back as one) replaced by U+FFFD, so the hash, the sandbox's files and
    every report can write it."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")


def output_sha(text: str) -> str:
    """The ``output_sha`` of a verdict on ``text`` (the code eval ran, after :func:`valid_text`)."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class PrepRecord:
    """One sample rendered for one task. ``prompt`` is the text the model sees (its specials included when
    ``template`` is ``chat``), ``answer`` what training teaches after it."""

    task: int
    github_id: int
    id: int
    template: str
    prompt: str
    answer: str
    messages: list[dict[str, str]] = field(default_factory=list)
    repo: str = ""
    repo_id: int | None = None
    path: str = ""
    type: str = ""
    arguments: dict[str, str] = field(default_factory=dict)
    instruction: str = ""
    readme_path: str | None = None
    context: str = ""
    context_chars: int = 0
    output: str = ""
    prefix_code: str = ""
    truncated: bool = False
    context_tokens: int | None = None
    dropped_tokens: int = 0
    total_tokens: int | None = None
    over_budget: bool = False

    REQUIRED = ("task", "github_id", "id", "template", "prompt", "answer")

    @property
    def key(self) -> tuple[int, int]:
        return (self.github_id, self.id)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: dict[str, Any], where: str) -> PrepRecord:
        """A record read back; missing columns are one error with ``where`` (file:line)."""
        missing = [c for c in cls.REQUIRED if c not in obj]
        if missing:
            raise MLBenchError(f"not a prep record: missing {', '.join(missing)}", where,
                               "pass the output of `mlbench prep`")
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in obj.items() if k in known})


def read_prep_records(path: str | Path, task: int | None = None) -> Iterator[tuple[str, PrepRecord]]:
    """``(file:line, record)`` for each record of ``path`` (of ``task`` only, when given)."""
    for lineno, obj in read_jsonl(path):
        rec = PrepRecord.from_json(obj, f"{path}:{lineno}")
        if task is None or rec.task == task:
            yield f"{path}:{lineno}", rec


@dataclass(frozen=True)
class GenerationRecord:
    """The responses to one prompt: ``output`` (code, what eval runs) parsed from ``raw`` (what the model said)."""

    github_id: int
    id: int
    output: list[str]
    task: int | None = None
    raw: list[str] | None = None
    n_tokens: list[int] | None = None
    prompt_sha: str | None = None
    model: str | None = None
    adapter: str | None = None
    backend: str | None = None
    sampling: dict[str, Any] | None = None
    errors: list[str | None] | None = None  # per sample: why the engine's reply was refused (an empty sample)

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass
class EvalResult:
    """The verdict on one generation: the static checks, what execution did, and why it failed.

    ``fault`` is set (and ``passed`` is None) when the environment or the sandbox failed: such a record is no
    verdict and is kept out of ``results.jsonl``."""

    github_id: int
    id: int
    idx: int
    repo: str
    type: str
    output_sha: str
    mode: str
    param_hits: dict[str, bool]
    params_ok: bool
    type_ok: bool
    cli: dict[str, Any] | None = None
    executed: bool = False
    exit_code: int | None = None
    signal: int | None = None
    timed_out: bool = False
    survivors: int = 0
    limit: str | None = None
    duration: float = 0.0
    cached: bool = False
    env: str | None = None  # the recipe hash of the environment that ran it
    log: str = ""
    usage: dict[str, float] | None = None
    passed: bool | None = None
    error_class: str | None = None
    fault: str | None = None

    REQUIRED = ("github_id", "id", "idx", "repo", "type", "output_sha", "mode", "param_hits", "params_ok", "type_ok")

    @property
    def key(self) -> tuple[int, int]:
        """The sample it answers: ``(github_id, id)``."""
        return (self.github_id, self.id)

    def to_json(self) -> dict[str, Any]:
        """The record as ``results.jsonl`` (and ``faults.jsonl``) hold it: every field, ``usage`` and ``fault``
        only when set."""
        d = asdict(self)
        for k in ("usage", "fault"):
            if d[k] is None:
                d.pop(k)
        return d

    @classmethod
    def from_json(cls, obj: Any, where: str) -> EvalResult:
        """A record read back (:meth:`to_json` of it gives ``obj`` again); a missing column or a value of the wrong
        type is one error at ``where`` (file:line). Columns this version does not know are left out."""
        if not isinstance(obj, dict):
            raise MLBenchError(f"not an eval result: a JSON {type(obj).__name__}, not an object", where, _REDO)
        missing = [c for c in cls.REQUIRED if c not in obj]
        if missing:
            raise MLBenchError(f"not an eval result: missing {', '.join(missing)}", where, _REDO)
        try:
            return build(cls, {k: v for k, v in obj.items() if k in _EVAL_FIELDS}, Lines(where))
        except MLBenchError as exc:
            raise MLBenchError(f"not an eval result: {exc.what}", where, _REDO) from None


_EVAL_FIELDS = frozenset(f.name for f in fields(EvalResult))
_REDO = "this file is written by `mlbench eval`: delete it (or the line) and run the same command to score it again"


def read_eval_results(path: str | Path) -> list[EvalResult]:
    """The verdicts of a run's ``results.jsonl`` (a torn last line, left by a kill, is ignored: it is redone).
    Each must be a verdict: ``passed`` true or false, no ``fault``."""
    out = []
    for lineno, obj in read_log_lines(path):
        rec = EvalResult.from_json(obj, f"{path}:{lineno}")
        if rec.passed is None or rec.fault is not None:
            raise MLBenchError("not a verdict: `passed` must be true or false, with no `fault`", f"{path}:{lineno}",
                               _REDO)
        out.append(rec)
    return out


def read_scored_folder(folder: str | Path, flag: str) -> tuple[Path, list[EvalResult]]:
    """The ``results.jsonl`` of an eval folder a user named with ``flag`` (a finished ``mlbench eval --out``), and
    its verdicts. A folder without one (not an eval folder, a typo, the eval not run yet) or whose file is a link is
    one error: never an empty list, which would make an empty training set without a word."""
    path = Path(folder) / "results.jsonl"
    if path.is_symlink() or not path.is_file():
        what = "is a link" if path.is_symlink() else "is missing"
        raise MLBenchError(f"this eval folder's results.jsonl {what}", str(path),
                           f"pass to {flag} the --out folder of the `mlbench eval` that scored these answers (run it "
                           "first if it has not run)")
    return path, read_eval_results(path)


# what an :class:`EvalResult`'s ``error_class`` means (the run's report and `mlbench report` print it)
ERROR_CLASSES = {
    "E1": "type mismatch / hallucinated form (bash vs python)",
    "E2": "missing or unknown parameter",
    "E4": "syntax error: the output does not parse (Python's compiler, bash -n) or reads undefined names",
    "E5": "runtime error (non-zero exit)",
    "TIMEOUT": "still running at the time limit (strict mode)",
    "BACKGROUND": "left processes running after exit (strict mode)",
    "LIMIT_MEMORY": "killed for exceeding the execution's memory limit",
    "LIMIT_PIDS": "ran into the execution's process limit",
    "LIMIT_DISK": "filled the execution's writable space",
    "LIMIT_FSIZE": "wrote a file over the per-file size limit",
    "LIMIT_CPU": "used up its CPU-time limit",
    "OVERSIZE": "an output over the length cap: not parsed, not executed",
}


def transcript_file(run: Path, key: tuple[int, int], idx: int) -> Path | None:
    """Episode ``idx`` of row ``key`` in an ``mlbench agent`` run folder (``transcripts/<github_id>-<id>/ep<k>.jsonl``),
    or None when that file, its row's folder or ``transcripts/`` is a link: a run folder is handed-over data, and a
    link inside it could lead out of it. The file may not exist."""
    folder = run / "transcripts" / f"{key[0]}-{key[1]}"
    path = folder / f"ep{idx}.jsonl"
    return None if any(p.is_symlink() for p in (folder.parent, folder, path)) else path
