"""Repository tarballs are untrusted data (issue 30, item 1): every member is checked before anything is written,
whatever the running Python's tarfile filter does (3.11.7 lacks the fix for CVE-2025-4517)."""

import gzip
import io
import json
import os
import tarfile
from pathlib import Path

import pytest

from mlbench_kit.cli import main
from mlbench_kit.errors import MLBenchError
from mlbench_kit.untar import DEFAULT_MAX_BYTES, Limits, safe_extract


def _tar(path: Path, members: list[tuple[str, str, object]]) -> Path:
    """members: (kind, name, data-or-linkname); kinds file, dir, sym, lnk, fifo, chr."""
    with tarfile.open(path, "w:gz", format=tarfile.GNU_FORMAT) as tf:
        for kind, name, arg in members:
            ti = tarfile.TarInfo(name)
            if kind == "file":
                data = arg if isinstance(arg, bytes) else str(arg).encode()
                ti.size, ti.mode = len(data), 0o4777  # setuid and world-writable: stripped on extraction
                tf.addfile(ti, io.BytesIO(data))
                continue
            ti.type = {"dir": tarfile.DIRTYPE, "sym": tarfile.SYMTYPE, "lnk": tarfile.LNKTYPE,
                       "fifo": tarfile.FIFOTYPE, "chr": tarfile.CHRTYPE}[kind]
            ti.linkname = str(arg or "")
            tf.addfile(ti)
    return path


def _files_under(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")} if root.exists() else set()


def _refused(tar: Path, dest: Path, member: str, limits: Limits | None = None) -> str:
    with pytest.raises(MLBenchError) as ei:
        safe_extract(tar, dest, limits)
    msg = ei.value.render()
    assert str(tar) in msg and member in msg, msg
    assert _files_under(dest) == set()  # nothing was written, not even the harmless members before it
    return msg


def _chain(prefix: str, up_from_prefix: int) -> list[tuple[str, str, object]]:
    """The published shape of CVE-2025-4517: 16 levels of long folder names, each reached through a one-letter
    link, so that realpath() gives up (PATH_MAX) while the kernel follows; then a link up through all of them, a
    link from it to ``outside`` (``up_from_prefix`` levels above ``prefix``) and a file written through it."""
    comp, steps = "d" * 247, "abcdefghijklmnop"
    members: list[tuple[str, str, object]] = [("file", prefix + "harmless.txt", "x")]
    path = ""
    for s in steps:
        members.append(("dir", prefix + os.path.join(path, comp), None))
        members.append(("sym", prefix + os.path.join(path, s), comp))
        path = os.path.join(path, comp)
    linkpath = os.path.join(*steps, "l" * 254)
    members.append(("sym", prefix + linkpath, "../" * len(steps)))
    members.append(("sym", prefix + "escape", linkpath + "/.." * up_from_prefix + "/outside"))
    members.append(("file", prefix + "escape/pwned", "owned"))
    return members


def test_cve_2025_4517_symlink_chain_writes_nothing_outside(tmp_path):
    dest, outside = tmp_path / "a" / "dest", tmp_path / "outside"
    outside.mkdir()
    tar = _tar(tmp_path / "chain.tar.gz", _chain("", 2))
    msg = _refused(tar, dest, "'a/b/c/")  # the first member reached through a link of the archive
    assert "passes through the link" in msg
    assert _files_under(outside) == set()


def test_env_build_with_the_chain_tarball_writes_nothing_outside(tmp_path, capsys):
    """Through `mlbench env build --tarballs`: on Python 3.11.7 the old extractall(filter="data") wrote
    outside/pwned here."""
    recipe = tmp_path / "recipes" / "r.yaml"
    recipe.parent.mkdir()
    recipe.write_text("repo: evil\ncheckout: {github: https://github.com/x/evil, commit: " + "a" * 40 + "}\n")
    (tmp_path / "tarballs").mkdir()
    (tmp_path / "outside").mkdir()
    # unpacked in c/envs/evil-<hash>/unpack/evil: five levels below tmp_path
    _tar(tmp_path / "tarballs" / "evil.tar.gz", _chain("evil/", 5))
    assert main(["env", "build", "--recipes", str(recipe.parent), "--cache", str(tmp_path / "c"),
                 "--tarballs", str(tmp_path / "tarballs")]) == 2
    assert "evil.tar.gz: refused member 'evil/a/b/c/" in capsys.readouterr().err
    assert _files_under(tmp_path / "outside") == set()


@pytest.mark.parametrize("members, member, why", [
    ([("file", "../evil", "x")], "../evil", "'..'"),
    ([("file", "ok/../../evil", "x")], "ok/../../evil", "'..'"),
    ([("file", "/tmp/evil-abs", "x")], "/tmp/evil-abs", "absolute"),
    ([("sym", "passwd", "/etc/passwd")], "passwd", "absolute"),
    ([("lnk", "passwd", "/etc/passwd")], "passwd", "hard link"),
    ([("lnk", "passwd", "../../../../etc/passwd")], "passwd", "hard link"),
    ([("sym", "up", "../outside")], "up", "outside"),
    # lexically inside, really outside: r is the destination itself, so r/.. is its parent
    ([("sym", "r", "."), ("sym", "esc", "r/..")], "esc", "outside"),
    ([("sym", "sub", "x/y/z"), ("sym", "esc", "sub/../../../..")], "esc", "outside"),
    ([("sym", "dir", "."), ("file", "dir/file", "x")], "dir/file", "passes through the link"),
    ([("dir", "d", None), ("file", "d/f", "x"), ("sym", "d", "..")], "d", "same name"),
    ([("sym", "loop1", "loop2"), ("sym", "loop2", "loop1")], "loop", "levels of links"),
    ([("fifo", "pipe", None)], "pipe", "FIFO"),
    ([("chr", "null", None)], "null", "device"),
    ([("file", "n" * 300, "x")], "nnnn", "longer than 255"),
])
def test_hostile_members_are_refused_before_anything_is_written(tmp_path, members, member, why):
    tar = _tar(tmp_path / "bad.tar.gz", [("file", "first.txt", "x"), *members])
    assert why in _refused(tar, tmp_path / "dest", member)
    assert not (tmp_path / "evil").exists() and not Path("/tmp/evil-abs").exists()


def test_size_and_member_caps(tmp_path):
    # a header declaring 3 GiB (the bomb's 2 GB would need as much disk): refused by the default cap, from its header
    bomb = tarfile.TarInfo("repo/weights.bin")
    bomb.size = 3 << 30
    raw = bomb.tobuf(tarfile.GNU_FORMAT) + bytes(1 << 20)
    (tmp_path / "bomb.tar.gz").write_bytes(gzip.compress(raw))
    assert 3 << 30 > DEFAULT_MAX_BYTES
    assert "exceed" in _refused(tmp_path / "bomb.tar.gz", tmp_path / "dest", "repo/weights.bin")
    # a real 2 MB of zeros (a few KB compressed) under a 1 MB cap; 5 members under a cap of 4
    zeros = _tar(tmp_path / "zeros.tar.gz", [("file", "z", bytes(2 << 20))])
    assert zeros.stat().st_size < 20_000
    _refused(zeros, tmp_path / "dest", "z", Limits(max_bytes=1 << 20))
    many = _tar(tmp_path / "many.tar.gz", [("file", f"f{i}", "x") for i in range(5)])
    assert "members" in _refused(many, tmp_path / "dest", "f4", Limits(max_members=4))
    safe_extract(many, tmp_path / "dest", Limits(max_members=5))
    assert _files_under(tmp_path / "dest") == {f"f{i}" for i in range(5)}


def test_a_benign_tarball_keeps_its_links_inside(tmp_path):
    tar = _tar(tmp_path / "ok.tar.gz", [
        ("dir", "repo", None), ("file", "repo/run.sh", "#!/bin/sh\n"), ("file", "repo/docs/a.md", "a"),
        ("sym", "repo/README", "docs/a.md"), ("sym", "repo/docs/up", "../run.sh"),
        ("lnk", "repo/copy.md", "repo/docs/a.md"),
        ("sym", "repo/docs/self", "."), ("sym", "repo/via", "docs/self/../run.sh")])
    dest = tmp_path / "dest"
    safe_extract(tar, dest, under="repo")
    r = dest / "repo"
    assert (r / "README").read_text() == "a" and (r / "copy.md").read_text() == "a"
    assert (r / "docs" / "up").read_text() == "#!/bin/sh\n" and (r / "via").read_text() == "#!/bin/sh\n"
    assert (r / "run.sh").stat().st_mode & 0o7777 == 0o755  # no setuid, no group/other write
    # `under`: a link that leaves the repository's folder (into a sibling folder of the archive) is refused
    tar2 = _tar(tmp_path / "sib.tar.gz", [("file", "repo/a", "x"), ("file", "other/secret", "s")])
    with pytest.raises(MLBenchError, match="outside the archive's folder"):
        safe_extract(tar2, tmp_path / "dest2", under="repo")
    tar3 = _tar(tmp_path / "sib2.tar.gz", [("dir", "repo", None), ("dir", "other", None),
                                           ("sym", "repo/s", "../other")])
    with pytest.raises(MLBenchError, match="outside the archive's folder"):
        safe_extract(tar3, tmp_path / "dest3", under="repo")


def test_env_build_refuses_a_hostile_tarball_naming_it_and_the_member(tmp_path, capsys):
    recipe = tmp_path / "recipes" / "r.yaml"
    recipe.parent.mkdir()
    recipe.write_text("repo: evil\ncheckout: {github: https://github.com/x/evil, commit: " + "a" * 40 + "}\n")
    tarballs = tmp_path / "tarballs"
    tarballs.mkdir()
    _tar(tarballs / "evil.tar.gz", [("file", "evil/ok.py", "x"), ("sym", "evil/pw", "/etc/passwd"),
                                    ("file", "evil/../../../pwned", "x")])
    assert main(["env", "build", "--recipes", str(recipe.parent), "--cache", str(tmp_path / "c"),
                 "--tarballs", str(tarballs)]) == 2
    err = capsys.readouterr().err
    assert f"{tarballs}/evil.tar.gz: refused member 'evil/pw'" in err
    assert not list(tmp_path.rglob("pwned")) and not list((tmp_path / "c").rglob("ok.py"))
    # a small cap from the command line
    _tar(tarballs / "evil.tar.gz", [("file", "evil/big", bytes(3 << 20))])
    assert main(["env", "build", "--recipes", str(recipe.parent), "--cache", str(tmp_path / "c"),
                 "--tarballs", str(tarballs), "--tar-max-mb", "2"]) == 2
    assert "exceed 2097152 bytes" in capsys.readouterr().err


def test_the_real_repository_tarballs_extract_under_the_default_caps(tmp_path, shared):
    tars = sorted((shared / "repos").glob("*.tar.gz"))
    assert len(tars) == 14
    manifest = json.loads((shared / "repos" / "MANIFEST.json").read_text())
    for t in tars:
        repo = t.name[: -len(".tar.gz")]
        assert repo in manifest
        dest = tmp_path / repo
        safe_extract(t, dest, under=repo)
        with tarfile.open(t) as tf:
            want = {m.name for m in tf.getmembers() if m.isfile()}
        got = {str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file()}
        assert got == want, repo


def _meta_header(kind: bytes, size: int, name: str = "././@LongLink") -> bytes:
    """A raw 512-byte tar header of ``kind`` declaring ``size`` bytes of data (what tarfile then reads whole)."""
    ti = tarfile.TarInfo(name)
    ti.type, ti.size = kind, size
    return ti.tobuf(tarfile.GNU_FORMAT if kind in (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK)
                    else tarfile.USTAR_FORMAT)


@pytest.mark.parametrize("kind", [tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK, tarfile.XHDTYPE,
                                  tarfile.XGLTYPE])
def test_pax_and_long_name_headers_are_bounded_before_they_are_read(tmp_path, kind):
    """Issue 30: tarfile reads a pax or GNU long-name header's whole declared size into memory before any member
    check: a 100 KB gzip declaring 100 MB cost 100 MB here (and gigabytes for a few MB more)."""
    import tracemalloc
    size = 100 << 20
    tar = tmp_path / "meta.tar.gz"
    with gzip.open(tar, "wb", compresslevel=1) as gz:
        gz.write(_meta_header(kind, size))
        zeros = b"\0" * (1 << 20)
        for _ in range(size >> 20):
            gz.write(zeros)
        gz.write(b"\0" * 1024)
    tracemalloc.start()
    try:
        msg = _refused(tar, tmp_path / "out", "")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"{peak} bytes held while refusing it"
    assert f"header of {size} bytes (at most {64 << 10})" in msg


def test_a_run_of_pax_headers_is_bounded(tmp_path):
    record = b"%d path=x\n" % (len(b"path=x\n") + 3)
    block = record + b"\0" * (512 - len(record))
    tar = tmp_path / "run.tar"
    tar.write_bytes((_meta_header(tarfile.XHDTYPE, len(record), "pax") + block) * 5000 + b"\0" * 1024)
    assert "more than 16 pax or long-name headers before one member" in _refused(tar, tmp_path / "out", "pax")


def _header(name: str, size: int, kind: bytes = tarfile.REGTYPE) -> bytes:
    """A raw 512-byte GNU header; a negative ``size`` in base-256, as ``tarfile`` reads it (and no writer makes)."""
    ti = tarfile.TarInfo(name)
    ti.type = kind
    buf = bytearray(ti.tobuf(tarfile.GNU_FORMAT))
    if size < 0:
        buf[124:136] = b"\xff" + (size % 256**11).to_bytes(11, "big")
    else:
        buf[124:136] = b"%011o\0" % size
    buf[148:156] = b" " * 8
    buf[148:156] = b"%06o\0 " % sum(buf)
    return bytes(buf)


def test_a_negative_size_cannot_move_back_past_the_size_cap(tmp_path):
    """Issue 41, item 2: a member of negative size moved tarfile's offset back into an earlier file's data, where a
    crafted header was read as a new member, and lowered the running total: here 2 MiB written under a 1.5 MiB cap
    (a 0.04 MB tarball wrote 320 MB against 64 MB through `env build --tarballs`)."""
    a = 1 << 20
    data = _header("c", a) + bytes(a - 512)  # a's data: a header of its own, read once the offset jumps back
    raw = _header("a", a) + data + _header("b", -(a + 512)) + bytes(1024)
    (tmp_path / "neg.tar").write_bytes(raw)
    msg = _refused(tmp_path / "neg.tar", tmp_path / "dest", "b", Limits(max_bytes=a * 3 // 2))
    assert "a negative size" in msg


def test_a_long_name_header_of_negative_size_is_one_clear_error(tmp_path):
    """It escaped as a bare ValueError (`mlbench agent --tarballs`, `env build --tarballs`)."""
    (tmp_path / "gnu.tar").write_bytes(_header("././@LongLink", -512, tarfile.GNUTYPE_LONGNAME)
                                       + _header("x", 0) + bytes(1024))
    assert "a negative size" in _refused(tmp_path / "gnu.tar", tmp_path / "dest", "@LongLink")


def _pax(records: bytes, name: str = "f") -> bytes:
    """One pax header holding ``records`` (written as is), then an empty file ``name`` and the end."""
    ti = tarfile.TarInfo("././@PaxHeader")
    ti.type, ti.size = tarfile.XHDTYPE, len(records)
    return ti.tobuf(tarfile.USTAR_FORMAT) + records + bytes(-len(records) % 512) + _header(name, 0) + bytes(1024)


def _record(field: bytes) -> bytes:
    """``field`` (``KEY=VALUE``) as a well-formed pax record: its length, counting itself, then a newline."""
    n = len(field) + 2
    while len(b"%d %s\n" % (n, field)) != n:
        n += 1
    return b"%d %s\n" % (n, field)


def test_pax_records_are_parsed_linearly_whatever_the_python(tmp_path):
    """Issue 41, item 3 (CVE-2024-6232): tarfile's pax regular expressions are quadratic in a run of digits on the
    pinned 3.11.7 (10 members in under 0.01 MB took 161 s of CPU). One 30,000-digit value took seconds there; it is
    refused here before tarfile reads it."""
    import time
    (tmp_path / "cve.tar").write_bytes(_pax(_record(b"path=" + b"1" * 30_000)))
    t0 = time.process_time()
    msg = _refused(tmp_path / "cve.tar", tmp_path / "dest", "PaxHeader")
    assert time.process_time() - t0 < 0.5
    assert "malformed pax header (a run of more than 40 digits)" in msg


@pytest.mark.parametrize("records, why", [
    (_record(b"size=-5"), "size b'-5'"),                 # a pax size below 0: the same backwards jump
    (b"12 path=abc", "broken record"),                   # no newline
    (b"5 path=abc\n", "broken record"),                  # a length that does not end at the newline
    (b"path=abc\n", "no record length"),
    (_record(b"GNU.sparse.size=100"), "a sparse file"),
])
def test_malformed_pax_records_are_refused(tmp_path, records, why):
    (tmp_path / "pax.tar").write_bytes(_pax(records))
    assert why in _refused(tmp_path / "pax.tar", tmp_path / "dest", "PaxHeader")


def test_depth_members_and_parsing_time_are_bounded(tmp_path):
    """Issue 41, item 1: a folder 1,100 levels deep in a repository tarball stopped `mlbench agent` (os.walk's
    RecursionError); headers that name no member were not counted; parsing had no deadline."""
    deep = _tar(tmp_path / "deep.tar.gz", [("file", "a/" * 1100 + "f", "x")])
    assert "more than 256 levels of folders" in _refused(deep, tmp_path / "dest", "a/a/")
    dots = _tar(tmp_path / "dots.tar.gz", [("dir", "./", None)] * 6)
    assert "more than 5 members" in _refused(dots, tmp_path / "dest", ".", Limits(max_members=5))
    ok = _tar(tmp_path / "ok.tar.gz", [("file", "f", "x")])
    assert "took more than 0 s" in _refused(ok, tmp_path / "dest", "f", Limits(max_seconds=0))
    safe_extract(ok, tmp_path / "dest")
