"""README text per sample: from a folder of READMEs or from git checkouts at pinned commits."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from mlbench_kit.dataset import confined_path, plain_name
from mlbench_kit.errors import MLBenchError

# When a folder holds several README files, prefer the canonical one (README.md over README_EN.md).
_PREFERRED = ("readme.md", "readme.rst", "readme.txt", "readme")


@dataclass(frozen=True)
class Readme:
    """The README a reader would use for a sample: where it is (inside the repository) and its text."""

    relpath: str  # e.g. "examples/pytorch/arma/README.md"
    text: str
    walked_up: bool  # True when the sample's own folder had no README


def _pick_readme(folder: Path) -> Path | None:
    if not folder.is_dir():
        return None
    files = [p for p in folder.iterdir() if p.is_file() and p.name.lower().startswith("readme")]
    if not files:
        return None
    return min(files, key=lambda p: (_PREFERRED.index(p.name.lower()) if p.name.lower() in _PREFERRED
                                     else len(_PREFERRED), p.name))


class ReadmeCorpus:
    """READMEs under ``root/<repo>/<path inside repo>/README*``.

    ``root`` is either a folder of READMEs laid out like ``shared/mlbench/readmes`` or a folder of full
    git checkouts (see :func:`checkout_repos`): both share that layout.
    """

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            raise MLBenchError("README folder not found", str(root),
                               "pass --readmes DIR (laid out as DIR/<repo>/<path>/README.md) or --repos-dir DIR")
        self._cache: dict[tuple[str, str], Readme] = {}

    def readme_for(self, repo: str, path: str) -> Readme:
        """Nearest README walking up from ``path`` towards the repository root."""
        key = (repo, path)
        if key not in self._cache:
            self._cache[key] = self._find(repo, path)
        return self._cache[key]

    def _find(self, repo: str, path: str) -> Readme:
        repo_dir = self.root / repo
        if not plain_name(repo) or not confined_path(path):
            raise MLBenchError(f"repository {repo!r} and path {path!r} do not name a folder inside one repository",
                               str(self.root), "a repository is one plain folder name, a path is relative without '..'")
        if not repo_dir.is_dir():
            raise MLBenchError(f"no folder for repository {repo!r}", str(repo_dir),
                               "check --readmes/--repos-dir points at the folder holding one sub-folder per repository")
        real_repo = repo_dir.resolve()
        parts = [p for p in PurePosixPath(path).parts if p not in (".", "")]
        for depth in range(len(parts), -1, -1):
            found = _pick_readme(repo_dir.joinpath(*parts[:depth]))
            if found is not None:
                if not found.resolve().is_relative_to(real_repo):  # a link in the checkout pointing elsewhere
                    raise MLBenchError(f"the README for {path!r} resolves outside repository {repo!r}: "
                                       f"{found.resolve()}", str(found), "remove the link from the checkout")
                rel = found.relative_to(repo_dir).as_posix()
                return Readme(rel, found.read_text(encoding="utf-8", errors="replace"), depth < len(parts))
        raise MLBenchError(f"no README anywhere between {path!r} and the root of {repo!r}", str(repo_dir))


def checkout_repos(repos_json: str | Path, dest: str | Path, only: set[str] | None = None) -> Path:
    """Clone each test repository of ``repos.json`` into ``dest/<name>`` at its pinned commit.

    Uses real ``git`` with progress on stderr; an existing checkout at the right commit is kept.
    ``github`` may be any git URL (a local path works too, which is how the tests exercise this).
    """
    dest = Path(dest)
    spec = json.loads(Path(repos_json).read_text())
    if shutil.which("git") is None:
        raise MLBenchError("git is not installed", None, "install git, or pass --readmes with a folder of READMEs")
    for repo in spec["test_repos"]:
        name, url, commit = repo["name"], repo["github"], repo["commit"]
        if only is not None and name not in only:
            continue
        target = dest / name
        if (target / ".git").is_dir() and _head(target) == commit:
            continue
        target.mkdir(parents=True, exist_ok=True)
        print(f"[checkout] {name} @ {commit[:10]} from {url}", file=sys.stderr, flush=True)
        steps = [["git", "init", "-q"], ["git", "remote", "remove", "origin"],
                 ["git", "remote", "add", "origin", url],
                 ["git", "fetch", "--progress", "--depth", "1", "origin", commit],
                 ["git", "checkout", "-q", "--force", "FETCH_HEAD"]]
        for cmd in steps:
            res = subprocess.run(cmd, cwd=target, stdout=subprocess.DEVNULL,
                                 stderr=None if cmd[1] == "fetch" else subprocess.PIPE, text=True)
            if res.returncode != 0 and cmd[1:3] != ["remote", "remove"]:
                raise MLBenchError(f"`{' '.join(cmd)}` failed for {name} ({(res.stderr or '').strip()[:200]})",
                                   str(target), "offline? pass --readmes with a folder of READMEs "
                                   "(e.g. shared/mlbench/readmes), or check the URL and commit in repos.json")
    return dest


def _head(path: Path) -> str:
    res = subprocess.run(["git", "rev-parse", "HEAD"], cwd=path, capture_output=True, text=True)
    return res.stdout.strip()
