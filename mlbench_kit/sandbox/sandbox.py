"""Run untrusted generations in isolation and return verdicts the generation cannot forge.

One :class:`Sandbox` per eval run. Each execution:

1. gets its own cgroup (memory, processes, CPU for the whole tree; :mod:`.cgroups`) where this host allows;
2. runs a stage script in a private mount namespace that mounts a size-capped tmpfs, an overlay of the
   pristine checkout on it (copy-on-write: ~ms whatever the repository's size) and read-only binds of the
   environment, then drops to an unprivileged uid (:mod:`.cmdline`);
3. starts the engine (bwrap or a container; :mod:`.engines`, one class per backend) whose PID 1 is the trusted
   runner (``runner.py``);
4. takes exit status and survivors from the runner's report alone (its pipe; for engines that cannot pass one,
   the stderr line carrying this run's nonce), the limit that was hit from the cgroup (or the container's own
   OOM record, docker), and never reads a file the generation could have written.

Environment and sandbox faults (an interpreter missing, a mount that failed, a missing report) are returned
as ``fault``: they are never verdicts about the model.
"""

from __future__ import annotations

import contextlib
import hashlib
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
from pathlib import Path

import mlbench_kit.tree as tree
from mlbench_kit.errors import MLBenchError

from . import cgroups
from .capture import capture_and_wait, captured
from .cmdline import LAYER, NONCE_ENV, SANDBOX, Identity, Mounts, idmap_probe_script, unshare_argv
from .engines import Launch, engine
from .local import run_local
from .spec import Env, ExecResult, Job, LayerCaps, LayerOut, Limits, RunnerSpec, Warmed, thread_vars
from .verdict import cpu_limit_hit, read_report, report_from_log, report_from_stream, result_from_report

RUNNER = Path(__file__).with_name("runner.py")
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
# uids of single executions (docker): above every range useradd, systemd and subuid allocations hand out
EXEC_UIDS = (1 << 30, (1 << 31) - 2)
# per-user kernel quotas that a user namespace of one's own can lower (kernel/ucount.c), each with the same limit
# of the initial user namespace, readable from any namespace: a child namespace's own start at INT_MAX, so inside
# a container's user namespace /proc/sys/user alone says nothing of the limit that holds
HOST_QUOTAS = {"max_inotify_instances": "fs/inotify/max_user_instances",
               "max_inotify_watches": "fs/inotify/max_user_watches",
               "max_fanotify_groups": "fs/fanotify/max_user_groups", "max_fanotify_marks": "fs/fanotify/max_user_marks"}
LAYER_MEMBERS = 100_000  # entries of a layer an engine sends back (docker), as many as untar's default


def _interpreter_dirs() -> list[str]:
    """The folder of the default environment: the base install of the interpreter running mlbench. Never
    mlbench's own venv (its packages, its ``setup.log``): an environment that wants it names it as ``venv:``."""
    base = os.path.realpath(sys.base_prefix)
    return [] if base.startswith(("/usr", "/bin", "/lib")) else [base]


# Names an answer calls the environment's interpreter by. The benchmark's answers say ``python`` (126 of 260 rows),
# ``python3`` (34) and ``pip`` (51); Debian's /usr/bin has python3 alone, and a conda or pyenv prefix may lack pip.
SHIMS = {"python": "", "python3": "", "pip": " -m pip", "pip3": " -m pip"}


def _interpreter_in(bindir: Path) -> Path | None:
    """The environment's own interpreter in ``bindir``: ``python3``, ``python`` or the running version's name."""
    for name in ("python3", "python", f"python{sys.version_info[0]}.{sys.version_info[1]}"):
        if (bindir / name).is_file() and os.access(bindir / name, os.X_OK):
            return bindir / name
    return None


def write_shims(folder: Path, prefix: str) -> bool:
    """Fill ``folder`` with the :data:`SHIMS` that ``prefix/bin`` lacks, each running the environment's own
    interpreter (``exec``: ``sys.executable`` stays the real one, so a venv is still found). False when none is
    needed or the prefix has no interpreter at all (the probe then reports it)."""
    bindir = Path(prefix, "bin")
    real = _interpreter_in(bindir)
    missing = [n for n in SHIMS if not (bindir / n).exists()]
    if real is None or not missing:
        return False
    folder.mkdir(parents=True, exist_ok=True)
    for name in missing:
        (folder / name).write_text(f'#!/bin/sh\nexec {shlex.quote(str(real))}{SHIMS[name]} "$@"\n')
        (folder / name).chmod(0o755)
    folder.chmod(0o755)
    return True


def user_quota_shares(concurrent: int, sys_folder: Path = Path("/proc/sys")) -> tuple[tuple[str, int], ...]:
    """Without root, one execution's share of the caller's per-user kernel quotas (see :func:`.cmdline.stage_script`):
    each limit of :data:`HOST_QUOTAS` (the lower of the caller's namespace's and the host's)
    divided by ``concurrent`` executions plus one share kept for the caller's own processes, so that
    ``concurrent`` executions holding all they may still leave their neighbours theirs."""
    out = []
    for key, host in HOST_QUOTAS.items():
        limits = []
        for path in (f"user/{key}", host):
            try:
                limits.append(int((sys_folder / path).read_text()))
            except (OSError, ValueError):
                continue
        if limits:
            out.append((key, max(1, min(limits) // (max(1, concurrent) + 1))))
    return tuple(out)


def _not_kept(res: ExecResult, why: str) -> None:
    """Say in an execution's log (the agent's observation) that its files were not kept, and why."""
    res.log += f"\n[mlbench: this execution's files were not kept ({why}); the files from before it are unchanged]"


def _owned_by(root: Path, uid: int, gid: int) -> bool:
    """Every entry of ``root`` belongs to ``uid`` and group ``gid`` (any depth; a folder that cannot be read counts
    as not), so the overlay's writable copy behaves like the checkout."""
    try:
        for dirpath, dirnames, filenames in tree.walk(root, onerror=_unreadable):
            for name in [*dirnames, *filenames, ""]:
                try:
                    st = os.lstat(os.path.join(dirpath, name))
                except FileNotFoundError:
                    continue
                if st.st_uid != uid or st.st_gid != gid:
                    return False
    except OSError:
        return False
    return True


def _unreadable(exc: OSError) -> None:
    raise exc


class Sandbox:
    """Executions of one eval run: a scratch folder, staged checkouts, and the backend's settings."""

    def __init__(self, backend: str, scratch_root: Path | None = None, uid: int | None = None,
                 strict_limits: bool = False, concurrent: int = 1, layer_caps: LayerCaps | None = None) -> None:
        self.backend = backend
        self.layer_caps = layer_caps or LayerCaps()
        self._layers: dict[Path, tuple[int, int]] = {}  # each live layer's (bytes, entries) on the host
        self.engine = engine(backend)
        is_root = os.geteuid() == 0
        self._draw_uids = uid is None  # a uid the user named runs every execution
        uid = (DEFAULT_UID if is_root else os.getuid()) if uid is None else uid
        self.who = Identity(uid, uid if is_root else os.getgid(), is_root)
        self.user_quotas = () if is_root else user_quota_shares(concurrent)
        self.cgroups = cgroups.available() if is_root or os.environ.get("MLBENCH_CGROUPS") else None
        if strict_limits and self.cgroups is None and not self.engine.container:
            # before the scratch folder exists: a refusal leaves nothing behind
            raise MLBenchError("per-execution cgroups are unavailable here, so memory and process limits would "
                               "hold per process only", "--require-cgroups",
                               "run as root, or on a host with a delegated cgroup v2 subtree, or drop the flag")
        self._own_tmp = scratch_root is None
        self.root = Path(tempfile.mkdtemp(prefix="mlbench-sandbox-")) if scratch_root is None else Path(scratch_root)
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o711)  # the sandbox uid must traverse to the staged checkouts, never list them
        self._lower: dict[Path, Path] = {}
        self._idmaps: dict[Path, bool] = {}
        self._shims: dict[str, str | None] = {}
        self._lock = threading.Lock()
        self.staged_s = 0.0
        self._runner_python = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else os.path.realpath(
            sys.executable)
        # one policy (mlbench_kit/sandbox/seccomp.py): JSON for containers, BPF for bwrap
        self._seccomp = self.engine.seccomp(self.root)
        if self._seccomp is not None:
            self._seccomp.chmod(0o644)

    @property
    def limits_mode(self) -> str:
        """How memory/process limits hold: 'cgroup-v1'/'cgroup-v2' (whole tree), 'container' or 'rlimit'."""
        if self.engine.container:
            return "container"
        return f"cgroup-{self.cgroups[0]}" if self.cgroups else "rlimit (per process)"

    @property
    def layers_ok(self) -> bool:
        """Whether executions can keep files between them (:attr:`Job.layer`): engines the stage script starts, and
        docker (its runner applies the layer and sends the changes back)."""
        return self.engine.isolated and (self.engine.staged(self.who) or self.engine.copy_layer)

    def new_layer(self) -> Path:
        """An empty persistent layer (see :attr:`Job.layer`) in the scratch folder; remove it with
        :meth:`drop_layer` when its executions are over."""
        d = self.root / "layers" / uuid.uuid4().hex[:12]
        d.parent.mkdir(mode=0o700, exist_ok=True)
        d.mkdir(mode=0o700)
        with self._lock:
            self._layers[d] = (0, 0)
        return d

    def drop_layer(self, layer: Path) -> str | None:
        """Remove a layer of :meth:`new_layer` (files the untrusted code wrote: removed without following links, at
        any depth). Never raises: returns what could not be removed, for the caller to record, or None."""
        try:
            tree.remove(layer)
        except OSError as exc:  # what is left still counts against the run's bounds
            return f"SANDBOX: the layer {layer} was not removed ({exc})"
        with self._lock:
            self._layers.pop(layer, None)
        return None

    def close(self) -> None:
        """Remove the scratch folder (staged checkouts included)."""
        if self._own_tmp:
            with contextlib.suppress(OSError):
                tree.remove(self.root)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- workspaces --------------------------------------------------------------------------------------------

    def lower(self, env: Env) -> Path:
        """The overlay's lower layer for ``env``: the checkout itself when its owner on the host (the sandbox uid as
        root, the caller without root) owns every file, else a copy made once per run and given to that owner."""
        src = env.checkout.resolve()
        with self._lock:
            if src in self._lower:
                return self._lower[src]
            # the group too: an idmapped lower layer (root) maps the run's uid and gid alone, and without root the
            # user namespace maps the caller's alone, so a file of another owner or group (a setgid project folder's)
            # shows unmapped, and the overlay cannot copy it up for a write (EOVERFLOW) or the execution write it
            # without root the files stay the caller's on the host (a named uid is the uid inside the namespace)
            owner = (self.who.uid, self.who.gid) if self.who.root else (os.getuid(), os.getgid())
            if _owned_by(src, *owner):
                self._lower[src] = src
                return src
            t0 = time.monotonic()
            dst = self.root / "pristine" / f"{env.name}-{uuid.uuid4().hex[:6]}"
            dst.parent.mkdir(exist_ok=True)
            os.chmod(dst.parent, 0o711)
            try:
                tree.copy(src, dst)
                # chowned even without root (to the caller's own group): a setgid scratch folder gives its group
                for dirpath, dirnames, filenames in tree.walk(dst, onerror=_unreadable):
                    for name in [*dirnames, *filenames]:
                        os.lchown(os.path.join(dirpath, name), *owner)
                os.lchown(dst, *owner)
            except OSError as exc:
                try:
                    tree.remove(dst)
                except OSError:
                    pass
                raise MLBenchError(f"cannot stage the checkout of {env.name!r} as a copy of your own ({exc})",
                                   env.where or str(src), "make every file of the checkout readable to you") from None
            self.staged_s += time.monotonic() - t0
            self._lower[src] = dst
            return dst

    # -- one execution -----------------------------------------------------------------------------------------

    def shim_dir(self, env: Env) -> str | None:
        """The host folder of ``env``'s shims (see :data:`SHIMS`), made once per run; None when it needs none
        (container images hold a venv at /opt/venv). Each execution gets a copy in its job folder
        (``/sandbox/job/bin``: no host path shows inside), right after the environment's ``bin/`` on the PATH, so
        ``python`` is the environment's interpreter in every engine, never another one that /usr/local/bin or
        /usr/bin happens to hold."""
        if self.engine.container:
            return None
        prefix = os.path.realpath(env.prefix or sys.base_prefix)
        with self._lock:
            if prefix not in self._shims:
                folder = self.root / "shims" / hashlib.sha256(prefix.encode()).hexdigest()[:12]
                self._shims[prefix] = str(folder) if write_shims(folder, prefix) else None
                if self._shims[prefix]:
                    os.chmod(folder.parent, 0o755)
            return self._shims[prefix]

    def _env_vars(self, env: Env) -> dict[str, str]:
        shims = None
        if not self.engine.container:
            # resolved, as _ro_binds mounts it: a venv reached through a symlink is not under its link's path
            prefix = os.path.realpath(env.prefix or sys.base_prefix)
            shims = self.shim_dir(env)
            if shims and self.engine.isolated:
                shims = f"{SANDBOX}/job/bin"
        else:  # images built by `mlbench env build --image` hold the environment in /opt/venv
            prefix = CONTAINER_PREFIX
        path = "/usr/local/bin:/usr/bin:/bin" if shims is None else f"{shims}:/usr/local/bin:/usr/bin:/bin"
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
            real_py = _interpreter_in(Path(env.prefix, "bin"))
            if real_py is not None:  # a venv's interpreter lives in its base install
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

    def runner_spec(self, job: Job, limits: Limits, staged: bool, drain: bool = True) -> RunnerSpec:
        """What the runner is told about one execution of ``job`` (see :class:`~.spec.RunnerSpec`): from the job,
        its limits and what the engine declares. ``staged``: the engine started by the stage script (else the
        runner copies the checkout); ``drain``: as :meth:`run`'s."""
        eng = self.engine
        workdir = os.path.normpath(os.path.join(f"{SANDBOX}/work", job.workdir))
        if not workdir.startswith(f"{SANDBOX}/work"):
            workdir = f"{SANDBOX}/work/.."  # a path escaping the repository: the runner reports it missing
        rlimits = {"RLIMIT_CPU": limits.cpu_s, "RLIMIT_FSIZE": limits.fsize_mb * 2**20, "RLIMIT_CORE": 0,
                   "RLIMIT_NOFILE": limits.nofile}
        if self.cgroups is None and not eng.container:  # no cgroup: per-process fallbacks
            rlimits |= {"RLIMIT_AS": limits.mem_mb * 2**20, "RLIMIT_NPROC": limits.pids}
        copy = not staged
        layer_in, layer_out = None, None
        if copy and job.layer is not None and eng.copy_layer:
            layer_in = LAYER if (job.layer / "upper").is_dir() else None
            n = min(LAYER_MEMBERS, self.layer_caps.entries)
            layer_out = LayerOut(max_bytes=limits.disk_mb * 2**20 + n * 2048, max_members=n)
        return RunnerSpec(
            argv=("bash", f"{SANDBOX}/job/cmd.sh") if job.as_shell else ("python", "temp.py"), workdir=workdir,
            env=self._job_env(job, limits), rlimits=rlimits,
            writable=(f"{SANDBOX}/work", f"{SANDBOX}/home", "/tmp", "/dev/shm"),
            temp_py=None if job.as_shell else f"{SANDBOX}/job/temp.py", cpu_limit_s=limits.cpu_limit_s,
            copy_from=f"{SANDBOX}/src" if copy else None, copy_to=f"{SANDBOX}/work" if copy else None,
            layer_in=layer_in, layer_out=layer_out,
            # relaying engines (docker): the container's stderr is the report's alone, the runner drains the
            # answer's output (relaying its head and tail) and holds the benchmark's undrained stdout itself
            undrained_stdout=not drain and eng.relays, report_alone=eng.relays, log_bytes=limits.log_bytes,
            cgroup_evidence=eng.cgroup_evidence)

    def _write_job(self, job: Job, spec: RunnerSpec, jobdir: Path) -> None:
        """The execution's read-only job folder: the runner and its spec, the code, passwd and group, the shims."""
        jobdir.mkdir(mode=0o700)
        (jobdir / "spec.json").write_text(spec.to_json())
        if job.as_shell:
            (jobdir / "cmd.sh").write_text(job.code + "\n")
        else:
            (jobdir / "temp.py").write_text(job.code)
        shutil.copyfile(RUNNER, jobdir / "runner.py")
        (jobdir / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\nsandbox:x:1000:1000:sandbox:/sandbox/home:"
                                       "/bin/bash\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n")
        (jobdir / "group").write_text("root:x:0:\nsandbox:x:1000:\nnogroup:x:65534:\n")
        (jobdir / "empty").write_text("")  # bwrap binds it over the /proc files runc masks
        for f in jobdir.iterdir():
            f.chmod(0o444)
        shims = self.shim_dir(job.env)
        if shims:
            shutil.copytree(shims, jobdir / "bin")  # its modes: 0755 folder, 0755 scripts
        if spec.copy_from is not None:
            jobdir.chmod(0o755)

    def run(self, job: Job, limits: Limits, drain: bool = True) -> ExecResult:
        """Execute ``job``. ``drain=False`` reproduces the benchmark's checker: stdout goes to a pipe nobody
        reads while the command runs, so a command printing more than the pipe holds blocks (and, in compat
        mode, "passes" by still running at the limit)."""
        eng = self.engine
        if job.layer is not None and not self.layers_ok:
            raise MLBenchError(f"the {self.backend} backend cannot keep files between executions here (a persistent "
                               "layer needs an engine started by the stage script, or docker)", "--backend",
                               "use bwrap, docker, or podman as root")
        if not eng.isolated:
            return run_local(job, limits, self.root, drain, self._job_env(job, limits))
        xid = uuid.uuid4().hex[:12]
        scratch, jobdir = self.root / xid, self.root / f"{xid}.job"
        staged = eng.staged(self.who)
        lower = self.lower(job.env) if staged else None
        spec = self.runner_spec(job, limits, staged, drain)
        inside = spec.undrained_stdout  # the undrained stdout reproduced by the runner (docker)
        self._write_job(job, spec, jobdir)
        scratch.mkdir(mode=0o700)
        cg = None
        if self.cgroups and eng.cgroup:
            try:
                cg = cgroups.ExecCgroup.create(limits.mem_mb, limits.pids, limits.cpus)
            except OSError as exc:
                return ExecResult(None, False, 0.0, 0, "", fault=f"SANDBOX: cannot create a cgroup ({exc})")
        binds = self._ro_binds(job.env) if eng.binds_env else ()
        who = self._exec_who(lower)
        m = Mounts(scratch, jobdir, lower, limits.disk_mb, binds, job.layer,
                   (self.who.uid, self.who.gid) if lower is not None and who != self.who else None, self.user_quotas,
                   # the workspace's own folders and the job's files beside the layer's entries
                   self.layer_caps.entries + 256 if job.layer is not None else None)
        name = f"mlbench-{xid}"
        report_r, report_w = os.pipe()
        nonce = secrets.token_hex(16)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", NONCE_ENV: nonce,
               f"APPTAINERENV_{NONCE_ENV}": nonce}
        try:
            argv = eng.command(Launch(job, limits, m, name, who, cg, self._seccomp,
                                      self._runner_python, report_w, staged))
        except BaseException:  # refused (no `image:`): nothing of this execution may outlive it, its cgroup included
            os.close(report_r)
            os.close(report_w)
            self._cleanup(scratch, jobdir, cg)
            raise
        t0 = time.monotonic()
        # docker: its stderr is the runner's alone (a report, and a layer's files, that no output can block or push
        # out of a capped log), into a file of its own
        stream = scratch / "report" if eng.relays else None
        try:
            with open(stream, "wb") if stream else open(os.devnull, "wb") as sink:
                proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=sink if stream else subprocess.STDOUT if drain or inside
                                        else subprocess.PIPE, pass_fds=(report_w,), start_new_session=True)
        except OSError as exc:
            os.close(report_r)
            os.close(report_w)
            self._cleanup(scratch, jobdir, cg)
            return ExecResult(None, False, 0.0, 0, "", fault=f"SANDBOX: cannot start {argv[0]} ({exc})")
        os.close(report_w)
        try:
            out_cap, err_cap, timed_out, duration = capture_and_wait(proc, limits, drain or inside, t0)
        except BaseException:  # Ctrl-C or SIGTERM mid-execution: its container, processes and cgroup go with it
            self._kill(proc, cg, name)
            os.close(report_r)
            self._cleanup(scratch, jobdir, cg)
            raise
        engine_oom = self._kill(proc, cg, name)
        log = captured(proc, out_cap, err_cap)
        raw = read_report(report_r)
        span = None
        if stream is not None:  # the report (and a layer) in the stream of their own; the engine's words to the log
            raw, said, span = report_from_stream(stream, nonce)
            log = f"{log}\n{said}" if said else log
        elif not staged:  # engines without a pipe: the report is the stderr line carrying our nonce
            raw, log = report_from_log(log, nonce)
        res = result_from_report(raw, timed_out, duration, log, proc.returncode, limits)
        if job.layer is not None and eng.copy_layer and not timed_out:
            self._keep_layer(job.layer, stream, span, limits, res, raw)
        elif job.layer is not None and staged:
            self._swap_layer(job.layer, timed_out, res)
        if engine_oom:  # the container's own record (docker): a verdict, even without a report or past the limit
            res.limit, res.fault = "memory", None
        if cg is not None:
            hit = cg.hit()
            res.usage = cg.usage()
            if "memory" in hit:
                # an OOM is the generation's doing and a verdict, even when it took the runner or the report
                # with it (memory no process maps, tmpfs files or SysV shm, stays charged to the cgroup)
                res.limit, res.fault = "memory", None
            elif hit and res.limit is None and not res.fault:
                res.limit = hit[0]
            elif res.limit is None and not res.fault and cpu_limit_hit(res.exit_code, res.signal,
                                                                       res.usage.get("cpu_s"), limits):
                res.limit = "cpu"  # the runner's sampled rusage read under the limit; the cgroup's count did not
        self._cleanup(scratch, jobdir, cg)
        return res

    def _exec_who(self, lower: Path | None) -> Identity:
        """Who runs one execution: a uid of its own drawn from :data:`EXEC_UIDS`, so that per-user kernel quotas
        (inotify instances and watches, the user's key quota, POSIX message queue bytes, ``RLIMIT_NPROC``) are not
        shared with the executions running beside it, where the engine allows: docker always; bwrap and podman
        staged as root where ``lower`` can be bound idmapped (:meth:`idmaps`; the group stays the run's). Else,
        and for a uid the user named (``sandbox_uid``), the run's sandbox uid."""
        if not self._draws_uids(lower):
            return self.who
        uid = EXEC_UIDS[0] + secrets.randbelow(EXEC_UIDS[1] - EXEC_UIDS[0])
        return Identity(uid, uid if self.engine.uid_per_execution == "always" else self.who.gid, self.who.root)

    def _draws_uids(self, lower: Path | None) -> bool:
        """Whether executions over ``lower`` (None: not staged) each get a uid of their own (see :meth:`_exec_who`)."""
        how = self.engine.uid_per_execution
        return self._draw_uids and (how == "always" or (how == "idmap" and lower is not None and self.idmaps(lower)))

    def uids(self, env: Env) -> str:
        """Who runs ``env``'s executions, in words for the run's first lines (see :meth:`_exec_who`)."""
        if not self.engine.isolated:
            return "your own uid, unisolated"
        if not self.who.root:
            return "your uid, per-user quotas shared by namespace" if self.user_quotas else "your uid"
        staged = self.engine.staged(self.who)
        if self._draws_uids(self.lower(env) if staged else None):
            return "a uid per execution"
        how = self.engine.uid_per_execution
        why = "named" if not self._draw_uids else "no idmapped mounts here" if how == "idmap" and staged else \
            f"one for {self.backend}"
        return f"uid {self.who.uid} for every execution ({why})"

    def idmaps(self, lower: Path) -> bool:
        """Whether an overlay of ``lower`` can be bound idmapped here (as root; Linux >= 5.19 and a filesystem that
        allows idmapped mounts, such as ext4, xfs, btrfs or tmpfs, not NFS), tried once per lower layer."""
        if not self.who.root:
            return False
        with self._lock:
            if lower not in self._idmaps:
                probe = self.root / f"idmap-probe-{uuid.uuid4().hex[:6]}"
                probe.mkdir(mode=0o700)
                script = probe.with_suffix(".sh")
                script.write_text(idmap_probe_script(lower, probe, self.who, Identity(EXEC_UIDS[0], self.who.gid,
                                                                                       True)))
                try:
                    r = subprocess.run(unshare_argv(self.who, script), capture_output=True, timeout=60)
                    self._idmaps[lower] = r.returncode == 0
                except (OSError, subprocess.TimeoutExpired):
                    self._idmaps[lower] = False
                finally:
                    script.unlink(missing_ok=True)
                    shutil.rmtree(probe, ignore_errors=True)
            return self._idmaps[lower]

    def _keep_layer(self, layer: Path, stream: Path | None, span: tuple[int, int] | None, limits: Limits,
                    res: ExecResult, raw: bytes = b"") -> None:
        """Docker's layer (see :func:`runner._send_layer`): the tar of the execution's changes, checked member by
        member (:func:`mlbench_kit.untar.safe_extract`, links kept as they are and never followed), replaces the
        earlier layer whole, or not at all (then the log says so)."""
        from mlbench_kit.untar import Limits as TarLimits
        from mlbench_kit.untar import safe_extract
        if span is None or stream is None:
            if res.fault is None:
                try:  # the runner's reason, in its own words (bounded, escaped by the observation)
                    why = str(json.loads(raw).get("layer_error") or "no layer came back")[:300]
                except (ValueError, AttributeError):
                    why = "no layer came back"
                _not_kept(res, why)
            return
        new, tar = layer / "new", layer / "new.tar"
        try:
            tree.remove(new)
            with stream.open("rb") as src, tar.open("wb") as dst:
                src.seek(span[0])
                left = span[1]
                while left > 0:
                    chunk = src.read(min(left, 1 << 20))
                    if not chunk:
                        raise OSError("the layer's tar is cut short")
                    dst.write(chunk)
                    left -= len(chunk)
            safe_extract(tar, new, TarLimits(max_bytes=limits.disk_mb * 2**20,
                                             max_members=min(LAYER_MEMBERS, self.layer_caps.entries) + 2),
                         any_link=True)
            # the next execution's runner reads it, whatever its uid and the umask (files are 0644 or 0755 already;
            # the layers' own folder, 0700, keeps everyone else out)
            for dirpath, dirnames, _ in tree.walk(new):
                for name in dirnames:
                    if not os.path.islink(os.path.join(dirpath, name)):
                        os.chmod(os.path.join(dirpath, name), 0o755)
            os.chmod(new / "upper", 0o755)
            os.chmod(layer, 0o755)
            # ("deleted" names checkout paths only: as bounded as the checkout)
            if not self._take_layer(layer, new / "upper", res):
                return
            tree.remove(layer / "upper")
            (layer / "deleted").unlink(missing_ok=True)
            os.rename(new / "upper", layer / "upper")
            os.rename(new / "deleted", layer / "deleted")
        except (OSError, MLBenchError) as exc:
            _not_kept(res, str(exc))
        finally:
            with contextlib.suppress(OSError):
                tar.unlink(missing_ok=True)
                tree.remove(new)

    def _swap_layer(self, layer: Path, timed_out: bool, res: ExecResult) -> None:
        """The stage script's copy of an execution's upper layer (``layer/new``) replaces the earlier one when it
        fits the bounds (:meth:`_take_layer`); an execution stopped at its limit, or refused, leaves it as it was."""
        new = layer / "new"
        try:
            if not timed_out and new.is_dir() and not new.is_symlink() and self._take_layer(layer, new, res):
                tree.remove(layer / "upper")
                os.rename(new, layer / "upper")
        except OSError as exc:
            _not_kept(res, str(exc))
        finally:
            with contextlib.suppress(OSError):
                tree.remove(new)

    def _take_layer(self, layer: Path, new: Path, res: ExecResult) -> bool:
        """Whether ``new``, an execution's changes about to replace ``layer``'s, fits :attr:`layer_caps`: its own
        entries, and every live layer of the run together (bytes and entries on the host). When it does, it is
        counted as ``layer``'s; when not, the execution's log says why (the caller keeps the earlier layer)."""
        caps = self.layer_caps
        try:
            size, entries = tree.weigh(new, caps.entries)
        except OSError as exc:
            _not_kept(res, f"its files could not be counted: {exc}")
            return False
        with self._lock:
            others = [use for d, use in self._layers.items() if d != layer]
            held, held_n = sum(b for b, _ in others), sum(n for _, n in others)
            if entries > caps.entries:
                why = f"the layer has more than {caps.entries} entries"
            elif held + size > caps.total_mb * 2**20:
                why = (f"the run's live layers would hold more than {caps.total_mb} MB: {size / 2**20:.1f} MB here, "
                       f"{held / 2**20:.1f} MB in {len(others)} other episode(s)")
            elif held_n + entries > caps.total_entries:
                why = (f"the run's live layers would hold more than {caps.total_entries} entries: {entries} here, "
                       f"{held_n} in {len(others)} other episode(s)")
            else:
                self._layers[layer] = (size, entries)
                return True
        _not_kept(res, why)
        return False

    def _kill(self, proc: subprocess.Popen, cg: cgroups.ExecCgroup | None, name: str) -> bool:
        """Kill what is left of an execution; True when its engine recorded an OOM kill."""
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # bwrap: its PID 1 dies with it, and the namespace with that
        except ProcessLookupError:
            pass
        oom = self.engine.stop(name, proc, cg)
        proc.wait()
        if cg is not None:
            cg.kill_all()
        return bool(oom)

    def _cleanup(self, scratch: Path, jobdir: Path, cg: cgroups.ExecCgroup | None) -> None:
        if cg is not None:
            cg.remove()
        for folder in (jobdir, scratch):  # the tmpfs lived in the stage's mount namespace: scratch is empty
            with contextlib.suppress(OSError):
                tree.remove(folder)

    # -- preflight ---------------------------------------------------------------------------------------------

    def preflight(self, env: Env, workdirs: list[str]) -> dict[str, str]:
        """Probe ``env`` once inside the sandbox: its interpreter starts and the repository is at
        ``/sandbox/work`` with every sample folder the run needs. A failure is one clear error naming the
        environment; nothing is scored."""
        missing = sorted({w for w in workdirs if not (env.checkout / w).is_dir()})
        if missing:
            fix = (f"rebuild it at the benchmark's pinned commit: mlbench env build {env.name}" if env.recipe else
                   f"check out the benchmark's pinned commit there (mlbench prep --checkout repos.json --repos-dir "
                   f"DIR), or point `checkout:` of {env.name} at such a checkout")
            raise MLBenchError(f"environment {env.name!r}: {len(missing)} sample folder(s) missing from the checkout "
                               f"{env.checkout}: {missing[:5]}", env.where or str(env.checkout), fix)
        expect = len(os.listdir(env.checkout))
        # "." is the checkout's root: /sandbox/work in the sandbox, the private copy under --backend local
        code = ("python -c 'import os, sys; print(\"MLBENCH-PROBE\", sys.executable, sys.version.split()[0], "
                "len(os.listdir(\".\")))'")
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
            what, fix = self.probe_advice(env)
            raise MLBenchError(f"environment {env.name!r} failed its probe in the {self.backend} sandbox: {problem}; "
                               f"{what}" + (f"\n  log:\n    {tail}" if tail else ""), env.where or str(env.checkout),
                               f"{fix}; then re-run (no verdict was written)")
        assert probe is not None  # no problem: the probe printed its line
        return {"python": probe[1], "version": probe[2]}

    def probe_advice(self, env: Env) -> tuple[str, str]:
        """What ``env`` is (which interpreter the probe ran) and what fixes it, by its kind: a build of
        ``mlbench env build``, an environment of the user's own, an image, or the default one (the base
        interpreter of the Python running mlbench, for a repository with no environment of its own)."""
        name, at = env.name, env.where.rsplit(":", 1)[0] if env.where else "the environments file (--envs)"
        if self.engine.container:
            image = env.image or "(none)"
            rebuild = (f"rebuild it: mlbench env build {name} --image" if env.recipe else
                       "the demo's base image: mlbench env base-image" if image.startswith("localhost/mlbench-base")
                       else f"rebuild it, or point `image:` of {name} in {at} at one that does")
            return (f"the probe ran `python` in the image {image}",
                    f"the image must have `python` on its PATH; {rebuild}")
        path = self._env_vars(env)["PATH"]
        if env.recipe:
            return (f"it is the build {env.prefix} of `mlbench env build`, its `python` run from PATH {path}",
                    f"see what is wrong with: mlbench env check {name}; rebuild it: mlbench env build {name}")
        if env.prefix:
            return (f"it is the environment {env.prefix} named in {at}, its `python` run from PATH {path}",
                    f"check that {env.prefix}/bin/python starts (`{env.prefix}/bin/python -c 'import sys'`), "
                    f"or point `venv:` of {name} in {at} at an environment that does")
        base = getattr(sys, "_base_executable", sys.executable)
        recipes = Path(__file__).resolve().parents[2] / "configs" / "eval"
        recipe = next((f"configs/eval/{d}" for d in ("envs-sample", "envs")
                       if (recipes / d / f"{name}.yaml").is_file()), None)
        build = (f", or build one from its recipe: mlbench env build {name} --recipes {recipe}, then pass --envs "
                 "$MLBENCH_CACHE/envs.yaml" if recipe else "")
        return (f"{name} has no environment of its own, so the probe ran the default one: the base interpreter of "
                f"the Python running mlbench ({base}) as `python` from PATH {path}",
                f"give {name} an environment with bin/python (`venv: DIR` under repos.{name} in {at}){build}; or "
                f"check that {base} starts for every user (`{base} -c 'import sys'`; its folders readable)")

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
