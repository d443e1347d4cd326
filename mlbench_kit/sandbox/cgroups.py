"""One cgroup per execution: memory, process and CPU limits for the whole process tree, and which one was hit.

Works on cgroup v2 (one unified tree) and on v1 (one tree per controller, the hybrid layout of many clusters
and of our CI machine). Only where this process may create cgroups (root, or a delegated v2 subtree);
otherwise :func:`available` says why and the sandbox falls back to per-process rlimits, which it reports.
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

ROOT = Path("/sys/fs/cgroup")
_V1 = ("memory", "pids", "cpu", "cpuacct")


def _own_path(controller: str) -> str:
    """This process's cgroup path in ``controller`` ('' for v2)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, ctrls, path = line.split(":", 2)
        if controller in ctrls.split(","):
            return path
    return "/"


def _layout() -> tuple[str, dict[str, Path]] | None:
    """('v2', {'': dir}) or ('v1', {controller: dir}) for a parent we may create children in, or None."""
    unified = ROOT / "cgroup.controllers"
    if unified.is_file() and {"memory", "pids"} <= set(unified.read_text().split()):
        base = ROOT / _own_path("").lstrip("/")
        # a process may not sit in a v2 cgroup that has children with controllers: use a sibling branch
        for cand in (base / "mlbench", ROOT / "mlbench"):
            if os.access(cand.parent, os.W_OK):
                return "v2", {"": cand}
        return None
    dirs = {}
    for c in _V1:
        mount = ROOT / c
        if not (mount / "cgroup.procs").is_file():
            if c in ("memory", "pids"):
                return None
            continue
        if not os.access(mount, os.W_OK):
            return None
        # the same relative path in every hierarchy: podman's --cgroup-parent names one path for all of them
        dirs[c] = mount / "mlbench"
    return "v1", dirs


_LAYOUT: tuple[str, dict[str, Path]] | None | Literal[False] = False  # False: not probed yet


def available() -> tuple[str, dict[str, Path]] | None:
    """The usable layout (cached), or None when per-execution cgroups cannot be made here."""
    global _LAYOUT
    if _LAYOUT is False:
        try:
            _LAYOUT = _layout()
            if _LAYOUT:  # prove it: make and remove one
                cg = ExecCgroup.create(mem_mb=64, pids=16)
                cg.remove()
        except OSError:
            _LAYOUT = None
    return _LAYOUT or None


@dataclass
class ExecCgroup:
    """A per-execution cgroup: write ``procs_files`` from the first process, then read what was hit."""

    version: str
    dirs: dict[str, Path]
    _oom_fd: int | None = None

    @classmethod
    def create(cls, mem_mb: int, pids: int, cpus: float | None = None) -> ExecCgroup:
        layout = _LAYOUT if _LAYOUT else _layout()
        if not layout:
            raise OSError("cgroups unavailable")
        version, parents = layout
        name = uuid.uuid4().hex[:12]
        dirs = {}
        try:
            for c, parent in parents.items():
                parent.mkdir(exist_ok=True)
                if version == "v2":
                    ctl = parent / "cgroup.subtree_control"
                    want = {"memory", "pids"} | ({"cpu"} if cpus else set())
                    have = set(ctl.read_text().split())
                    if not want <= have:
                        ctl.write_text(" ".join(f"+{x}" for x in want - have))
                d = parent / name
                d.mkdir()
                dirs[c] = d
            cg = cls(version, dirs)
            cg._limit(mem_mb, pids, cpus)
            if version == "v1":
                cg._arm_oom_event()
            return cg
        except OSError:
            cls(version, dirs).remove()
            raise

    def _write(self, controller: str, v1: str, v2: str, value: str) -> None:
        d = self.dirs["" if self.version == "v2" else controller]
        (d / (v2 if self.version == "v2" else v1)).write_text(value)

    def _limit(self, mem_mb: int, pids: int, cpus: float | None) -> None:
        mem = str(mem_mb * 1024 * 1024)
        self._write("memory", "memory.limit_in_bytes", "memory.max", mem)
        if self.version == "v2":
            swap = self.dirs[""] / "memory.swap.max"
            if swap.exists():
                swap.write_text("0")
        elif (self.dirs["memory"] / "memory.memsw.limit_in_bytes").exists():
            try:
                (self.dirs["memory"] / "memory.memsw.limit_in_bytes").write_text(mem)
            except OSError:
                pass  # swap accounting off: memory alone is the limit
        if self.version == "v2" and (self.dirs[""] / "memory.oom.group").exists():
            # an OOM kills the whole execution at once (a process with oom_score_adj -1000, the runner, excepted)
            (self.dirs[""] / "memory.oom.group").write_text("1")
        elif self.version == "v1" and (self.dirs["memory"] / "memory.kmem.tcp.limit_in_bytes").exists():
            try:  # v1 counts socket buffers only once a limit turns their accounting on
                (self.dirs["memory"] / "memory.kmem.tcp.limit_in_bytes").write_text(mem)
            except OSError:
                pass
        self._write("pids", "pids.max", "pids.max", str(pids))
        if cpus:
            period = 100_000
            if self.version == "v2":
                (self.dirs[""] / "cpu.max").write_text(f"{int(cpus * period)} {period}")
            elif "cpu" in self.dirs:
                (self.dirs["cpu"] / "cpu.cfs_period_us").write_text(str(period))
                (self.dirs["cpu"] / "cpu.cfs_quota_us").write_text(str(int(cpus * period)))

    def _arm_oom_event(self) -> None:
        """v1: an eventfd the kernel signals when this cgroup's limit drives an OOM, wherever in its subtree
        the victim lives (v1 counts the kill itself only in the victim's own cgroup)."""
        d = self.dirs["memory"]
        efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        ofd = os.open(d / "memory.oom_control", os.O_RDONLY | os.O_CLOEXEC)
        try:
            (d / "cgroup.event_control").write_text(f"{efd} {ofd}")
            self._oom_fd = efd
        except OSError:
            os.close(efd)
        finally:
            os.close(ofd)

    def _oom_events(self) -> int:
        if self._oom_fd is None:
            return 0
        try:
            return os.eventfd_read(self._oom_fd)
        except BlockingIOError:
            return 0

    @property
    def procs_files(self) -> list[str]:
        """Where the first process writes its pid (every controller)."""
        return [str(d / "cgroup.procs") for d in self.dirs.values()]

    def parent_for_podman(self) -> str:
        """The path podman's ``--cgroup-parent`` takes (relative to the hierarchy root)."""
        d = self.dirs.get("memory") or self.dirs[""]
        mount = ROOT / "memory" if self.version == "v1" else ROOT
        return "/" + str(d.relative_to(mount))

    def _read(self, controller: str, name: str) -> str:
        d = self.dirs.get("" if self.version == "v2" else controller)
        try:
            return (d / name).read_text() if d else ""
        except OSError:
            return ""

    def hit(self) -> list[str]:
        """The limits the execution ran into: 'memory' (an OOM), 'pids' (a refused fork).

        'memory' is any OOM situation of the cgroup, whether the kernel killed a process or found none it may
        kill (the runner is exempt): memory no process maps (tmpfs files, SysV shm, memfds) still fills it.
        On cgroup v1 refused forks are counted in the task's own cgroup only (for a container, its child
        cgroup, gone by now), so there the peak decides: as many processes at once as allowed."""
        out = []
        mem = self._read("memory", "memory.events" if self.version == "v2" else "memory.oom_control")
        if _field(mem, "oom_kill") > 0 or _field(mem, "oom") > 0 or self._oom_events() > 0:
            out.append("memory")
        pids_max = _int(self._read("pids", "pids.max"))
        if _field(self._read("pids", "pids.events"), "max") > 0 or (
                self.version == "v1" and pids_max and _int(self._read("pids", "pids.peak")) >= pids_max):
            out.append("pids")
        return out

    def usage(self) -> dict[str, float]:
        """CPU seconds and peak memory (MB) of the whole tree."""
        if self.version == "v2":
            cpu = _field(self._read("", "cpu.stat"), "usage_usec") / 1e6
            peak = self._read("", "memory.peak").strip()
            mem = int(peak) if peak.isdigit() else 0
        else:
            raw = self._read("cpuacct", "cpuacct.usage").strip()
            cpu = int(raw) / 1e9 if raw.isdigit() else 0.0
            raw = self._read("memory", "memory.max_usage_in_bytes").strip()
            mem = int(raw) if raw.isdigit() else 0
        return {"cpu_s": round(cpu, 3), "peak_mem_mb": round(mem / 2**20, 1)}

    def kill_all(self) -> None:
        """SIGKILL every process still in the cgroup (a backstop: the namespaces normally took them)."""
        if self.version == "v2" and (self.dirs[""] / "cgroup.kill").exists():
            try:
                (self.dirs[""] / "cgroup.kill").write_text("1")
            except OSError:
                pass
            return
        for d in self.dirs.values():
            for procs in d.glob("**/cgroup.procs"):  # with the container engine's own child cgroups
                for pid in self._pids(procs.parent):
                    try:
                        os.kill(pid, 9)
                    except (ProcessLookupError, PermissionError):
                        pass

    @staticmethod
    def _pids(d: Path) -> list[int]:
        try:
            return [int(x) for x in (d / "cgroup.procs").read_text().split()]
        except OSError:
            return []

    def remove(self, wait_s: float = 5.0) -> None:
        """Remove the cgroup once empty (killing what is left)."""
        if self._oom_fd is not None:
            os.close(self._oom_fd)
            self._oom_fd = None
        deadline = time.monotonic() + wait_s
        for d in self.dirs.values():
            for sub in sorted((p for p in d.glob("**/") if p != d), key=lambda p: -len(p.parts)):
                _rmdir(sub, deadline)  # podman's own child cgroups
            _rmdir(d, deadline, self)


def _rmdir(d: Path, deadline: float, cg: ExecCgroup | None = None) -> None:
    while True:
        try:
            d.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                return
            if cg is not None:
                cg.kill_all()
            time.sleep(0.01)


def _int(text: str) -> int:
    return int(text.strip()) if text.strip().isdigit() else 0


def _field(text: str, key: str) -> int:
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == key and parts[1].isdigit():
            return int(parts[1])
    return 0


def usable_cores() -> int:
    """The cores this process may use: its CPU affinity, lowered to its cgroup's CPU quota where one is set (a
    container limited to 2 CPUs on a 64-core host sees 64 cores in its affinity)."""
    cores = len(os.sched_getaffinity(0))
    files: list[tuple[Path, Path | None]]  # (quota, period): v2 keeps both in cpu.max
    if (ROOT / "cgroup.controllers").is_file():
        files = [(d / "cpu.max", None) for d in (ROOT / _own_path("").lstrip("/"), ROOT)]
    else:
        files = [(d / "cpu.cfs_quota_us", d / "cpu.cfs_period_us")
                 for d in (ROOT / "cpu" / _own_path("cpu").lstrip("/"), ROOT / "cpu")]
    for quota_file, period_file in files:
        try:
            if period_file is None:
                quota, period = quota_file.read_text().split()[:2]
            else:
                quota, period = quota_file.read_text().strip(), period_file.read_text().strip()
            if quota not in ("max", "-1"):
                return max(1, min(cores, int(quota) // int(period)))
        except (OSError, ValueError):
            continue
    return cores
