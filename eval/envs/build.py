"""Build environments from recipes: a venv (default, no root), an OCI image, an Apptainer definition.

Each build lives in ``CACHE/envs/<repo>-<recipe hash>/``::

    checkout/      the repository at the pinned commit, plus its assets
    venv/          the Python environment (uv, hard-linked from uv's cache; pip where uv is missing), compiled
                   to bytecode like the checkout (both are read-only in the sandbox)
    freeze.txt     what was installed          build.log   every command and its output
    meta.json      recipe hash, interpreter, missing assets, host packages missing, timings
    Containerfile, apptainer.def   generated from the same recipe

A build runs in its final folder (a venv's scripts embed its path, so it cannot be moved afterwards) with a
marker per finished step, so an interrupted build resumes where it stopped; ``meta.json``, written last, marks
it complete. Builds of other recipe versions live in other folders and stay intact whatever fails. A complete
build of an unchanged recipe is never redone. ``CACHE/envs.yaml`` lists every complete build in the format
``mlbench eval --envs`` reads. Building never happens while scoring: eval only reads these folders.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
import zipfile
from pathlib import Path
from typing import Any

import yaml

from mlbench_kit import tree
from mlbench_kit.envspec import Asset, Recipe
from mlbench_kit.errors import MLBenchError
from mlbench_kit.io import write_json_atomic
from mlbench_kit.untar import Limits, safe_extract

from .images import apptainer_def, build_env_image, containerfile, image_plan

SANDBOX_UID = 65534


def env_dir(cache: Path, recipe: Recipe) -> Path:
    """Where ``recipe``'s build lives."""
    return cache / "envs" / f"{recipe.repo}-{recipe.hash}"


class Builder:
    """Builds recipes into ``cache``; ``tarballs`` (a folder of ``<repo>.tar.gz``) or git gives checkouts."""

    def __init__(self, cache: Path, tarballs: Path | None = None, fetch_assets: bool = False,
                 installer: str | None = None, log=print, limits: Limits | None = None) -> None:
        self.cache, self.tarballs, self.fetch_assets, self.log = Path(cache), tarballs, fetch_assets, log
        self.installer = installer or ("uv" if _uv() else "pip")
        self.limits = limits or Limits()  # caps on what one tarball may hold (untar.py)
        self.assets = AssetStore(self.cache / "assets", self.limits)

    # -- one recipe --------------------------------------------------------------------------------------------

    def build(self, recipe: Recipe) -> Path:
        """Build ``recipe`` (or find it built); returns its folder. Raises MLBenchError with the reason."""
        final = env_dir(self.cache, recipe)
        if (final / "meta.json").is_file():
            meta: dict = json.loads((final / "meta.json").read_text())
            if "bytecode" not in meta:  # built by an older mlbench-kit: the one step it lacks, in place
                self.log(f"env {recipe.repo}: bytecode (older build)")
                meta |= self._bytecode(recipe, final)
                if os.geteuid() == 0:
                    _chown_tree(final / "checkout", SANDBOX_UID)
                write_json_atomic(final / "meta.json", meta)
            self.log(f"env {recipe.repo}: up to date ({final.name})")
            return final
        if recipe.build_fails:
            raise MLBenchError(f"environment {recipe.repo} cannot be built here: {recipe.build_fails}", recipe.where,
                               "see the recipe's notes for what a machine that can build it needs")
        part = final
        part.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        meta = {"repo": recipe.repo, "recipe": recipe.hash, "commit": recipe.commit, "where": recipe.where}
        steps = [("checkout", self._checkout), ("assets", self._assets), ("venv", self._venv),
                 ("setup", self._setup), ("bytecode", self._bytecode), ("freeze", self._freeze)]
        for name, step in steps:
            marker = part / f".done-{name}"
            if marker.exists():
                continue
            self.log(f"env {recipe.repo}: {name}")
            info = step(recipe, part) or {}
            (part / f".info-{name}.json").write_text(json.dumps(info))
            marker.touch()
        for name, _ in steps:
            meta |= json.loads((part / f".info-{name}.json").read_text())
        meta["missing_host_packages"] = _missing_debs(recipe.apt)
        meta["build_s"] = round(time.monotonic() - t0, 1)
        (part / "Containerfile").write_text(containerfile(recipe, image_plan(part)))  # what --image builds
        (part / "apptainer.def").write_text(apptainer_def(recipe))
        if os.geteuid() == 0:  # the sandbox runs untrusted code as this uid: let it own the pristine checkout
            _chown_tree(part / "checkout", SANDBOX_UID)
        for f in part.glob(".done-*"):
            f.unlink()
        for f in part.glob(".info-*"):
            f.unlink()
        write_json_atomic(part / "meta.json", meta)
        self.log(f"env {recipe.repo}: built in {meta['build_s']} s ({final})")
        return final

    def _run(self, argv: list[str], part: Path, cwd: Path | None = None, env: dict | None = None,
             what: str = "") -> str:
        with (part / "build.log").open("a") as log:
            log.write(f"$ {' '.join(argv)}\n")
            log.flush()
            r = subprocess.run(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            log.write(r.stdout)
        if r.returncode != 0:
            tail = "\n    ".join(r.stdout.strip().splitlines()[-12:])
            raise MLBenchError(f"{what or argv[0]} failed (exit {r.returncode}):\n    {tail}", str(part / "build.log"))
        return r.stdout

    def _checkout(self, recipe: Recipe, part: Path) -> dict:
        dest = part / "checkout"
        shutil.rmtree(dest, ignore_errors=True)
        if recipe.path:
            shutil.copytree(recipe.path, dest, symlinks=True)
            return {"checkout_source": recipe.path}
        if self.tarballs is not None:
            tar = Path(self.tarballs) / f"{recipe.repo}.tar.gz"
            if not tar.is_file():
                raise MLBenchError(f"no checkout tarball for {recipe.repo}", str(tar),
                                   "pass --tarballs DIR holding <repo>.tar.gz, or --git to clone")
            manifest = Path(self.tarballs) / "MANIFEST.json"
            if manifest.is_file():
                pinned = json.loads(manifest.read_text()).get(recipe.repo, {}).get("commit")
                if pinned and pinned != recipe.commit:
                    raise MLBenchError(f"{tar.name} holds commit {pinned}, the recipe pins {recipe.commit}",
                                       recipe.where, "update the recipe's commit or the tarball")
            tmp = part / "unpack"
            shutil.rmtree(tmp, ignore_errors=True)
            safe_extract(tar, tmp, self.limits, under=recipe.repo)
            if not (tmp / recipe.repo).is_dir() or (tmp / recipe.repo).is_symlink():
                raise MLBenchError(f"the tarball holds no folder {recipe.repo}/", str(tar),
                                   "a checkout tarball holds one top-level folder named after the repository")
            (tmp / recipe.repo).rename(dest)
            tmp.rmdir()
            return {"checkout_source": str(tar)}
        self._run(["git", "clone", "--quiet", "--no-checkout", recipe.github, str(dest)], part, what="git clone")
        self._run(["git", "-C", str(dest), "checkout", "--quiet", recipe.commit], part, what="git checkout")
        return {"checkout_source": recipe.github}

    def _assets(self, recipe: Recipe, part: Path) -> dict:
        missing: list[dict[str, Any]] = []
        for a in recipe.assets:
            try:
                self.assets.place(a, part / "checkout", self.fetch_assets)
            except AssetMissing as exc:
                missing.append({"path": a.path, "kind": a.kind, "url": a.url, "why": str(exc)})
        if missing:
            self.log(f"env {recipe.repo}: {len(missing)} asset(s) missing (fetch with --fetch-assets where the "
                     f"network allows): " + ", ".join(m["path"] for m in missing[:4]))
        return {"missing_assets": missing}

    def _venv(self, recipe: Recipe, part: Path) -> dict:
        venv = part / "venv"
        shutil.rmtree(venv, ignore_errors=True)
        py = _find_python(recipe)
        if self.installer == "uv":
            uv = _uv()
            if uv is None:
                raise MLBenchError("uv is not installed", recipe.where, "pip install uv, or pass --installer pip")
            self._run([uv, "venv", "--quiet", "--seed", "-p", py, str(venv)], part, what="uv venv")
            if recipe.pip:
                self._run([uv, "pip", "install", "-p", str(venv / "bin" / "python"), *recipe.pip], part,
                          what=f"installing {recipe.repo}'s requirements ({recipe.where})")
        else:
            self._run([py, "-m", "venv", str(venv)], part, what="venv")
            if recipe.pip:
                self._run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", *recipe.pip], part,
                          what=f"installing {recipe.repo}'s requirements ({recipe.where})")
        version = subprocess.run([str(venv / "bin" / "python"), "-c", "import sys; print(sys.version.split()[0])"],
                                 capture_output=True, text=True).stdout.strip()
        return {"python": version, "installer": self.installer}

    def _setup(self, recipe: Recipe, part: Path) -> dict:
        venv = part / "venv"
        env = {**os.environ, "PATH": f"{venv / 'bin'}:{os.environ.get('PATH', '')}", "VIRTUAL_ENV": str(venv)}
        for cmd in recipe.setup:
            self._run(["bash", "-c", cmd], part, cwd=part / "checkout", env=env, what=f"setup `{cmd}`")
        return {}

    def _bytecode(self, recipe: Recipe, part: Path) -> dict:
        """Compile the environment and the checkout to bytecode. The sandbox mounts both read-only, so nothing
        is cached between executions: without this every execution compiled torch's modules again (the TSL
        venv held 1 .pyc for 1,639 modules; uv does not compile, pip does), which cost each answer seconds and,
        at compat's 10 s limit, decided whether it reached its failure point in time."""
        t0 = time.monotonic()
        py = str(part / "venv" / "bin" / "python")
        site = subprocess.run([py, "-c", "import site; print('\\n'.join(site.getsitepackages()))"],
                              capture_output=True, text=True).stdout.split()
        # exit 1 only means some file did not compile (Python 2 sources in old packages): not a build failure
        subprocess.run([py, "-m", "compileall", "-q", "-j", "0", *site, str(part / "checkout")],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        n = sum(1 for d in [*site, str(part / "checkout")] for _ in Path(d).rglob("*.pyc"))
        return {"bytecode": {"pyc": n, "seconds": round(time.monotonic() - t0, 1)}}

    def _freeze(self, recipe: Recipe, part: Path) -> dict:
        out = subprocess.run([str(part / "venv" / "bin" / "python"), "-m", "pip", "freeze", "--all"],
                             capture_output=True, text=True).stdout
        (part / "freeze.txt").write_text(out)
        return {"packages": len(out.splitlines())}

    # -- images ------------------------------------------------------------------------------------------------

    def build_image(self, recipe: Recipe, folder: Path, engine: str = "podman", base: str | None = None) -> str:
        """The image of a built environment (see :mod:`.images`: assembled from this build, nothing fetched);
        returns the tag. Its size and build time go to ``folder/image.json``."""
        info = build_env_image(recipe, folder, engine, base,
                               run=lambda argv, what: self._run(argv, folder, what=what))
        if "build_s" in info:
            self.log(f"env {recipe.repo}: image {info['tag']} ({info.get('bytes', 0) / 1e9:.2f} GB, "
                     f"{info['build_s']} s)")
        return info["tag"]


def write_envs_yaml(cache: Path, recipes: list[Recipe], images: dict[str, str] | None = None) -> Path:
    """``CACHE/envs.yaml``: the builds of the current ``recipes``, in the format ``mlbench eval --envs`` reads.
    A repository whose current recipe is not built keeps the entry it had (an earlier build stays usable)."""
    cache = cache.resolve()  # the file is read from anywhere: a relative --cache would resolve against it
    target = cache / "envs.yaml"
    repos: dict[str, dict] = {}
    if target.is_file():
        repos = (yaml.safe_load(target.read_text()) or {}).get("repos") or {}
    for r in recipes:
        d = env_dir(cache, r)
        old = repos.get(r.repo, {})
        if not (d / "meta.json").is_file():
            continue
        spec: dict[str, Any] = {"checkout": str(d / "checkout"), "venv": str(d / "venv"), "recipe": r.hash}
        if r.env:
            spec["env"] = dict(r.env)
        image = (images or {}).get(r.repo) or (old.get("image") if old.get("recipe") == r.hash else None)
        if image:
            spec["image"] = image
        repos[r.repo] = spec
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("# written by `mlbench env build`: the built environments, for `mlbench eval --envs`\n"
                      + yaml.safe_dump({"repos": dict(sorted(repos.items()))}, sort_keys=False))
    return target


def stale_builds(cache: Path, recipes: list[Recipe]) -> list[Path]:
    """Build folders of these repositories made from other recipe versions (finished or not)."""
    current = {env_dir(cache, r).name for r in recipes}
    names = {r.repo for r in recipes}
    return [d for d in sorted((cache / "envs").glob("*"))
            if d.name.rsplit("-", 1)[0] in names and d.name not in current]


class AssetMissing(Exception):
    """An asset that is neither cached nor fetchable now."""


class AssetStore:
    """Fetched assets, content-addressed: ``ROOT/sha256/<digest>``; ``ROOT/lock.json`` pins what was fetched
    without a declared checksum (trust on first fetch, then verified)."""

    def __init__(self, root: Path, limits: Limits | None = None) -> None:
        self.root, self.limits = root, limits or Limits()
        self.lock_file = root / "lock.json"

    def _lock(self) -> dict[str, str]:
        return json.loads(self.lock_file.read_text()) if self.lock_file.is_file() else {}

    def place(self, a: Asset, checkout: Path, fetch: bool) -> None:
        """Put ``a`` (and its copies) into ``checkout``."""
        dests = [checkout / p for p in (a.path, *a.copies)]
        if a.generate:
            for d in dests:
                d.parent.mkdir(parents=True, exist_ok=True)
                if not d.exists():
                    _picture(d)
            return
        assert a.url is not None  # an asset has either url: or generate: (recipes.py checks)
        digest = a.sha256 or self._lock().get(a.url)
        blob = self.root / "sha256" / digest if digest else None
        if blob is None or not blob.is_file():
            if not fetch:
                raise AssetMissing("not fetched (offline build)")
            blob = self._fetch(a)
        for d in dests:
            d.parent.mkdir(parents=True, exist_ok=True)
            if a.unpack == "zip":
                with zipfile.ZipFile(blob) as z:
                    infos = z.infolist()
                    if len(infos) > self.limits.max_members or \
                            sum(i.file_size for i in infos) > self.limits.max_bytes:
                        raise MLBenchError(f"the archive exceeds the caps ({self.limits.max_members} members, "
                                           f"{self.limits.max_bytes} bytes)", a.url or str(blob))
                    z.extractall(d)  # zipfile drops absolute names and '..', and makes no links
            elif a.unpack == "tar":
                safe_extract(blob, d, self.limits)
            else:
                shutil.copyfile(blob, d)

    def _fetch(self, a: Asset) -> Path:
        assert a.url is not None  # only fetched assets come here
        (self.root / "sha256").mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".download-{os.getpid()}"
        h = hashlib.sha256()
        try:
            with urllib.request.urlopen(a.url, timeout=60) as r, tmp.open("wb") as out:
                for chunk in iter(lambda: r.read(1 << 20), b""):
                    h.update(chunk)
                    out.write(chunk)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise AssetMissing(f"fetch failed: {exc}") from None
        digest = h.hexdigest()
        if a.sha256 and digest != a.sha256:
            tmp.unlink()
            raise MLBenchError(f"checksum mismatch for {a.url}: got {digest}, the recipe says {a.sha256}", a.path)
        blob = self.root / "sha256" / digest
        tmp.rename(blob)
        if not a.sha256:
            lock = self._lock() | {a.url: digest}
            self.lock_file.write_text(json.dumps(lock, indent=2, sort_keys=True))
        return blob


def _picture(path: Path) -> None:
    """A small, valid placeholder picture (what the benchmark's set-up copies to the paths instructions use)."""
    from PIL import Image, ImageDraw
    img = Image.new("RGB", (224, 224), (120, 160, 200))
    ImageDraw.Draw(img).ellipse((40, 40, 184, 184), fill=(230, 180, 60))
    fmt = {"png": "PNG", "jpg": "JPEG", "jpeg": "JPEG"}.get(path.suffix.lower().lstrip("."), "PNG")
    img.save(path, fmt)


def _uv() -> str | None:
    exe = Path(sys.executable).with_name("uv")
    return str(exe) if exe.exists() else shutil.which("uv")


def _find_python(recipe: Recipe) -> str:
    """An interpreter of the recipe's version: this one, a pyenv install, or one on PATH that really runs (pyenv's
    shims only answer for the versions selected globally)."""
    want = recipe.python
    if sys.version_info[:2] == tuple(int(x) for x in want.split(".")):
        return os.path.realpath(sys.executable)
    pyenv = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv")
    cands = [str(p) for p in sorted(pyenv.glob(f"versions/{want}.*/bin/python{want}"), reverse=True)]
    cands += [c for c in (shutil.which(f"python{want}"),) if c]
    for cand in cands:
        if subprocess.run([cand, "-c", "pass"], capture_output=True).returncode == 0:
            return cand
    raise MLBenchError(f"Python {want} is not installed here", recipe.where,
                       f"install Python {want} (pyenv install {want}, or `uv python install {want}` with network), "
                       "or change the recipe's python:")


def _missing_debs(packages: tuple[str, ...]) -> list[str]:
    if not packages or shutil.which("dpkg-query") is None:
        return []
    missing = []
    for p in packages:
        r = subprocess.run(["dpkg-query", "-W", "-f=${Status}", p], capture_output=True, text=True)
        if "install ok installed" not in r.stdout:
            missing.append(p)
    return missing


def _chown_tree(root: Path, uid: int) -> None:
    for dirpath, dirnames, filenames in tree.walk(root):  # any depth
        for name in [*dirnames, *filenames]:
            os.lchown(os.path.join(dirpath, name), uid, uid)
    os.lchown(root, uid, uid)

