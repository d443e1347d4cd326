"""The row's repository as the agent sees it: the directory index, the README files, and files read on request.

The checkout is untrusted input. Every read is confined to it: a path is taken apart component by component, an
absolute path, a ``..`` component or a symbolic link anywhere on the way is refused without being followed, only
regular files are read, at most ``max_file_bytes`` of them, and only UTF-8 text. A refusal is a sentence the model
sees in place of the file (the transcript records it as the observation)."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from mlbench_kit import tree


class Refused(ValueError):
    """A read the harness will not do; ``str()`` is what the model is shown."""


def cut(text: str, limit: int) -> tuple[str, int]:
    """``text`` cut to ``limit`` characters with the cut said at the end; returns (text, characters dropped)."""
    if len(text) <= limit:
        return text, 0
    dropped = len(text) - limit
    return text[:limit] + f"\n[... {dropped} more characters not shown]", dropped


@dataclass
class RepoView:
    """One pristine checkout; ``name`` is how the prompts call it (``repo_name``)."""

    root: Path
    name: str
    max_file_bytes: int = 1_000_000

    def __post_init__(self) -> None:
        self.root = Path(self.root).resolve()
        self._files: list[str] | None = None

    def files(self) -> list[str]:
        """Every regular file under the checkout, relative, in walk order (sorted), links not followed; .git left
        out. The released agent listed the files of ``os.walk`` the same way."""
        if self._files is None:
            out = []
            for top, dirs, names in tree.walk(self.root):  # any depth: a checkout is untrusted
                dirs[:] = sorted(d for d in dirs if d != ".git")
                for n in sorted(names):
                    p = Path(top) / n
                    if stat.S_ISREG(p.lstat().st_mode):
                        out.append(p.relative_to(self.root).as_posix())
            self._files = out
        return self._files

    def index(self, task_folder: str, limit: int) -> tuple[str, int]:
        """The directory index (one path per line), at most ``limit`` characters: the row's task folder's files
        first, then the others in walk order; returns (text, files left out). The released agent sent the whole
        index (dgl's has 2,097 files): cut, the task folder is what must survive."""
        folder = PurePosixPath(task_folder.strip() or ".").as_posix().lstrip("./")
        files = self.files()
        first = [f for f in files if folder and (f == folder or f.startswith(folder + "/"))]
        chosen = set(first)
        rest = [f for f in files if f not in chosen]
        lines, used = [], 0
        for f in first + rest:
            if used + len(f) + 1 > limit:
                break
            lines.append(f)
            used += len(f) + 1
        left = len(files) - len(lines)
        text = "\n".join(lines)
        if left:
            text += f"\n[... {left} more files not listed]"
        return text, left

    def readmes(self) -> list[str]:
        """README.md files (any case), shortest path first, as the released agent ranked its candidates."""
        return sorted((f for f in self.files() if PurePosixPath(f).name.lower() == "readme.md"),
                      key=lambda f: (len(f), f))

    def description(self, limit: int = 300) -> str:
        """What stands in for the repository's GitHub description (step 2's candidates): the first paragraph of its
        main README that is prose (not a heading, an image, a badge or HTML), whitespace collapsed, at most ``limit``
        characters; "" when there is none."""
        readmes = self.readmes()
        if not readmes:
            return ""
        try:
            text = self.read(readmes[0])
        except Refused:
            return ""
        for para in text.split("\n\n"):
            prose = [ln for ln in para.splitlines()
                     if not ln.lstrip().startswith(("#", "<", "[![", "![", "---", "```", "|", "="))]
            p = " ".join(" ".join(prose).split())
            if p:
                return p if len(p) <= limit else p[:limit] + " ..."
        return ""

    def display(self, rel: str) -> str:
        """How a file is named to the model: ``<repo_name>/<path>`` (the paper's ``repo_name/README.md``)."""
        return f"{self.name}/{rel}"

    def resolve_name(self, given: str) -> str:
        """The checkout-relative path a model meant: with or without the ``<repo_name>/`` (or ``repo/<name>/``)
        prefix, a leading ``./``. Refused: absolute paths and ``..`` components."""
        g = given.strip().strip("`'\"")
        if "\0" in g or len(g) > 4096:
            raise Refused(f"refused: {given[:80]!r} is not a file name")
        if g.startswith("/") or g.startswith("\\") or (len(g) > 1 and g[1] == ":"):
            raise Refused(f"refused: {given!r} is an absolute path; name a file of the repository index")
        parts = [p for p in PurePosixPath(g.replace("\\", "/")).parts if p not in (".", "")]
        if ".." in parts:
            raise Refused(f"refused: {given!r} leaves the repository; name a file of the repository index")
        for prefix in (["repo", self.name], [self.name]):
            n = len(prefix)
            if parts[:n] == prefix and len(parts) > n and not os.path.lexists(self.root / parts[0]):
                parts = parts[n:]
                break
        if not parts:
            raise Refused(f"refused: {given!r} names no file")
        return "/".join(parts)

    def read(self, given: str) -> str:
        """The text of a file of the checkout, or :class:`Refused` (the reason, as the model will see it)."""
        rel = self.resolve_name(given)
        here = self.root
        for i, part in enumerate(rel.split("/")):
            here = here / part
            try:
                st = here.lstat()
            except FileNotFoundError:
                raise Refused(f"refused: {given!r} is not in the repository index") from None
            except OSError as exc:
                raise Refused(f"refused: {given!r} cannot be read ({exc.strerror})") from None
            if stat.S_ISLNK(st.st_mode):
                raise Refused(f"refused: {given!r} goes through a symbolic link, which is not followed")
            last = i == len(rel.split("/")) - 1
            if not last and not stat.S_ISDIR(st.st_mode):
                raise Refused(f"refused: {given!r} is not in the repository index")
        if not stat.S_ISREG(st.st_mode):
            raise Refused(f"refused: {given!r} is not a regular file")
        if st.st_size > self.max_file_bytes:
            raise Refused(f"refused: {given!r} is {st.st_size} bytes, over the {self.max_file_bytes}-byte limit")
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)
        fd = os.open(here, flags)
        try:
            with os.fdopen(fd, "rb") as fh:
                data = fh.read(self.max_file_bytes + 1)
        except OSError as exc:
            raise Refused(f"refused: {given!r} cannot be read ({exc.strerror})") from None
        if b"\0" in data:
            raise Refused(f"refused: {given!r} is not a text file")
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            raise Refused(f"refused: {given!r} is not UTF-8 text") from None
