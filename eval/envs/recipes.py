"""Environment recipes: how to build the execution environment of one repository (``configs/eval/envs/*.yaml``).

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
    notes: free text (what a user must add: GPUs, licences, data)
    gold_defects: {261: "why the dataset's own answer cannot pass"}   # by row id; validation names them

Every key is checked; an unknown key or a bad value is one error with the recipe's file:line. The recipe's
hash (of everything but ``notes`` and ``gold_defects``) names its build, so a changed recipe builds anew and an unchanged one is
never rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml
from packaging.requirements import InvalidRequirement, Requirement

from mlbench_kit.errors import MLBenchError

_KEYS = {"repo", "checkout", "python", "apt", "pip", "setup", "assets", "env", "notes", "build_fails", "gold_defects"}
_ASSET_KEYS = {"path", "url", "sha256", "unpack", "generate", "kind", "copies"}
ASSET_KINDS = ("data", "weights", "picture")
GENERATORS = ("picture",)


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


def _line(node: yaml.Node, key: str, path: Path) -> str:
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            if k.value == key:
                return f"{path}:{k.start_mark.line + 1}"
    return f"{path}:{node.start_mark.line + 1}"


def _strs(value: Any, what: str, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        raise MLBenchError(f"`{what}` must be a list of strings", where)
    return tuple(value)


def load_recipe(path: str | Path) -> Recipe:
    """Parse and check one recipe file."""
    p = Path(path)
    try:
        text = p.read_text()
        node = yaml.compose(text)
        doc = yaml.safe_load(text)
    except OSError as exc:
        raise MLBenchError(f"cannot read recipe ({exc.strerror})", str(p)) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        raise MLBenchError(f"bad YAML ({getattr(exc, 'problem', exc)})", f"{p}:{mark.line + 1}" if mark else str(p))
    if not isinstance(doc, dict):
        raise MLBenchError("a recipe is a mapping (repo:, checkout:, pip:, ...)", str(p))
    for key in doc:
        if key not in _KEYS:
            raise MLBenchError(f"unknown key {key!r}", _line(node, key, p), f"allowed: {sorted(_KEYS)}")
    at = {k: _line(node, k, p) for k in doc}
    for key in ("repo", "checkout"):
        if key not in doc:
            raise MLBenchError(f"missing `{key}:`", str(p))
    co = doc["checkout"]
    local = None
    if isinstance(co, dict) and set(co) == {"path"}:
        local = (p.parent / str(co["path"])).resolve()
        if not local.is_dir():
            raise MLBenchError(f"checkout folder not found: {local}", at["checkout"])
        co = {"github": "", "commit": _tree_digest(local)}  # the content names the build, as a commit would
    elif not isinstance(co, dict) or set(co) != {"github", "commit"} or not re.fullmatch(r"[0-9a-f]{40}",
                                                                                         str(co.get("commit"))):
        raise MLBenchError("`checkout` needs `github:` (URL) and `commit:` (40 hex digits), or `path:`",
                           at["checkout"])
    python = str(doc.get("python", "3.11"))
    if not re.fullmatch(r"3\.\d+", python):
        raise MLBenchError(f"`python` must look like 3.11, got {python!r}", at.get("python", str(p)))
    pip = _strs(doc.get("pip"), "pip", at.get("pip", str(p)))
    for req in pip:
        if req.startswith(("git+", "https://", "http://")):
            continue
        try:
            Requirement(req)
        except InvalidRequirement as exc:
            raise MLBenchError(f"not a pip requirement: {req!r} ({exc})", at["pip"], "write it like name==1.2.3") \
                from None
    assets = []
    for i, a in enumerate(doc.get("assets") or []):
        where = at.get("assets", str(p)) + f" (assets[{i}])"
        if not isinstance(a, dict) or "path" not in a:
            raise MLBenchError("each asset needs `path:`", where)
        unknown = set(a) - _ASSET_KEYS
        if unknown:
            raise MLBenchError(f"unknown asset key(s) {sorted(unknown)}", where, f"allowed: {sorted(_ASSET_KEYS)}")
        if bool(a.get("url")) == bool(a.get("generate")):
            raise MLBenchError("an asset has either `url:` (fetched) or `generate:` (made here)", where)
        if a.get("generate") and a["generate"] not in GENERATORS:
            raise MLBenchError(f"unknown generator {a['generate']!r}", where, f"use one of {GENERATORS}")
        kind = a.get("kind", "picture" if a.get("generate") else "data")
        if kind not in ASSET_KINDS:
            raise MLBenchError(f"unknown asset kind {kind!r}", where, f"use one of {ASSET_KINDS}")
        if a.get("sha256") is not None and not re.fullmatch(r"[0-9a-f]{64}", str(a["sha256"])):
            raise MLBenchError("`sha256` must be 64 hex digits (or absent: pinned on first fetch)", where)
        if a.get("unpack") not in (None, "zip", "tar"):
            raise MLBenchError("`unpack` is zip or tar", where)
        paths = [a["path"], *(a.get("copies") or [])]
        if any(Path(x).is_absolute() or ".." in Path(x).parts for x in paths):
            raise MLBenchError("asset paths are relative to the checkout and stay inside it", where)
        assets.append(Asset(a["path"], kind, a.get("url"), a.get("sha256"), a.get("unpack"), a.get("generate"),
                            tuple(a.get("copies") or ())))
    env = doc.get("env") or {}
    if not isinstance(env, dict):
        raise MLBenchError("`env` maps variable names to values", at.get("env", str(p)))
    defects = doc.get("gold_defects") or {}
    if not isinstance(defects, dict) or not all(isinstance(k, int) and isinstance(v, str) and v.strip()
                                                for k, v in defects.items()):
        raise MLBenchError("`gold_defects` maps a row id (integer) to why its answer fails",
                           at.get("gold_defects", str(p)))
    return Recipe(repo=str(doc["repo"]), github=str(co["github"]), commit=str(co["commit"]), python=python,
                  path=str(local) if local else None,
                  apt=_strs(doc.get("apt"), "apt", at.get("apt", str(p))), pip=pip,
                  setup=_strs(doc.get("setup"), "setup", at.get("setup", str(p))), assets=tuple(assets),
                  env=tuple(sorted((str(k), str(v)) for k, v in env.items())), notes=str(doc.get("notes") or ""),
                  build_fails=doc.get("build_fails"), gold_defects=tuple(sorted(defects.items())),
                  where=f"{p}:1")


def _tree_digest(root: Path) -> str:
    h = hashlib.sha1()
    for f in sorted(x for x in root.rglob("*") if x.is_file()):
        h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


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
