"""The environments' two file formats as typed configs: recipes (``configs/eval/envs/*.yaml``: how to build one
repository's environment) and environments files (``envs.yaml``: where each repository's built environment is).

Both are read by :func:`mlbench_kit.config.load`, the loader of every stage's config: an unknown key or a bad
value is one error naming the file and line.

A recipe::

    repo: External-Attention-pytorch
    checkout: {github: https://github.com/xmu-xiaoma666/External-Attention-pytorch, commit: 90e774e...}
                                   # or {path: ../../../examples/sample/repos/toybench} (a local folder)
    python: "3.11"
    apt: [libgl1]                  # Debian packages (images install them; venv builds check the host has them)
    pip: [torch==2.13.0, einops==0.8.1]
    setup: ["python setup.py build_ext --inplace"]   # run once in the checkout, at build time
    assets:                        # files the benchmark's commands expect before they run
      - {path: data/pic.jpg, generate: picture}
      - {path: model/x.zip, url: https://..., sha256: ..., unpack: zip, kind: weights}
    env: {GLUE_DIR: data/glue}     # variables the benchmark's commands rely on
    notes: free text (what a user must add: GPUs, licences, data)
    gold_defects: {261: "why the dataset's own answer cannot pass"}   # by row id; validation names them

The recipe's hash (of everything but ``notes`` and ``gold_defects``) names its build, so a changed recipe builds
anew and an unchanged one is never rebuilt.

An environments file::

    repos_dir: ../repos            # default checkout location: <repos_dir>/<repo>
    conda_root: /opt/conda         # for `conda:` entries (else $CONDA_ROOT)
    repos:
      dgl: {venv: /envs/dgl, image: mlbench/dgl:latest}
      bert: {conda: bert_DS, checkout: /data/bert}
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from packaging.requirements import InvalidRequirement, Requirement

from .config import Check, Lines, load, read_yaml
from .dataset import plain_name
from .errors import MLBenchError
from .sandbox import Env

# --- the recipe file, as written -------------------------------------------------------------------------------

@dataclass
class CheckoutSpec:
    """Where the repository comes from: a GitHub URL at a commit, or a local folder (fixtures)."""

    github: str | None = None
    commit: str | None = None
    path: str | None = None

    def check(self, at: Check) -> None:
        if self.path is not None and self.github is None and self.commit is None:
            return
        if self.path is None and self.github and re.fullmatch(r"[0-9a-f]{40}", str(self.commit)):
            return
        raise MLBenchError("`checkout` needs `github:` (URL) and `commit:` (40 hex digits), or `path:`",
                           at("github" if self.github is not None else "path"))


@dataclass
class AssetSpec:
    """One file (or unpacked folder) the repository's commands expect: fetched (``url``) or made (``generate``)."""

    path: str
    url: str | None = None
    sha256: str | None = None
    unpack: Literal["zip", "tar"] | None = None
    generate: Literal["picture"] | None = None
    kind: Literal["data", "weights", "picture"] | None = None  # default: picture when generated, else data
    copies: list[str] = field(default_factory=list)  # more paths that get the same file

    def check(self, at: Check) -> None:
        if bool(self.url) == bool(self.generate):
            raise MLBenchError("an asset has either `url:` (fetched) or `generate:` (made here)", at("path"))
        if self.sha256 is not None and not re.fullmatch(r"[0-9a-f]{64}", self.sha256):
            raise MLBenchError("`sha256` must be 64 hex digits (or absent: pinned on first fetch)", at("sha256"))
        if any(Path(x).is_absolute() or ".." in Path(x).parts for x in [self.path, *self.copies]):
            raise MLBenchError("asset paths are relative to the checkout and stay inside it", at("path"))


@dataclass
class RecipeSpec:
    """A recipe file, key by key."""

    repo: str
    checkout: CheckoutSpec
    python: str | float = "3.11"  # a float only to say how to write it: YAML reads 3.10 as 3.1
    apt: list[str] = field(default_factory=list)
    pip: list[str] = field(default_factory=list)
    setup: list[str] = field(default_factory=list)
    assets: list[AssetSpec] = field(default_factory=list)
    env: dict[str, str | int | float | bool] = field(default_factory=dict)
    notes: str | None = None
    build_fails: str | None = None  # why this recipe cannot build on a CPU-only Linux host, if it cannot
    gold_defects: dict[Any, str] = field(default_factory=dict)

    def check(self, at: Check) -> None:
        if not isinstance(self.python, str):
            raise MLBenchError(f"`python` is a string: write python: \"{self.python}\"", at("python"),
                               "YAML reads an unquoted 3.10 as the number 3.1")
        if not re.fullmatch(r"3\.\d+", self.python):
            raise MLBenchError(f"`python` must look like 3.11, got {self.python!r}", at("python"))
        for req in self.pip:
            if req.startswith(("git+", "https://", "http://")):
                continue
            try:
                Requirement(req)
            except InvalidRequirement as exc:
                raise MLBenchError(f"not a pip requirement: {req!r} ({exc})", at("pip"),
                                   "write it like name==1.2.3") from None
        if not all(isinstance(k, int) and not isinstance(k, bool) and v.strip() for k, v in self.gold_defects.items()):
            raise MLBenchError("`gold_defects` maps a row id (integer) to why its answer fails", at("gold_defects"))


# --- the recipe, as the builders use it (frozen: its hash names the build) --------------------------------------

@dataclass(frozen=True)
class Asset:
    """A file or folder a repository's commands expect: fetched (``url``) or made here (``generate``)."""

    path: str
    kind: str = "data"
    url: str | None = None
    sha256: str | None = None
    unpack: str | None = None  # zip | tar: unpack into ``path`` (a folder)
    generate: str | None = None
    copies: tuple[str, ...] = ()  # more paths that get the same file


@dataclass(frozen=True)
class Recipe:
    """One repository's environment."""

    repo: str
    github: str
    commit: str
    python: str = "3.11"
    path: str | None = None  # a local checkout (fixtures), instead of github + commit
    apt: tuple[str, ...] = ()
    pip: tuple[str, ...] = ()
    setup: tuple[str, ...] = ()
    assets: tuple[Asset, ...] = ()
    env: tuple[tuple[str, str], ...] = ()  # variables the benchmark's commands rely on (e.g. GLUE_DIR)
    notes: str = ""
    build_fails: str | None = None  # why this recipe cannot build on a CPU-only Linux host, if it cannot
    gold_defects: tuple[tuple[int, str], ...] = ()  # (row id, why its gold answer fails in any environment)
    where: str = field(default="", compare=False)  # file:line of the recipe

    @property
    def hash(self) -> str:
        """12 hex digits naming this recipe's build (notes, gold defects and location excluded)."""
        d = asdict(self)
        for k in ("notes", "gold_defects", "where"):
            d.pop(k)
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]


def _tree_digest(root: Path) -> str:
    h = hashlib.sha1()
    for f in sorted(x for x in root.rglob("*") if x.is_file()):
        h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def load_recipe(path: str | Path) -> Recipe:
    """Read and check one recipe file."""
    p = Path(path)
    raw, lines = read_yaml(p)
    spec = load(RecipeSpec, raw=raw, lines=lines)
    co = spec.checkout
    github, commit, local = co.github or "", co.commit or "", None
    if co.path is not None:
        local = (p.parent / co.path).resolve()
        if not local.is_dir():
            raise MLBenchError(f"checkout folder not found: {local}", lines.at("checkout.path"))
        commit = _tree_digest(local)  # the content names the build, as a commit would
    assets = tuple(Asset(a.path, a.kind or ("picture" if a.generate else "data"), a.url, a.sha256, a.unpack,
                         a.generate, tuple(a.copies)) for a in spec.assets)
    return Recipe(repo=spec.repo, github=github, commit=commit, python=str(spec.python),
                  path=str(local) if local else None, apt=tuple(spec.apt), pip=tuple(spec.pip),
                  setup=tuple(spec.setup), assets=assets,
                  env=tuple(sorted((str(k), str(v)) for k, v in spec.env.items())), notes=spec.notes or "",
                  build_fails=spec.build_fails, gold_defects=tuple(sorted(spec.gold_defects.items())),
                  where=f"{p}:1")


def load_recipes(folder: str | Path, names: list[str] | None = None) -> list[Recipe]:
    """Every recipe in ``folder`` (``*.yaml``), or the ones named; an unknown name is an error."""
    d = Path(folder)
    if not d.is_dir():
        raise MLBenchError("recipe folder not found", str(d), "pass --recipes configs/eval/envs")
    recipes = {r.repo: r for r in (load_recipe(f) for f in sorted(d.glob("*.yaml")))}
    if names:
        missing = [n for n in names if n not in recipes]
        if missing:
            raise MLBenchError(f"no recipe for {missing}", str(d), f"recipes here: {sorted(recipes)}")
        return [recipes[n] for n in names]
    return list(recipes.values())


# --- the environments file -------------------------------------------------------------------------------------

@dataclass
class RepoEnv:
    """Where one repository's environment is. Relative paths are relative to the environments file."""

    checkout: str | None = None  # default: <repos_dir>/<repo>
    venv: str | None = None  # any environment with bin/python
    prefix: str | None = None  # the same as venv
    conda: str | None = None  # a conda environment's name under conda_root
    image: str | None = None  # the container image (podman, docker, apptainer backends)
    ro_paths: list[str] = field(default_factory=list)  # more host paths the sandbox mounts read-only
    recipe: str | None = None  # the hash of the recipe it was built from
    env: dict[str, str | int | float | bool] = field(default_factory=dict)  # variables the commands rely on
    warm: list[str] | None = None  # modules imported once before the first verdict (None: the common ones)


@dataclass
class EnvsFile:
    """An environments file: per-repository environments and where checkouts live."""

    repos_dir: str | None = None
    conda_root: str | None = None
    repos: dict[str, RepoEnv | None] = field(default_factory=dict)


def load_envs_file(path: str | Path) -> tuple[EnvsFile, Lines]:
    """Read and check an environments file; the lines locate each repository's entry for later errors."""
    raw, lines = read_yaml(path)
    return load(EnvsFile, raw=raw, lines=lines), lines


# --- one repository's environment, resolved (eval scores in it; the agent acts in it) ---------------------------

def default_cache() -> Path:
    """``$MLBENCH_CACHE`` or ``~/.cache/mlbench`` (where `mlbench env build` writes ``envs.yaml``)."""
    return Path(os.environ.get("MLBENCH_CACHE") or Path.home() / ".cache" / "mlbench")


def envs_file_missing(path: Path) -> MLBenchError:
    """The error for an environments file that is not there: who writes one, and where it is looked up."""
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
