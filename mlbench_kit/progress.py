"""Quiet, visible progress: progress bars only on a terminal, library and engine logs in a file.

- :func:`bars_only_on_tty`: where stderr is not a terminal (a log file, a pipe, Slurm), every library's tqdm bar is
  off (``TQDM_DISABLE``, ``HF_HUB_DISABLE_PROGRESS_BARS``), so no ``\\r``-filled lines land in logs. Called by
  ``mlbench`` before anything imports tqdm; child processes (vLLM's engine) inherit it.
- :class:`Progress`: our own progress: a tqdm bar on a terminal, elsewhere a plain line now and then.
- :func:`logs_to_file`: while a stage runs, this process's stdout and stderr (file descriptors 1 and 2, so C++
  warnings and every child process too) go to a log file; the stage's own lines go to the terminal.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

from .escape import visible

_ENV_OFF = {"TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}


def bars_only_on_tty(stream: TextIO | None = None) -> bool:
    """Turn library progress bars off unless ``stream`` (default: stderr) is a terminal; returns whether it is.
    Must run before tqdm is imported (tqdm reads ``TQDM_*`` at import); a variable the user set is kept."""
    stream = stream if stream is not None else sys.stderr
    tty = _isatty(stream)
    if not tty:
        for k, v in _ENV_OFF.items():
            os.environ.setdefault(k, v)
    return tty


def _bars_off() -> None:
    """Library bars off from now on: for child processes and later imports (the variables), and in the libraries
    this process has already imported (their switches; tqdm reads its variables only at import)."""
    os.environ.update(_ENV_OFF)
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars
        disable_progress_bars()
    if "transformers" in sys.modules:
        from transformers.utils import logging
        logging.disable_progress_bar()


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def _hms(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class Progress:
    """``done/total`` of something, shown as a tqdm bar on a terminal, else as a plain line (``desc: i/N unit
    (p%), extra, elapsed m:ss, ETA m:ss``) at most every ``every`` seconds and at the end: never a ``\\r``."""

    def __init__(self, total: int, desc: str, unit: str, stream: TextIO | None = None, every: float = 30.0,
                 initial: int = 0) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.total, self.desc, self.unit, self.every = total, desc, unit, every
        self.done, self.start, self.t0 = initial, initial, time.monotonic()
        self.printed = initial  # done as of the last plain line
        self.last = self.t0
        self.extra = ""
        self.bar: Any = None
        if total and _isatty(self.stream):
            from tqdm import tqdm
            self.bar = tqdm(total=total, initial=initial, desc=desc, unit=unit, file=self.stream, disable=False)

    def update(self, n: int = 1, extra: str = "") -> None:
        self.done += n
        self.extra = extra
        if self.bar is not None:
            self.bar.update(n)
            if extra:
                self.bar.set_postfix_str(extra)
            return
        now = time.monotonic()
        if now - self.last >= self.every and self.done < self.total:
            self.last = now
            self._line(now)

    def _line(self, now: float) -> None:
        if not self.total:
            return
        self.printed = self.done
        elapsed = now - self.t0
        rate = (self.done - self.start) / elapsed if elapsed > 0 else 0.0
        eta = f", ETA {_hms((self.total - self.done) / rate)}" if rate > 0 and self.done < self.total else ""
        extra = f", {self.extra}" if self.extra else ""
        print(f"{self.desc}: {self.done}/{self.total} {self.unit}s ({100 * self.done / self.total:.0f}%){extra}, "
              f"elapsed {_hms(elapsed)}{eta}", file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        elif self.done > self.printed:  # the final state, unless the last line showed it
            self._line(time.monotonic())


class Console:
    """Where a stage's own lines go: the terminal (also echoed into the log file, when there is one)."""

    def __init__(self, stream: TextIO, log: Path | None = None) -> None:
        self.stream, self.log = stream, log

    def say(self, line: str) -> None:
        print(line, file=self.stream, flush=True)
        if self.log is not None:
            sys.stdout.flush()
            print(line, file=sys.stderr, flush=True)  # the log: file descriptor 2 points there


@contextmanager
def logs_to_file(path: Path | None, stage: str) -> Iterator[Console]:
    """Send file descriptors 1 and 2 (this process's and every child's output: Python logging, warnings, C++
    messages, engine processes) to ``path``, appended, until the block ends; yields the :class:`Console` that
    writes to the terminal. ``path`` None: nothing is redirected (``--verbose``). A failure other than a
    :class:`~mlbench_kit.errors.MLBenchError` shows the log's last lines on the terminal."""
    from mlbench_kit.errors import MLBenchError
    if path is None:
        yield Console(sys.stderr)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    term = os.fdopen(os.dup(2), "w", buffering=1, encoding=sys.stderr.encoding or "utf-8", errors="replace")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)
    os.write(fd, f"\n=== {stage} {time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(sys.argv)}\n".encode())
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    env = {k: os.environ.get(k) for k in _ENV_OFF}
    _bars_off()  # a log file, whatever the terminal is: no bars in it (this process's libraries, and children)
    try:
        yield Console(term, path)
    except (MLBenchError, KeyboardInterrupt):
        raise
    except BaseException:
        import traceback
        traceback.print_exc()  # into the log, then its tail on the terminal
        sys.stderr.flush()
        tail = path.read_text(errors="replace").splitlines()[-15:]
        print(f"{stage}: failed; the last lines of its log {path}:", file=term)
        print("\n".join("  " + visible(x, keep="\t") for x in tail), file=term, flush=True)
        raise
    finally:
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])
        term.close()


# libraries that log on import, before a stage knows its log file (bitsandbytes: "pip install kernels" on CPU)
HELD_LOGGERS = ("bitsandbytes",)


class _Held(logging.Handler):
    """Keeps the records a library logs until :func:`replay_held_logs`."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def hold_library_logs(names: tuple[str, ...] = HELD_LOGGERS) -> None:
    """Hold what the ``names`` loggers log (their import-time warnings) instead of printing it on the terminal,
    until :func:`replay_held_logs` writes it into the stage's log."""
    for name in names:
        lg = logging.getLogger(name)
        if not any(isinstance(h, _Held) for h in lg.handlers):
            lg.addHandler(_Held())
            lg.propagate = False


def replay_held_logs(names: tuple[str, ...] = HELD_LOGGERS) -> None:
    """Write the held records to stderr (inside :func:`logs_to_file`: the log) and let the loggers log as usual."""
    fmt = logging.Formatter("%(name)s: %(levelname)s: %(message)s")
    for name in names:
        lg = logging.getLogger(name)
        for h in [h for h in lg.handlers if isinstance(h, _Held)]:
            lg.removeHandler(h)
            for record in h.records:
                print(fmt.format(record), file=sys.stderr, flush=True)
        lg.propagate = True
