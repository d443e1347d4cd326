"""The runner's report turned into an :class:`ExecResult`: bounded, checked, and a fault (never a verdict)
whenever it is missing, unreadable or incomplete. The limit that was hit comes from evidence, never a status."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any, cast

from .spec import ExecResult, Limits

REPORT_CAP = 16384


def read_report(fd: int) -> bytes:
    """Read the runner's report: bounded, non-blocking (every writer is dead by now)."""
    os.set_blocking(fd, False)
    data = b""
    try:
        while len(data) <= REPORT_CAP:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            data += chunk
    except BlockingIOError:
        pass
    finally:
        os.close(fd)
    return data


def report_from_log(log: str, nonce: str) -> tuple[bytes, str]:
    marker = f"MLBENCH-REPORT {nonce} "
    i = log.rfind(marker)
    if i < 0:
        return b"", log
    line = log[i + len(marker):].split("\n", 1)[0]
    return line.encode(), log[:i].rstrip("\n")


def report_from_stream(path: Path, nonce: str) -> tuple[bytes, str, tuple[int, int] | None]:
    """The report in a stream that only the runner writes (docker's stderr, in a file): ``(report, the engine's own
    text around it, (offset, size) of the layer's tar before it or None)``. Read from its two ends only: the layer
    before the report may be large."""
    size = path.stat().st_size
    with path.open("rb") as fh:
        head = fh.read(4096)
        fh.seek(max(0, size - 2 * REPORT_CAP))
        tail_at = fh.tell()
        tail = fh.read()
        marker = f"\nMLBENCH-REPORT {nonce} ".encode()
        i = tail.rfind(marker)
        if i < 0:  # no report: the engine's own words (an image it cannot find, a daemon it cannot reach)
            return b"", head.decode("utf-8", errors="replace").strip(), None
        raw = tail[i + len(marker):].split(b"\n", 1)[0]
        at = tail_at + i  # where the report starts in the file
        span = None
        try:
            n = json.loads(raw).get("layer_bytes")
        except (ValueError, AttributeError):
            n = None
        header = f"\nMLBENCH-LAYER {nonce}\n".encode()
        if isinstance(n, int) and not isinstance(n, bool) and 0 < n <= at - len(header):
            fh.seek(at - n - len(header))
            if fh.read(len(header)) == header:
                span = (at - n, n)
        # the engine's own words end where the runner's stream begins: a layer's header, even of a layer the runner
        # gave up on (its tar cut short), is never shown (the observation says in words what became of it)
        cut = head.find(header)
        before = head[:max(0, (span[0] - len(header)) if span else at if cut < 0 else min(cut, at))]
    return raw, before.decode("utf-8", errors="replace").strip(), span


def cpu_limit_hit(code: object, sig: object, cpu: object, limits: Limits) -> bool:
    """Died of RLIMIT_CPU: SIGXCPU (or the hard limit's SIGKILL), or a shell's status for either, with CPU seconds
    near the limit as evidence. ``cpu`` is the runner's rusage, or the execution cgroup's exact count where there is
    one. The kernel enforces RLIMIT_CPU on tick-sampled time, which on a loaded machine runs ahead of the exact run
    time both of those report: a 1 s limit fired at 0.85-0.9 s of rusage and at 0.87 s of the cgroup's count,
    hence 0.75 (an answer can still class itself a CPU-limit death only by spending most of its budget)."""
    used_up = isinstance(cpu, (int, float)) and cpu >= 0.75 * limits.cpu_s
    return used_up and (sig in (signal.SIGXCPU, signal.SIGKILL)
                        or code in (128 + signal.SIGXCPU, 128 + signal.SIGKILL))


def _limit_hit(rep: dict, code: object, sig: object, limits: Limits) -> str | None:
    """The per-process limit an execution ran into, from what the runner saw: the signal its child died of (or
    a shell's exit status for it) backed by evidence of the limit (a file at the size limit; CPU seconds at the
    CPU limit, from the rusage of everything the child waited for). A status or a signal alone proves nothing:
    any program may ``exit 153`` or send itself SIGXFSZ."""
    if (sig == signal.SIGXFSZ or code == 128 + signal.SIGXFSZ) and rep.get("at_fsize") is True:
        return "fsize"
    if cpu_limit_hit(code, sig, rep.get("cpu_s"), limits):
        return "cpu"
    if rep.get("full"):
        return "disk"
    if _counted(rep, "pids_max"):  # docker: its pids controller refused a fork (a count only the kernel keeps)
        return "pids"
    return None


def _counted(rep: dict, key: str) -> bool:
    """Whether the report's kernel count ``key`` is a positive number."""
    n = rep.get(key)
    return isinstance(n, int) and not isinstance(n, bool) and n > 0


def result_from_report(raw: bytes, timed_out: bool, duration: float, log: str, returncode: int | None,
            limits: Limits) -> ExecResult:
    """Turn the runner's report into a result; anything unexpected is a sandbox fault, never a verdict. An OOM
    its container's memory controller counted (docker: ``oom``, read once everything is dead) is a verdict over
    everything else, as the host's cgroup makes it on the other engines: past the cpu clock's limit, where compat
    would pass an answer still running, and over a fault that the OOM may have caused."""
    rep = None if timed_out else _read_report(raw)
    res = _result(rep, raw, timed_out, duration, log, returncode, limits)
    if rep is not None and _counted(rep, "oom"):
        res.limit, res.fault = "memory", None
    return res


def _read_report(raw: bytes) -> dict | None:
    """The runner's report (version 1) in ``raw``, None if there is none or it is not one."""
    try:
        rep = json.loads(raw.decode("utf-8")) if raw and len(raw) <= REPORT_CAP else None
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return rep if isinstance(rep, dict) and rep.get("v") == 1 else None


def _result(rep: dict | None, raw: bytes, timed_out: bool, duration: float, log: str, returncode: int | None,
            limits: Limits) -> ExecResult:
    """The result report ``rep`` tells, before its OOM count is applied."""
    base: dict[str, Any] = dict(timed_out=timed_out, duration=round(duration, 3), log=log)
    if timed_out:
        return ExecResult(None, survivors=0, **base)
    if rep is None:
        why = "no report from the runner" if not raw else "an unreadable report from the runner"
        return ExecResult(None, survivors=0, fault=f"SANDBOX: {why} (engine exit {returncode})", **base)
    at_limit = rep.get("at_limit")
    if isinstance(at_limit, (int, float)) and not isinstance(at_limit, bool):
        # the cpu clock's limit, reached while still running: the same result as a wall-clock timeout
        return ExecResult(None, survivors=0, usage={"cpu_s": float(at_limit)}, **(base | {"timed_out": True}))
    fault = rep.get("fault")
    if fault:
        kind = fault.get("kind") if isinstance(fault, dict) else "?"
        detail = str(fault.get("detail", ""))[:300] if isinstance(fault, dict) else str(fault)[:300]
        cls = "ENV" if kind in ("workdir", "exec", "interpreter") else "SANDBOX"
        return ExecResult(None, survivors=0, fault=f"{cls}: {kind}: {detail}", **base)
    code, sig, surv = rep.get("exit"), rep.get("signal"), rep.get("survivors")
    if not (isinstance(code, int) or isinstance(sig, int)) or not isinstance(surv, int):
        return ExecResult(None, survivors=0, fault="SANDBOX: an incomplete report from the runner", **base)
    limit = _limit_hit(rep, code, sig, limits)
    exit_code = code if isinstance(code, int) else 128 + cast(int, sig)  # one of them is an int (checked above)
    return ExecResult(exit_code, survivors=surv, signal=sig if isinstance(sig, int) else None, limit=limit, **base)
