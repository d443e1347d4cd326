"""`mlbench report NAME=DIR...`: eval runs side by side — per setting (task 1–3, or an agent policy), per
repository, per type.

Each DIR is an ``mlbench eval`` folder (its summary.json). Folders given the same NAME are one checkpoint: its
tasks become the settings, and several folders of the same task (seeds) are averaged, the seed range shown. An eval
of `mlbench agent`'s generations is an agent setting of its checkpoint (found by the agent run beside the
generations file), shown beside the task rows with its episodes (exits, turns, tokens, the openhands rule).
Published rows (``--reference``) are added to the tables, marked as quoted: those of the tasks measured here
(all of them with ``--all-reference``), with their per-type split where the paper gives one.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

from mlbench_kit.errors import MLBenchError

from .data import load_reference, load_settings
from .html import write_html
from .render import write_csv, write_markdown, write_plots


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``mlbench report``."""
    p.add_argument("runs", nargs="+", help="eval output folders (summary.json); NAME=DIR to label them, the same "
                                           "NAME for a checkpoint's tasks and seeds")
    p.add_argument("--out", required=True,
                   help="folder for report.md, report.csv, the PNG plots and report.html (every row, to browse)")
    p.add_argument("--reference", help="YAML of published rows to quote beside yours (configs/report/*.yaml)")
    p.add_argument("--all-reference", action="store_true",
                   help="quote every reference row, not only those of the tasks measured here")
    p.add_argument("--skip-missing", action="store_true", help="leave out folders without summary.json (sweeps)")
    p.add_argument("--baseline", metavar="NAME",
                   help="a run's NAME: every other run against it on the same setting, paired over the rows both "
                        "scored (the difference and its 95%% interval)")


def run(args: argparse.Namespace) -> int:
    """Write report.csv, the plots, report.md and report.html; returns the exit status."""
    settings = load_settings(args.runs, args.skip_missing)
    refs = load_reference(args.reference) if args.reference else []
    tasks = {s.task for s in settings if s.agent is None}
    if not args.all_reference:
        # task rows of the tasks measured here (all of them when a run's task is unknown); agent rows beside
        # agent runs only
        agents = any(s.agent for s in settings)
        refs = [r for r in refs if (agents if r.agent else (None in tasks or r.task is None or r.task in tasks))]
    if args.baseline is not None and args.baseline not in {s.run for s in settings}:
        raise MLBenchError(f"no run named {args.baseline!r} to compare with", "--baseline",
                           f"name one of: {', '.join(dict.fromkeys(s.run for s in settings))}")
    out = Path(args.out)
    ks = sorted({k for s in settings for summ in s.summaries for k in summ["ks"]})
    write_csv(settings, refs, ks, out / "report.csv")
    plots = write_plots(settings, ks, out)
    write_markdown(settings, refs, ks, plots, out / "report.md", args.baseline)
    write_html(settings, out / "report.html")
    runs = defaultdict(list)
    for s in settings:
        runs[s.run].append(s.task)
    print(f"report: {len(runs)} run(s), {len(settings)} setting(s): {out / 'report.md'}; every row: "
          f"{out / 'report.html'}", file=sys.stderr)
    return 0
