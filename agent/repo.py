"""The row's repository as the agent sees it: the directory index, the README files, and files read on request.

The checkout is untrusted input. Every read is confined to it: a path is taken apart component by component, an
absolute path, a ``..`` component or a symbolic link anywhere on the way is refused without being followed, only
regular files are read, at most ``max_file_bytes`` of them, and only UTF-8 text. A refusal is a sentence the model
sees in place of the file (the transcript records it as the observation)."""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from mlbench_kit import tree
from mlbench_kit.bm25 import BM25Index


class Refused(ValueError):
    """A read the harness will not do; ``str()`` is what the model is shown."""


def cut(text: str, limit: int) -> tuple[str, int]:
    """``text`` cut to ``limit`` characters with the cut said at the end; returns (text, characters dropped)."""
    if len(text) <= limit:
        return text, 0
    dropped = len(text) - limit
    return text[:limit] + f"\n[... {dropped} more characters not shown]", dropped


_HEADING = re.compile(r"(#{1,6})[ \t]")
_FENCE = re.compile(r"[ \t]{0,3}(```|~~~)")
_WORD = re.compile(r"\w+")
# a task's function words and numbers (its own shapes and values, which a README's examples do not share) rank
# nothing: without them, short sections full of "the", "of" or "(50, 512, 7, 7)" outrank the one the task names
_STOP = frozenset("a an and are as at be by can could do for from have i in into is it m me my of on or our please "
                  "so that the this to use using want what with would you your".split())


def query_terms(query: str) -> list[str]:
    """The words of a task that rank README sections: lower-cased, function words and numbers left out."""
    return [w for w in _WORD.findall(query.lower()) if w not in _STOP and not w.isdigit()]


def sections(text: str) -> list[tuple[int, int, str]]:
    """A markdown text's sections: (start, end, heading path), one per heading line outside code fences (and the
    text before the first one); the heading path is the section's heading with its enclosing ones, which is what
    a section about "HaloNet Attention Usage" says in its sub-section "Usage Code"."""
    starts: list[tuple[int, int, str]] = []  # offset, level, heading line
    fenced, pos = False, 0
    for line in text.splitlines(keepends=True):
        if _FENCE.match(line):
            fenced = not fenced
        elif not fenced and (m := _HEADING.match(line)):
            starts.append((pos, len(m.group(1)), line.strip()))
        pos += len(line)
    if not starts or starts[0][0] > 0:
        starts.insert(0, (0, 0, ""))
    out: list[tuple[int, int, str]] = []
    path: list[tuple[int, str]] = []  # the enclosing headings (level, line)
    for i, (start, level, head) in enumerate(starts):
        end = starts[i + 1][0] if i + 1 < len(starts) else len(text)
        if level:
            path = [(lv, h) for lv, h in path if lv < level] + [(level, head)]
        out.append((start, end, " ".join(h for _, h in path)))
    return [s for s in out if s[1] > s[0]]


def readme_window(text: str, limit: int, query: str) -> tuple[str, int]:
    """What the model is shown of a README longer than ``limit`` characters: its sections ranked by BM25 against
    ``query`` (the task's :func:`query_terms`; each section's lower-cased words with its heading path,
    :class:`~mlbench_kit.bm25.BM25Index`), taken best first while they fit (the best one cut to ``limit`` when even
    it does not; sections scoring nothing follow in the README's order), then shown in the README's order, each gap
    said in the text. Returns (text, characters left out). A README within ``limit`` is shown whole."""
    if len(text) <= limit:
        return text, 0
    secs = sections(text)
    index = BM25Index([_WORD.findall(f"{path}\n{text[a:b]}".lower()) for a, b, path in secs])
    scores = index.term_scores(query_terms(query))
    order = sorted(range(len(secs)), key=lambda i: -scores[i])  # stable: ties in the README's order
    chosen: dict[int, int] = {}  # section -> characters shown (its head)
    used = 0
    for i in order:
        a, b, _ = secs[i]
        if used + (b - a) <= limit:
            chosen[i] = b - a
            used += b - a
        elif not chosen:
            chosen[i] = limit
            used = limit
    parts, shown, last = [], 0, 0
    for i in sorted(chosen):
        a, b, _ = secs[i]
        if a > last:
            parts.append(f"[... {a - last} characters not shown ...]\n")
        parts.append(text[a:a + chosen[i]])
        shown += chosen[i]
        last = a + chosen[i]
    if last < len(text):
        parts.append(f"\n[... {len(text) - last} more characters not shown]")
    return "".join(parts), len(text) - shown


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
        lines = self.listed(task_folder, limit)
        left = len(self.files()) - len(lines)
        text = "\n".join(lines)
        if left:
            text += f"\n[... {left} more files not listed]"
        return text, left

    def listed(self, task_folder: str, limit: int) -> list[str]:
        """The files :meth:`index` lists within ``limit`` characters, in its order: the names a step that asks
        for a file of the index offers (``decoding: json`` constrains the reply to them)."""
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
        return lines

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
