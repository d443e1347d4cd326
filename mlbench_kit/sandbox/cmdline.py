"""Command lines of the isolation engines, one function each, over one shared execution layout.

Inside every engine the execution sees the same thing::

    /sandbox/work   the repository: a copy-on-write overlay of the pristine checkout (or a private copy)
    /sandbox/home   a scratch home        /tmp, /dev/shm   size-capped tmpfs
    /sandbox/job    read-only: runner.py, spec.json (what to run), cmd.sh / temp.py

and the trusted runner (``runner.py``) is PID 1. The writable parts live on one size-capped tmpfs that
a *stage script* mounts in a private mount namespace before anything untrusted starts; the pristine checkout
is only ever an overlay's lower layer, so no execution can change it or see another's writes. Everything here
builds argv lists or script text and runs nothing; :mod:`.sandbox` runs them.
"""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

SANDBOX = "/sandbox"
REPORT_FD = 3  # the runner's report pipe (bwrap, podman)
NONCE_ENV = "MLBENCH_REPORT_NONCE"  # engines that cannot pass a pipe: the report goes to stderr under this nonce
SECCOMP_FD = 4  # bwrap reads the compiled seccomp policy from it
LAYER = f"{SANDBOX}/layer"  # docker: the earlier executions' changes (Job.layer), read-only, applied by the runner
# the runner in a container: the base image's Python (>= 3.9, standard library), never the environment's, which
# may be older than the runner supports (bert's 3.7) and is not the runner's to trust
CONTAINER_RUNNER_PYTHON = "/usr/bin/python3"
_MASKED_PROC = ("/proc/keys", "/proc/key-users", "/proc/kcore", "/proc/timer_list", "/proc/sched_debug",
                "/proc/latency_stats")
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/etc")
IDMAP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "idmap.py")  # run by the stage script as root


@dataclass(frozen=True)
class Identity:
    """Who runs the untrusted code: as root we drop to ``uid``/``gid`` (never host root); otherwise we are it."""

    uid: int
    gid: int
    root: bool  # mlbench runs as root: the stage script mounts directly, then drops privileges


@dataclass(frozen=True)
class Mounts:
    """Host paths the stage script prepares for one execution."""

    scratch: Path  # an empty folder: the per-execution tmpfs is mounted over it
    job: Path  # host folder with runner.py, spec.json, cmd.sh/temp.py, passwd, group
    lower: Path | None  # the pristine checkout (None: the engine copies it itself)
    disk_mb: int
    ro_binds: tuple[str, ...] = ()  # host folders bound read-only at their own path (environment, interpreter)
    layer: Path | None = None  # a persistent upper layer (Job.layer): copied in before, back after the engine
    lower_ids: tuple[int, int] | None = None  # the owner of lower's files where the execution runs as another uid
    #                                           (as root): lower is bound idmapped, its files shown as the execution's
    user_quotas: tuple[tuple[str, int], ...] = ()  # without root: /proc/sys/user limits of the execution's own
    #                                                user namespace (its share of the caller's per-user quotas)
    inodes: int | None = None  # the tmpfs's entries at most (nr_inodes): a layer's entry cap, held by the kernel


def stage_script(m: Mounts, who: Identity, cgroup_procs: list[str], report_fd: int, engine_argv: list[str],
                 drop: bool = True, seccomp_bpf: Path | None = None, shm_mb: int | None = None) -> str:
    """The shell script run in a fresh mount namespace (``unshare --mount``; ``--user`` too when not root).

    It joins the execution's cgroups, mounts the size-capped tmpfs over ``scratch``, binds the read-only
    folders, mounts the overlay (relative paths, so ``/proc/self/mountinfo`` shows no host path), moves the
    report pipe to fd 3 and execs the engine, after dropping to the sandbox uid when running as root (``drop``;
    a rootful container engine switches uid itself, with ``--user``).

    ``m.user_quotas`` (without root): the user namespace the stage script runs in is the execution's own, and its
    per-user limits (``/proc/sys/user``: inotify instances and watches, fanotify groups and marks) are set to a
    share of the caller's, so one answer cannot take them all from its neighbours (every level of nested
    namespaces is charged and checked, up to the caller's own limit).

    ``shm_mb``: where no cgroup counts memory no process maps, the execution's own IPC namespace (``unshare
    --ipc``, kept by bwrap) holds at most this much SysV shared memory, and a segment is removed as soon as no
    process of the execution is attached to it or alive to have made it (``shm_rmid_forced``).
    """
    q = shlex.quote
    s = q(str(m.scratch))
    owner = f",uid={who.uid},gid={who.gid}" if who.root else ""
    lines = ["set -eu"]
    if who.root:  # the runner is never the OOM killer's victim where we may (CAP_SYS_RESOURCE) lower it
        lines.append("echo -1000 2>/dev/null > /proc/self/oom_score_adj || true")
    lines += [f"echo $$ > {q(p)}" for p in cgroup_procs]
    if not who.root:  # where a kernel refuses, the quotas stay shared (docs/sandbox.md), never a fault
        lines += [f"echo {n} 2>/dev/null > /proc/sys/user/{k} || true" for k, n in m.user_quotas]
    if shm_mb is not None:
        lines += ["echo 1 > /proc/sys/kernel/shm_rmid_forced", f"echo {shm_mb * 256} > /proc/sys/kernel/shmall",
                  f"echo {shm_mb * 2**20} > /proc/sys/kernel/shmmax"]
    inodes = f",nr_inodes={m.inodes}" if m.inodes else ""
    lines += [f"mount -t tmpfs -o size={m.disk_mb}m{inodes},mode=0700{owner} mlbench {s}",
              f"cd {s}", "mkdir upper ovw work home job ro lower", f"cp -pR {q(str(m.job))}/* job/"]  # 0444, bin/ 0755
    for i, src in enumerate(m.ro_binds):
        lines += [f"mkdir ro/{i}", f"mount --bind {q(src)} ro/{i}"]  # bwrap binds it on read-only
    layer = q(str(m.layer)) if m.layer is not None else None
    if layer is not None:  # the earlier executions' changes, into this one's size-capped tmpfs
        lines += [f"rm -rf {layer}/new", f"if [ -d {layer}/upper ]; then cp -a {layer}/upper/. upper/; fi"]
        if m.lower_ids is not None:  # written by an earlier execution's uid: now this one's (links not followed)
            lines.append(f"chown -hR {who.uid}:{who.gid} upper")
    if m.lower is not None:
        lines += overlay_lines(m, who)
    if who.root:
        lines.append(f"chown {who.uid}:{who.gid} upper ovw work home")
    setpriv = (["setpriv", f"--reuid={who.uid}", f"--regid={who.gid}", "--clear-groups", "--inh-caps=-all",
                "--bounding-set=-all"] if who.root and drop else [])
    start = (" ".join(q(a) for a in setpriv + engine_argv) + f" {REPORT_FD}>&{report_fd}"
             + (f" {report_fd}>&-" if report_fd != REPORT_FD else "")
             + (f" {SECCOMP_FD}<{q(str(seccomp_bpf))}" if seccomp_bpf else ""))  # last: may reuse report_fd
    if layer is None:
        lines.append("exec " + start)
    else:
        # the engine as a child: when it has exited (its PID 1 gone, every process of the execution with it) the
        # upper layer is quiescent; its copy replaces the earlier one only once the host has weighed it against
        # the run's bounds (Sandbox._take_layer), so a kill or a refusal leaves the earlier layer as it was
        lines += ["rc=0", f"{start} || rc=$?", f"exec {report_fd}>&-", f"cp -a upper {layer}/new", "exit $rc"]
    return "\n".join(lines) + "\n"


def overlay_lines(m: Mounts, who: Identity) -> list[str]:
    """Shell lines, run in the scratch tmpfs, that mount the overlay of ``m.lower`` at ``work``: its lower layer
    bound plainly, or idmapped (:mod:`.idmap`) so that files of ``m.lower_ids`` show as ``who``'s."""
    assert m.lower is not None
    q = shlex.quote
    if m.lower_ids is not None and who.root:
        (uid, gid), python = m.lower_ids, os.path.realpath(sys.executable)
        bind = f"{q(python)} -I -S {q(IDMAP)} {q(str(m.lower))} lower {uid} {who.uid} {gid} {who.gid}"
    else:
        bind = f"mount --bind {q(str(m.lower))} lower"
    xattr = "" if who.root else ",userxattr"
    return [bind, f"mount -t overlay mlbench -o lowerdir=lower,upperdir=upper,workdir=ovw{xattr} work"]


def idmap_probe_script(lower: Path, folder: Path, run: Identity, execution: Identity) -> str:
    """A script (run as root in a private mount namespace) that exits 0 when an idmapped overlay of ``lower``
    works here: the kernel has idmapped mounts and overlayfs takes them, and ``lower``'s filesystem allows them."""
    m = Mounts(folder, folder, lower, 1, lower_ids=(run.uid, run.gid))
    return "\n".join(["set -eu", f"mount -t tmpfs -o size=1m,mode=0700 mlbench {shlex.quote(str(folder))}",
                      f"cd {shlex.quote(str(folder))}", "mkdir upper ovw work lower", *overlay_lines(m, execution),
                      f'test "$(stat -c %u:%g lower)" = {execution.uid}:{execution.gid}']) + "\n"


def unshare_argv(who: Identity, script: Path) -> list[str]:
    """How the host starts the stage script: private mount and IPC namespaces (and a user namespace when not
    root); bwrap keeps that IPC namespace, so the stage script's limits on it hold for the execution."""
    ns = ["--mount", "--ipc"] if who.root else ["--user", "--map-root-user", "--mount", "--ipc"]
    return ["unshare", *ns, "--propagation", "private", "bash", str(script)]  # bash: fds above 9


def _system_binds() -> list[str]:
    argv: list[str] = []
    for p in _SYSTEM_DIRS:
        if os.path.islink(p):
            argv += ["--symlink", os.readlink(p), p]
        elif os.path.isdir(p):
            argv += ["--ro-bind", p, p]
    return argv


def bwrap_argv(m: Mounts, tmp_mb: int, runner_python: str, seccomp: bool = True) -> list[str]:
    """bubblewrap: every namespace new (network too), an unprivileged uid in a user namespace of its own,
    no capabilities, no nested user namespaces, the seccomp policy of :mod:`.seccomp` (read from fd
    ``SECCOMP_FD``), system folders and the environment read-only, then the runner.

    Mount order matters: ``/tmp`` and ``/dev`` come before the environment's binds, so a virtualenv under
    ``/tmp`` is not hidden by the sandbox's own ``/tmp``; the root is remounted read-only last.
    """
    s = str(m.scratch)
    # every namespace new but IPC, which is the stage script's own (see unshare_argv), with its limits
    argv = ["bwrap", "--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
            "--uid", "1000", "--gid", "1000", "--disable-userns",
            "--cap-drop", "ALL", "--die-with-parent", "--new-session", "--as-pid-1", "--hostname", "sandbox",
            "--clearenv", *_system_binds(),
            "--ro-bind", f"{s}/job/passwd", "/etc/passwd", "--ro-bind", f"{s}/job/group", "/etc/group",
            "--size", str(tmp_mb * 2**20), "--tmpfs", "/tmp", "--dev", "/dev",
            "--size", str(tmp_mb * 2**20), "--tmpfs", "/dev/shm", "--proc", "/proc"]
    for p in _MASKED_PROC:  # as the OCI runtimes mask them: /proc/keys lists other executions' keys by name
        argv += ["--ro-bind", f"{s}/job/empty", p] if os.path.exists(p) else []  # reads as empty, as in runc
    for i, dest in sorted(enumerate(m.ro_binds), key=lambda x: x[1].count("/")):
        argv += ["--ro-bind", f"{s}/ro/{i}", dest]
    argv += ["--bind", f"{s}/work", f"{SANDBOX}/work", "--bind", f"{s}/home", f"{SANDBOX}/home",
             "--ro-bind", f"{s}/job", f"{SANDBOX}/job", "--remount-ro", "/dev", "--remount-ro", "/",
             "--chdir", f"{SANDBOX}/work", "--setenv", "PATH", "/usr/bin:/bin"]
    argv += ["--seccomp", str(SECCOMP_FD)] if seccomp else []
    return argv + runner_argv(runner_python)


def runner_argv(python: str = "python3", report: str = str(REPORT_FD)) -> list[str]:
    """The runner's command line inside any engine; ``report`` is a file descriptor or ``stderr``."""
    return [python, "-I", "-S", f"{SANDBOX}/job/runner.py", f"{SANDBOX}/job/spec.json", report]


def container_argv(engine: str, image: str, name: str, m: Mounts, mem_mb: int, pids: int, cpus: float | None,
                   tmp_mb: int, uid: int, cgroup_parent: str | None, seccomp: Path | None,
                   src: str | None = None, layer: str | None = None, gid: int | None = None) -> list[str]:
    """podman / docker: no network, no capabilities, no new privileges, a read-only image, an unprivileged
    uid, memory/pids/CPU limits, size-capped tmpfs, the runner as PID 1 (no ``--init``).

    Without ``src`` (podman started by the stage script) ``/sandbox/{work,home,job}`` are the stage script's
    overlay and tmpfs, and the report pipe is handed over with ``--preserve-fds``. With ``src`` (docker, whose
    daemon cannot see our mount namespace) the checkout is bound read-only at ``/sandbox/src``, the runner
    copies it into a size-capped tmpfs, and the report comes back on stderr under a per-execution nonce; ``layer``
    (:attr:`Job.layer`'s folder, when it holds files) is bound read-only at ``/sandbox/layer`` for the runner to
    apply over that copy.
    """
    s = str(m.scratch)
    # docker: no --rm, so that its OOM record can be read before the container is removed (Docker.stop)
    argv = [engine, "run", *(["--rm"] if engine == "podman" else []), "--name", name]
    if engine == "podman":
        # crun fails on cgroup-v1 hybrid hosts; passthrough: the container's stdout/stderr are our pipes, as in
        # bwrap (no conmon copy, no log file on the host disk outside every limit)
        argv += ["--runtime", "runc", "--log-driver", "passthrough"]
    else:
        argv += ["--log-driver", "none"]
    argv += ["--network", "none", "--cap-drop", "ALL", "--security-opt", "no-new-privileges", "--read-only",
             "--user", f"{uid}:{uid if gid is None else gid}", "--hostname", "sandbox", "--ulimit", "nofile=1024:1024",
             "--ulimit", "nproc=4096:4096", "--tmpfs", f"/tmp:rw,size={tmp_mb}m,mode=1777", "--shm-size", f"{tmp_mb}m"]
    if cgroup_parent:
        # our per-execution cgroup holds the limits, so the kernel counts the OOM kill or refused fork there
        argv += ["--cgroup-parent", cgroup_parent]
        if engine == "podman":
            # conmon (and the `podman cleanup` it starts) stay in the CLI's cgroup, never charged to the answer's
            # limits (they were put in <parent>/conmon, and OOM-killed there with the answer)
            argv += ["--cgroups", "no-conmon"]
    else:
        argv += ["--memory", f"{mem_mb}m", "--memory-swap", f"{mem_mb}m", "--pids-limit", str(pids)]
        argv += ["--cpus", str(cpus)] if cpus else []
    if seccomp is not None:
        argv += ["--security-opt", f"seccomp={seccomp}"]
    if src is None:
        argv += ["--preserve-fds", "1", "-v", f"{s}/work:{SANDBOX}/work", "-v", f"{s}/home:{SANDBOX}/home",
                 "-v", f"{s}/job:{SANDBOX}/job:ro"]
        report = str(REPORT_FD)
    else:
        argv += ["-v", f"{src}:{SANDBOX}/src:ro", "-v", f"{m.job}:{SANDBOX}/job:ro",
                 "--tmpfs", f"{SANDBOX}/work:rw,size={m.disk_mb}m,uid={uid}",
                 "--tmpfs", f"{SANDBOX}/home:rw,size={tmp_mb}m,uid={uid}", "-e", NONCE_ENV]
        argv += ["-v", f"{layer}:{LAYER}:ro"] if layer else []
        report = "stderr"
    return argv + ["-w", f"{SANDBOX}/work", image] + runner_argv(CONTAINER_RUNNER_PYTHON, report)


def apptainer_argv(image: str, job: Path, src: str) -> list[str]:
    """Apptainer (HPC clusters): contained, no home, no network, the runner as PID 1 (``--no-init``), the
    checkout read-only at ``/sandbox/src`` copied by the runner into a writable tmpfs overlay. The report
    nonce travels as ``APPTAINERENV_MLBENCH_REPORT_NONCE`` (``--cleanenv`` keeps those)."""
    return ["apptainer", "exec", "--containall", "--cleanenv", "--no-home", "--no-init", "--pid", "--ipc",
            "--net", "--network", "none", "--no-privs", "--writable-tmpfs", "--bind", f"{src}:{SANDBOX}/src:ro",
            "--bind", f"{job}:{SANDBOX}/job:ro", "--pwd", "/", image,
            *runner_argv(CONTAINER_RUNNER_PYTHON, "stderr")]
