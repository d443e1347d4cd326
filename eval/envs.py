"""Per-repository execution environments from a YAML file in ``configs/eval/``.

    repos_dir: ../repos            # default checkout location: <repos_dir>/<repo>
    repos:
      dgl: {venv: /envs/dgl, image: mlbench/dgl:latest}
      bert: {conda: bert_DS, checkout: /data/bert}

Relative paths are relative to the YAML file. A repository not listed uses ``<repos_dir>/<repo>`` and the
interpreter running mlbench.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from mlbench_kit.errors import MLBenchError

_KEYS = {"checkout", "venv", "conda", "image", "ro_paths"}


@dataclass(frozen=True)
class RepoEnv:
    """Where a repository's checkout lives and which environment runs its code."""

    checkout: Path
    env_bin: str | None = None
    conda: str | None = None
    image: str | None = None
    ro_paths: tuple[str, ...] = ()


class EnvConfig:
    """The parsed YAML; :meth:`for_repo` resolves one repository."""

    def __init__(self, path: str | Path | None = None, repos_dir: str | Path | None = None) -> None:
        self.repos: dict[str, dict] = {}
        base = Path.cwd()
        data: dict = {}
        if path is not None:
            p = Path(path)
            if not p.is_file():
                raise MLBenchError("environments file not found", str(p))
            try:
                data = yaml.safe_load(p.read_text()) or {}
            except yaml.YAMLError as exc:
                mark = getattr(exc, "problem_mark", None)
                where = f"{p}:{mark.line + 1}" if mark else str(p)
                raise MLBenchError(f"bad YAML ({getattr(exc, 'problem', exc)})", where) from None
            base = p.parent
            for name, spec in (data.get("repos") or {}).items():
                unknown = set(spec or {}) - _KEYS
                if unknown:
                    raise MLBenchError(f"unknown key(s) {sorted(unknown)} for repository {name!r}", str(p),
                                       f"allowed: {sorted(_KEYS)}")
                self.repos[name] = spec or {}
        self.base = base
        # --repos-dir is relative to where mlbench runs; the YAML's repos_dir to the YAML file
        if repos_dir is not None:
            self.repos_dir: Path | None = Path(repos_dir).resolve()
        else:
            self.repos_dir = (base / data["repos_dir"]).resolve() if data.get("repos_dir") else None
        self._resolved: dict[str, RepoEnv] = {}

    def for_repo(self, repo: str) -> RepoEnv:
        """The environment of ``repo`` (resolved once); a missing checkout is a clear error."""
        if repo not in self._resolved:
            self._resolved[repo] = self._resolve(repo)
        return self._resolved[repo]

    def _resolve(self, repo: str) -> RepoEnv:
        spec = self.repos.get(repo, {})
        if spec.get("checkout"):
            checkout = (self.base / spec["checkout"]).resolve()
        elif self.repos_dir is not None:
            checkout = self.repos_dir / repo
        else:
            raise MLBenchError(f"no checkout known for repository {repo!r}", "--repos-dir",
                               "pass --repos-dir DIR (holding DIR/<repo>) or set `checkout:` in --envs YAML")
        if not checkout.is_dir():
            raise MLBenchError(f"checkout of {repo!r} not found", str(checkout),
                               "clone it (mlbench prep --checkout repos.json --repos-dir DIR) or fix the path")
        venv = spec.get("venv")
        env_bin = str((self.base / venv / "bin").resolve()) if venv else None
        return RepoEnv(checkout, env_bin, spec.get("conda"), spec.get("image"), tuple(spec.get("ro_paths") or ()))
