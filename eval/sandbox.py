"""Run untrusted generations in isolation: bubblewrap, docker/podman, apptainer, or (explicitly) unsafe local.

Every backend runs the same generated wrapper script, ``/sandbox/run.sh``, over a per-execution scratch folder
holding a private writable copy of the repository (``/sandbox/work``), a scratch home and the command.
The original checkout is never visible to the generation. Network is off, the environment is scrubbed,
ulimits cap CPU time, memory, file size and processes, output is captured to a capped log, and the whole
process tree is killed at the end.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from mlbench_kit.errors import MLBenchError

BACKENDS = ("bwrap", "docker", "podman", "apptainer", "local")
SANDBOX = "/sandbox"
PIPE_BUF = 65536


@dataclass(frozen=True)
class Limits:
    """Per-execution limits."""

    wall_s: float = 10.0
    cpu_s: int = 120
    mem_mb: int = 8192
    nproc: int = 512
    fsize_mb: int = 1024
    log_bytes: int = 65536


@dataclass(frozen=True)
class Job:
    """One execution: ``code`` run as a shell command or as a Python file, in ``workdir`` of ``repo``."""

    code: str
    as_shell: bool
    repo: Path
    workdir: str  # path inside the repository, e.g. "./examples/gnn"
    env_bin: str | None = None  # a folder put first on PATH (a venv's bin)
    conda: str | None = None
    image: str | None = None
    ro_paths: tuple[str, ...] = ()


@dataclass
class ExecResult:
    """What happened."""

    exit_code: int | None
    timed_out: bool
    duration: float
    survivors: int  # processes still alive when the command itself had exited (background jobs, daemons)
    log: str  # captured stdout + stderr, capped (head and tail kept)


def _wrapper(job: Job, limits: Limits, scan_proc: bool) -> str:
    workdir = job.workdir.strip("./") if job.workdir not in (".", "./") else ""
    act = f'export PATH="{job.env_bin}:$PATH"\n' if job.env_bin else ""
    if job.conda:
        act += f"source activate {job.conda} || exit 96\n"
    run = "bash /sandbox/cmd.sh" if job.as_shell else "python temp.py"
    scan = ('n=0; for p in /proc/[0-9]*; do q=${p#/proc/}; case $q in 1|$$) ;; *) [ -e "$p/stat" ] && '
            'n=$((n+1));; esac; done\n') if scan_proc else "n=-1\n"
    return (f"ulimit -t {limits.cpu_s} 2>/dev/null; ulimit -v {limits.mem_mb * 1024} 2>/dev/null\n"
            f"ulimit -f {limits.fsize_mb * 1024} 2>/dev/null; ulimit -u {limits.nproc} 2>/dev/null\n"
            f"{act}cd \"/sandbox/work/{workdir}\" || exit 97\n{run}\nrc=$?\n{scan}"
            f'echo "$rc $n" > /sandbox/status\nexit $rc\n')


def prepare_scratch(job: Job, limits: Limits, scratch: Path, scan_proc: bool, mount: str = SANDBOX) -> Path:
    """Lay out the scratch folder: a private copy of the repository, home, the command and the wrapper."""
    scratch.mkdir(parents=True, exist_ok=True)
    shutil.copytree(job.repo, scratch / "work", symlinks=True)
    (scratch / "home").mkdir()
    (scratch / "cmd.sh").write_text(job.code + "\n")
    if not job.as_shell:
        target = scratch / "work" / job.workdir / "temp.py"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(job.code)
    text = _wrapper(job, limits, scan_proc)
    (scratch / "run.sh").write_text(text.replace(SANDBOX, mount) if mount != SANDBOX else text)
    return scratch


def _base_env() -> dict[str, str]:
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": f"{SANDBOX}/home", "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1", "MPLBACKEND": "Agg"}


def _python_ro_paths() -> list[str]:
    """Folders the interpreter needs: its base install and, when run from a venv, the venv."""
    paths = {os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix)}
    return sorted(p for p in paths if not p.startswith(("/usr", "/bin", "/lib")))


def bwrap_argv(job: Job, scratch: Path) -> list[str]:
    """The bubblewrap command line: system folders read-only, only the scratch folder writable, no network."""
    argv = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--clearenv"]
    for p in ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/etc"):
        if os.path.exists(p):
            argv += ["--ro-bind", p, p]
    env_dirs = [os.path.dirname(job.env_bin)] if job.env_bin else []
    for p in _python_ro_paths() + env_dirs + list(job.ro_paths):
        if os.path.exists(p):
            argv += ["--ro-bind", p, p]
    argv += ["--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp", "--bind", str(scratch), SANDBOX]
    env = _base_env()
    if not job.env_bin:  # default: the interpreter running mlbench, so `python` resolves like outside
        env["PATH"] = f"{os.path.dirname(sys.executable)}:{env['PATH']}"
    for k, v in env.items():
        argv += ["--setenv", k, v]
    return argv + ["--chdir", f"{SANDBOX}/work", "bash", f"{SANDBOX}/run.sh"]


def container_argv(engine: str, job: Job, scratch: Path, limits: Limits, name: str) -> list[str]:
    """docker/podman: network off, memory/pids limits, only the scratch folder mounted."""
    if not job.image:
        raise MLBenchError(f"backend {engine} needs an image for this repository", "envs config",
                           "set `image:` for the repository in the eval environments YAML")
    argv = [engine, "run", "--rm", "--name", name, "--network", "none", "--memory", f"{limits.mem_mb}m",
            "--pids-limit", str(limits.nproc), "--security-opt", "no-new-privileges",
            "-v", f"{scratch}:{SANDBOX}", "-w", f"{SANDBOX}/work"]
    for k, v in _base_env().items():
        if k != "PATH":
            argv += ["-e", f"{k}={v}"]
    return argv + [job.image, "bash", f"{SANDBOX}/run.sh"]


def apptainer_argv(job: Job, scratch: Path) -> list[str]:
    """apptainer (Slurm clusters): contained, no home, no network, scratch bound at /sandbox."""
    if not job.image:
        raise MLBenchError("backend apptainer needs an image (.sif) for this repository", "envs config",
                           "set `image:` for the repository in the eval environments YAML")
    return ["apptainer", "exec", "--containall", "--cleanenv", "--no-home", "--net", "--network", "none",
            "--bind", f"{scratch}:{SANDBOX}", "--pwd", f"{SANDBOX}/work", job.image, "bash", f"{SANDBOX}/run.sh"]


class _Capture:
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


def check_backend(backend: str, unsafe_local: bool) -> None:
    """Fail early, clearly, when a backend cannot run here or is unsafe without consent."""
    if backend not in BACKENDS:
        raise MLBenchError(f"unknown backend {backend!r}", "--backend", f"use one of {BACKENDS}")
    if backend == "local" and not unsafe_local:
        raise MLBenchError("the local backend runs untrusted generations without isolation", "--backend local",
                           "pass --unsafe-local to accept that, or use --backend bwrap")
    exe = {"bwrap": "bwrap", "docker": "docker", "podman": "podman", "apptainer": "apptainer"}.get(backend)
    if exe and shutil.which(exe) is None:
        raise MLBenchError(f"{exe} is not installed", f"--backend {backend}",
                           "install it (Debian: apt-get install bubblewrap), or choose another --backend")


def execute(job: Job, backend: str, limits: Limits, scratch_root: Path, drain: bool = True,
            keep_scratch: bool = False) -> ExecResult:
    """Run ``job`` in a fresh scratch folder under ``scratch_root`` with ``backend``.

    ``drain=False`` reproduces the benchmark's checker: stdout goes to a pipe nobody reads while the command
    runs, so a command printing more than the pipe holds blocks (and, in compat mode, "passes" by timing out).
    """
    scratch = scratch_root / uuid.uuid4().hex[:12]
    name = f"mlbench-{scratch.name}"
    prepare_scratch(job, limits, scratch, scan_proc=backend == "bwrap")
    if backend == "bwrap":
        argv, env, cwd = bwrap_argv(job, scratch), {}, None
    elif backend in ("docker", "podman"):
        argv, env, cwd = container_argv(backend, job, scratch, limits, name), dict(os.environ), None
    elif backend == "apptainer":
        argv, env, cwd = apptainer_argv(job, scratch), dict(os.environ), None
    else:  # local, unsafe: same wrapper, scratch mounted nowhere, so rewrite the paths
        (scratch / "run.sh").write_text((scratch / "run.sh").read_text().replace(SANDBOX, str(scratch)))
        env = _base_env() | {"HOME": str(scratch / "home")}
        env["PATH"] = f"{os.path.dirname(sys.executable)}:{env['PATH']}" if not job.env_bin else env["PATH"]
        argv, cwd = ["bash", str(scratch / "run.sh")], str(scratch / "work")
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT if drain else subprocess.PIPE, start_new_session=True)
    out_cap = _Capture(proc.stdout, limits.log_bytes) if drain else None
    err_cap = None if drain else _Capture(proc.stderr, limits.log_bytes)
    timed_out = False
    try:
        proc.wait(timeout=limits.wall_s)
    except subprocess.TimeoutExpired:
        timed_out = True
    duration = time.monotonic() - t0
    survivors = _kill_tree(proc, backend, name)
    log = out_cap.text() if out_cap else _read_undrained(proc) + err_cap.text()
    status = (scratch / "status").read_text().split() if (scratch / "status").exists() else []
    if backend == "bwrap" and len(status) == 2 and not timed_out:
        survivors = int(status[1])
    exit_code = None if timed_out else (int(status[0]) if status and backend != "local" else proc.returncode)
    if not keep_scratch:
        shutil.rmtree(scratch, ignore_errors=True)
    return ExecResult(exit_code, timed_out, round(duration, 3), max(survivors, 0), log)


def _read_undrained(proc: subprocess.Popen) -> str:
    os.set_blocking(proc.stdout.fileno(), False)
    try:
        data = proc.stdout.read(PIPE_BUF) or b""
    except (BlockingIOError, ValueError):
        data = b""
    return data.decode("utf-8", errors="replace")


def _kill_tree(proc: subprocess.Popen, backend: str, name: str) -> int:
    """Kill everything the execution started; return how many processes were still alive (local backend)."""
    import psutil
    survivors = 0
    if backend == "local":
        # processes that outlived the command keep its session id (unless they called setsid themselves)
        for p in psutil.process_iter(["pid"]):
            try:
                if p.pid != proc.pid and os.getsid(p.pid) == proc.pid:
                    survivors += 1
                    p.kill()
            except (psutil.Error, ProcessLookupError, PermissionError):
                continue
    if backend in ("docker", "podman"):
        subprocess.run([backend, "kill", name], capture_output=True)
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # bwrap: killing it tears down the whole PID namespace
    except ProcessLookupError:
        pass
    proc.wait()
    return survivors
