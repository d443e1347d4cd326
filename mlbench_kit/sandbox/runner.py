"""The trusted supervisor that runs as PID 1 inside every sandbox (bwrap, podman, docker, apptainer).

Started as ``python3 -I -S runner.py SPEC REPORT`` (``SPEC``: the execution's ``RunnerSpec``, the host's typed
contract in ``mlbench_kit/sandbox/spec.py``, as JSON, read here by its field names; ``REPORT``: a file descriptor,
or ``stderr`` for engines that cannot pass one; the report line then carries the nonce from
``$MLBENCH_REPORT_NONCE``, which only this process knows: its environment is unreadable once it is non-dumpable, and
the child never gets it). Standard library only, never imports the project. It makes itself non-dumpable (so the
generation, running under the same uid, can neither ptrace it nor open its ``/proc/1/fd``), forks the generation,
waits for it, counts every process still alive in the PID namespace, kills them, and writes one JSON report to
``REPORT_FD``: a pipe held only by this process. As PID 1 of its namespace it receives no signal from inside that it
did not ask for, so the generation cannot kill it either. The host takes its verdict from this report alone; nothing
the generation can write is read back. Under the cpu clock (``cpu_limit_s`` in the spec) it also ends the execution
once every process of the namespace together has used that many CPU seconds, and reports it as the time limit
reached.
"""

import ctypes
import json
import os
import shutil
import signal
import stat
import sys
import time

PR_SET_DUMPABLE = 4
KEYCTL_JOIN_SESSION_KEYRING = 1
_KEYCTL = {"x86_64": 250, "aarch64": 219}  # the keyctl system call's number


def _harden() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")
    nr = _KEYCTL.get(os.uname().machine)
    if nr is not None:
        # a new, empty anonymous session keyring for this execution (the only keyctl the seccomp policy allows);
        # where it fails, keyctl is blocked altogether and no keyring is reachable either
        libc.syscall(nr, KEYCTL_JOIN_SESSION_KEYRING, None)
    # SIG_DFL everywhere: the kernel then drops every signal sent to PID 1 from inside its namespace
    for sig in range(1, signal.NSIG):
        try:
            signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError, RuntimeError):
            pass


def _open_oom() -> int | None:
    """``/proc/self/oom_score_adj``, opened while this process is still dumpable: once it is not, the file belongs
    to root, and neither the runner nor its child (which inherits non-dumpability until exec) may open it; the
    child's own attempt failed silently, so generations ran at the runner's value (0, or -1000 as root)."""
    try:
        return os.open("/proc/self/oom_score_adj", os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return None


def _oom_fork(oom_fd: int | None) -> int:
    """Fork the generation with oom_score_adj 1000 (the OOM killer's first choice, always), the runner keeping its
    own value: raised for the fork (unprivileged), restored right after (never below the value it had)."""
    own = None
    if oom_fd is not None:
        try:
            own = os.pread(oom_fd, 16, 0).strip()
            os.pwrite(oom_fd, b"1000", 0)
        except OSError:
            own = None
    pid = os.fork()
    if pid != 0 and own is not None and oom_fd is not None:
        try:
            os.pwrite(oom_fd, own, 0)
        except OSError:
            pass  # the runner stays at 1000 beside its child: no worse than before this fix
    if oom_fd is not None:
        os.close(oom_fd)
    return pid


def _copy_workspace(src: str, dst: str) -> None:
    """The "copy" workspace (engines that cannot mount an overlay for us): a private copy in a tmpfs."""
    for name in os.listdir(src):
        s, d = os.path.join(src, name), os.path.join(dst, name)
        if os.path.isdir(s) and not os.path.islink(s):
            shutil.copytree(s, d, symlinks=True)
        else:
            shutil.copy2(s, d, follow_symlinks=False)


def _child(spec: dict, errw: int, stdout_w: int | None = None, out_w: int | None = None) -> None:
    """In the forked child: limits, working folder, then exec. Failures before exec go to ``errw``."""
    import resource
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGCHLD])  # blocked in the runner (the cpu clock)
        if out_w is not None:  # the runner drains the output (_Drain); the report's stream (docker's stderr) and
            os.dup2(out_w, 2)  # the container's stdout stay the runner's alone
            if stdout_w is None:
                os.dup2(out_w, 1)
        if stdout_w is not None:  # the benchmark's checker: stdout a pipe nobody reads while the command runs
            os.dup2(stdout_w, 1)
        os.setsid()  # (oom_score_adj 1000 was set by the runner around the fork: see _oom_fork)
        for name, value in spec.get("rlimits", {}).items():
            lim = getattr(resource, name)
            # CPU: a hard limit one second above the soft one, so the soft limit's SIGXCPU comes first
            resource.setrlimit(lim, (value, value + 1 if name == "RLIMIT_CPU" else value))
        try:
            os.chdir(spec["workdir"])
        except OSError as exc:
            os.write(errw, json.dumps({"kind": "workdir", "detail": f"{spec['workdir']}: {exc.strerror}"}).encode())
            os._exit(127)
        if spec.get("temp_py"):
            shutil.copyfile(spec["temp_py"], "temp.py")
        env = spec["env"]
        try:
            os.execvpe(spec["argv"][0], spec["argv"], env)
        except OSError as exc:
            os.write(errw, json.dumps({"kind": "exec", "detail": f"{spec['argv'][0]}: {exc.strerror}"}).encode())
            os._exit(127)
    except BaseException as exc:  # noqa: BLE001 - anything here is the sandbox's fault, reported as such
        os.write(errw, json.dumps({"kind": "setup", "detail": f"{type(exc).__name__}: {exc}"}).encode())
        os._exit(127)


def _alive() -> list[int]:
    pids = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or d == "1":
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as fh:
                state = fh.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue  # gone meanwhile
        if state not in (b"Z", b"X"):
            pids.append(int(d))
    return pids


def _tree_cpu() -> float:
    """CPU seconds of every process of the namespace but this one: what each live process used and what it reaped
    (``/proc/PID/stat``: utime, stime, cutime, cstime), plus everything this process reaped itself. As PID 1 it
    reaps every orphan, so a process escapes this count only by being reaped by nobody (a parent ignoring
    SIGCHLD): an undercount, which can only delay the limit to the wall-clock backstop, never pass an answer
    sooner than sleeping would."""
    import resource
    total = 0
    for d in sorted((d for d in os.listdir("/proc") if d.isdigit() and d != "1"), key=int):  # parents first
        try:
            with open(f"/proc/{d}/stat", "rb") as fh:
                fields = fh.read().rsplit(b")", 1)[1].split()
            total += sum(int(x) for x in fields[11:15])  # fields 14-17 of proc(5)
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return total / os.sysconf("SC_CLK_TCK") + ru.ru_utime + ru.ru_stime


def _wait_cpu(pid: int, limit: float, report: dict) -> int | None:
    """Wait for ``pid`` (reaping every other process meanwhile) until the namespace has used ``limit`` CPU seconds;
    its wait status, or None with ``report["at_limit"]`` set. SIGCHLD is blocked, so its arrival wakes the wait at
    once; otherwise the count is read every 50 ms (longer when reading it takes longer: many processes). The limit
    counts as reached on two reads in a row, so a child counted twice during one read (reaped between reading it
    and its parent) cannot end an execution early."""
    step, over = 0.05, 0
    while True:
        signal.sigtimedwait([signal.SIGCHLD], step)
        while True:
            try:
                p, st, ru = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                p = 0
            if p == 0:
                break
            if p == pid:
                report["cpu_s"] = round(ru.ru_utime + ru.ru_stime, 3)
                return st
        t0 = time.monotonic()
        used = _tree_cpu()
        step = max(0.05, 4 * (time.monotonic() - t0))
        over = over + 1 if used >= limit else 0
        if over >= 2:
            report["at_limit"] = round(used, 3)
            return None


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _full(paths: list[str]) -> list[str]:
    """Writable mounts with no room left, in bytes or in entries (a layer's ``nr_inodes``): the generation hit its
    disk limit there."""
    out = []
    for p in paths:
        try:
            st = os.statvfs(p)
        except OSError:
            continue
        if st.f_blocks and st.f_bavail * st.f_frsize < 64 * 1024 or st.f_files and st.f_favail < 4:
            out.append(p)
    return out


def _at_size(paths: list, size: int, max_entries: int = 20000) -> bool:
    """Whether a regular file of at least ``size`` bytes is under ``paths`` (a write stopped by RLIMIT_FSIZE
    leaves one of exactly that size). Iterative and bounded: at most ``max_entries`` entries, any depth."""
    stack, seen = list(paths), 0
    while stack and seen < max_entries:
        try:
            with os.scandir(stack.pop()) as it:
                for e in it:
                    seen += 1
                    if seen > max_entries:  # one folder of a million entries counts too
                        return False
                    if e.is_dir(follow_symlinks=False):
                        stack.append(e.path)
                    elif e.is_file(follow_symlinks=False) and e.stat(follow_symlinks=False).st_size >= size:
                        return True
        except OSError:
            continue
    return False


def _oom_counts() -> dict[str, int] | None:
    """The OOM situations the container's memory controller counted so far ("oom" and "oom_kill" of
    memory.events on cgroup v2, "oom_kill" of memory.oom_control on v1), None if unreadable. The kernel's own
    count: the daemon's OOMKilled flag comes from an event it handles asynchronously, and under load Docker
    reported a container that had an OOM kill as not OOM-killed."""
    for path, keys in (("/sys/fs/cgroup/memory.events", ("oom", "oom_kill")),
                       ("/sys/fs/cgroup/memory/memory.oom_control", ("oom_kill",))):
        try:
            with open(path, encoding="ascii") as fh:
                counts = dict(line.split(" ", 1) for line in fh.read(4096).splitlines() if " " in line)
            return {k: int(counts.get(k, 0)) for k in keys}
        except (OSError, ValueError):
            continue
    return None


def _oom_growth(before: dict[str, int]) -> int | None:
    """How much the most grown of the counts of :func:`_oom_counts` grew since ``before``, None if unreadable."""
    now = _oom_counts()
    return None if now is None else max(now.get(k, 0) - n for k, n in before.items())


def _pids_max():
    """Forks the container's pids controller refused ("max" of pids.events, cgroup v2 or v1), None if unreadable."""
    for path in ("/sys/fs/cgroup/pids.events", "/sys/fs/cgroup/pids/pids.events"):
        try:
            with open(path, encoding="ascii") as fh:
                for line in fh:
                    key, _, value = line.partition(" ")
                    if key == "max":
                        return int(value)
        except (OSError, ValueError):
            continue
    return None


def _probe(report: dict, key: str, probe) -> None:
    """``report[key] = probe()``; a probe that fails is named under "unproven" instead of failing the report."""
    try:
        report[key] = probe()
    except Exception as exc:  # noqa: BLE001 - e.g. out of memory in an OOM-filled cgroup
        report.setdefault("unproven", []).append(f"{key}: {type(exc).__name__}")


def _evidence(report: dict, spec: dict) -> None:
    """What the generation left behind: survivors, full mounts, a file at the size limit. Each part is bounded,
    and none can fail the report: a verdict without one piece of evidence beats a fault."""
    writable = spec.get("writable", [])
    fsize = spec.get("rlimits", {}).get("RLIMIT_FSIZE")
    probes = [("survivors", lambda: len(_alive())), ("full", lambda: _full(writable)),
              ("at_fsize", lambda: bool(fsize) and _at_size(writable, fsize))]
    if spec.get("cgroup_evidence"):  # a container whose /sys/fs/cgroup is its own (docker): the kernel's count
        probes.append(("pids_max", _pids_max))
    for key, probe in probes:
        _probe(report, key, probe)
    if report["survivors"] is None:
        report["survivors"] = 0


def _relay_undrained(fd: int) -> None:
    """What the undrained stdout pipe holds (at most its 64 KB) to this process's stdout, for the log."""
    os.set_blocking(fd, False)
    try:
        data = os.read(fd, 1 << 16)
    except OSError:
        data = b""
    while data:
        try:
            data = data[os.write(1, data):]
        except OSError:
            return


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except InterruptedError:
            continue
        except OSError:
            return


class _Drain:
    """The answer's output drained here, in large reads (engines whose CLI relays the output: docker). Relayed as
    written, a flood of small writes crossed the engine one frame each (3 million 64-byte writes outlasted a 10 s
    limit). The first half of ``cap`` bytes goes to stdout as it comes; the last half follows once everything is
    dead, after the count of the bytes dropped between, as the host's own capture writes it."""

    def __init__(self, fd: int, cap: int) -> None:
        import threading
        self.fd, self.half, self.head, self.tail, self.dropped = fd, cap // 2, 0, bytearray(), 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            try:
                chunk = os.read(self.fd, 1 << 16)
            except InterruptedError:
                continue
            except OSError:
                return
            if not chunk:
                return
            room = self.half - self.head
            if room > 0:
                _write_all(1, chunk[:room])
                self.head += min(room, len(chunk))
                chunk = chunk[room:]
            self.tail += chunk
            if len(self.tail) > self.half:  # (bytearray drops its front without copying the rest)
                self.dropped += len(self.tail) - self.half
                del self.tail[:len(self.tail) - self.half]

    def finish(self) -> None:
        """Once every writer is dead: the tail, after the count of what was dropped."""
        self.thread.join()
        os.close(self.fd)
        mid = f"\n[... {self.dropped} bytes dropped ...]\n".encode() if self.dropped else b""
        _write_all(1, mid + bytes(self.tail))


class _Counted:
    """A write-only stream onto a file descriptor that counts the bytes written and stops past ``cap``."""

    def __init__(self, fd: int, cap: int) -> None:
        self.fd, self.cap, self.n = fd, cap, 0

    def write(self, data) -> int:
        if self.n + len(data) > self.cap:
            raise OSError(f"the layer exceeds {self.cap} bytes")
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view):]
        self.n += len(data)
        return len(data)


def _same(a: os.stat_result, b: os.stat_result) -> bool:
    return (stat.S_IFMT(a.st_mode) == stat.S_IFMT(b.st_mode) and a.st_size == b.st_size
            and a.st_mtime_ns == b.st_mtime_ns and stat.S_IMODE(a.st_mode) == stat.S_IMODE(b.st_mode))


def _changes(src: str, work: str) -> tuple[list[str], list[str]]:
    """What differs between the pristine checkout ``src`` and the workspace ``work``, as an overlay's upper layer
    sees it: the entries written or replaced (a new folder whole), and the entries removed (relative paths)."""
    changed, deleted = [], []
    for dirpath, dirnames, filenames in os.walk(work):
        rel = os.path.relpath(dirpath, work)
        for name in sorted(dirnames + filenames):
            r = os.path.normpath(os.path.join(rel, name))
            w = os.lstat(os.path.join(work, r))
            try:
                o = os.lstat(os.path.join(src, r))
            except OSError:
                o = None
            if stat.S_ISDIR(w.st_mode) and o is not None and stat.S_ISDIR(o.st_mode):
                continue  # walked into: its entries decide
            if name in dirnames:
                dirnames.remove(name)  # a new (or replaced) folder goes whole
            if o is None or not _same(w, o) or (stat.S_ISLNK(w.st_mode) and os.readlink(os.path.join(work, r))
                                                != os.readlink(os.path.join(src, r))):
                changed.append(r)
    for dirpath, dirnames, filenames in os.walk(src):
        rel = os.path.relpath(dirpath, src)
        for name in sorted(dirnames + filenames):
            r = os.path.normpath(os.path.join(rel, name))
            if not os.path.lexists(os.path.join(work, r)):
                deleted.append(r)
                if name in dirnames:
                    dirnames.remove(name)
    return changed, deleted


def _apply_layer(layer: str, work: str) -> None:
    """An earlier execution's changes (:func:`_send_layer`) onto the fresh copy of the checkout in ``work``."""
    try:
        with open(os.path.join(layer, "deleted"), "rb") as fh:
            gone = [os.fsdecode(x) for x in fh.read().split(b"\0") if x]
    except FileNotFoundError:
        gone = []
    for r in gone:
        path = os.path.normpath(os.path.join(work, r))
        if not path.startswith(work + "/"):
            continue
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        elif os.path.lexists(path):
            os.unlink(path)
    upper = os.path.join(layer, "upper")
    for dirpath, dirnames, filenames in os.walk(upper):
        rel = os.path.relpath(dirpath, upper)
        for name in dirnames + filenames:
            s, d = os.path.join(dirpath, name), os.path.normpath(os.path.join(work, rel, name))
            is_dir = stat.S_ISDIR(os.lstat(s).st_mode)
            if os.path.lexists(d) and not (is_dir and os.path.isdir(d) and not os.path.islink(d)):
                shutil.rmtree(d) if os.path.isdir(d) and not os.path.islink(d) else os.unlink(d)
            if is_dir:
                os.makedirs(d, exist_ok=True)
            else:
                shutil.copy2(s, d, follow_symlinks=False)


def _send_layer(fd: int, spec: dict, nonce: str, report: dict) -> None:
    """The workspace's changes since the pristine checkout, every process dead, as a tar on ``fd`` (the report's
    stream, which only this process writes): ``upper/`` (what was written, links stored and never followed, FIFOs,
    sockets and devices left out) and ``deleted`` (the removed paths, NUL-separated). It is the files an engine
    without a stage script keeps between executions (:attr:`Job.layer`). Its size goes into the report, which
    follows it; a layer that fails or exceeds its caps is left out, and the host keeps the earlier one."""
    import io
    import tarfile
    out, work = spec["layer_out"], spec["copy_to"]
    counted = _Counted(fd, out["max_bytes"])
    kept = [0]

    def only_files(ti):
        if not (ti.isreg() or ti.isdir() or ti.issym() or ti.islnk()):
            return None
        kept[0] += 1
        if kept[0] > out["max_members"]:
            raise OSError(f"the layer has more than {out['max_members']} entries")
        ti.uid = ti.gid = 0
        ti.uname = ti.gname = ""
        return ti

    os.write(fd, f"\nMLBENCH-LAYER {nonce}\n".encode())
    try:
        changed, deleted = _changes(spec["copy_from"], work)
        gone = b"\0".join(os.fsencode(r) for r in deleted)
        tar = tarfile.open(fileobj=counted, mode="w|", format=tarfile.PAX_FORMAT)  # type: ignore[call-overload]
        with tar as tf:
            tf.add(work, arcname="upper", recursive=False, filter=only_files)
            for r in changed:
                tf.add(os.path.join(work, r), arcname=f"upper/{r}", recursive=True, filter=only_files)
            info = tarfile.TarInfo("deleted")
            info.size = len(gone)
            tf.addfile(info, io.BytesIO(gone))
        report["layer_bytes"] = counted.n
    except Exception as exc:  # noqa: BLE001 - no layer (the host keeps the earlier one), still a verdict
        report["layer_error"] = f"{type(exc).__name__}: {exc}"[:300]


def _quiesce() -> None:
    """Wait until every other process of the namespace is gone (they were sent SIGKILL), so no file still changes."""
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return
        except InterruptedError:
            continue


def main() -> int:
    spec_path, channel = sys.argv[1], sys.argv[2]
    nonce = os.environ.pop("MLBENCH_REPORT_NONCE", "")
    report_fd = 2 if channel == "stderr" else int(channel)
    report: dict = {"v": 1, "exit": None, "signal": None, "survivors": None, "fault": None, "full": [],
                    "cpu_s": None, "at_fsize": False}
    inner: tuple[int, int] | None = None
    drain: _Drain | None = None
    spec: dict = {}
    copied = False  # the workspace was made: a layer may be sent back
    oom_before: dict[str, int] | None = None
    try:
        oom_fd = _open_oom()
        _harden()
        with open(spec_path, encoding="utf-8") as fh:
            spec = json.load(fh)
        if os.getpid() != 1:
            raise RuntimeError(f"the runner must be PID 1 of a new PID namespace, is {os.getpid()}")
        if spec.get("copy_from"):
            _copy_workspace(spec["copy_from"], spec["copy_to"])
            if spec.get("layer_in"):
                _apply_layer(spec["layer_in"], spec["copy_to"])
            copied = True
        errr, errw = os.pipe2(os.O_CLOEXEC)
        if spec.get("undrained_stdout"):
            # engines whose CLI relays the output (docker): the host drains it all, and the undrained stdout of
            # the benchmark's checker is this pipe, which the runner holds and reads only once everything is dead
            # (an answer that fills the host's pipe blocked the CLI, and with it the runner's report)
            inner = os.pipe2(os.O_CLOEXEC)
        out = os.pipe2(os.O_CLOEXEC) if spec.get("report_alone") else None
        limit = spec.get("cpu_limit_s")
        if limit:
            signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGCHLD])  # unblocked in the child
        if spec.get("cgroup_evidence"):  # an OOM of the runner's own set-up is not the answer's
            oom_before = _oom_counts()
        pid = _oom_fork(oom_fd)
        if pid == 0:
            os.close(errr)
            if report_fd != 2:
                os.close(report_fd)
            _child(spec, errw, inner[1] if inner else None, out[1] if out else None)
        os.close(errw)
        if inner:
            os.close(inner[1])
        if out:
            os.close(out[1])
            drain = _Drain(out[0], int(spec.get("log_bytes", 65536)))
        status = _wait_cpu(pid, float(limit), report) if limit else None
        while status is None and not limit:
            try:
                p, st, ru = os.wait4(-1, 0)
            except InterruptedError:
                continue
            if p == pid:  # its rusage counts the descendants it waited for: the evidence of RLIMIT_CPU
                status = st
                report["cpu_s"] = round(ru.ru_utime + ru.ru_stime, 3)
        err = os.read(errr, 4096) if status is not None else b""
        os.close(errr)
        _reap()
        if status is None:
            pass  # the time limit, reached on the cpu clock: still running then, like a wall-clock timeout
        elif err:
            report["fault"] = json.loads(err)
        elif os.WIFEXITED(status):
            report["exit"] = os.WEXITSTATUS(status)
            if report["exit"] == 127 and shutil.which(spec.get("interpreter", "python"),
                                                      path=spec["env"].get("PATH")) is None:
                report["fault"] = {"kind": "interpreter",
                                   "detail": f"{spec.get('interpreter', 'python')} is not on the sandbox PATH"}
        else:
            report["signal"] = os.WTERMSIG(status)
        _evidence(report, spec)
    except BaseException as exc:  # noqa: BLE001 - reported to the host as a sandbox fault
        report["fault"] = {"kind": "runner", "detail": f"{type(exc).__name__}: {exc}"}
    try:
        os.kill(-1, signal.SIGKILL)  # as PID 1: every other process of the namespace
    except ProcessLookupError:
        pass
    if drain:
        drain.finish()
    if inner:
        _relay_undrained(inner[0])
    if oom_before is not None:
        # once everything is dead, as the host reads its cgroup on the other engines: every OOM of the answer's
        # processes counted, background ones too, and the runner's own probes' (they allocate only in the
        # memory the answer left full)
        _probe(report, "oom", lambda: _oom_growth(oom_before))
    if copied and spec.get("layer_out") and report_fd == 2:
        _quiesce()
        _send_layer(report_fd, spec, nonce, report)
    data = json.dumps(report).encode()
    os.write(report_fd, f"\nMLBENCH-REPORT {nonce} ".encode() + data + b"\n" if report_fd == 2 else data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
