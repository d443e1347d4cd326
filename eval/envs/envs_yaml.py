"""Per-repository execution environments from an environments file (``configs/eval/*.yaml``; the format is
:class:`mlbench_kit.envspec.EnvsFile`, read by the core's config loader).

Relative paths are relative to the YAML file. ``venv`` (or ``prefix``) is any environment with ``bin/python`` or
``bin/python3`` (the sandbox then adds the missing name); ``conda: NAME`` is looked up under ``conda_root``
(top-level key, or ``$CONDA_ROOT``); ``env:`` sets variables the repository's commands rely on; ``warm: [torch]``
names the modules imported once before a run's first verdict (default: the common heavy ones; ``[]`` for none). A
repository that is not listed uses ``<repos_dir>/<repo>`` and the base interpreter of the Python running mlbench
(never its venv).
"""

from __future__ import annotations

import os
from pathlib import Path

from mlbench_kit.dataset import plain_name
from mlbench_kit.envspec import EnvsFile, RepoEnv, load_envs_file
from mlbench_kit.errors import MLBenchError
from mlbench_kit.sandbox import Env


def envs_file_missing(path: Path) -> MLBenchError:
    """The error for an environments file that is not there: who writes one, and where it is looked up."""
    from .build import default_cache
    built = default_cache() / "envs.yaml"
    return MLBenchError("environments file not found", str(path),
                        "`mlbench env build [REPO ...]` builds the repositories' environments and writes "
                        f"$MLBENCH_CACHE/envs.yaml (here {built}); then pass --envs {built}. Your own "
                        "environments: a YAML like configs/eval/mlbench.yaml (configs/eval/sample.yaml for the "
                        "demo's sample)")


class EnvConfig:
    """An environments file (:class:`mlbench_kit.envspec.EnvsFile`); :meth:`for_repo` resolves one repository."""

    def __init__(self, path: str | Path | None = None, repos_dir: str | Path | None = None) -> None:
        self.path = Path(path) if path is not None else None
        if self.path is not None:
            if not self.path.is_file():
                raise envs_file_missing(self.path)
            spec, lines = load_envs_file(self.path)
            self.base = self.path.parent
            self.where = {name: lines.at(("repos", name)) for name in spec.repos}
        else:
            spec, self.base, self.where = EnvsFile(), Path.cwd(), {}
        self.repos: dict[str, RepoEnv] = {name: e or RepoEnv() for name, e in spec.repos.items()}
        self.conda_root = spec.conda_root or os.environ.get("CONDA_ROOT")
        # --repos-dir is relative to where mlbench runs; the YAML's repos_dir to the YAML file
        if repos_dir is not None:
            self.repos_dir: Path | None = Path(repos_dir).resolve()
        else:
            self.repos_dir = (self.base / spec.repos_dir).resolve() if spec.repos_dir else None
        self._resolved: dict[str, Env] = {}

    def for_repo(self, repo: str) -> Env:
        """The environment of ``repo`` (resolved once); a missing checkout is a clear error."""
        if repo not in self._resolved:
            self._resolved[repo] = self._resolve(repo)
        return self._resolved[repo]

    def _resolve(self, repo: str) -> Env:
        spec = self.repos.get(repo, RepoEnv())
        where = self.where.get(repo, str(self.path) if self.path else "--repos-dir")
        if spec.checkout:
            checkout = (self.base / spec.checkout).resolve()
        elif self.repos_dir is not None:
            # the name comes from a dataset row: one plain folder of repos_dir, also after resolving links
            checkout = (self.repos_dir / repo).resolve()
            if not plain_name(repo) or checkout.parent != self.repos_dir.resolve():
                raise MLBenchError(f"repository name {repo!r} does not name a folder directly inside {self.repos_dir}",
                                   where, "a repository's name is one plain folder name (the last part of its URL)")
        else:
            raise MLBenchError(f"no checkout known for repository {repo!r}", "--repos-dir",
                               "pass --repos-dir DIR (holding DIR/<repo>) or set `checkout:` in --envs YAML")
        if not checkout.is_dir():
            raise MLBenchError(f"checkout of {repo!r} not found at {checkout}", where,
                               f"rebuild it: mlbench env build {repo}" if spec.recipe else
                               "clone the repositories at their pinned commits (mlbench prep --checkout "
                               "../shared/mlbench/repos.json --repos-dir DIR ...), or point `checkout:`/`repos_dir` "
                               "at them")
        prefix = spec.venv or spec.prefix
        ro = tuple(spec.ro_paths)
        if spec.conda:
            if not self.conda_root:
                raise MLBenchError(f"repository {repo!r} names conda env {spec.conda!r} but no conda root is known",
                                   where, "set `conda_root:` at the top of the file or $CONDA_ROOT")
            prefix = str(Path(self.conda_root) / "envs" / spec.conda)
            ro += (str(Path(self.conda_root).resolve()),)
        if prefix:
            prefix = str((self.base / prefix).resolve())
            if not any(Path(prefix, "bin", n).exists() for n in ("python", "python3")):
                raise MLBenchError(f"environment of {repo!r} has no bin/python or bin/python3: {prefix}", where,
                                   f"rebuild it: mlbench env build {repo}" if spec.recipe else
                                   f"create it (python3 -m venv {prefix}) or point `venv:`/`conda:` of {repo} at an "
                                   "environment with bin/python3")
        return Env(repo, checkout, prefix, spec.image, ro, spec.recipe, where,
                   tuple(sorted((str(k), str(v)) for k, v in spec.env.items())),
                   None if spec.warm is None else tuple(spec.warm))
