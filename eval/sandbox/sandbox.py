"""Run untrusted generations in isolation and return verdicts the generation cannot forge.

One :class:`Sandbox` per eval run. Each execution:

1. gets its own cgroup (memory, processes, CPU for the whole tree; :mod:`.cgroups`) where this host allows;
2. runs a stage script in a private mount namespace that mounts a size-capped tmpfs, an overlay of the
   pristine checkout on it (copy-on-write: ~ms whatever the repository's size) and read-only binds of the
   environment, then drops to an unprivileged uid (:mod:`.cmdline`);
3. starts the engine (bwrap or a container) whose PID 1 is the trusted runner (``runner.py``);
4. takes exit status and survivors from the runner's report pipe alone, the limit that was hit from the
   cgroup, and never reads a file the generation could have written.

Environment and sandbox faults (an interpreter missing, a mount that failed, a missing report) are returned
as ``fault``: they are never verdicts about the model.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from mlbench_kit.errors import MLBenchError

from . import cgroups, seccomp
from .cmdline import (
    NONCE_ENV,
    SANDBOX,
    Identity,
    Mounts,
    apptainer_argv,
    bwrap_argv,
    container_argv,
    stage_script,
    unshare_argv,
)

BACKENDS = ("bwrap", "podman", "docker", "apptainer", "local")
PIPE_BUF = 65536
RUNNER = Path(__file__).with_name("runner.py")
REPORT_CAP = 16384
DEFAULT_UID = 65534  # as root, untrusted code runs as nobody:nogroup (never as host root)

# Imported (when installed) by Sandbox.warm before a run's first verdict. Python 3.7 syntax: bert's env.
WARM_MODULES = ("numpy", "scipy", "pandas", "sklearn", "PIL", "cv2", "matplotlib", "torch", "torchvision",
                "tensorflow", "jax", "dgl", "transformers", "fairseq")
_WARM_CODE = """import importlib, importlib.util, json, os, time
out = []
for m in %r:
    try:
        if importlib.util.find_spec(m) is None:
            continue
    except Exception:
        continue
    t = time.time()
    try:
        mod = importlib.import_module(m)
        src = getattr(mod, "__file__", None) or ""
        compiled = not src.endswith(".py") or os.path.exists(importlib.util.cache_from_source(src))
        out.append([m, round(time.time() - t, 2), compiled, None])
    except BaseException as e:
        out.append([m, None, False, type(e).__name__])
print("MLBENCH-WARM " + json.dumps(out), flush=True)
"""
CONTAINER_PREFIX = "/opt/venv"


@dataclass(frozen=True)
class Limits:
    """Per-execution limits. Memory, processes and CPU hold for the whole process tree (a cgroup), the tmpfs
    sizes for everything written; ``cpu_s`` and ``fsize_mb`` are per process (rlimits)."""

    wall_s: float = 10.0
    mem_mb: int = 8192
    pids: int = 512
    cpus: float | None = None  # CPU quota in cores; None: no quota
    disk_mb: int = 2048  # the repository's writable layer plus home
    tmp_mb: int = 1024  # /tmp and /dev/shm, each
    cpu_s: int = 300
    fsize_mb: int = 1024
    nofile: int = 1024
    log_bytes: int = 65536
    threads: int | None = None  # OMP/MKL/BLAS threads of one execution; None: the libraries' defaults


THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS",
               "VECLIB_MAXIMUM_THREADS")


def thread_vars(limits: Limits) -> dict[str, str]:
    """The thread-count variables of one execution. Without them torch starts one thread per core of the host,
    so the same answer's run time (and, at the benchmark's timeouts, its verdict) depends on the machine and on
    how many executions share it."""
    return {v: str(limits.threads) for v in THREAD_VARS} if limits.threads else {}


@dataclass(frozen=True)
class Env:
    """Where a repository's code runs: its pristine checkout and its environment."""

    name: str
    checkout: Path
    prefix: str | None = None  # a venv / conda env / interpreter prefix: its bin/ leads PATH
    image: str | None = None  # container backends
    ro_paths: tuple[str, ...] = ()  # more host folders the environment needs, read-only at their own path
    recipe: str | None = None  # the recipe hash the environment was built from (mlbench env build)
    where: str = ""  # where it was configured (file:line), for errors
    vars: tuple[tuple[str, str], ...] = ()  # environment variables the repository's commands rely on
    warm: tuple[str, ...] | None = None  # modules Sandbox.warm imports before a run; None: WARM_MODULES


@dataclass(frozen=True)
class Warmed:
    """One library :meth:`Sandbox.warm` imported: how long it took, whether it had bytecode, or why it failed."""

    module: str
    seconds: float | None = None  # None when the import failed
    compiled: bool = True  # False: no bytecode, and the read-only sandbox cannot cache it, so every run compiles it
    error: str | None = None  # the exception's type name, or why the warm-up itself failed


@dataclass(frozen=True)
class Job:
    """One execution: ``code`` as a shell command (``bash cmd.sh``) or as ``python temp.py``, in ``workdir``."""

    code: str
    as_shell: bool
    env: Env
    workdir: str  # path inside the repository, e.g. "./examples/gnn"
    vars: tuple[tuple[str, str], ...] = ()  # variables of this sample (the exports of its prefix_code)


@dataclass
class ExecResult:
    """What happened, as the runner and the cgroup saw it."""

    exit_code: int | None
    timed_out: bool
    duration: float
    survivors: int
    log: str  # captured stdout + stderr (strict) or stderr (compat), capped: head and tail kept
    signal: int | None = None
    limit: str | None = None  # memory | pids | disk | fsize | cpu: a limit the execution ran into
    fault: str | None = None  # an environment or sandbox fault: no verdict may be drawn from this execution
    usage: dict[str, float] = field(default_factory=dict)


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
    if backend == "local":
        if not unsafe_local:
            raise MLBenchError("the local backend runs untrusted generations without isolation", "--backend local",
                               "pass --unsafe-local to accept that, or use --backend bwrap")
        return
    need = {"bwrap": ["bwrap", "unshare"], "podman": ["podman", "unshare"], "docker": ["docker"],
            "apptainer": ["apptainer"]}[backend]
    if os.geteuid() == 0 and backend in ("bwrap", "podman"):
        need.append("setpriv")
    for exe in need:
        if shutil.which(exe) is None:
            pkg = {"bwrap": "bubblewrap", "unshare": "util-linux", "setpriv": "util-linux"}.get(exe, exe)
            raise MLBenchError(f"{exe} is not installed", f"--backend {backend}",
                               f"install it (Debian: apt-get install {pkg}), or choose another --backend")


def _interpreter_dirs() -> list[str]:
    """The folder of the default environment: the base install of the interpreter running mlbench. Never
    mlbench's own venv (its packages, its ``setup.log``): an environment that wants it names it as ``venv:``."""
    base = os.path.realpath(sys.base_prefix)
    return [] if base.startswith(("/usr", "/bin", "/lib")) else [base]


def _owned_by(root: Path, uid: int) -> bool:
    """Every entry of ``root`` belongs to ``uid`` (so the overlay's writable copy behaves like the checkout)."""
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames, ""]:
            try:
                if os.lstat(os.path.join(dirpath, name)).st_uid != uid:
                    return False
            except FileNotFoundError:
                continue
    return True


class Sandbox:
    """Executions of one eval run: a scratch folder, staged checkouts, and the backend's settings."""

    def __init__(self, backend: str, scratch_root: Path | None = None, uid: int | None = None,
                 strict_limits: bool = False) -> None:
        self.backend = backend
        is_root = os.geteuid() == 0
        uid = (DEFAULT_UID if is_root else os.getuid()) if uid is None else uid
        self.who = Identity(uid, uid if is_root else os.getgid(), is_root)
        self.cgroups = cgroups.available() if is_root or os.environ.get("MLBENCH_CGROUPS") else None
        if strict_limits and self.cgroups is None and backend in ("bwrap", "local"):
            # before the scratch folder exists: a refusal leaves nothing behind
            raise MLBenchError("per-execution cgroups are unavailable here, so memory and process limits would "
                               "hold per process only", "--require-cgroups",
                               "run as root, or on a host with a delegated cgroup v2 subtree, or drop the flag")
        self._own_tmp = scratch_root is None
        self.root = Path(tempfile.mkdtemp(prefix="mlbench-sandbox-")) if scratch_root is None else Path(scratch_root)
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o711)  # the sandbox uid must traverse to the staged checkouts, never list them
        self._lower: dict[Path, Path] = {}
        self._lock = threading.Lock()
        self.staged_s = 0.0
        self._runner_python = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else os.path.realpath(
            sys.executable)
        self._seccomp: Path | None = None  # one policy (eval/sandbox/seccomp.py): JSON for containers, BPF for bwrap
        if backend in ("podman", "docker"):
            self._seccomp = self.root / "seccomp.json"
            self._seccomp.write_text(json.dumps(seccomp.podman_profile()))
        elif backend == "bwrap":
            self._seccomp = self.root / "seccomp.bpf"
            seccomp.write_bpf(self._seccomp)
        if self._seccomp is not None:
            self._seccomp.chmod(0o644)

    @property
    def limits_mode(self) -> str:
        """How memory/process limits hold: 'cgroup-v1'/'cgroup-v2' (whole tree), 'container' or 'rlimit'."""
        if self.backend in ("podman", "docker", "apptainer"):
            return "container"
        return f"cgroup-{self.cgroups[0]}" if self.cgroups else "rlimit (per process)"

    def close(self) -> None:
        """Remove the scratch folder (staged checkouts included)."""
        if self._own_tmp:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- workspaces --------------------------------------------------------------------------------------------

    def lower(self, env: Env) -> Path:
        """The overlay's lower layer for ``env``: the checkout itself when the sandbox uid owns it, else a
        copy made once per run (its files then belong to the sandbox uid, like a checkout of one's own)."""
        src = env.checkout.resolve()
        with self._lock:
            if src in self._lower:
                return self._lower[src]
            if _owned_by(src, self.who.uid):
                self._lower[src] = src
                return src
            t0 = time.monotonic()
            dst = self.root / "pristine" / f"{env.name}-{uuid.uuid4().hex[:6]}"
            dst.parent.mkdir(exist_ok=True)
            os.chmod(dst.parent, 0o711)
            shutil.copytree(src, dst, symlinks=True)
            if self.who.root:
                for dirpath, dirnames, filenames in os.walk(dst):
                    for name in [*dirnames, *filenames]:
                        os.lchown(os.path.join(dirpath, name), self.who.uid, self.who.gid)
                os.lchown(dst, self.who.uid, self.who.gid)
            self.staged_s += time.monotonic() - t0
            self._lower[src] = dst
            return dst

    # -- one execution -----------------------------------------------------------------------------------------

    def _env_vars(self, env: Env) -> dict[str, str]:
        if self.backend in ("bwrap", "local"):
            # resolved, as _ro_binds mounts it: a venv reached through a symlink is not under its link's path
            prefix = os.path.realpath(env.prefix or sys.base_prefix)
        else:  # images built by `mlbench env build --image` hold the environment in /opt/venv
            prefix = CONTAINER_PREFIX
        path = "/usr/local/bin:/usr/bin:/bin"
        out = {"HOME": f"{SANDBOX}/home", "USER": "sandbox", "LOGNAME": "sandbox", "LANG": "C.UTF-8",
               "TMPDIR": "/tmp", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1", "MPLBACKEND": "Agg"}
        if prefix:
            path = f"{prefix}/bin:{path}"
            if prefix == CONTAINER_PREFIX or (Path(prefix) / "pyvenv.cfg").exists():
                out["VIRTUAL_ENV"] = prefix
            elif (Path(prefix) / "conda-meta").is_dir():
                out["CONDA_PREFIX"] = prefix
        out["PATH"] = path
        out |= {k: v for k, v in env.vars if k not in ("PATH", "HOME")}
        return out

    def _job_env(self, job: Job, limits: Limits) -> dict[str, str]:
        """One execution's variables: its environment's, the thread counts, then the sample's own exports."""
        return self._env_vars(job.env) | thread_vars(limits) | {k: v for k, v in job.vars
                                                                if k not in ("PATH", "HOME")}

    def _ro_binds(self, env: Env) -> tuple[str, ...]:
        paths = set(env.ro_paths)
        if env.prefix:
            paths.add(os.path.realpath(env.prefix))
            real_py = Path(env.prefix, "bin", "python")
            if real_py.exists():  # a venv's interpreter lives in its base install
                paths.add(str(Path(os.path.realpath(real_py)).parent.parent))
        else:
            paths.update(_interpreter_dirs())
        paths.update(p for p in _interpreter_dirs() if not self._runner_python.startswith("/usr"))
        out = []
        for p in sorted(paths):
            rp = os.path.realpath(p)
            if os.path.isdir(rp) and not rp.startswith(("/usr/", "/etc/")) and rp != "/usr":
                out.append(rp)
        # a folder inside another bound folder is already visible
        return tuple(p for p in out if not any(p != q and p.startswith(q + "/") for q in out))

    def _write_job(self, job: Job, limits: Limits, jobdir: Path, copy: bool) -> None:
        jobdir.mkdir(mode=0o700)
        workdir = os.path.normpath(os.path.join(f"{SANDBOX}/work", job.workdir))
        if not workdir.startswith(f"{SANDBOX}/work"):
            workdir = f"{SANDBOX}/work/.."  # a path escaping the repository: the runner reports it missing
        env = self._job_env(job, limits)
        spec = {"argv": ["bash", f"{SANDBOX}/job/cmd.sh"] if job.as_shell else ["python", "temp.py"],
                "workdir": workdir, "env": env, "interpreter": "python",
                "temp_py": None if job.as_shell else f"{SANDBOX}/job/temp.py",
                "writable": [f"{SANDBOX}/work", f"{SANDBOX}/home", "/tmp", "/dev/shm"],
                "rlimits": {"RLIMIT_CPU": limits.cpu_s, "RLIMIT_FSIZE": limits.fsize_mb * 2**20,
                            "RLIMIT_CORE": 0, "RLIMIT_NOFILE": limits.nofile}}
        if self.cgroups is None and self.backend in ("bwrap", "local"):  # no cgroup: per-process fallbacks
            spec["rlimits"] |= {"RLIMIT_AS": limits.mem_mb * 2**20, "RLIMIT_NPROC": limits.pids}
        if copy:
            spec |= {"copy_from": f"{SANDBOX}/src", "copy_to": f"{SANDBOX}/work"}
        (jobdir / "spec.json").write_text(json.dumps(spec))
        (jobdir / "cmd.sh" if job.as_shell else jobdir / "temp.py").write_text(job.code + ("\n" if job.as_shell else ""))
        shutil.copyfile(RUNNER, jobdir / "runner.py")
        (jobdir / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\nsandbox:x:1000:1000:sandbox:/sandbox/home:"
                                       "/bin/bash\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n")
        (jobdir / "group").write_text("root:x:0:\nsandbox:x:1000:\nnogroup:x:65534:\n")
        (jobdir / "empty").write_text("")  # bwrap binds it over the /proc files runc masks
        for f in jobdir.iterdir():
            f.chmod(0o444)
        if copy:
            jobdir.chmod(0o755)

    def run(self, job: Job, limits: Limits, drain: bool = True) -> ExecResult:
        """Execute ``job``. ``drain=False`` reproduces the benchmark's checker: stdout goes to a pipe nobody
        reads while the command runs, so a command printing more than the pipe holds blocks (and, in compat
        mode, "passes" by still running at the limit)."""
        if self.backend == "local":
            return _run_local(job, limits, self.root, drain, self._job_env(job, limits))
        xid = uuid.uuid4().hex[:12]
        scratch, jobdir = self.root / xid, self.root / f"{xid}.job"
        staged = self.backend in ("bwrap",) or (self.backend == "podman" and self.who.root)
        lower = self.lower(job.env) if staged else None
        self._write_job(job, limits, jobdir, copy=not staged)
        scratch.mkdir(mode=0o700)
        cg = None
        if self.cgroups and self.backend in ("bwrap", "podman"):
            try:
                cg = cgroups.ExecCgroup.create(limits.mem_mb, limits.pids, limits.cpus)
            except OSError as exc:
                return ExecResult(None, False, 0.0, 0, "", fault=f"SANDBOX: cannot create a cgroup ({exc})")
        binds = self._ro_binds(job.env) if self.backend == "bwrap" else ()
        m = Mounts(scratch, jobdir, lower, limits.disk_mb, binds)
        name = f"mlbench-{xid}"
        report_r, report_w = os.pipe()
        nonce = secrets.token_hex(16)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", NONCE_ENV: nonce,
               f"APPTAINERENV_{NONCE_ENV}": nonce}
        if self.backend == "bwrap":
            engine = bwrap_argv(m, limits.tmp_mb, self._runner_python)
        elif self.backend in ("podman", "docker"):
            engine = container_argv(self.backend, _need_image(job.env, self.backend), name, m, limits.mem_mb,
                                    limits.pids, limits.cpus, limits.tmp_mb, self.who.uid,
                                    cg.parent_for_podman() if cg else None, self._seccomp,
                                    src=None if staged else str(job.env.checkout.resolve()))
        else:
            engine = apptainer_argv(_need_image(job.env, "apptainer"), jobdir, str(job.env.checkout.resolve()))
        if staged:
            script = jobdir / "stage.sh"
            # bwrap's whole tree joins the cgroup; podman's CLI stays out of it (the container goes in via
            # --cgroup-parent), so the engine's own memory is not charged to the generation
            procs = cg.procs_files if cg and self.backend == "bwrap" else []
            script.write_text(stage_script(m, self.who, procs, report_w, engine, drop=self.backend == "bwrap",
                                           seccomp_bpf=self._seccomp if self.backend == "bwrap" else None))
            argv = unshare_argv(self.who, script)
        else:
            argv = engine
        t0 = time.monotonic()
        try:
            proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT if drain else subprocess.PIPE, pass_fds=(report_w,),
                                    start_new_session=True)
        except OSError as exc:
            os.close(report_r)
            os.close(report_w)
            self._cleanup(scratch, jobdir, cg)
            return ExecResult(None, False, 0.0, 0, "", fault=f"SANDBOX: cannot start {argv[0]} ({exc})")
        os.close(report_w)
        out_cap, err_cap, timed_out, duration = _capture_and_wait(proc, limits, drain, t0)
        self._kill(proc, cg, name)
        log = out_cap.text() if out_cap else _read_undrained(proc) + err_cap.text()
        raw = _read_report(report_r)
        if not staged:  # engines without a pipe: the report is the stderr line carrying our nonce
            raw, log = _report_from_log(log, nonce)
        res = _result(raw, timed_out, duration, log, proc.returncode, limits)
        if cg is not None:
            hit = cg.hit()
            res.usage = cg.usage()
            if "memory" in hit:
                # an OOM is the generation's doing and a verdict, even when it took the runner or the report
                # with it (memory no process maps, tmpfs files or SysV shm, stays charged to the cgroup)
                res.limit, res.fault = "memory", None
            elif hit and res.limit is None and not res.fault:
                res.limit = hit[0]
        self._cleanup(scratch, jobdir, cg)
        return res

    def _kill(self, proc: subprocess.Popen, cg: cgroups.ExecCgroup | None, name: str) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # bwrap: its PID 1 dies with it, and the namespace with that
        except ProcessLookupError:
            pass
        if self.backend in ("podman", "docker") and (proc.poll() is None or cg is None):
            # passthrough: the container outlives its CLI; without our cgroup to kill, the engine must remove it
            subprocess.run([self.backend, "rm", "-f", "-t", "0", name], capture_output=True)
        proc.wait()
        if cg is not None:
            cg.kill_all()

    def _cleanup(self, scratch: Path, jobdir: Path, cg: cgroups.ExecCgroup | None) -> None:
        if cg is not None:
            cg.remove()
        shutil.rmtree(jobdir, ignore_errors=True)
        try:
            scratch.rmdir()  # the tmpfs lived in the stage's mount namespace: the host folder is empty
        except OSError:
            shutil.rmtree(scratch, ignore_errors=True)

    # -- preflight ---------------------------------------------------------------------------------------------

    def preflight(self, env: Env, workdirs: list[str]) -> dict[str, str]:
        """Probe ``env`` once inside the sandbox: its interpreter starts and the repository is at
        ``/sandbox/work`` with every sample folder the run needs. A failure is one clear error naming the
        environment; nothing is scored."""
        missing = sorted({w for w in workdirs if not (env.checkout / w).is_dir()})
        if missing:
            raise MLBenchError(f"environment {env.name!r}: {len(missing)} sample folder(s) missing from the checkout "
                               f"{env.checkout}: {missing[:5]}", env.where or str(env.checkout),
                               "check the checkout is at the benchmark's pinned commit (mlbench env build)")
        expect = len(os.listdir(env.checkout))
        code = ("python -c 'import os, sys; print(\"MLBENCH-PROBE\", sys.executable, sys.version.split()[0], "
                "len(os.listdir(\"/sandbox/work\")))'")
        res = self.run(Job(code, True, env, "."), Limits(wall_s=120, pids=64, disk_mb=64, tmp_mb=64))
        probe = next((ln.split() for ln in res.log.splitlines() if ln.startswith("MLBENCH-PROBE ")), None)
        problem = None
        if res.fault:
            problem = res.fault
        elif res.timed_out:
            problem = "the probe did not finish in 120 s"
        elif res.exit_code != 0 or probe is None or len(probe) != 4:
            problem = f"the interpreter did not start (exit {res.exit_code})"
        elif int(probe[3]) != expect:
            problem = (f"/sandbox/work has {probe[3]} entries, the checkout {expect}: a mount hides or lacks "
                       f"the repository")
        if problem:
            tail = "\n    ".join(res.log.strip().splitlines()[-8:])
            raise MLBenchError(f"environment {env.name!r} failed its probe in the {self.backend} sandbox: {problem}"
                               + (f"\n  log:\n    {tail}" if tail else ""), env.where or str(env.checkout),
                               "build or fix the environment (mlbench env check), then re-run; no verdict was "
                               "written")
        return {"python": probe[1], "version": probe[2]}

    def warm(self, env: Env) -> list[Warmed]:
        """Import the environment's heavy libraries once inside the sandbox, before any verdict, timing each.
        From a cold page cache the first answer of an environment loads its libraries from disk (a PyTorch-GAN
        answer took 7 s instead of 4), and at the benchmark's 10 s limit, where compat counts "still running" as
        a pass, that can turn a failing answer into a pass. Not fatal: a module that fails here is reported, and
        the answers that need it fail on their own."""
        modules = WARM_MODULES if env.warm is None else env.warm
        if not modules:
            return []
        code = "python -c " + shlex.quote(warm_code(modules))
        res = self.run(Job(code, True, env, "."), Limits(wall_s=300, pids=256, disk_mb=64, tmp_mb=256, threads=1))
        line = next((ln[len("MLBENCH-WARM "):] for ln in res.log.splitlines() if ln.startswith("MLBENCH-WARM ")),
                    None)
        if res.fault or res.timed_out or line is None:
            why = res.fault or ("did not finish in 300 s" if res.timed_out else f"exit {res.exit_code}")
            return [Warmed("warm-up", error=why)]
        try:
            return [Warmed(str(m), None if t is None else float(t), bool(c), None if e is None else str(e))
                    for m, t, c, e in json.loads(line)]
        except (ValueError, TypeError):  # the environment's python printed something else on that line
            return [Warmed("warm-up", error=f"unreadable report {line[:80]!r}")]


def warm_code(modules: tuple[str, ...]) -> str:
    """Python source that imports each installed module of ``modules`` and prints ``MLBENCH-WARM`` and a JSON list
    of ``[module, seconds, compiled, error]``."""
    return _WARM_CODE % (tuple(modules),)


def warm_summary(warm: list[Warmed]) -> str:
    """One line for what :meth:`Sandbox.warm` found: the imports and their seconds, failures named first."""
    bad = [f"{w.module} FAILED ({w.error})" for w in warm if w.error]
    ok = [f"{w.module} {w.seconds:.2f} s" + ("" if w.compiled else " (not compiled)") for w in warm if not w.error]
    return "warm-up: " + (", ".join(bad + ok) or "nothing to import")


def _need_image(env: Env, backend: str) -> str:
    if not env.image:
        raise MLBenchError(f"backend {backend} needs an image for repository {env.name!r}", env.where or "envs config",
                           "set `image:` for the repository, or build one: mlbench env build --image")
    return env.image


def _read_report(fd: int) -> bytes:
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


def _report_from_log(log: str, nonce: str) -> tuple[bytes, str]:
    marker = f"MLBENCH-REPORT {nonce} "
    i = log.rfind(marker)
    if i < 0:
        return b"", log
    line = log[i + len(marker):].split("\n", 1)[0]
    return line.encode(), log[:i].rstrip("\n")


def _limit_hit(rep: dict, code: object, sig: object, limits: Limits) -> str | None:
    """The per-process limit an execution ran into, from what the runner saw: the signal its child died of (or
    a shell's exit status for it) backed by evidence of the limit (a file at the size limit; CPU seconds at the
    CPU limit, from the rusage of everything the child waited for). A status or a signal alone proves nothing:
    any program may ``exit 153`` or send itself SIGXFSZ."""
    if (sig == signal.SIGXFSZ or code == 128 + signal.SIGXFSZ) and rep.get("at_fsize") is True:
        return "fsize"
    cpu = rep.get("cpu_s")
    # rusage is sampled: it may read a little under the limit the kernel enforced on exact run time
    used_up = isinstance(cpu, (int, float)) and cpu >= 0.9 * limits.cpu_s
    if used_up and (sig in (signal.SIGXCPU, signal.SIGKILL) or code in (128 + signal.SIGXCPU, 128 + signal.SIGKILL)):
        return "cpu"
    if rep.get("full"):
        return "disk"
    return None


def _result(raw: bytes, timed_out: bool, duration: float, log: str, returncode: int | None,
            limits: Limits) -> ExecResult:
    """Turn the runner's report into a result; anything unexpected is a sandbox fault, never a verdict."""
    base = dict(timed_out=timed_out, duration=round(duration, 3), log=log)
    if timed_out:
        return ExecResult(None, survivors=0, **base)
    try:
        rep = json.loads(raw.decode("utf-8")) if raw and len(raw) <= REPORT_CAP else None
    except (UnicodeDecodeError, json.JSONDecodeError):
        rep = None
    if not isinstance(rep, dict) or rep.get("v") != 1:
        why = "no report from the runner" if not raw else "an unreadable report from the runner"
        return ExecResult(None, survivors=0, fault=f"SANDBOX: {why} (engine exit {returncode})", **base)
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
    exit_code = code if isinstance(code, int) else 128 + sig
    return ExecResult(exit_code, survivors=surv, signal=sig if isinstance(sig, int) else None, limit=limit, **base)


def _read_undrained(proc: subprocess.Popen) -> str:
    os.set_blocking(proc.stdout.fileno(), False)
    try:
        data = proc.stdout.read(PIPE_BUF) or b""
    except (BlockingIOError, ValueError):
        data = b""
    return data.decode("utf-8", errors="replace")


def _capture_and_wait(proc: subprocess.Popen, limits: Limits, drain: bool, t0: float) \
        -> tuple[_Capture | None, _Capture | None, bool, float]:
    """Capture stdout+stderr (``drain``) or only stderr (the benchmark's undrained stdout), wait up to the wall
    limit; ``(stdout capture, stderr capture, timed out, seconds since t0)``."""
    out_cap = _Capture(proc.stdout, limits.log_bytes) if drain else None
    err_cap = None if drain else _Capture(proc.stderr, limits.log_bytes)
    try:
        proc.wait(timeout=limits.wall_s)
        timed_out = False
    except subprocess.TimeoutExpired:
        timed_out = True
    return out_cap, err_cap, timed_out, time.monotonic() - t0


def _run_local(job: Job, limits: Limits, root: Path, drain: bool, env: dict[str, str]) -> ExecResult:
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
    out_cap, err_cap, timed_out, duration = _capture_and_wait(proc, limits, drain, t0)
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
    log = out_cap.text() if out_cap else _read_undrained(proc) + err_cap.text()
    shutil.rmtree(scratch, ignore_errors=True)
    code = None if timed_out else proc.returncode
    return ExecResult(code, timed_out, round(duration, 3), 0 if timed_out else survivors, log)
