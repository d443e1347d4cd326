"""`mlbench env build|list|check|validate|base-image`: the repositories' execution environments.

    mlbench env build --tarballs ../shared/mlbench/repos                 # every recipe, as venvs
    mlbench env build External-Attention-pytorch --image                 # and its podman image
    mlbench env list                                                     # recipes, builds, validation
    mlbench env check                                                    # each build probed in the sandbox
    mlbench env validate --data ../shared/mlbench/full.jsonl --out runs/validation
    mlbench env export bert --format sif-recipe --out images/            # archive + Apptainer definition
"""

from __future__ import annotations

import argparse
import json
import sys
from argparse import Namespace
from pathlib import Path

from mlbench_kit.envspec import default_cache, load_recipes
from mlbench_kit.errors import MLBenchError
from mlbench_kit.escape import visible
from mlbench_kit.io import read_jsonl_tolerant, write_atomic, write_json_atomic
from mlbench_kit.untar import DEFAULT_MAX_BYTES, DEFAULT_MAX_MEMBERS, Limits

from .envs.build import Builder, env_dir, stale_builds, write_envs_yaml

RECIPES = Path(__file__).resolve().parents[1] / "configs" / "eval" / "envs"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``mlbench env``."""
    sub = p.add_subparsers(dest="env_cmd", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("repos", nargs="*", help="repositories (default: every recipe)")
    common.add_argument("--recipes", default=str(RECIPES), help="folder of recipe YAML files")
    common.add_argument("--cache", default=None, help="where builds live (default $MLBENCH_CACHE or ~/.cache/mlbench)")
    b = sub.add_parser("build", parents=[common], help="build environments from recipes (idempotent, resumable)")
    b.add_argument("--tarballs", help="folder of <repo>.tar.gz checkouts (offline); default: git clone")
    b.add_argument("--fetch-assets", action="store_true", help="download declared assets (needs network)")
    b.add_argument("--image", action="store_true", help="also build each podman image")
    b.add_argument("--installer", choices=["uv", "pip"], help="default: uv when installed")
    b.add_argument("--tar-max-mb", type=int, default=DEFAULT_MAX_BYTES >> 20,
                   help="refuse a tarball whose files exceed this many MiB (default %(default)s)")
    b.add_argument("--tar-max-members", type=int, default=DEFAULT_MAX_MEMBERS,
                   help="refuse a tarball with more members (default %(default)s)")
    b.add_argument("--keep-going", action="store_true", help="build the others when one fails (exit 1 at the end)")
    sub.add_parser("list", parents=[common], help="recipes, their builds and validation")
    sub.add_parser("prune", parents=[common], help="remove builds of older recipe versions and unfinished ones")
    c = sub.add_parser("check", parents=[common], help="probe each built environment in the sandbox")
    c.add_argument("--backend", default="bwrap", choices=["bwrap", "podman"], help="sandbox (default %(default)s)")
    v = sub.add_parser("validate", parents=[common], help="run every gold answer in its environment, say why "
                                                          "failures fail")
    v.add_argument("--data", required=True, help="ML-Bench rows (file or hub id)")
    v.add_argument("--split", default="full", help="split of --data (default %(default)s)")
    v.add_argument("--out", required=True, help="folder: validation.json, validation.md, eval runs per mode")
    v.add_argument("--modes", nargs="+", default=["compat", "strict"], choices=["compat", "strict"],
                   help="scoring modes to validate in (default: both)")
    v.add_argument("--workers", type=int, default=2, help="executions at once (default %(default)s)")
    v.add_argument("--cpus", type=float, default=1.0,
                   help="CPU quota of one execution in cores (default 1; 0: none). Compat passes an answer still "
                        "running at the limit, so without a quota a verdict depends on what runs beside it")
    v.add_argument("--backend", default="bwrap", choices=["bwrap", "podman"], help="sandbox (default %(default)s)")
    ex = sub.add_parser("export", parents=[common], help="write built images to files (OCI archive, docker-archive, "
                                                         "or an Apptainer definition for a SIF), for clusters")
    ex.add_argument("--format", required=True, choices=["oci", "docker-archive", "sif-recipe"],
                    help="OCI archive, docker-archive, or an Apptainer definition to build a SIF from")
    ex.add_argument("--out", required=True, help="folder for the archives (and definitions)")
    ex.add_argument("--image", help="export this tag instead of the repositories' images")
    bi = sub.add_parser("base-image", help="the podman base image from a Debian root filesystem (no registry)")
    bi.add_argument("--mirror", default="http://deb.debian.org/debian",
                    help="Debian mirror mmdebstrap installs from (default %(default)s)")
    bi.add_argument("--force", action="store_true", help="rebuild the image even if it exists")


def _cache(args: Namespace) -> Path:
    return Path(args.cache) if args.cache else default_cache()


def run(args: Namespace) -> int:
    """Dispatch ``mlbench env``."""
    return {"build": _build, "list": _list, "prune": _prune, "check": _check, "validate": _validate,
            "export": _export, "base-image": _base_image}[args.env_cmd](args)


def _prune(args: Namespace) -> int:
    import shutil
    cache = _cache(args)
    for d in stale_builds(cache, load_recipes(args.recipes, args.repos or None)):
        shutil.rmtree(d)
        _log(f"env: removed {d}")
    return 0


def _log(msg: str) -> None:
    print(msg, file=sys.stderr)


def _build(args: Namespace) -> int:
    cache = _cache(args)
    recipes = load_recipes(args.recipes, args.repos or None)
    builder = Builder(cache, Path(args.tarballs) if args.tarballs else None, args.fetch_assets, args.installer, _log,
                      Limits(args.tar_max_mb << 20, args.tar_max_members))
    failed, images = {}, {}
    for r in recipes:
        try:
            folder = builder.build(r)
            if args.image:
                images[r.repo] = builder.build_image(r, folder)
        except MLBenchError as exc:
            _record_failures(cache, {r.repo: exc.render()})
            if not args.keep_going:
                write_envs_yaml(cache, recipes, images)
                raise
            failed[r.repo] = exc.render()
            _log(f"env {r.repo}: FAILED: {exc.what.splitlines()[0]}")
    _record_failures(cache, {r.repo: None for r in recipes if r.repo not in failed})
    path = write_envs_yaml(cache, recipes, images)
    _log(f"env: {len(recipes) - len(failed)}/{len(recipes)} built; eval with --envs {path}")
    stale = stale_builds(cache, recipes)
    if stale:
        _log(f"env: {len(stale)} build folder(s) of older recipe versions or unfinished builds; "
             f"`mlbench env prune` removes them")
    return 1 if failed else 0


def _record_failures(cache: Path, update: dict[str, str | None]) -> None:
    path = cache / "build-failures.json"
    old = json.loads(path.read_text()) if path.is_file() else {}
    for k, v in update.items():
        if v is None:
            old.pop(k, None)
        else:
            old[k] = v
    write_json_atomic(path, old)


def built_status(cache: Path, recipes) -> dict[str, str | None]:
    """Per repository: None when its current recipe is built, else why not."""
    fails = json.loads((cache / "build-failures.json").read_text()) if (cache / "build-failures.json").is_file() else {}
    out: dict[str, str | None] = {}
    for r in recipes:
        if (env_dir(cache, r) / "meta.json").is_file():
            out[r.repo] = None
        else:
            out[r.repo] = r.build_fails or (fails.get(r.repo, "").splitlines() or ["not built yet"])[0]
    return out


def _list(args: Namespace) -> int:
    cache = _cache(args)
    recipes = load_recipes(args.recipes, args.repos or None)
    status = built_status(cache, recipes)
    print(f"{'repository':28} {'recipe':12} {'python':7} {'built':6} {'assets missing':15} note")
    for r in recipes:
        meta_f = env_dir(cache, r) / "meta.json"
        meta = json.loads(meta_f.read_text()) if meta_f.is_file() else {}
        miss = len(meta.get("missing_assets", [])) if meta else "-"
        why = status[r.repo]
        note = "" if why is None else visible(why[:70], keep="")
        print(f"{r.repo:28} {r.hash:12} {r.python:7} {'yes' if meta else 'no':6} {miss!s:15} {note}")
    return 0


def _check(args: Namespace) -> int:
    from mlbench_kit.sandbox import Sandbox, check_backend, warm_summary

    from .envs import EnvConfig
    cache = _cache(args)
    check_backend(args.backend, False)
    envs_file = cache / "envs.yaml"
    if not envs_file.is_file():
        raise MLBenchError("no environments built yet", str(envs_file),
                           "build them first: mlbench env build [REPO ...] (without REPO: every recipe of --recipes, "
                           "the 14 benchmark repositories by default); env check checks builds only, not an "
                           "environments file of your own (mlbench eval --envs FILE probes those)")
    envs = EnvConfig(envs_file)
    names = args.repos or sorted(envs.repos)
    bad = 0
    with Sandbox(args.backend) as sb:
        for name in names:
            try:
                env = envs.for_repo(name)
                probe = sb.preflight(env, ["."])
                print(f"{name:28} ok    python {probe['version']} ({probe['python']}); "
                      f"{warm_summary(sb.warm(env))}")
            except MLBenchError as exc:
                bad += 1
                print(f"{name:28} FAIL  {visible(exc.what.splitlines()[0])}")
    return 1 if bad else 0


def _validate(args: Namespace) -> int:
    from mlbench_kit.config import load
    from mlbench_kit.dataset import load_samples
    from mlbench_kit.eval_config import EvalConfig

    from . import run as eval_run
    from .envs.validate import validate, validation_markdown
    cache = _cache(args)
    recipes = load_recipes(args.recipes, args.repos or None)
    status = built_status(cache, recipes)
    built = [r.repo for r in recipes if status[r.repo] is None]
    out = Path(args.out)
    samples = [s for s in load_samples(args.data, args.split) if s.repo in {r.repo for r in recipes}]
    results: dict[str, list[dict]] = {}
    for mode in args.modes:
        recs: list[dict] = []
        if built:
            options = {"data": args.data, "split": args.split, "gold": True, "envs": str(cache / "envs.yaml"),
                       "out": str(out / f"gold-{mode}"), "mode": mode, "workers": args.workers,
                       "backend": args.backend, "ci": False, "cpus": args.cpus or None, "repos": built}
            code = eval_run.score(load(EvalConfig, None, {k: (v, f"mlbench env validate ({k})")
                                                       for k, v in options.items()}))
            if code not in (0, 3):
                return code
            recs = read_jsonl_tolerant(out / f"gold-{mode}" / "results.jsonl")
        results[mode] = recs
    rows = [{"github_id": s.github_id, "id": s.id, "repo": s.repo, "type": s.type} for s in samples]
    defects = {(r.repo, i): why for r in recipes for i, why in r.gold_defects}
    report = validate(results, rows, status, defects)
    report["recipes"] = {r.repo: r.hash for r in recipes}
    report["settings"] = {"workers": args.workers, "cpus": args.cpus or None, "backend": args.backend}
    write_json_atomic(out / "validation.json", report)
    write_atomic(out / "validation.md", validation_markdown(report, status))
    for mode in args.modes:
        n = sum(r[mode]["passed"] for r in report["rows"])
        print(f"validate: {mode}: {n}/{len(rows)} gold answers pass; table: {out / 'validation.md'}", file=sys.stderr)
    return 0


def _base_image(args: Namespace) -> int:
    from .envs.images import BASE_TAG, build_base_image
    print(build_base_image(BASE_TAG, mirror=args.mirror, force=args.force))
    return 0


def _export(args: Namespace) -> int:
    """Each image as a file a cluster can use without a registry; sif-recipe adds the Apptainer definition."""
    from .envs.images import apptainer_def, env_image_tag, export_image, sif_command
    out = Path(args.out)
    todo: list[tuple[str, str | None]]
    if args.image:
        todo = [(args.image, None)]
    else:
        todo = [(env_image_tag(r.repo, r.hash), apptainer_def(r))
                for r in load_recipes(args.recipes, args.repos or None)]
    for tag, definition in todo:
        files = export_image(tag, args.format, out, definition=definition)
        for f in files:
            print(f)
        if args.format == "sif-recipe":
            _log(f"env export: {tag}: {sif_command(files[1])}  (or: apptainer build X.sif docker-archive://{files[0]})")
    return 0
