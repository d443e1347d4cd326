"""Answers and load shared by the sandbox tests of every engine (test_sandbox.py, test_unprivileged.py): the cpu
clock's cases, a busy core beside them, the socket-family probe, and an answer hoarding a per-user quota beside
its neighbour."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psutil

BURN_THEN_FAIL = """import time
t = time.process_time()
while time.process_time() - t < 1.0:
    pass
raise SystemExit(1)
"""
SPIN = "while True:\n    pass\n"


@contextlib.contextmanager
def busy_core(loops: int = 2) -> Iterator[None]:
    """This thread, what it starts, and ``loops`` busy loops on one core: an execution started here gets at most
    1/(loops+1) of a core, so it runs at least that many times slower than alone, whatever else the machine does
    (two: the answer that burns 1.3 s of CPU takes at least 3.9 s, past its 3 s limit on the wall clock, and at
    least 20% of the core, what the 5x backstop needs, is left unless three more programs share that core)."""
    before = os.sched_getaffinity(0)
    core = min(before)
    os.sched_setaffinity(0, {core})  # pid 0: this thread alone; its children inherit it
    # a session each: with autogroup scheduling the loops of one session (this test's) share one scheduler entity
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
             for _ in range(loops)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()
        os.sched_setaffinity(0, before)


def clock_cases(run_one: Callable[[str, bool, float], Any]) -> dict[str, Any]:
    """Three answers under the cpu clock: one that burns 1 s of CPU and fails (limit 3 s), one that spins (limit
    2 s), one that sleeps (limit 1 s; it uses no CPU, so the 5x wall-clock backstop ends it)."""
    return {"burn-then-fail": run_one(BURN_THEN_FAIL, False, 3.0), "spin": run_one(SPIN, False, 2.0),
            "sleep": run_one("sleep 60", True, 1.0)}


def check_cpu_clock(res: dict[str, Any]) -> None:
    """Each verdict is the cpu clock's: assertions on CPU seconds and on the backstop, with margins, never on how
    fast the machine happened to be. The spinning answer is stopped at its 2 CPU seconds, or, on a machine so busy
    that it got less than a fifth of a core, at the 10 s backstop: never at 2 s of wall time with less CPU."""
    burn, spin, sleep = res["burn-then-fail"], res["spin"], res["sleep"]
    assert burn.fault is None and not burn.timed_out and burn.exit_code == 1, (burn.duration, burn.usage)
    assert spin.fault is None and spin.timed_out, (spin.duration, spin.usage)
    assert spin.usage.get("cpu_s", 0) >= 2.0 or spin.duration >= 9.5, (spin.duration, spin.usage)
    assert sleep.fault is None and sleep.timed_out and 4.5 <= sleep.duration < 30, sleep.duration


SOCKETS_PY = """import ctypes, errno, mmap, os, struct
libc = ctypes.CDLL(None, use_errno=True)
def attempt(fam, typ):  # socket(2) itself, the family as a full 64-bit register
    fd = libc.syscall(ctypes.c_long(41), ctypes.c_long(fam), ctypes.c_long(typ), ctypes.c_long(0))
    if fd >= 0:
        os.close(fd)
        return 'ok'
    return errno.errorcode.get(ctypes.get_errno(), '?')
for name, fam, typ in (('unix', 1, 1), ('inet', 2, 2), ('inet6', 10, 2), ('netlink', 16, 3), ('vsock', 40, 1),
                       ('vsock-high-bits', 0x100000028, 1), ('packet', 17, 2), ('key', 15, 3), ('alg', 38, 5),
                       ('bluetooth', 31, 1), ('tipc', 30, 2), ('appletalk', 5, 2), ('max', 45, 1)):
    print(name, attempt(fam, typ))
# i386 ABI (int 0x80): socketcall(SYS_SOCKET, [AF_VSOCK, SOCK_STREAM, 0]) and socket(AF_VSOCK) as syscall 359;
# code and arguments in one page below 4 GB (MAP_32BIT), where 32-bit pointers reach
page = mmap.mmap(-1, 4096, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x40,
                 prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
base = ctypes.addressof(ctypes.c_char.from_buffer(page))
assert base < 2**32
args = struct.pack('<3I', 40, 1, 0)
calls = {'i386-socketcall': bytes.fromhex('53b866000000bb01000000b9') + struct.pack('<I', base + 512),
         'i386-socket': bytes.fromhex('53b867010000bb28000000b90100000031d2')}
for name, head in calls.items():
    code = head + bytes.fromhex('cd805bc3')
    page.seek(0)
    page.write(code)
    page.seek(512)
    page.write(args)
    fd = ctypes.CFUNCTYPE(ctypes.c_int)(base)()
    if fd >= 0:
        os.close(fd)
    print(name, 'ok' if fd >= 0 else errno.errorcode.get(-fd, '?'))
"""


def check_sockets(log: str) -> None:
    """What :data:`SOCKETS_PY` printed: the four families a Python program uses open (or fail for a reason of
    their own, never the policy's EPERM); every other attempt fails with EPERM."""
    got = dict(ln.split() for ln in log.splitlines() if len(ln.split()) == 2)
    assert len(got) == 15, log
    allowed = ("unix", "inet", "inet6", "netlink")
    assert {k: got[k] != "EPERM" for k in allowed} == dict.fromkeys(allowed, True), got
    assert {k: v for k, v in got.items() if k not in allowed} == {k: "EPERM" for k in got if k not in allowed}, got


HOARD_INOTIFY = ("import ctypes, time\nlibc = ctypes.CDLL(None)\nheld = []\nwhile len(held) < 4096:\n"
                 "    fd = libc.inotify_init()\n    if fd < 0:\n        break\n    held.append(fd)\n"
                 "print('held', len(held), flush=True)\ntime.sleep(600)\n")  # until it is killed
ONE_INOTIFY = "import ctypes, sys\nsys.exit(0 if ctypes.CDLL(None).inotify_init() >= 0 else 1)\n"


def _inotify_hoarder(min_fds: int) -> int | None:
    """The pid of the process holding the most inotify instances, at least ``min_fds``."""
    counts: dict[int, int] = {}
    for p in psutil.process_iter():
        try:
            n = sum(1 for fd in os.listdir(f"/proc/{p.pid}/fd")
                    if os.readlink(f"/proc/{p.pid}/fd/{fd}") == "anon_inode:inotify")
        except OSError:
            continue
        if n >= min_fds:
            counts[p.pid] = n
    return max(counts, key=counts.__getitem__) if counts else None


def hoard_beside(run_one: Callable[[str, float], Any], min_fds: int = 16) -> dict[str, Any]:
    """An answer that takes every inotify instance it can and holds them, and, once its count holds still, a
    neighbour needing one: ``{"alone": exit code of the neighbour run alone first, "held": how many the hoarder
    got (its own words), "neighbour": its exit code beside the hoarder}``. ``run_one(python_code, wall_s)`` runs one
    execution; the hoarder is killed by pid (host or caller's namespace) once the neighbour is done, so load cannot
    make it let go first."""
    out: dict[str, Any] = {"alone": run_one(ONE_INOTIFY, 60).exit_code}
    hoard = threading.Thread(target=lambda: out.setdefault("hoarder", run_one(HOARD_INOTIFY, 900)), daemon=True)
    hoard.start()
    deadline, last = time.monotonic() + 300, None
    while time.monotonic() < deadline:  # until the hoarder holds all it could get, its count steady
        pid = _inotify_hoarder(min_fds)
        try:
            now = (pid, len(os.listdir(f"/proc/{pid}/fd"))) if pid else None
        except OSError:  # it ended meanwhile
            now = None
        if now and now == last:
            break
        last = now
        time.sleep(0.5)
    try:
        if last is not None:
            out["neighbour"] = run_one(ONE_INOTIFY, 60).exit_code
    finally:
        if last is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(last[0], signal.SIGKILL)
        hoard.join(120)
    found = re.search(r"held (\d+)", out["hoarder"].log) if "hoarder" in out else None
    out["held"] = int(found.group(1)) if found else 0
    out.pop("hoarder", None)
    return out
