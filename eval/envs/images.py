"""Container base images without a registry: a Debian root filesystem (``mmdebstrap``) imported into the engine.

No registry may be reachable (clusters behind firewalls, our CI), but Debian's package mirror usually is. The
image holds Debian's Python (``python`` and ``python3``) and what the runner needs; environment images are
built on top of it from recipes (``mlbench env build --image``).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mlbench_kit.errors import MLBenchError

BASE_TAG = "localhost/mlbench-base:bookworm"
BASE_PACKAGES = ("python3", "python-is-python3", "python3-venv", "python3-pip", "ca-certificates", "git", "bash",
                 "coreutils")


def image_exists(tag: str, engine: str = "podman") -> bool:
    """Whether ``engine`` has ``tag`` locally."""
    r = subprocess.run([engine, "image", "inspect", tag], capture_output=True)
    return r.returncode == 0


def build_base_image(tag: str = BASE_TAG, suite: str = "bookworm", mirror: str = "http://deb.debian.org/debian",
                     engine: str = "podman", packages: tuple[str, ...] = BASE_PACKAGES, force: bool = False) -> str:
    """Build ``tag`` from a Debian root filesystem unless it exists; returns the tag."""
    if not force and image_exists(tag, engine):
        return tag
    for exe, pkg in (("mmdebstrap", "mmdebstrap"), (engine, engine)):
        if shutil.which(exe) is None:
            raise MLBenchError(f"{exe} is not installed", "base image", f"apt-get install {pkg}")
    mm = subprocess.Popen(["mmdebstrap", "--quiet", "--variant=apt", f"--include={','.join(packages)}", suite, "-",
                           mirror], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert mm.stdout is not None and mm.stderr is not None  # both piped
    imp = subprocess.run([engine, "import", "--change", "CMD=/bin/bash", "-", tag], stdin=mm.stdout,
                         capture_output=True, text=True)
    mm.stdout.close()
    err = mm.stderr.read().decode(errors="replace")
    if mm.wait() != 0 or imp.returncode != 0:
        raise MLBenchError(f"building the base image {tag} failed: {(err or imp.stderr).strip()[-600:]}",
                           f"mmdebstrap {suite} {mirror}", "check that the Debian mirror is reachable (--mirror)")
    return tag


# -- environment images, assembled from a built environment ---------------------------------------------------
#
# An environment image is the base image plus what `mlbench env build` already built and validated here: the
# venv (at /opt/venv, where the sandbox's container engines look for it), its base interpreter and the
# checkout (at /opt/checkout). Nothing is installed while the image builds: no package index, no network, no
# CA bundle, and the image holds the very files the bwrap backend runs, whatever Python the recipe names.
# The interpreter keeps its own path (its RUNPATH names its libpython). Site-packages entries of
# HEAVY_MB or more (torch, its CUDA libraries) get a layer each, without bytecode: their files are hard links
# into uv's cache, identical in every venv that installed the same wheel, so images of the same torch share
# those layers on disk (podman's layer cache). Everything else, bytecode included, is the image's own layer.

IMAGE_LAYOUT = "venv-v1"  # label mlbench.layout: images of an older layout are rebuilt
VENV_IN_IMAGE = "/opt/venv"
CHECKOUT_IN_IMAGE = "/opt/checkout"
HEAVY_MB = 200


def env_image_tag(repo: str, recipe_hash: str) -> str:
    """The tag of a repository's image: its recipe hash names it."""
    return f"localhost/mlbench-env-{repo.lower()}:{recipe_hash}"


@dataclass(frozen=True)
class ImagePlan:
    """What goes into a built environment's image, layer by layer."""

    venv: str  # the venv on this host
    interpreter: str | None  # the base interpreter's prefix, copied at its own path (None: the base image's)
    site: str  # site-packages, relative to the venv
    heavy: tuple[str, ...]  # site-packages entries with a layer of their own, largest first
    checkout: str
    syslibs: tuple[str, ...] = ()  # host system libraries the build's binaries load and the base image lacks


def _tree_bytes(root: Path) -> int:
    n = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for f in filenames:
            try:
                n += os.lstat(os.path.join(dirpath, f)).st_size
            except FileNotFoundError:
                pass
    return n


def _shared_objects(roots: list[Path]) -> list[str]:
    out = []
    for root in roots:
        for dirpath, _, filenames in os.walk(root):
            out += [p for f in filenames if ".so" in f and os.path.isfile(p := os.path.join(dirpath, f))
                    and not os.path.islink(p)]
    return out


def system_libraries(roots: list[Path], base_root: Path) -> tuple[str, ...]:
    """System libraries (``/lib``, ``/usr/lib``) that the shared objects under ``roots`` link against here
    (``ldd``) and the base image, mounted at ``base_root``, lacks: bwrap runs the environment on the host's
    ``/usr``, so without them an image fails where bwrap passes (open3d needs libX11 and libGL, torch 1.7.1
    libgomp). Paths are canonical (``/lib`` is ``usr/lib`` in Debian 12), symlinks followed to their files."""
    found: set[str] = set()
    files = _shared_objects(roots)
    for i in range(0, len(files), 200):
        r = subprocess.run(["ldd", *files[i:i + 200]], capture_output=True, text=True)
        for line in r.stdout.splitlines():
            target = line.split("=>", 1)[1].strip().split(" (")[0] if "=>" in line else ""
            if target.startswith(("/lib", "/usr/lib")):
                found.add(target)
    out: set[str] = set()
    for lib in found:
        path = os.path.join(os.path.realpath(os.path.dirname(lib)), os.path.basename(lib))
        while True:
            if os.path.lexists(str(base_root) + path):
                break
            out.add(path)
            if not os.path.islink(path):
                break
            path = os.path.join(os.path.dirname(path), os.readlink(path))
            path = os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))
    return tuple(sorted(out))


def image_plan(folder: Path, heavy_mb: int = HEAVY_MB, base_root: Path | None = None) -> ImagePlan:
    """The layers of the image of the environment built in ``folder`` (``venv/``, ``checkout/``); with
    ``base_root`` (the base image's files) also the host libraries the base image lacks."""
    venv = folder / "venv"
    sites = sorted((venv / "lib").glob("python3*/site-packages"))
    if not (venv / "bin" / "python").exists() or not sites:
        raise MLBenchError(f"no built venv in {folder}", str(folder), "run `mlbench env build` first")
    prefix = Path(os.path.realpath(venv / "bin" / "python")).parent.parent
    interpreter = None if str(prefix).startswith(("/usr", "/bin")) else str(prefix)
    sizes = {p.name: _tree_bytes(p) for p in sites[0].iterdir() if p.is_dir() and not p.is_symlink()
             and p.name != "__pycache__"}
    heavy = tuple(sorted((n for n, b in sizes.items() if b >= heavy_mb * 2**20), key=lambda n: (-sizes[n], n)))
    # the venv's binaries only: the interpreter's optional modules (tkinter's Tk and X11) are left out
    libs = system_libraries([venv], base_root) if base_root else ()
    return ImagePlan(str(venv), interpreter, str(sites[0].relative_to(venv)), heavy, str(folder / "checkout"), libs)


def _layers(plan: ImagePlan) -> list[tuple[str, Path, str, Callable[[Path, bool], bool]]]:
    """(context folder, host tree, path in the image, filter) per layer, in order."""
    venv, site = Path(plan.venv), Path(plan.site)
    out: list[tuple[str, Path, str, Callable[[Path, bool], bool]]] = []
    if plan.interpreter:
        own = Path(plan.interpreter)
        site_rel = {p.relative_to(own) for p in own.glob("lib/python3*/site-packages")}
        # the interpreter's own site-packages stay out: the venv does not see them
        def outside_site(rel: Path, is_dir: bool, s: set[Path] = site_rel) -> bool:
            return not any(p in s for p in rel.parents)
        out.append(("L-python", own, plan.interpreter, outside_site))
    for name in plan.heavy:
        out.append((f"L-pkg-{name}", venv / site / name, f"{VENV_IN_IMAGE}/{site}/{name}",
                    lambda rel, is_dir: "__pycache__" not in rel.parts))
    heavy = {site / n for n in plan.heavy}
    if plan.syslibs:  # after the shared layers, so they stay shared
        out.append(("L-syslibs", Path("/"), "/", lambda rel, is_dir: False))

    def rest(rel: Path, is_dir: bool) -> bool:
        under = next((h for h in heavy if rel == h or h in rel.parents), None)
        return under is None or is_dir or "__pycache__" in rel.parts

    out.append(("L-venv", venv, VENV_IN_IMAGE, rest))
    out.append(("L-checkout", Path(plan.checkout), CHECKOUT_IN_IMAGE, lambda rel, is_dir: True))
    return out


def containerfile(recipe, plan: ImagePlan, base: str = BASE_TAG) -> str:
    """The Containerfile that assembles the image from a build context :func:`assemble_context` made."""
    lines = [f"# generated by mlbench env build from {recipe.where} (recipe {recipe.hash}): the venv, its",
             "# interpreter and the checkout built here, copied in; nothing is installed, nothing is fetched",
             f"FROM {base}"]
    lines += [f"COPY {name} /" for name, *_ in _layers(plan)]
    lines.append(f"ENV PATH={VENV_IN_IMAGE}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "
                 f"VIRTUAL_ENV={VENV_IN_IMAGE}")
    lines += [f"ENV {k}={shlex.quote(v)}" for k, v in recipe.env]
    lines.append(f"LABEL mlbench.repo={recipe.repo} mlbench.recipe={recipe.hash} mlbench.layout={IMAGE_LAYOUT}")
    return "\n".join(lines) + "\n"


def apptainer_def(recipe, archive: str | None = None) -> str:
    """An Apptainer definition of the same image, from its docker-archive (``mlbench env export``)."""
    archive = archive or f"{env_image_tag(recipe.repo, recipe.hash).rsplit('/', 1)[1].replace(':', '-')}.docker.tar"
    env = "".join(f"    export {k}={shlex.quote(v)}\n" for k, v in recipe.env)
    return (f"# generated by mlbench env build from {recipe.where} (recipe {recipe.hash})\n"
            f"# the image `mlbench env build --image` assembles, exported by\n"
            f"#   mlbench env export {recipe.repo} --format sif-recipe --out DIR\n"
            f"# then: apptainer build {recipe.repo}.sif {recipe.repo}.def (no registry, no network)\n"
            f"Bootstrap: docker-archive\nFrom: {archive}\n\n"
            f"%environment\n    export PATH={VENV_IN_IMAGE}/bin:$PATH VIRTUAL_ENV={VENV_IN_IMAGE}\n{env}\n"
            f"%labels\n    mlbench.repo {recipe.repo}\n    mlbench.recipe {recipe.hash}\n"
            f"    mlbench.layout {IMAGE_LAYOUT}\n")


def _whole_seconds(path: str) -> None:
    """Drop the fraction of a second from ``path``'s mtime. A layer keeps whole seconds, rounded to the nearest
    (Go's tar), while a timestamp .pyc records its source's whole seconds, truncated: a module written at
    44.7 s was 45 s in the image and its bytecode stale (695 of torch's modules recompiled at every import,
    in a read-only image). Truncating keeps every .pyc of the build valid here too."""
    st = os.lstat(path)
    frac = st.st_mtime_ns % 10**9
    if frac:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns - frac), follow_symlinks=False)


def _place(src: str, dst: str, old: bytes | None, new: bytes) -> None:
    """Hard-link ``src`` at ``dst`` (a copy across file systems); a small file naming the venv's host path
    (scripts' shebangs, activate) is written anew with the image's path. Never writes through a link."""
    _whole_seconds(src)
    if old is not None and os.path.getsize(src) < 2**20:
        data = Path(src).read_bytes()
        if old in data:
            Path(dst).write_bytes(data.replace(old, new))
            shutil.copystat(src, dst)
            return
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _mirror(src: Path, dst: Path, keep: Callable[[Path, bool], bool], old: bytes | None = None,
            new: bytes = b"") -> None:
    """``src`` under ``dst``: files hard-linked, symlinks as they are, folders with their mode; ``keep(rel,
    is_dir)`` filters; files directly in ``bin/`` or in site-packages are checked for ``old`` (see _place)."""
    for dirpath, dirnames, filenames in os.walk(src):
        rel = Path(dirpath).relative_to(src)
        target = dst / rel
        target.mkdir(parents=True, exist_ok=True)
        os.chmod(target, os.stat(dirpath).st_mode & 0o7777)
        links = [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]
        dirnames[:] = [d for d in dirnames if d not in links and keep(rel / d, True)]
        rewrite = old if rel.name in ("bin", "site-packages") or rel == Path() else None
        for name in [*filenames, *links]:
            if not keep(rel / name, False):
                continue
            s = os.path.join(dirpath, name)
            if os.path.islink(s):
                os.symlink(os.readlink(s), target / name)
            elif os.path.isfile(s):
                _place(s, str(target / name), rewrite, new)


def assemble_context(plan: ImagePlan, ctx: Path) -> None:
    """The build context: one folder per layer, each a tree rooted at ``/``, of hard links to the build."""
    shutil.rmtree(ctx, ignore_errors=True)
    old = os.path.realpath(plan.venv).encode()
    for name, src, dest, keep in _layers(plan):
        root = ctx / name
        if name == "L-syslibs":  # copies (never links: nothing of the host's /usr is touched), symlinks as such
            for lib in plan.syslibs:
                target = root / lib.lstrip("/")
                target.parent.mkdir(parents=True, exist_ok=True)
                if os.path.islink(lib):
                    os.symlink(os.readlink(lib), target)
                else:
                    shutil.copy2(lib, target)
            for d in [root, *(p for p in root.rglob("*") if p.is_dir())]:
                os.chmod(d, 0o755)
            continue
        target = root / dest.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        for d in [root, *(p for p in target.parents if root in p.parents)]:
            os.chmod(d, 0o755)
        _mirror(src, target, keep, old if name == "L-venv" else None, VENV_IN_IMAGE.encode())


def _mounted(image: str, engine: str) -> Path:
    """Where ``image``'s files are (``podman image mount``, root only): what the base image already holds."""
    r = subprocess.run([engine, "image", "mount", image], capture_output=True, text=True)
    if r.returncode != 0 or not r.stdout.strip():
        raise MLBenchError(f"cannot read the files of {image}: {r.stderr.strip()[-300:]}", image,
                           "build images as root (podman image mount)")
    return Path(r.stdout.strip())


def image_current(tag: str, recipe_hash: str, engine: str = "podman") -> bool:
    """``tag`` exists and was assembled by this layout from this recipe."""
    r = subprocess.run([engine, "image", "inspect", "--format", "{{json .Config.Labels}}", tag], capture_output=True,
                       text=True)
    if r.returncode != 0:
        return False
    labels = json.loads(r.stdout.strip() or "null") or {}
    return labels.get("mlbench.recipe") == recipe_hash and labels.get("mlbench.layout") == IMAGE_LAYOUT


def image_size(tag: str, engine: str = "podman") -> int:
    """The image's size in bytes, shared layers included."""
    r = subprocess.run([engine, "image", "inspect", "--format", "{{.Size}}", tag], capture_output=True, text=True)
    return int(r.stdout.strip()) if r.returncode == 0 and r.stdout.strip().isdigit() else 0


def build_env_image(recipe, folder: Path, engine: str = "podman", base: str | None = None,
                    run=None) -> dict:
    """Assemble the image of the environment built in ``folder`` unless it is current; returns and writes
    ``folder/image.json`` (tag, seconds, bytes). ``run(argv, what)`` runs a command, raising on failure."""
    tag = env_image_tag(recipe.repo, recipe.hash)
    info_f = folder / "image.json"
    if image_current(tag, recipe.hash, engine):
        info = json.loads(info_f.read_text()) if info_f.is_file() else {}
        return {**info, "tag": tag}
    base = base or build_base_image(BASE_TAG, engine=engine)
    t0 = time.monotonic()
    plan = image_plan(folder, base_root=_mounted(base, engine))
    subprocess.run([engine, "image", "unmount", base], capture_output=True)
    ctx = folder / "image-context"
    assemble_context(plan, ctx)
    (ctx / "Containerfile").write_text(containerfile(recipe, plan, base))
    (folder / "Containerfile").write_text(containerfile(recipe, plan, base))  # beside the build, as it built
    (folder / "apptainer.def").write_text(apptainer_def(recipe))
    argv = [engine, "build", "--pull=never", "--network", "none", "--layers", "-t", tag, "-f",
            str(ctx / "Containerfile"), str(ctx)]
    try:
        if run is None:
            r = subprocess.run(argv, capture_output=True, text=True)
            if r.returncode != 0:
                raise MLBenchError(f"{engine} build {tag} failed: {r.stderr.strip()[-600:]}", str(ctx))
        else:
            run(argv, f"{engine} build {tag}")
    finally:
        shutil.rmtree(ctx, ignore_errors=True)
    info = {"tag": tag, "layout": IMAGE_LAYOUT, "build_s": round(time.monotonic() - t0, 1),
            "bytes": image_size(tag, engine), "heavy_layers": list(plan.heavy), "interpreter": plan.interpreter}
    info_f.write_text(json.dumps(info, indent=2))
    return info


# -- export ------------------------------------------------------------------------------------------------------

EXPORT_FORMATS = ("oci", "docker-archive", "sif-recipe")


def export_image(tag: str, fmt: str, out: Path, engine: str = "podman", definition: str | None = None) -> list[Path]:
    """Write ``tag`` to ``out`` as an OCI archive, a docker-archive, or (``sif-recipe``) a docker-archive and
    the Apptainer definition that turns it into a SIF; returns the files written."""
    if fmt not in EXPORT_FORMATS:
        raise MLBenchError(f"unknown export format {fmt!r}", "--format", f"use one of {EXPORT_FORMATS}")
    if not image_exists(tag, engine):
        raise MLBenchError(f"no image {tag}", tag, "build it: mlbench env build --image")
    out.mkdir(parents=True, exist_ok=True)
    stem = tag.rsplit("/", 1)[-1].replace(":", "-")
    path = out / f"{stem}.{'oci' if fmt == 'oci' else 'docker'}.tar"
    tmp = path.with_name(f".{path.name}.part")
    tmp.unlink(missing_ok=True)
    r = subprocess.run([engine, "save", "--format", "oci-archive" if fmt == "oci" else "docker-archive", "-o",
                        str(tmp), tag], capture_output=True, text=True)
    if r.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise MLBenchError(f"{engine} save {tag} failed: {r.stderr.strip()[-600:]}", tag)
    tmp.rename(path)
    if fmt != "sif-recipe":
        return [path]
    d = out / f"{stem}.def"
    text = definition or f"Bootstrap: docker-archive\nFrom: {path.name}\n"
    d.write_text(text.replace(f"From: {_def_from(text)}", f"From: {path.resolve()}"))
    return [path, d]


def _def_from(text: str) -> str:
    return next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("From:")), "")


def sif_command(definition: Path) -> str:
    """The command that builds the SIF of an exported image (needs apptainer, no registry, no root)."""
    return f"apptainer build {definition.with_suffix('.sif')} {definition}"
