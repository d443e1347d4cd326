"""Extract an untrusted tarball without trusting ``tarfile``'s extraction filters.

``tarfile``'s ``filter="data"`` checks links with ``os.path.realpath``, which on interpreters without the fix for
CVE-2025-4517 (3.11.7 among them) stops resolving once a chain of links exceeds PATH_MAX while the kernel still
follows it: a crafted archive then writes anywhere the extracting user can. Here every member is checked by this
module before anything is written, and nothing is extracted through ``tarfile``'s own extraction code:

* every header is checked here before ``tarfile`` acts on it: a size is never negative (a base-256 size below 0
  moves ``tarfile``'s offset backwards: the same members read again and again, past every cap), pax and GNU
  long-name headers are bounded (size, and how many in a row), and a pax header's records are parsed here first,
  linearly, and refused unless well-formed with no long run of digits (``tarfile``'s own regular expressions are
  quadratic on such input before Python 3.11.10: CVE-2024-6232), so that nothing depends on the Python patch level;
  the headers are counted and their parsing has a deadline;
* names are relative, hold no ``..``, are bounded (component, depth and whole name), and are unique;
* a member is a regular file, a folder, a symbolic link or a hard link (no devices, FIFOs, sparse files);
* no member's path passes through a symbolic link of the archive (so no write can follow one);
* a symbolic link's target, resolved through the archive's own links (the destination is empty), stays inside
  the destination; a hard link names an earlier regular file of the archive;
* the total size of the files and the number of members are capped (the headers declare the sizes, and a file's
  data is read up to its declared size only), checked before the first byte is written;
* files are created with ``O_NOFOLLOW | O_EXCL`` relative to folder descriptors opened with ``O_NOFOLLOW``, and the
  links are made last, so a write never passes through a link even if a check above were wrong.

Modes keep only the owner's executable bit (like the ``data`` filter: no setuid, no group/other write);
owners are not restored.
"""

from __future__ import annotations

import gzip
import lzma
import os
import posixpath
import re
import tarfile
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlbench_kit.errors import MLBenchError

# The 14 ML-Bench tarballs: at most 2,097 members (dgl) and 34.5 MB of files (muzic). The defaults are ~50x that.
DEFAULT_MAX_BYTES = 2 << 30
DEFAULT_MAX_MEMBERS = 100_000
MAX_NAME = 4096       # bytes of a whole member name
MAX_COMPONENT = 255   # bytes of one path component (NAME_MAX)
MAX_LINK_HOPS = 40    # like the kernel's ELOOP limit
MAX_META = 64 << 10   # bytes of one pax or GNU long-name header (real ones hold well under 1 KiB)
MAX_META_RUN = 16     # such headers in a row before one member (each is read, and held, while the next is parsed)
MAX_DEPTH = 256       # components of a member name: walks of the extracted tree stay shallow (the 14 hold <= 20)
MAX_DIGITS = 40       # consecutive digits in a pax header (a length, a time: at most ~30)
DEFAULT_MAX_SECONDS = 300.0  # to read every header (the 14 tarballs: under 2 s each)
_DIGITS = re.compile(rb"[0-9]{%d}" % (MAX_DIGITS + 1))  # linear: at most MAX_DIGITS + 1 steps from each byte


@dataclass(frozen=True)
class Limits:
    """Caps on what one tarball may hold."""
    max_bytes: int = DEFAULT_MAX_BYTES
    max_members: int = DEFAULT_MAX_MEMBERS
    max_seconds: float = DEFAULT_MAX_SECONDS


class _Refused(Exception):
    def __init__(self, member: str, why: str) -> None:
        super().__init__(why)
        self.member, self.why = member, why


def safe_extract(tar: str | Path, dest: str | Path, limits: Limits | None = None, under: str | None = None,
                 any_link: bool = False) -> None:
    """Extract ``tar`` into ``dest`` (created; must not exist or be empty) after checking every member.

    ``under``: every member must lie in this top-level folder of the archive, and its links must stay inside it.
    ``any_link``: symbolic links keep whatever target they name, inside the destination or not (a sandbox's files,
    kept for its next execution, which resolves them inside the sandbox); they are still never passed through nor
    followed here. Raises one MLBenchError naming the tarball and the offending member; nothing is written then."""
    tar, dest = Path(tar), Path(dest)
    limits = limits or Limits()
    # the caps of this call, read by every header as tarfile parses it (tarfile.open reads the first one already)
    info = type("_Info", (_BoundedInfo,), {"limits": limits, "deadline": time.monotonic() + limits.max_seconds})
    try:
        with tarfile.open(tar, tarinfo=info) as tf:
            plan = _check(tf, limits, under, any_link)
            dest.mkdir(parents=True, exist_ok=True)
            if any(dest.iterdir()):
                raise MLBenchError("extraction needs an empty destination", str(dest))
            _extract(tf, plan, dest)
    except _Refused as exc:
        member = exc.member if len(exc.member) <= 300 else exc.member[:300] + "..."
        raise MLBenchError(f"refused member {member!r}: {exc.why}", str(tar),
                           "this tarball is unsafe or damaged: use the repository's own archive "
                           "(or raise --tar-max-mb / --tar-max-members if it is only large)") from None
    except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile, lzma.LZMAError, RecursionError, ValueError,
            OverflowError) as exc:  # whatever else a damaged header makes tarfile raise
        why = str(exc) if len(str(exc)) <= 300 else str(exc)[:300] + "..."
        raise MLBenchError(f"not a readable tarball ({exc.__class__.__name__}: {why})", str(tar),
                           "this tarball is damaged: use the repository's own archive") from None


_META_TYPES = {tarfile.GNUTYPE_LONGNAME: "GNU long-name", tarfile.GNUTYPE_LONGLINK: "GNU long-link",
               tarfile.XHDTYPE: "pax", tarfile.XGLTYPE: "pax global", tarfile.SOLARIS_XHDTYPE: "pax"}


class _BoundedInfo(tarfile.TarInfo):
    """A member header checked before ``tarfile`` acts on it (see the module's docstring): ``tarfile`` reads a pax or
    long-name header's whole declared size into memory (a 10 MB gzip declares gigabytes), moves its offset by any
    size a header declares, and parses pax records with regular expressions."""

    limits: Limits = Limits()
    deadline: float = float("inf")

    def _proc_member(self, tf: tarfile.TarFile) -> tarfile.TarInfo:
        kind = _META_TYPES.get(self.type)
        run = getattr(tf, "_mlbench_meta_run", 0) + 1 if kind else 0
        tf._mlbench_meta_run = run  # type: ignore[attr-defined]
        headers = getattr(tf, "_mlbench_headers", 0) + (0 if kind else 1)
        tf._mlbench_headers = headers  # type: ignore[attr-defined]
        if self.size < 0:
            raise _Refused(self.name, f"a negative size ({self.size})")
        if kind and self.size > MAX_META:
            raise _Refused(self.name, f"a {kind} header of {self.size} bytes (at most {MAX_META})")
        if run > MAX_META_RUN:
            raise _Refused(self.name, f"more than {MAX_META_RUN} pax or long-name headers before one member")
        if headers > self.limits.max_members:  # members _check never sees (empty names) count too
            raise _Refused(self.name, f"more than {self.limits.max_members} members (the cap)")
        if time.monotonic() > self.deadline:
            raise _Refused(self.name, f"reading its headers took more than {self.limits.max_seconds:g} s")
        start = tf.offset
        out = super()._proc_member(tf)  # type: ignore[misc]
        if out.size < 0 or tf.offset <= start:
            raise _Refused(out.name, f"a header that moves the archive's offset backwards (size {out.size})")
        return out

    def _proc_pax(self, tf: tarfile.TarFile) -> tarfile.TarInfo:
        buf = tf.fileobj.read(self._block(self.size))  # type: ignore[attr-defined]
        _check_pax(buf, self.size, self.name)
        read, tf.fileobj = tf.fileobj, _Replay(tf.fileobj, buf)  # tarfile reads the checked bytes
        try:
            return super()._proc_pax(tf)  # type: ignore[misc]
        finally:
            tf.fileobj = read


class _Replay:
    """``fileobj`` whose next ``read`` returns ``buf``, already read from it."""

    def __init__(self, fileobj: Any, buf: bytes) -> None:
        self._fileobj = fileobj
        self._buf: bytes | None = buf

    def read(self, n: int = -1) -> bytes:
        if self._buf is not None:
            buf, self._buf = self._buf, None
            return buf
        return bytes(self._fileobj.read(n))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fileobj, name)


def _check_pax(buf: bytes, size: int, member: str) -> None:
    """Refuse a pax header unless its records (``LENGTH KEYWORD=VALUE`` and a newline) exactly fill its size, NULs
    after, with no run of more than :data:`MAX_DIGITS` digits, a ``size`` that is a plain number, and no sparse-file
    keyword. Linear in the header's size."""
    def bad(why: str) -> _Refused:
        return _Refused(member, f"a malformed pax header ({why})")
    if len(buf) < size:
        raise bad("cut short")
    if buf[size:].strip(b"\0"):
        raise bad("data after its records")
    if _DIGITS.search(buf):
        raise bad(f"a run of more than {MAX_DIGITS} digits")
    pos = 0
    while pos < size:
        if not buf[pos:size].strip(b"\0"):
            break
        sp = buf.find(b" ", pos, size)
        if sp <= pos or not buf[pos:sp].isdigit():
            raise bad(f"no record length at byte {pos}")
        end = pos + int(buf[pos:sp])
        eq = buf.find(b"=", sp + 1, end)
        if end > size or end <= sp + 1 or buf[end - 1:end] != b"\n" or eq <= sp + 1:
            raise bad(f"a broken record at byte {pos}")
        key, value = buf[sp + 1:eq], buf[eq + 1:end - 1]
        if key.startswith(b"GNU.sparse"):
            raise bad("a sparse file")
        if key == b"size" and not value.isdigit():
            raise bad(f"size {value[:40]!r}")
        pos = end


def _norm(m: tarfile.TarInfo) -> str:
    name = m.name
    if "\0" in name:
        raise _Refused(name, "a NUL byte in the name")
    if len(name.encode("utf-8", "surrogateescape")) > MAX_NAME:
        raise _Refused(name, f"name longer than {MAX_NAME} bytes")
    if name.startswith("/") or (len(name) > 1 and name[1] == ":"):
        raise _Refused(name, "an absolute name")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise _Refused(name, "a '..' component")
    if len(parts) > MAX_DEPTH:
        raise _Refused(name, f"more than {MAX_DEPTH} levels of folders")
    if any(len(p.encode("utf-8", "surrogateescape")) > MAX_COMPONENT for p in parts):
        raise _Refused(name, f"a path component longer than {MAX_COMPONENT} bytes")
    return "/".join(parts)


def _resolve(path: str, links: dict[str, str], member: str) -> str:
    """``path`` (relative to the destination) with the archive's symbolic links followed, as the kernel would in a
    destination holding only this archive; refuses a path that leaves the destination. ``links`` maps a link's
    name to its target joined onto the link's folder (no member passes through a link, so that folder is real)."""
    todo = [p for p in path.split("/") if p not in ("", ".")]
    done: list[str] = []
    hops = 0
    while todo:
        part = todo.pop(0)
        if part == "..":
            if not done:
                raise _Refused(member, "a link that points outside the destination")
            done.pop()
            continue
        cur = "/".join([*done, part])
        if cur in links:
            hops += 1
            if hops > MAX_LINK_HOPS:
                raise _Refused(member, "too many levels of links")
            todo = [p for p in links[cur].split("/") if p not in ("", ".")] + todo
            done = []
            continue
        done.append(part)
    return "/".join(done)


def _within(path: str, root: str) -> bool:
    return not root or path == root or path.startswith(root + "/")


def _check(tf: tarfile.TarFile, limits: Limits, under: str | None,
           any_link: bool = False) -> list[tuple[tarfile.TarInfo, str]]:
    plan: list[tuple[tarfile.TarInfo, str]] = []
    kinds: dict[str, str] = {}  # normalized name -> "dir" | "file" | "sym"
    parents: set[str] = set()   # every proper prefix of a member's name
    links: dict[str, str] = {}  # symbolic link name -> target joined onto its folder
    total = 0
    root = (under or "").strip("/")
    for m in tf:  # streamed: the caps hold before the next header is read
        if len(plan) >= limits.max_members:
            raise _Refused(m.name, f"more than {limits.max_members} members (the cap)")
        name = _norm(m)
        if not name:
            if m.isdir():
                continue
            raise _Refused(m.name, "an empty name")
        if not _within(name, root):
            raise _Refused(m.name, f"outside the archive's folder {root!r}")
        if m.issparse() or not (m.isreg() or m.isdir() or m.issym() or m.islnk()):
            raise _Refused(m.name, "not a regular file, folder or link (a device, FIFO or sparse member)")
        kind = "dir" if m.isdir() else "sym" if m.issym() else "file"
        parts = name.split("/")
        for i in range(1, len(parts)):
            prefix = "/".join(parts[:i])
            if kinds.get(prefix, "dir") == "sym":
                raise _Refused(m.name, f"its path passes through the link {prefix!r}")
            if kinds.get(prefix, "dir") != "dir":
                raise _Refused(m.name, f"its path passes through the file {prefix!r}")
        if name in kinds and not (kind == "dir" and kinds[name] == "dir"):
            raise _Refused(m.name, "a second member of the same name")
        if kind != "dir" and name in parents:
            raise _Refused(m.name, "a file or link where an earlier member needs a folder")
        if m.isreg():
            total += m.size
            if total > limits.max_bytes:
                raise _Refused(m.name, f"the files exceed {limits.max_bytes} bytes (the cap)")
        elif m.islnk():
            target = _norm_link(m)
            if kinds.get(target) != "file":
                raise _Refused(m.name, f"a hard link to {m.linkname!r}, which is no earlier regular file")
            if not _within(target, root):
                raise _Refused(m.name, f"a hard link outside the archive's folder {root!r}")
        elif m.issym():
            if not m.linkname or (m.linkname.startswith("/") and not any_link):
                raise _Refused(m.name, f"a link to an absolute path {m.linkname!r}")
            if "\0" in m.linkname or len(m.linkname.encode("utf-8", "surrogateescape")) > MAX_NAME:
                raise _Refused(m.name, "a link target that is too long")
            if not any_link:
                links[name] = posixpath.join(posixpath.dirname(name), m.linkname)
        kinds[name] = kind
        parents.update("/".join(parts[:i]) for i in range(1, len(parts)))
        plan.append((m, name))
    # every link resolved through all of them (a later link may redirect an earlier one's target)
    for name, target in links.items():
        if not _within(_resolve(target, links, name), root):
            raise _Refused(name, f"a link that points outside the archive's folder {root!r}")
    return plan


def _norm_link(m: tarfile.TarInfo) -> str:
    if m.linkname.startswith("/"):
        raise _Refused(m.name, f"a hard link to an absolute path {m.linkname!r}")
    parts = [p for p in m.linkname.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise _Refused(m.name, "a hard link with a '..' component")
    return "/".join(parts)


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _open_dir(root_fd: int, parts: list[str]) -> int:
    """A descriptor of the folder ``parts`` under ``root_fd``, made as needed, never through a link."""
    fd = os.dup(root_fd)
    try:
        for p in parts:
            try:
                os.mkdir(p, 0o755, dir_fd=fd)
            except FileExistsError:
                pass
            nfd = os.open(p, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd


def _extract(tf: tarfile.TarFile, plan: list[tuple[tarfile.TarInfo, str]], dest: Path) -> None:
    root_fd = os.open(dest, _DIR_FLAGS)
    try:
        for m, name in plan:  # folders and files, in archive order (one pass over a compressed stream)
            parts = name.split("/")
            if m.isdir():
                os.close(_open_dir(root_fd, parts))
            elif m.isreg():
                _write_file(tf, m, root_fd, parts)
        for m, name in plan:  # then the links: no write above can pass through one
            parts = name.split("/")
            if m.islnk():
                src = _norm_link(m).split("/")
                sfd, dfd = _open_dir(root_fd, src[:-1]), _open_dir(root_fd, parts[:-1])
                try:
                    os.link(src[-1], parts[-1], src_dir_fd=sfd, dst_dir_fd=dfd, follow_symlinks=False)
                finally:
                    os.close(sfd)
                    os.close(dfd)
            elif m.issym():
                dfd = _open_dir(root_fd, parts[:-1])
                try:
                    os.symlink(m.linkname, parts[-1], dir_fd=dfd)
                finally:
                    os.close(dfd)
    finally:
        os.close(root_fd)


def _write_file(tf: tarfile.TarFile, m: tarfile.TarInfo, root_fd: int, parts: list[str]) -> None:
    src = tf.extractfile(m)
    assert src is not None  # a regular member has data
    dfd = _open_dir(root_fd, parts[:-1])
    try:
        mode = 0o755 if m.mode & 0o100 else 0o644
        fd = os.open(parts[-1], os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode,
                     dir_fd=dfd)
    finally:
        os.close(dfd)
    with os.fdopen(fd, "wb") as out, src:
        left = m.size
        while left > 0:
            chunk = src.read(min(left, 1 << 20))
            if not chunk:
                raise tarfile.ReadError(f"unexpected end of data in {m.name!r}")
            out.write(chunk)
            left -= len(chunk)
        os.fchmod(out.fileno(), mode)
        os.utime(out.fileno(), (m.mtime, m.mtime))
