"""Trees an answer or an archive made are walked, copied and removed at any depth (issue 41, item 1): Python 3.11's
os.walk, shutil.copytree and shutil.rmtree recurse once per level and raise RecursionError past ~1,000 levels."""

import os
from pathlib import Path

import pytest

from mlbench_kit import tree


def _deep(root: Path, levels: int, name: str = "d") -> Path:
    """``levels`` nested folders under ``root`` (made relative to each other: the whole path may exceed PATH_MAX),
    a file at the bottom; returns ``root``."""
    root.mkdir()
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(levels):
            os.mkdir(name, dir_fd=fd)
            nfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nfd
        os.close(os.open("bottom", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))
        os.symlink("/etc/passwd", "link", dir_fd=fd)
        os.chmod(fd, 0)  # its owner made it unreadable: still emptied
    finally:
        os.close(fd)
    return root


# as root the mode-0 folder is readable anyway; as a user it proves what the comment in _deep says
@pytest.mark.user
def test_walk_copy_and_remove_a_tree_deeper_than_the_recursion_limit(tmp_path):
    src = _deep(tmp_path / "src", 1100)
    try:
        os.chmod(os.path.join(src, *["d"] * 1100), 0o755)
        names = [os.path.relpath(os.path.join(top, f), src) for top, _, files in tree.walk(src) for f in files]
        assert sorted(names) == ["/".join(["d"] * 1100 + [n]) for n in ("bottom", "link")]
        tree.copy(src, tmp_path / "copy")
        assert os.readlink(os.path.join(tmp_path, "copy", *["d"] * 1100, "link")) == "/etc/passwd"
        for d in (src, tmp_path / "copy"):
            tree.remove(d)
            assert not d.exists()
        assert Path("/etc/passwd").exists()  # the link went, not what it names
    finally:  # pytest's own clean-up of tmp_path recurses
        for d in (src, tmp_path / "copy"):
            tree.remove(d)


def test_remove_a_tree_deeper_than_path_max(tmp_path):
    """1,100 levels of 200-character names: 220 KB of path, 54 times PATH_MAX; a folder at the bottom unreadable."""
    root = _deep(tmp_path / "deep", 1100, "n" * 200)
    tree.remove(root)
    assert list(tmp_path.iterdir()) == []
