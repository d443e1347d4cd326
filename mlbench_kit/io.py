"""JSONL reading with file:line errors, atomic writes and append-only logs."""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .errors import MLBenchError

MAX_RECORD_BYTES = 64 << 20  # one JSONL line (a record, a transcript's turn) read at most: inputs are untrusted
MAX_JSON_BYTES = 16 << 20  # one small JSON document (a run's stages.json, run.json, summary.json) read at most


def _lines(path: Path, limit: int | None = None) -> Iterator[tuple[int, bytes, bool]]:
    """``(line number, bytes, ended by "\n")`` of each line of ``path``, split on "\n" only (never on U+2028,
    U+2029, U+0085 or "\r", which a record may hold raw); a line over ``limit`` bytes (default
    :data:`MAX_RECORD_BYTES`) is one error at file:line, read no further than that."""
    limit = MAX_RECORD_BYTES if limit is None else limit
    with path.open("rb") as fh:
        lineno = 0
        while line := fh.readline(limit + 1):
            lineno += 1
            if len(line) > limit and not (len(line) == limit + 1 and line.endswith(b"\n")):
                raise MLBenchError(f"a line over {limit} bytes", f"{path}:{lineno}",
                                   "each line must be one JSON record of bounded size; is this the right file?")
            ended = line.endswith(b"\n")
            yield lineno, line[:-1] if ended else line, ended


def _decode(line: bytes, where: str, errors: str = "strict") -> Any:
    """One JSON value from one line's bytes; what is not UTF-8 or not JSON (also nested too deeply, or a number
    too long for Python's int) is one error naming ``where`` (file:line)."""
    try:
        return json.loads(line.decode("utf-8", errors))
    except UnicodeDecodeError as exc:
        raise MLBenchError(f"not UTF-8 (byte {line[exc.start]:#04x} at byte {exc.start + 1})", where,
                           "each line must be one JSON object in UTF-8") from None
    except json.JSONDecodeError as exc:
        raise MLBenchError(f"bad JSON ({exc.msg} at column {exc.colno})", where,
                           "each line must be one JSON object") from None
    except RecursionError:
        raise MLBenchError("bad JSON (nested too deeply)", where, "each line must be one JSON object") from None
    except ValueError as exc:  # e.g. an integer over Python's 4300-digit limit
        raise MLBenchError(f"bad JSON ({exc})", where, "each line must be one JSON object") from None


def read_jsonl(path: str | Path, errors: str = "strict") -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield ``(line_number, object)`` for each non-blank line; bad JSON, bytes that are not UTF-8 and a line over
    :data:`MAX_RECORD_BYTES` raise with file:line. ``errors``: how bytes that are not UTF-8 decode
    (``surrogateescape`` keeps them, for the reader to replace)."""
    path = Path(path)
    if not path.is_file():
        raise MLBenchError("file not found", str(path), "check the path")
    # a record ends at "\n" only; text may hold U+2028, U+2029, U+0085, "\r" (str.splitlines() and universal
    # newlines would split there: one printed character made a whole run unreadable)
    for lineno, line, _ in _lines(path):
        if not line.strip():
            continue
        obj = _decode(line, f"{path}:{lineno}", errors)
        if not isinstance(obj, dict):
            raise MLBenchError(f"expected a JSON object, got {type(obj).__name__}", f"{path}:{lineno}")
        yield lineno, obj


def read_json(path: str | Path, limit: int = MAX_JSON_BYTES) -> Any:
    """One JSON document (a run's own small record): a file that is not one, a link, larger than ``limit`` bytes,
    not UTF-8 or not JSON (nested too deeply included) is one error naming it (file:line for bad JSON)."""
    path = Path(path)
    fix = "it is written by mlbench: delete it to start that step over, or pass the right folder"
    if path.is_symlink() or not path.is_file():
        raise MLBenchError("not a file (missing, a folder or a link)", str(path), fix)
    with path.open("rb") as fh:
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise MLBenchError(f"larger than {limit} bytes", str(path), fix)
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise MLBenchError(f"not UTF-8 (byte {data[exc.start]:#04x} at byte {exc.start + 1})", str(path),
                           fix) from None
    except json.JSONDecodeError as exc:
        raise MLBenchError(f"bad JSON ({exc.msg} at column {exc.colno})", f"{path}:{exc.lineno}", fix) from None
    except RecursionError:
        raise MLBenchError("bad JSON (nested too deeply)", str(path), fix) from None
    except ValueError as exc:
        raise MLBenchError(f"bad JSON ({exc})", str(path), fix) from None


def split_records(text: str) -> list[str]:
    """The lines of a JSONL text: split on "\n" only (never ``str.splitlines()``, which also splits on U+2028,
    U+2029, U+0085, "\r", "\x1c"... that a record may hold raw, as ``ensure_ascii=False`` writes them)."""
    lines = text.split("\n")
    return lines[:-1] if lines and lines[-1] == "" else lines


def read_jsonl_tolerant(path: str | Path) -> list[dict[str, Any]]:
    """Read an append-only log, ignoring a torn last line left by a killed writer."""
    return [obj for _, obj in read_log_lines(path)]


def read_log_lines(path: str | Path) -> list[tuple[int, Any]]:
    """``(line number, value)`` of each record of an append-only log: :func:`read_jsonl_tolerant` with the line
    numbers, for errors that name a record's file:line. A missing file has none; a bad last line (torn by a kill
    mid-write) is left out; any other bad line, and a line over :data:`MAX_RECORD_BYTES`, is an error."""
    path = Path(path)
    if not path.exists():
        return []
    rows = []
    torn: tuple[int, MLBenchError] | None = None  # a bad line: an error unless it turns out to be the last
    for lineno, line, _ in _lines(path):
        if torn is not None:
            raise MLBenchError(f"corrupt record in the middle of a results log: {torn[1].what}",
                               f"{path}:{torn[0]}", "delete the file to start over")
        if not line.strip():
            continue
        try:
            rows.append((lineno, _decode(line, f"{path}:{lineno}")))
        except MLBenchError as exc:
            torn = (lineno, exc)  # a torn tail from a kill mid-write: that record is redone
    return rows


def current_umask() -> int:
    """The process's umask, read without changing it (``os.umask`` can only be read by setting it, which races
    with other threads creating files)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def shared_mode(executable: bool = False, umask: int | None = None) -> int:
    """The mode a plain ``open()`` would give a new file: 0666 (0777 for executables and folders) less the umask."""
    return (0o777 if executable else 0o666) & ~(current_umask() if umask is None else umask)


def honour_umask(root: str | Path) -> None:
    """Give ``root`` (a file, or a folder and everything in it) the modes the umask allows. Some writers create
    files 0600 whatever the umask (``tempfile.mkstemp``; safetensors' ``save_file``, hence every adapter and
    checkpoint): on a shared cluster a labmate could not read the report or load the adapter. Links are left
    alone; executables keep their execute bits."""
    root = Path(root)
    mask = current_umask()
    entries = [root] if not root.is_dir() or root.is_symlink() else [
        root, *(Path(d) / n for d, dirs, files in os.walk(root) for n in (*dirs, *files))]
    for p in entries:
        st = os.lstat(p)
        if stat.S_ISLNK(st.st_mode):
            continue
        want = shared_mode(stat.S_ISDIR(st.st_mode) or bool(st.st_mode & 0o100), mask)
        if stat.S_IMODE(st.st_mode) != want:
            os.chmod(p, want)


def write_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` so that readers see the old file or the new one, never half of it; the file gets the
    umask's mode, as a plain ``open()`` would give it (``mkstemp`` alone makes it 0600)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, shared_mode())
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextmanager
def atomic_dir(final: str | Path) -> Iterator[Path]:
    """A fresh ``<final>.tmp`` folder to fill; once the block succeeds it replaces ``final`` (a reader sees the old
    folder or the new one, never half of one); if the block fails it is removed and ``final`` is left as it was.
    What the block wrote gets the umask's modes (see :func:`honour_umask`) before it is published."""
    final = Path(final)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    honour_umask(tmp)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)


def write_jsonl_atomic(path: str | Path, rows: Iterable[dict[str, Any]]) -> None:
    """Write all rows as JSONL atomically."""
    write_atomic(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def write_json_atomic(path: str | Path, obj: Any) -> None:
    """Write one JSON document atomically."""
    write_atomic(path, json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


class AppendLog:
    """An append-only JSONL file: one whole line per record, flushed and fsynced. A log that is a link is refused
    (a run folder handed over could point it at any file of the user's, which every resume would append to)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o666)
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            raise MLBenchError("this log is a link: a run folder's files are written only inside it", str(self.path),
                               "delete the link (or use a new --out)") from None
        try:
            _cut_torn_tail(fd)
            self._fh = os.fdopen(fd, "a", encoding="utf-8")
        except BaseException:
            os.close(fd)
            raise

    def append(self, row: dict[str, Any]) -> None:
        self._fh.write(json.dumps(row, ensure_ascii=False) + "\n")
        self._fh.flush()
        os.fsync(self._fh.fileno())

    def close(self) -> None:
        self._fh.close()

    def __enter__(self) -> AppendLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _cut_torn_tail(fd: int, chunk: int = 1 << 16) -> None:
    """A kill mid-write leaves a last line without "\n": cut it so the next append starts clean. Reads back from
    the end a chunk at a time (a log may be gigabytes; only its torn tail is looked at)."""
    end = os.fstat(fd).st_size
    if end == 0 or os.pread(fd, 1, end - 1) == b"\n":
        return
    pos = end
    while pos > 0:
        start = max(0, pos - chunk)
        i = os.pread(fd, pos - start, start).rfind(b"\n")
        if i != -1:
            os.ftruncate(fd, start + i + 1)
            return
        pos = start
    os.ftruncate(fd, 0)


def settings_diff(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> dict[str, tuple[Any, Any]]:
    """The keys of ``new`` whose values differ from ``old``'s, by dotted name down to the innermost one that differs
    (``config.sampling.seed``), each with (old, new). Inside a value, a key only one side has is a difference (None
    on the other side); at the top, keys only ``old`` has are not (what a run folder recorded that is no longer
    compared)."""
    out: dict[str, tuple[Any, Any]] = {}
    for k in [*new, *(k for k in old if prefix and k not in new)]:
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out.update(settings_diff(a, b, f"{prefix}{k}."))
        elif a != b:
            out[f"{prefix}{k}"] = (a, b)
    return out


def claim_run_folder(path: str | Path, settings: dict[str, Any],
                     upgrade: Callable[[dict[str, Any]], None] | None = None) -> None:
    """Record ``settings`` in ``path`` (a run's JSON); refuse if it already holds different ones.

    Resuming needs the same settings; a different run must use another folder, never mix into this one.
    ``upgrade`` brings what an older version recorded up to today's names first (in place), so its run resumes."""
    path = Path(path)
    if path.exists():
        old = read_json(path)
        if not isinstance(old, dict):
            raise MLBenchError("not a JSON object", str(path), "use a new --out (this folder's record is damaged)")
        if upgrade is not None:
            upgrade(old)
        diff = settings_diff(old, settings)
        if diff:
            said = "; ".join(f"{k}: {json.dumps(a)} here, now {json.dumps(b)}" for k, (a, b) in list(diff.items())[:12])
            more = f" (and {len(diff) - 12} more)" if len(diff) > 12 else ""
            raise MLBenchError(f"this run folder was made with other settings: {len(diff)} differ: {said}{more}",
                               str(path), "use a new --out, or the same settings to resume")
    write_json_atomic(path, settings)
