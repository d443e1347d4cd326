"""`mlbench prep`: load ML-Bench, attach README context, render tasks 1–3, write JSONL + datasets folders + stats."""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from mlbench_kit.config import save_resolved
from mlbench_kit.dataset import Sample, check_no_leak, load_samples
from mlbench_kit.errors import MLBenchError
from mlbench_kit.flags import resolve
from mlbench_kit.hf import check_model_available, load_tokenizer, model_positions
from mlbench_kit.io import (
    atomic_dir,
    write_atomic,
    write_json_atomic,
    write_jsonl_atomic,
)
from mlbench_kit.prep_config import PrepConfig
from mlbench_kit.stages import stage

from .corpus import ReadmeCorpus, checkout_repos
from .render import Renderer
from .retrieval import check_punkt, get_splitter
from .splits import build_splits
from .stats import prompt_stats, prompt_stats_markdown


def _load(cfg: PrepConfig) -> dict[str, list[Sample]]:
    loaded = {name: load_samples(cfg.data, name) for name in cfg.splits}
    if cfg.repos:
        known = {s.repo for rows in loaded.values() for s in rows}
        unknown = sorted(set(cfg.repos) - known)
        if unknown:
            raise MLBenchError(f"--repos names repositories not in the data: {unknown}", "--repos",
                               f"choose from {sorted(known)}")
        loaded = {name: [s for s in rows if s.repo in cfg.repos] for name, rows in loaded.items()}
    if cfg.build_splits:
        return build_splits(next(iter(loaded.values())), cfg.ood_repos, cfg.id_test_fraction, cfg.seed)
    return loaded


def _check_leaks(splits: dict[str, list[Sample]]) -> None:
    train = [s for n, rows in splits.items() if "train" in n for s in rows]
    test = [s for n, rows in splits.items() if "train" not in n for s in rows]
    if train and test:
        check_no_leak(train, test)


def _save_hf(records: list[dict[str, Any]], folder: Path) -> None:
    import datasets
    # Arrow needs one schema per column: `arguments` dicts have different keys per row, so they are
    # stored JSON-encoded here (the JSONL beside keeps the dict).
    ds = datasets.Dataset.from_list([{**r, "arguments": json.dumps(r["arguments"])} for r in records])
    with atomic_dir(folder) as tmp:
        ds.save_to_disk(str(tmp))


def run(args: argparse.Namespace) -> int:
    """``mlbench prep``: the options resolved into a :class:`PrepConfig` (:func:`mlbench_kit.flags.resolve`), then
    :func:`prepare`."""
    return prepare(resolve(stage("prep"), args))


def _check_out(out: Path) -> None:
    """The output folder can be written: it is a folder (or will be), and we may create entries in it."""
    if out.exists() and not out.is_dir():
        raise MLBenchError("--out is a file, not a folder", str(out), "pass a folder (it is created if missing)")
    probe = out
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not os.access(probe, os.W_OK | os.X_OK):
        raise MLBenchError(f"cannot write the output folder: {probe} is not writable by this user", str(out),
                           "pass an --out under a folder you can write to (e.g. in your home or scratch space)")


def _check_readmes(corpus: ReadmeCorpus | None, splits: dict[str, list[Sample]], tasks: list[int]) -> None:
    """Tasks 1 and 2 need a README for every row: all of them found now, or one error naming what is missing."""
    needs = [t for t in tasks if t in (1, 2)]
    if not needs:
        return
    if corpus is None:
        raise MLBenchError(f"task {needs[0]} needs README text", "--readmes",
                           "pass --readmes DIR or --repos-dir DIR (task 3 alone needs neither)")
    missing: dict[str, list[str]] = {}
    for rows in splits.values():
        for s in rows:
            try:
                corpus.readme_for(s.repo, s.path)
            except MLBenchError as exc:
                missing.setdefault(exc.where or s.repo, []).append(f"{s.repo}/{s.path}")
    if missing:
        n = sum(len(v) for v in missing.values())
        first = "; ".join(f"{where} ({len(v)} row(s), e.g. {v[0]})" for where, v in list(missing.items())[:3])
        raise MLBenchError(f"no README found for {n} row(s) of tasks {needs}: {first}"
                           + (f" and {len(missing) - 3} more folder(s)" if len(missing) > 3 else ""),
                           str(corpus.root),
                           "point --readmes/--repos-dir at the folder holding <repo>/<path>/README* for every "
                           "repository (shared/mlbench/readmes, or checkouts from --checkout repos.json), or choose "
                           "rows with --repos")


def _staging(out: Path) -> Path:
    """A fresh folder the outputs are written into before they appear in ``out`` all at once: beside ``out`` when
    it does not exist yet (renamed to it at the end), else inside it (its entries moved in, the manifest last)."""
    name = f".prep-tmp-{os.getpid()}-{secrets.token_hex(3)}"
    if out.exists():
        staging = out / name
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = out.parent / f".{out.name}{name}"
    staging.mkdir()  # mode from the umask, as the folder it becomes
    return staging


def _merge(src: Path, dst: Path) -> None:
    """Move every entry of ``src`` into ``dst``, replacing entries of the same name (folders are merged, a
    ``.hf`` dataset folder is replaced whole)."""
    dst.mkdir(exist_ok=True)
    for entry in sorted(src.iterdir()):
        target = dst / entry.name
        if entry.is_dir() and not entry.name.endswith(".hf") and target.is_dir() and not target.is_symlink():
            _merge(entry, target)
            continue
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        elif target.exists() or target.is_symlink():
            target.unlink()
        os.replace(entry, target)


def _commit(staging: Path, out: Path) -> None:
    """Make the staged outputs ``out``'s. A new folder is one rename; into an existing one, the old manifest goes
    first and the new one comes last, so a folder with a manifest always holds one whole prep run."""
    if staging.parent != out:
        staging.rename(out)
        return
    (out / "manifest.json").unlink(missing_ok=True)
    manifest = staging / "manifest.json"
    held = staging.parent / f"{staging.name}.manifest"
    os.replace(manifest, held)
    try:
        _merge(staging, out)
        os.replace(held, out / "manifest.json")
    finally:
        held.unlink(missing_ok=True)
        shutil.rmtree(staging, ignore_errors=True)


def prepare(cfg: PrepConfig) -> int:
    """Render tasks 1-3 of the loaded rows and write them with their stats; returns the exit status.

    Everything the run needs is checked before the first file is written (the output folder, task 2's Punkt
    model, the tokenizer and the model's positions, a README for every row of tasks 1-2), and the outputs are
    written into a staging folder that becomes ``--out`` only when all of them are there: a failed or interrupted
    prep leaves no half folder that looks done."""
    t0 = time.perf_counter()
    out = Path(str(cfg.out))  # set: PrepConfig.check
    _check_out(out)
    if 2 in cfg.tasks:
        get_splitter(cfg.splitter)
        if cfg.splitter == "punkt":
            check_punkt()
    splits = _load(cfg)
    _check_leaks(splits)
    if cfg.tokenizer:
        check_model_available(cfg.tokenizer, "--tokenizer")
    tokenizer = load_tokenizer(cfg.tokenizer) if cfg.tokenizer else None
    positions = model_positions(cfg.tokenizer) if cfg.tokenizer else None  # the config beside the tokenizer
    asked = cfg.max_context_tokens
    budget = min(asked, positions) if positions else asked
    max_prompt = positions - cfg.max_new_tokens if positions and cfg.max_new_tokens else None
    if max_prompt is not None and max_prompt < 1:
        raise MLBenchError(f"--max-new-tokens {cfg.max_new_tokens} leaves no room for a prompt in the model's "
                           f"{positions} positions", "--max-new-tokens", f"use less than {positions}")
    root = cfg.readmes
    if cfg.checkout and cfg.repos_dir:
        checkout_repos(cfg.checkout, cfg.repos_dir)
    root = root or cfg.repos_dir
    corpus = ReadmeCorpus(root) if root else None
    _check_readmes(corpus, splits, cfg.tasks)
    if budget < asked:
        print(f"prep: --max-context-tokens {asked} capped at the model's {positions} positions", file=sys.stderr)
    if max_prompt is not None and max_prompt < budget:
        print(f"prep: prompts of the evaluation splits cut to {max_prompt} tokens (the model's {positions} positions"
              f" - {cfg.max_new_tokens} new tokens)", file=sys.stderr)
    renderer = Renderer(corpus, cfg.template, tokenizer, budget, max_prompt, cfg.splitter)
    staging = _staging(out)
    try:
        by = _write(cfg, renderer, splits, staging, tokenizer, budget, asked, positions, max_prompt, root)
        _commit(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    n = sum(len(v) for v in by.values())
    trunc = sum(r["truncated"] for v in by.values() for r in v)
    print(f"prep: wrote {n} records ({trunc} truncated) for splits {list(splits)} tasks {cfg.tasks} "
          f"to {out} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return 0


def _write(cfg: PrepConfig, renderer: Renderer, splits: dict[str, list[Sample]], out: Path, tokenizer: Any,
           budget: int, asked: int, positions: int | None, max_prompt: int | None, root: str | None
           ) -> dict[tuple[str, int], list[dict[str, Any]]]:
    """Render and write every split and task, the stats, the resolved config and the manifest last, into ``out``
    (the staging folder)."""
    by: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for name, samples in splits.items():
        for task in cfg.tasks:
            records = renderer.render_task(samples, task, desc=f"{name} task {task}",
                                           for_inference="train" not in name)
            by[(name, task)] = records
            write_jsonl_atomic(out / name / f"task{task}.jsonl", records)
            if cfg.hf:
                _save_hf(records, out / name / f"task{task}.hf")
    stats = prompt_stats(by)
    write_json_atomic(out / "stats.json", stats)
    note = None
    if tokenizer is not None:
        note = (f"Token budget (prompt + answer + EOS): {budget}"
                + (f", the model's {positions} positions (--max-context-tokens {asked} asked for more)."
                   if budget < asked else f" (the model has {positions or 'unknown'} positions).")
                + (f" Prompts of the evaluation splits: at most {max_prompt} tokens, leaving {cfg.max_new_tokens} "
                   "for generation." if max_prompt is not None and max_prompt < budget else ""))
    write_atomic(out / "stats.md", prompt_stats_markdown(stats, tokenizer is not None, note))
    save_resolved(cfg, out / "config.yaml")  # `mlbench prep --config OUT/config.yaml` replays this run
    write_json_atomic(out / "manifest.json", {
        "data": str(cfg.data), "splits": {n: len(s) for n, s in splits.items()}, "tasks": cfg.tasks,
        # max_context_tokens: the budget prep cut to (written as max_tokens before; train reads either)
        "template": cfg.template, "tokenizer": cfg.tokenizer, "max_context_tokens": budget,
        "max_context_tokens_requested": asked, "model_positions": positions,
        "max_new_tokens": cfg.max_new_tokens, "max_prompt_tokens": max_prompt,
        "splitter": cfg.splitter, "readmes": root, "ood_repos": cfg.ood_repos if cfg.build_splits else None,
        "repos": cfg.repos,
    })
    return by
