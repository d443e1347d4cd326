"""`mlbench prep`: load ML-Bench, attach README context, render tasks 1–3, write JSONL + datasets folders + stats."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from mlbench_kit.dataset import HUB_ID, Sample, load_samples
from mlbench_kit.deprecation import deprecated_flag
from mlbench_kit.errors import MLBenchError
from mlbench_kit.hf import check_model_available, load_tokenizer, model_positions
from mlbench_kit.io import (
    atomic_dir,
    write_atomic,
    write_json_atomic,
    write_jsonl_atomic,
)
from mlbench_kit.records import TASKS

from .corpus import ReadmeCorpus, checkout_repos
from .render import Renderer
from .splits import build_splits, check_no_leak
from .stats import prompt_stats, prompt_stats_markdown
from .templates import TEMPLATES


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``mlbench prep``."""
    p.add_argument("--data", default=HUB_ID, help=f"hub id, .jsonl/.parquet file or save_to_disk folder (default {HUB_ID})")
    p.add_argument("--splits", nargs="+", default=["full"],
                   help="splits to load (hub/DatasetDict: full quarter id_train ood_train; a file holds one)")
    p.add_argument("--readmes", help="folder of READMEs laid out as DIR/<repo>/<path>/README.md")
    p.add_argument("--repos-dir", help="folder of repository checkouts (DIR/<repo>); with --checkout, cloned there")
    p.add_argument("--checkout", metavar="REPOS_JSON", help="clone repositories of this repos.json at their pinned commits")
    p.add_argument("--tasks", nargs="+", type=int, default=list(TASKS), choices=TASKS)
    p.add_argument("--template", default="paper", choices=TEMPLATES)
    p.add_argument("--tokenizer", help="tokenizer folder or hub id; without it nothing is truncated")
    p.add_argument("--max-context-tokens", type=int, default=8192,
                   help="budget for prompt + answer + EOS, capped at the model's positions (default 8192)")
    deprecated_flag(p, "--max-tokens", "--max-context-tokens", type=int)
    p.add_argument("--max-new-tokens", type=int, default=1024,
                   help="room left for generation in the splits inference reads (all but *train*): their prompts "
                        "are cut to the model's positions minus this (default 1024, the benchmark's; 0: off)")
    p.add_argument("--splitter", default="punkt", choices=["punkt", "regex"],
                   help="sentence splitter for task 2 (punkt is the paper's; regex is an explicit fallback)")
    p.add_argument("--build-splits", action="store_true",
                   help="build test/id_train/ood_train from the loaded rows (see --ood-repos)")
    p.add_argument("--ood-repos", nargs="*", default=[], help="repositories held out for ood_train")
    p.add_argument("--repos", nargs="+", metavar="REPO",
                   help="only these repositories' rows (e.g. those whose environments are built); default: all")
    p.add_argument("--id-test-fraction", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-hf", action="store_true", help="write JSONL only, no datasets folders")
    p.add_argument("--out", required=True, help="output folder")


def _load(args: argparse.Namespace) -> dict[str, list[Sample]]:
    is_file = Path(args.data).suffix in (".jsonl", ".json", ".parquet")
    if is_file and len(args.splits) > 1:
        raise MLBenchError("a file holds one split; --splits names it", "--splits", "pass one name, e.g. --splits test")
    loaded = {name: load_samples(args.data, name) for name in args.splits}
    if args.repos:
        known = {s.repo for rows in loaded.values() for s in rows}
        unknown = sorted(set(args.repos) - known)
        if unknown:
            raise MLBenchError(f"--repos names repositories not in the data: {unknown}", "--repos",
                               f"choose from {sorted(known)}")
        loaded = {name: [s for s in rows if s.repo in args.repos] for name, rows in loaded.items()}
    if args.build_splits:
        if len(loaded) != 1:
            raise MLBenchError("--build-splits takes exactly one loaded split", "--splits")
        return build_splits(next(iter(loaded.values())), args.ood_repos, args.id_test_fraction, args.seed)
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
    """Run the prep stage; returns the exit status."""
    t0 = time.perf_counter()
    splits = _load(args)
    _check_leaks(splits)
    root = args.readmes
    if args.checkout:
        if not args.repos_dir:
            raise MLBenchError("--checkout needs --repos-dir to clone into", "--checkout")
        checkout_repos(args.checkout, args.repos_dir)
    root = root or args.repos_dir
    corpus = ReadmeCorpus(root) if root else None
    if args.tokenizer:
        check_model_available(args.tokenizer, "--tokenizer")
    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
    positions = model_positions(args.tokenizer) if args.tokenizer else None  # the config beside the tokenizer
    asked = args.max_context_tokens
    budget = min(asked, positions) if positions else asked
    if budget < asked:
        print(f"prep: --max-context-tokens {asked} capped at the model's {positions} positions", file=sys.stderr)
    if args.max_new_tokens < 0:
        raise MLBenchError("--max-new-tokens must be >= 0", "--max-new-tokens")
    max_prompt = positions - args.max_new_tokens if positions and args.max_new_tokens else None
    if max_prompt is not None and max_prompt < 1:
        raise MLBenchError(f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt in the model's "
                           f"{positions} positions", "--max-new-tokens", f"use less than {positions}")
    if max_prompt is not None and max_prompt < budget:
        print(f"prep: prompts of the evaluation splits cut to {max_prompt} tokens (the model's {positions} positions"
              f" - {args.max_new_tokens} new tokens)", file=sys.stderr)
    renderer = Renderer(corpus, args.template, tokenizer, budget, max_prompt, args.splitter)
    out = Path(args.out)
    by: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for name, samples in splits.items():
        for task in args.tasks:
            records = renderer.render_task(samples, task, desc=f"{name} task {task}",
                                           for_inference="train" not in name)
            by[(name, task)] = records
            write_jsonl_atomic(out / name / f"task{task}.jsonl", records)
            if not args.no_hf:
                _save_hf(records, out / name / f"task{task}.hf")
    stats = prompt_stats(by)
    write_json_atomic(out / "stats.json", stats)
    note = None
    if tokenizer is not None:
        note = (f"Token budget (prompt + answer + EOS): {budget}"
                + (f", the model's {positions} positions (--max-context-tokens {asked} asked for more)."
                   if budget < asked else f" (the model has {positions or 'unknown'} positions).")
                + (f" Prompts of the evaluation splits: at most {max_prompt} tokens, leaving {args.max_new_tokens} "
                   "for generation." if max_prompt is not None and max_prompt < budget else ""))
    write_atomic(out / "stats.md", prompt_stats_markdown(stats, tokenizer is not None, note))
    write_json_atomic(out / "manifest.json", {
        "data": str(args.data), "splits": {n: len(s) for n, s in splits.items()}, "tasks": args.tasks,
        # max_context_tokens: the budget prep cut to (written as max_tokens before; train reads either)
        "template": args.template, "tokenizer": args.tokenizer, "max_context_tokens": budget,
        "max_context_tokens_requested": asked, "model_positions": positions,
        "max_new_tokens": args.max_new_tokens, "max_prompt_tokens": max_prompt,
        "splitter": args.splitter, "readmes": root, "ood_repos": args.ood_repos if args.build_splits else None,
        "repos": args.repos,
    })
    n = sum(len(v) for v in by.values())
    trunc = sum(r["truncated"] for v in by.values() for r in v)
    print(f"prep: wrote {n} records ({trunc} truncated) for splits {list(splits)} tasks {args.tasks} "
          f"to {out} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return 0
