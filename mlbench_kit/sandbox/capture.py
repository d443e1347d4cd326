"""An execution's output, bounded: a pipe drained in a thread (head and tail kept), or left undrained as the
benchmark's checker leaves stdout, and the wait up to the wall limit."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Callable

from .spec import Limits

PIPE_BUF = 65536


class Capture:
    """Drain a pipe in a thread, keeping at most ``cap`` bytes (head and tail)."""

    def __init__(self, stream, cap: int) -> None:
        self.head, self.tail, self.dropped, self.cap = bytearray(), bytearray(), 0, cap
        self.t = threading.Thread(target=self._run, args=(stream,), daemon=True)
        self.t.start()

    def _run(self, stream) -> None:
        half = self.cap // 2
        for chunk in iter(lambda: stream.read1(8192), b""):
            room = half - len(self.head)
            if room > 0:
                self.head += chunk[:room]
                chunk = chunk[room:]
            self.tail += chunk
            if len(self.tail) > half:
                self.dropped += len(self.tail) - half
                del self.tail[: len(self.tail) - half]

    def text(self) -> str:
        self.t.join(timeout=2)
        mid = f"\n[... {self.dropped} bytes dropped ...]\n".encode() if self.dropped else b""
        return bytes(self.head + mid + self.tail).decode("utf-8", errors="replace")


def captured(proc: subprocess.Popen, out_cap: Capture | None, err_cap: Capture | None) -> str:
    """The log: stdout + stderr when drained, else what stdout's pipe holds and stderr (one capture is set)."""
    if out_cap is not None:
        return out_cap.text()
    assert err_cap is not None
    return read_undrained(proc) + err_cap.text()


def read_undrained(proc: subprocess.Popen) -> str:
    assert proc.stdout is not None  # piped
    os.set_blocking(proc.stdout.fileno(), False)
    try:
        data = proc.stdout.read(PIPE_BUF) or b""
    except (BlockingIOError, ValueError):
        data = b""
    return data.decode("utf-8", errors="replace")


def capture_and_wait(proc: subprocess.Popen, limits: Limits, drain: bool, t0: float,
                     cpu: Callable[[], float] | None = None) -> tuple[Capture | None, Capture | None, bool, float]:
    """Capture stdout+stderr (``drain``) or only stderr (the benchmark's undrained stdout), wait up to the time
    limit; ``(stdout capture, stderr capture, timed out, seconds since t0)``. The wall clock stops it at
    :attr:`Limits.wall_limit_s` (the limit, or the cpu clock's backstop); under the cpu clock the runner ends it
    at the limit, or, for the local engine, which has no runner, ``cpu`` (its process tree's CPU seconds, read
    every 50 ms, the limit reached on two reads in a row as in the runner)."""
    out_cap = Capture(proc.stdout, limits.log_bytes) if drain else None
    err_cap = None if drain else Capture(proc.stderr, limits.log_bytes)
    deadline, over = t0 + limits.wall_limit_s, 0
    limit = limits.cpu_limit_s if cpu is not None else None
    while True:
        left = deadline - time.monotonic()
        try:
            proc.wait(timeout=max(0.0, left if limit is None else min(left, 0.05)))
            return out_cap, err_cap, False, time.monotonic() - t0
        except subprocess.TimeoutExpired:
            pass
        if limit is not None and cpu is not None:
            over = over + 1 if cpu() >= limit else 0
        if over >= 2 or time.monotonic() >= deadline:
            return out_cap, err_cap, True, time.monotonic() - t0
