"""``--backend local``: the one engine without isolation, run in place (only with ``--unsafe-local``)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

from .capture import capture_and_wait, captured
from .spec import ExecResult, Job, Limits


def _tree_cpu(pid: int) -> float:
    """CPU seconds of ``pid`` and its descendants, each with what it reaped (the cpu clock of the local engine,
    which has no runner; a process that leaves the tree, a daemon, is no longer counted)."""
    import psutil
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


def run_local(job: Job, limits: Limits, root: Path, drain: bool, env: dict[str, str]) -> ExecResult:
    """``--backend local --unsafe-local``: no isolation at all, a private copy of the checkout, a scrubbed
    environment; processes left behind are found by session id (a ``setsid`` daemon escapes this count)."""
    import psutil
    scratch = root / uuid.uuid4().hex[:12]
    work = scratch / "work"
    shutil.copytree(job.env.checkout, work, symlinks=True)
    (scratch / "home").mkdir()
    cwd = work / job.workdir
    if not cwd.is_dir():
        shutil.rmtree(scratch, ignore_errors=True)
        return ExecResult(None, False, 0.0, 0, "", fault=f"ENV: workdir: {job.workdir} is not in the checkout")
    if job.as_shell:
        (scratch / "cmd.sh").write_text(job.code + "\n")
        argv = ["bash", str(scratch / "cmd.sh")]
    else:
        (cwd / "temp.py").write_text(job.code)
        argv = ["python", "temp.py"]
    env = env | {"HOME": str(scratch / "home")}
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT if drain else subprocess.PIPE, start_new_session=True)
    out_cap, err_cap, timed_out, duration = capture_and_wait(proc, limits, drain, t0, lambda: _tree_cpu(proc.pid))
    survivors = 0
    for p in psutil.process_iter(["pid"]):
        try:
            if p.pid != proc.pid and os.getsid(p.pid) == proc.pid:
                survivors += 1
                p.kill()
        except (psutil.Error, ProcessLookupError, PermissionError):
            continue
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    log = captured(proc, out_cap, err_cap)
    shutil.rmtree(scratch, ignore_errors=True)
    code = None if timed_out else proc.returncode
    return ExecResult(code, timed_out, round(duration, 3), 0 if timed_out else survivors, log)
