"""Per-repository execution environments from a YAML file in ``configs/eval/``.

    repos_dir: ../repos            # default checkout location: <repos_dir>/<repo>
    repos:
      dgl: {venv: /envs/dgl, image: mlbench/dgl:latest}
      bert: {conda: bert_DS, checkout: /data/bert}

Relative paths are relative to the YAML file. ``venv`` (or ``prefix``) is any environment with ``bin/python``;
``conda: NAME`` is looked up under ``conda_root`` (top-level key, or ``$CONDA_ROOT``); ``env:`` sets variables the
repository's commands rely on; ``warm: [torch]`` names the modules imported once before a run's first verdict
(default: the common heavy ones; ``[]`` for none). A repository that is not listed uses ``<repos_dir>/<repo>``
and the base interpreter of the Python running mlbench (never its venv).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from mlbench_kit.errors import MLBenchError

from ..sandbox import Env

_KEYS = {"checkout", "venv", "prefix", "conda", "image", "ro_paths", "recipe", "env", "warm"}
_TOP = {"repos_dir", "conda_root", "repos"}


def _lines(node: yaml.Node, path: Path) -> dict[str, str]:
    """file:line of each repository entry under ``repos:``."""
    out: dict[str, str] = {}
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            if k.value == "repos" and isinstance(v, yaml.MappingNode):
                for rk, _ in v.value:
                    out[rk.value] = f"{path}:{rk.start_mark.line + 1}"
    return out


class EnvConfig:
    """The parsed YAML; :meth:`for_repo` resolves one repository."""

    def __init__(self, path: str | Path | None = None, repos_dir: str | Path | None = None) -> None:
        self.repos: dict[str, dict[str, Any]] = {}
        self.where: dict[str, str] = {}
        base = Path.cwd()
        data: dict = {}
        self.path = Path(path) if path is not None else None
        if self.path is not None:
            p = self.path
            if not p.is_file():
                raise MLBenchError("environments file not found", str(p))
            try:
                text = p.read_text()
                data = yaml.safe_load(text) or {}
                self.where = _lines(yaml.compose(text), p)
            except yaml.YAMLError as exc:
                mark = getattr(exc, "problem_mark", None)
                where = f"{p}:{mark.line + 1}" if mark else str(p)
                raise MLBenchError(f"bad YAML ({getattr(exc, 'problem', exc)})", where) from None
            if not isinstance(data, dict):
                raise MLBenchError("expected a mapping with `repos:`", str(p))
            unknown = set(data) - _TOP
            if unknown:
                raise MLBenchError(f"unknown top-level key(s) {sorted(unknown)}", str(p), f"allowed: {sorted(_TOP)}")
            base = p.parent
            for name, spec in (data.get("repos") or {}).items():
                where = self.where.get(name, str(p))
                if spec is not None and not isinstance(spec, dict):
                    raise MLBenchError(f"repository {name!r} must map to keys like venv:, checkout:", where)
                unknown = set(spec or {}) - _KEYS
                if unknown:
                    raise MLBenchError(f"unknown key(s) {sorted(unknown)} for repository {name!r}", where,
                                       f"allowed: {sorted(_KEYS)}")
                self.repos[name] = spec or {}
        self.base = base
        self.conda_root = data.get("conda_root") or os.environ.get("CONDA_ROOT")
        # --repos-dir is relative to where mlbench runs; the YAML's repos_dir to the YAML file
        if repos_dir is not None:
            self.repos_dir: Path | None = Path(repos_dir).resolve()
        else:
            self.repos_dir = (base / data["repos_dir"]).resolve() if data.get("repos_dir") else None
        self._resolved: dict[str, Env] = {}

    def for_repo(self, repo: str) -> Env:
        """The environment of ``repo`` (resolved once); a missing checkout is a clear error."""
        if repo not in self._resolved:
            self._resolved[repo] = self._resolve(repo)
        return self._resolved[repo]

    def _resolve(self, repo: str) -> Env:
        spec = self.repos.get(repo, {})
        where = self.where.get(repo, str(self.path) if self.path else "--repos-dir")
        if spec.get("checkout"):
            checkout = (self.base / spec["checkout"]).resolve()
        elif self.repos_dir is not None:
            checkout = self.repos_dir / repo
        else:
            raise MLBenchError(f"no checkout known for repository {repo!r}", "--repos-dir",
                               "pass --repos-dir DIR (holding DIR/<repo>) or set `checkout:` in --envs YAML")
        if not checkout.is_dir():
            raise MLBenchError(f"checkout of {repo!r} not found at {checkout}", where,
                               "unpack it (mlbench env build) or clone it (mlbench prep --checkout), or fix the path")
        prefix = spec.get("venv") or spec.get("prefix")
        if spec.get("conda"):
            if not self.conda_root:
                raise MLBenchError(f"repository {repo!r} names conda env {spec['conda']!r} but no conda root is known",
                                   where, "set `conda_root:` at the top of the file or $CONDA_ROOT")
            prefix = str(Path(self.conda_root) / "envs" / spec["conda"])
        ro = tuple(spec.get("ro_paths") or ())
        if prefix:
            prefix = str((self.base / prefix).resolve())
            if not Path(prefix, "bin", "python").exists():
                raise MLBenchError(f"environment of {repo!r} has no bin/python: {prefix}", where,
                                   "build it (mlbench env build) or fix the path")
            if spec.get("conda"):
                ro += (str(Path(self.conda_root).resolve()),)
        variables = spec.get("env") or {}
        if not isinstance(variables, dict):
            raise MLBenchError(f"`env` of repository {repo!r} maps variable names to values", where)
        warm = spec.get("warm")
        if warm is not None and not (isinstance(warm, list) and all(isinstance(m, str) for m in warm)):
            raise MLBenchError(f"`warm` of repository {repo!r} is a list of module names", where, "e.g. warm: [torch]")
        return Env(repo, checkout, prefix, spec.get("image"), ro, spec.get("recipe"), where,
                   tuple(sorted((str(k), str(v)) for k, v in variables.items())),
                   None if warm is None else tuple(warm))
