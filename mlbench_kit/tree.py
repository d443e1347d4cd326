"""Walk, copy and remove folder trees that untrusted code or an archive made: iteratively, at any depth.

Python 3.11's ``os.walk``, ``shutil.copytree`` and ``shutil.rmtree`` recurse once per level, so a folder 1,100
levels deep (one ``mkdir -p`` in an agent's action) raises ``RecursionError``, which ``rmtree(ignore_errors=True)``
does not catch. Nothing here recurses, no symbolic link is followed, and :func:`remove` holds a bounded number of
descriptors and never builds a path longer than the tree's top: a tree deeper than ``PATH_MAX`` is removed too.
"""

from __future__ import annotations

import os
import stat
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_CUT_DEPTH = 64  # remove(): folders open at once; a deeper one is moved up to the top and removed from there


def walk(root: str | Path, onerror: Callable[[OSError], None] | None = None
         ) -> Iterator[tuple[str, list[str], list[str]]]:
    """``os.walk(root)`` top-down without recursion: ``(dirpath, dirnames, filenames)``, links to folders listed
    in ``filenames`` and never entered; ``dirnames`` may be pruned in place. A folder that cannot be listed is
    skipped, or passed to ``onerror`` (which may raise)."""
    stack = [os.fspath(root)]
    while stack:
        top = stack.pop()
        dirs: list[str] = []
        files: list[str] = []
        try:
            with os.scandir(top) as it:
                for e in it:
                    (dirs if e.is_dir(follow_symlinks=False) else files).append(e.name)
        except OSError as exc:
            if onerror is not None:
                onerror(exc)
            continue
        yield top, dirs, files
        stack.extend(os.path.join(top, d) for d in reversed(dirs))


def weigh(root: str | Path, max_entries: int) -> tuple[int, int]:
    """``(bytes, entries)`` under ``root`` as the disk holds them (allocated blocks; links not followed), ``root``
    itself not counted. Counting stops past ``max_entries``: a larger tree reads as ``max_entries + 1``. Raises
    OSError for a folder that cannot be listed."""
    size = entries = 0
    for top, dirs, files in walk(root, onerror=_raise):
        for name in dirs + files:
            entries += 1
            if entries > max_entries:
                return size, entries
            size += os.lstat(os.path.join(top, name)).st_blocks * 512
    return size, entries


def copy(src: str | Path, dst: str | Path) -> None:
    """Copy the tree ``src`` to ``dst`` (which must not exist): folders, regular files (mode bits but setuid/setgid,
    times) and symbolic links as links; the copy belongs to the caller. Other entries (FIFOs, devices, sockets) are
    left out. Raises OSError."""
    src, dst = os.fspath(src), os.fspath(dst)
    os.mkdir(dst, 0o700)
    folders = [(src, dst)]
    for top, dirs, files in walk(src, onerror=_raise):
        here = os.path.join(dst, os.path.relpath(top, src))
        for name in dirs:
            os.mkdir(os.path.join(here, name), 0o700)
            folders.append((os.path.join(top, name), os.path.join(here, name)))
        for name in files:
            s, d = os.path.join(top, name), os.path.join(here, name)
            st = os.lstat(s)
            if stat.S_ISLNK(st.st_mode):
                os.symlink(os.readlink(s), d)
            elif stat.S_ISREG(st.st_mode):
                _copy_file(s, d, st)
    for s, d in reversed(folders):  # modes last: a read-only folder of the checkout is still filled first
        st = os.stat(s, follow_symlinks=False)
        os.chmod(d, stat.S_IMODE(st.st_mode) & 0o1777)
        os.utime(d, ns=(st.st_atime_ns, st.st_mtime_ns))


def _copy_file(s: str, d: str, st: os.stat_result) -> None:
    fd = os.open(s, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        out = os.open(d, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            while os.sendfile(out, fd, None, 1 << 24):
                pass
            os.fchmod(out, stat.S_IMODE(st.st_mode) & 0o1777)
            os.utime(out, ns=(st.st_atime_ns, st.st_mtime_ns))
        finally:
            os.close(out)
    finally:
        os.close(fd)


def _raise(exc: OSError) -> None:
    raise exc


def remove(path: str | Path) -> None:
    """Remove ``path`` and everything under it, whatever its depth, without following links; a missing path is no
    error. A folder its owner made unreadable is opened up (its mode only) to be emptied. Raises OSError when
    something cannot be removed."""
    path = os.fspath(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(path)
        return
    top = _open_dir(path, None)
    try:
        while os.listdir(top):  # cut-off subtrees land in the top folder: empty it until nothing is left
            _empty(top)
    finally:
        os.close(top)
    os.rmdir(path)


def _open_dir(name: str, dir_fd: int | None) -> int:
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except PermissionError:
        os.chmod(name, 0o700, dir_fd=dir_fd)  # a folder, just checked with lstat, and nothing runs in it now
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)


def _empty(top: int) -> None:
    """Remove the entries of the folder ``top``. Folders deeper than :data:`_CUT_DEPTH` are renamed into ``top``
    instead of entered, so at most that many descriptors are open; the caller empties ``top`` again for them."""
    stack: list[tuple[int, Iterator[str], str]] = [(os.dup(top), iter(os.listdir(top)), "")]
    try:
        while stack:
            fd, names, own_name = stack[-1]
            name = next(names, None)
            if name is None:
                stack.pop()
                os.close(fd)
                if stack:
                    os.rmdir(own_name, dir_fd=stack[-1][0])
                continue
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if not stat.S_ISDIR(st.st_mode):
                os.unlink(name, dir_fd=fd)
            elif len(stack) >= _CUT_DEPTH:
                os.rename(name, f".mlbench-cut-{uuid.uuid4().hex}", src_dir_fd=fd, dst_dir_fd=top)
            else:
                sub = _open_dir(name, fd)
                try:
                    stack.append((sub, iter(os.listdir(sub)), name))
                except BaseException:
                    os.close(sub)
                    raise
    finally:
        for frame in stack:
            os.close(frame[0])
