"""An idmapped bind mount: ``python3 -I -S idmap.py SRC DST FROM_UID TO_UID FROM_GID TO_GID``.

The stage script (as root, in the execution's private mount namespace) binds the pristine checkout, whose files
belong to the run's sandbox uid, at ``DST`` so that they show as belonging to the execution's own uid. The overlay
is then built on that mount, so every execution can run as a uid of its own (per-user kernel quotas are not
shared) while all of them share one lower layer, unchanged on disk. util-linux gained ``X-mount.idmap`` only in
2.39, so the new mount API is called directly: a user namespace carrying the one mapping (``FROM -> TO``), then
``open_tree(OPEN_TREE_CLONE)``, ``mount_setattr(MOUNT_ATTR_IDMAP)`` and ``move_mount``. Standard library only, so
any Python 3.9+ runs it; exit status 3 means the kernel or the filesystem refused (the caller falls back).
"""

from __future__ import annotations

import ctypes
import os
import sys

# the same numbers on every architecture but alpha (the "unified" syscall table, Linux 5.2 / 5.12)
SYS_OPEN_TREE, SYS_MOVE_MOUNT, SYS_MOUNT_SETATTR = 428, 429, 442
OPEN_TREE_CLONE, OPEN_TREE_CLOEXEC = 1, 0o2000000
AT_FDCWD, AT_EMPTY_PATH = -100, 0x1000
MOVE_MOUNT_F_EMPTY_PATH = 0x4
MOUNT_ATTR_IDMAP = 0x00100000
CLONE_NEWUSER = 0x10000000


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64), ("propagation", ctypes.c_uint64),
                ("userns_fd", ctypes.c_uint64)]


def _userns(uid_map: str, gid_map: str) -> int:
    """A file descriptor of a new user namespace holding the given maps (its one process is gone by then)."""
    libc = ctypes.CDLL(None, use_errno=True)
    ready_r, ready_w = os.pipe()
    done_r, done_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: enter a new user namespace, say so, wait until the parent has its fd
        os.close(ready_r)
        os.close(done_w)
        ok = libc.unshare(CLONE_NEWUSER) == 0
        os.write(ready_w, b"1" if ok else b"0")
        os.read(done_r, 1)
        os._exit(0)
    os.close(ready_w)
    os.close(done_r)
    try:
        if os.read(ready_r, 1) != b"1":
            raise OSError("unshare(CLONE_NEWUSER) failed")
        with open(f"/proc/{pid}/uid_map", "w") as f:
            f.write(uid_map)
        with open(f"/proc/{pid}/gid_map", "w") as f:
            f.write(gid_map)
        return os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        os.close(done_w)
        os.close(ready_r)
        os.waitpid(pid, 0)


def _fail(what: str) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, f"{what}: {os.strerror(err)}")


def idmapped_bind(src: str, dst: str, from_uid: int, to_uid: int, from_gid: int, to_gid: int) -> None:
    """Bind ``src`` at ``dst`` with files of ``from_uid``/``from_gid`` shown (and written) as ``to_uid``/``to_gid``;
    every other owner shows as the overflow id."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    long = ctypes.c_long  # syscall(2) is variadic: every argument a full register wide, sizes as size_t
    ns = _userns(f"{from_uid} {to_uid} 1\n", f"{from_gid} {to_gid} 1\n")
    tree = libc.syscall(long(SYS_OPEN_TREE), long(AT_FDCWD), ctypes.c_char_p(src.encode()),
                        long(OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC))
    if tree < 0:
        raise _fail(f"open_tree {src}")
    attr = _MountAttr(MOUNT_ATTR_IDMAP, 0, 0, ns)
    if libc.syscall(long(SYS_MOUNT_SETATTR), long(tree), ctypes.c_char_p(b""), long(AT_EMPTY_PATH),
                    ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr))) < 0:
        raise _fail(f"mount_setattr(MOUNT_ATTR_IDMAP) {src}")
    if libc.syscall(long(SYS_MOVE_MOUNT), long(tree), ctypes.c_char_p(b""), long(AT_FDCWD),
                    ctypes.c_char_p(dst.encode()), long(MOVE_MOUNT_F_EMPTY_PATH)) < 0:
        raise _fail(f"move_mount {dst}")
    os.close(tree)
    os.close(ns)


def main(argv: list[str]) -> int:
    src, dst, *ids = argv
    try:
        idmapped_bind(src, dst, *(int(i) for i in ids))
    except OSError as exc:
        print(f"mlbench idmap: {exc}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
