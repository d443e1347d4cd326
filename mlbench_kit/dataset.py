"""The benchmark's rows (a contract of every stage): load them from the hub, a local JSONL/Parquet file or a
``save_to_disk`` folder, and validate them into :class:`Sample`."""

from __future__ import annotations

import ast
import re
import shlex
import unicodedata
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlbench_kit.errors import MLBenchError
from mlbench_kit.io import read_jsonl

HUB_ID = "super-dainiu/ml-bench"
HUB_SPLITS = ("full", "quarter", "id_train", "ood_train")
SPLIT_NAMES = ("full", "quarter", "test", "id_train", "ood_train")  # prep's names (test: a --build-splits prep's)
TYPES = ("Bash Script", "Python Code")
REQUIRED = ("github_id", "id", "path", "arguments", "instruction", "oracle", "type", "output")
# Column names used by older releases of the dataset and by the benchmark's scripts.
ALIASES = {"instructions": "instruction", "oracle_segment": "oracle"}


@dataclass(frozen=True)
class Sample:
    """One validated ML-Bench row. ``where`` says where it came from (file:line or split[index])."""

    github_id: int
    id: int
    repo: str
    path: str
    arguments: dict[str, str]
    instruction: str
    oracle: str
    type: str
    output: str
    github: str = ""
    repo_id: int | None = None
    prefix_code: str = ""
    where: str = field(default="", compare=False)

    @property
    def key(self) -> tuple[int, int]:
        return (self.github_id, self.id)


# the most a row may ask for: the paper's rows have at most 29 arguments in 642 characters; every argument costs a
# pass over each output in strict mode's check, so a row's cost per output is bounded here
MAX_ARGUMENTS = 256
MAX_ARGUMENTS_CHARS = 65536


def runs_as_shell(output: str) -> bool:
    """The benchmark runs an output as a shell command iff it contains ``'.sh '`` or ``'.py '`` (else as Python)."""
    return ".sh " in output or ".py " in output


def parse_arguments(value: Any, where: str) -> dict[str, str]:
    """Parse the ``arguments`` column: a Python-literal dict string (never ``eval``), or a dict; at most
    ``MAX_ARGUMENTS`` of them, in at most ``MAX_ARGUMENTS_CHARS`` characters."""
    fix = f"a row names the parameters its instruction asks for: at most {MAX_ARGUMENTS}, in {MAX_ARGUMENTS_CHARS} " \
          "characters; fix or drop the row"
    if isinstance(value, str) and len(value) > MAX_ARGUMENTS_CHARS:
        raise MLBenchError(f"`arguments` holds {len(value)} characters", where, fix)
    if isinstance(value, dict):
        parsed = value
    elif isinstance(value, str):
        try:
            parsed = ast.literal_eval(value) if value.strip() else {}
        except (ValueError, SyntaxError, RecursionError, MemoryError) as exc:
            raise MLBenchError(f"`arguments` is not a Python-literal dict: {value[:80]!r} ({exc.__class__.__name__})",
                               where, "write it like \"{'dataset': 'cora', 'lr': '0.01'}\"") from None
    else:
        raise MLBenchError(f"`arguments` must be a string or dict, got {type(value).__name__}", where)
    if not isinstance(parsed, dict):
        raise MLBenchError(f"`arguments` must be a dict, got {type(parsed).__name__}: {value!r:.80}", where)
    if len(parsed) > MAX_ARGUMENTS:
        raise MLBenchError(f"`arguments` names {len(parsed)} parameters", where, fix)
    out = {str(k): str(v) for k, v in parsed.items()}
    if sum(len(k) + len(v) for k, v in out.items()) > MAX_ARGUMENTS_CHARS:
        raise MLBenchError(f"`arguments` holds more than {MAX_ARGUMENTS_CHARS} characters", where, fix)
    return out


def repo_name(github: str, github_id: int) -> str:
    """Repository folder name: the last part of the GitHub URL (``dmlc/dgl`` -> ``dgl``)."""
    name = github.rstrip("/").rsplit("/", 1)[-1] if github else ""
    return name.removesuffix(".git") or f"repo{github_id}"


def plain_name(name: str) -> bool:
    """Whether ``name`` is one plain path component (a repository folder's name): not empty, ``.`` or ``..``,
    no ``/``, ``\\`` or NUL."""
    return bool(name) and name not in (".", "..") and not any(c in name for c in "/\\\0")


def confined_path(path: str) -> bool:
    """Whether a row's ``path`` stays inside its repository: relative, no ``..`` component, no NUL."""
    return not path.startswith(("/", "\\")) and "\0" not in path and ".." not in path.replace("\\", "/").split("/")


def validate_row(row: dict[str, Any], where: str) -> Sample:
    """Turn one raw row into a :class:`Sample`, or raise one clear error."""
    row = {ALIASES.get(k, k): v for k, v in row.items()}
    missing = [c for c in REQUIRED if c not in row or row[c] is None]
    if missing:
        raise MLBenchError(f"missing column(s) {', '.join(missing)}", where,
                           f"every row needs: {', '.join(REQUIRED)}")
    if row["type"] not in TYPES:
        raise MLBenchError(f"unknown type {row['type']!r}", where, f"use one of {TYPES}")
    for col in ("github_id", "id"):
        v = row[col]
        if isinstance(v, bool) or not isinstance(v, (int, str)) or not str(v).lstrip("-").isdigit():
            raise MLBenchError(f"`{col}` must be an integer, got {row[col]!r}", where)
    for col in ("path", "instruction", "oracle", "output"):
        if not isinstance(row[col], str):
            raise MLBenchError(f"`{col}` must be a string, got {type(row[col]).__name__}", where)
    github_id = int(row["github_id"])
    github = row.get("github") or ""
    if not isinstance(github, str):
        raise MLBenchError(f"`github` must be a string, got {type(github).__name__}", where)
    repo = repo_name(github, github_id)
    if not plain_name(repo):
        raise MLBenchError(f"`github` {github[:120]!r} names the repository {repo!r}, which is not a plain folder "
                           "name", where, "the URL must end in the repository's name, like "
                           "https://github.com/dmlc/dgl")
    if not confined_path(row["path"]):
        raise MLBenchError(f"`path` {row['path'][:120]!r} leaves the repository (absolute, or a '..' component)",
                           where, "write it relative to the repository's root, like ./examples/pytorch/gcn")
    return Sample(
        github_id=github_id, id=int(row["id"]), repo=repo,
        path=row["path"], arguments=parse_arguments(row["arguments"], where), instruction=row["instruction"],
        oracle=row["oracle"], type=row["type"], output=row["output"], github=github,
        repo_id=int(row["repo_id"]) if row.get("repo_id") is not None else None,
        prefix_code=row.get("prefix_code") or "", where=where,
    )


def _check_unique(samples: Iterable[Sample]) -> None:
    seen: dict[tuple[int, int], str] = {}
    for s in samples:
        if s.key in seen:
            raise MLBenchError(f"duplicate sample (github_id={s.github_id}, id={s.id}); first seen at {seen[s.key]}",
                               s.where, "each (github_id, id) must appear once per split")
        seen[s.key] = s.where


def _rows_from_datasets(ds: Any, label: str) -> list[Sample]:
    return [validate_row(dict(r), f"{label}[{i}]") for i, r in enumerate(ds)]


def load_samples(source: str | Path, split: str = "full") -> list[Sample]:
    """Load and validate ML-Bench rows.

    ``source`` is a hub id (``super-dainiu/ml-bench``), a ``.jsonl`` / ``.parquet`` file, or a folder
    written by ``datasets.save_to_disk`` (a ``DatasetDict``, from which ``split`` is taken, or a ``Dataset``).
    """
    src = str(source)
    path = Path(src)
    if path.is_file() and path.suffix in (".jsonl", ".json", ".parquet"):
        check_file_split(path, split)
    if path.suffix == ".jsonl" or (path.is_file() and path.suffix == ".json"):
        samples = [validate_row(row, f"{path}:{ln}") for ln, row in read_jsonl(path)]
    elif path.suffix == ".parquet":
        if not path.is_file():
            raise MLBenchError("file not found", src)
        import datasets
        samples = _rows_from_datasets(datasets.Dataset.from_parquet(src), str(path))
    elif path.is_dir():
        import datasets
        try:
            ds = datasets.load_from_disk(src)
        except FileNotFoundError as exc:
            raise MLBenchError(f"not a datasets.save_to_disk folder ({exc})", src,
                               "pass a .jsonl/.parquet file, a save_to_disk folder, or a hub id") from None
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise MLBenchError(f"split {split!r} not in this DatasetDict (has {sorted(ds)})", src)
            ds = ds[split]
        samples = _rows_from_datasets(ds, f"{src}[{split}]")
    elif "/" in src and not path.exists() and not src.startswith((".", "/")):
        samples = _load_hub(src, split)
    else:
        raise MLBenchError("no such file, folder or hub dataset", src,
                           f"pass a .jsonl/.parquet file, a save_to_disk folder, or a hub id like {HUB_ID}")
    if not samples:
        raise MLBenchError("no rows", src, "the source is empty")
    _check_unique(samples)
    return samples


def file_split_names(path: str | Path) -> tuple[str, ...]:
    """The names one file's rows answer to as a split: prep's split names and the file's own (``quarter.jsonl``:
    ``quarter``). A file holds one split; the name says what it is, and a typo is caught here rather than
    recorded in run.json or written as a split folder."""
    stem = Path(path).stem
    return SPLIT_NAMES + ((stem,) if stem not in SPLIT_NAMES and plain_name(stem) else ())


def check_file_split(path: str | Path, split: str) -> None:
    """Refuse a split name that a data file does not answer to (:func:`file_split_names`)."""
    names = file_split_names(path)
    if split not in names:
        raise MLBenchError(f"unknown split {split!r}: a data file holds one split, called one of {', '.join(names)}",
                           str(path), f"pass --split (prep: --splits) {names[0]}, or the name of the split this "
                                      "file holds")


def _load_hub(hub_id: str, split: str) -> list[Sample]:
    import datasets
    if hub_id == HUB_ID and split not in HUB_SPLITS:
        raise MLBenchError(f"unknown split {split!r} of {HUB_ID}", hub_id, f"use one of {HUB_SPLITS}")
    try:
        ds = datasets.load_dataset(hub_id, split=split)
    except Exception as exc:  # offline, unknown id, auth: datasets raises many types
        raise MLBenchError(f"could not load {hub_id!r} split {split!r} from the Hugging Face hub "
                           f"({exc.__class__.__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''})",
                           hub_id, "offline? pass a local copy instead: --data path/to/full.jsonl "
                           "(or a .parquet file, or a datasets.save_to_disk folder)") from None
    return _rows_from_datasets(ds, f"{hub_id}[{split}]")


_EXPORT = re.compile(r"^\s*export\s+([A-Za-z_][A-Za-z0-9_]*)=(.*)$")


def prefix_exports(prefix_code: str) -> tuple[tuple[str, str], ...]:
    """The ``export NAME=VALUE`` lines of a sample's prefix_code: environment settings its answer relies on
    (e.g. bert's ``$BERT_BASE_DIR``). The rest of prefix_code (installs, downloads) belongs to building the
    environment and is never run while scoring."""
    out: dict[str, str] = {}
    for line in prefix_code.splitlines():
        m = _EXPORT.match(line)
        if not m:
            continue
        try:
            parts = shlex.split(m.group(2), comments=True)
        except ValueError:
            continue
        value = parts[0] if parts else ""
        out[m.group(1)] = re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", lambda v: out.get(v.group(1), ""), value)
    return tuple(out.items())


def normalized_text(text: str) -> str:
    """Whitespace-, case- and Unicode-normalised text (NFKC, invisible format characters such as zero-width spaces
    dropped): what the leak check compares, so a fullwidth or zero-width variant of a test row is the row."""
    text = "".join(c for c in unicodedata.normalize("NFKC", text) if unicodedata.category(c) != "Cf")
    return re.sub(r"\s+", " ", text.strip().lower())


def instruction_finder(evaluated: Sequence[Any]) -> Any:
    """A function of a text returning the first of ``evaluated`` (rows with ``instruction``) whose normalised
    instruction it holds, else None: a training prompt may not carry an evaluated instruction under any field."""
    held = {normalized_text(r.instruction): r for r in evaluated if r.instruction.strip()}

    def find(text: str) -> Any:
        norm = normalized_text(text)
        return next((r for instruction, r in held.items() if instruction in norm), None)
    return find


def check_no_leak(train: Sequence[Any], test: Sequence[Any]) -> None:
    """Raise if any test instruction or answer (whitespace/case-normalised) appears in a training split. Rows are
    :class:`Sample` or anything with ``id``, ``instruction`` and ``output`` (prep records: learning checks its
    training prompts against the evaluation split's)."""
    seen = {("instruction", normalized_text(s.instruction)): s for s in train}
    seen.update({("answer", normalized_text(s.output)): s for s in train})
    leaks = [(kind, t, seen[(kind, normalized_text(getattr(t, attr)))]) for t in test
             for kind, attr in (("instruction", "instruction"), ("answer", "output"))
             if (kind, normalized_text(getattr(t, attr))) in seen]
    if leaks:
        kind, t, s = leaks[0]
        raise MLBenchError(f"{len(leaks)} test {kind}(s) also appear in a training split; first: test id {t.id} "
                           f"({getattr(t, 'where', '')}) = train id {s.id} ({getattr(s, 'where', '')})",
                           "train/test splits", "remove the overlapping rows from the training data")
