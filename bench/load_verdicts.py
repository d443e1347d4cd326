"""Verdicts that load cannot move (issue 30): the gold answers of built environments scored idle, then with busy
loops beside the run, on the cpu clock (`--limit-clock cpu`, the default) and on the benchmark's wall clock
(`--limit-clock wall`), in one invocation; counts the verdicts that differ between idle and loaded per clock.

Each pass is `mlbench eval --gold --mode compat` on the rows of --repos, in its own folder; the loaded passes run
with --loops processes of `while True: pass` beside them (not pinned: they share the machine's cores with the
run, as another user's job would). Order: wall idle, cpu idle, wall loaded, cpu loaded, so both clocks see the
same page cache and the same neighbours.

    python bench/load_verdicts.py --data ../shared/mlbench/full.jsonl --envs ~/.cache/mlbench/envs.yaml \\
        --out runs/load-verdicts --md bench/results/2026-11-27-load-verdicts.md

Needs the environments: mlbench env build --tarballs ../shared/mlbench/repos External-Attention-pytorch \\
PyTorch-GAN Time-Series-Library
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from mlbench_kit.io import read_jsonl_tolerant

REPOS = ("External-Attention-pytorch", "PyTorch-GAN", "Time-Series-Library")
CLOCKS = ("wall", "cpu")


def score(a: argparse.Namespace, clock: str, load: str) -> dict:
    """One `mlbench eval --gold` pass; its seconds, exit status and verdicts ({id: result})."""
    out = Path(a.out) / f"{clock}-{load}"
    argv = [sys.executable, "-m", "mlbench_kit.cli", "eval", "--gold", "--data", a.data, "--envs", a.envs,
            "--out", str(out), "--repos", *a.repos, "--workers", str(a.workers), "--mode", "compat",
            "--backend", a.backend, "--limit-clock", clock, "--no-ci"]
    loops = []
    if load == "loaded":
        # each in a session of its own, as another user's job: with autogroup scheduling (Linux's default for
        # desktops and many servers) the loops of one session share one scheduler entity, a far lighter load
        loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
                 for _ in range(a.loops)]
    t0 = time.monotonic()
    try:
        r = subprocess.run(argv, capture_output=True, text=True)
    finally:
        for p in loops:
            p.kill()
            p.wait()
    seconds = time.monotonic() - t0
    verdicts = {x["id"]: x for x in read_jsonl_tolerant(out / "results.jsonl")} if r.returncode == 0 else {}
    print(f"{clock:4} {load:6} {seconds:7.1f} s exit {r.returncode} pass {sum(v['passed'] for v in verdicts.values())}"
          f"/{len(verdicts)}", file=sys.stderr, flush=True)
    if r.returncode != 0:
        print(r.stderr[-3000:], file=sys.stderr)
    return {"seconds": round(seconds, 1), "exit": r.returncode, "verdicts": verdicts}


def _cause(v: dict) -> str:
    if v.get("timed_out"):
        return f"still running at the limit ({v.get('duration')} s)"
    return f"{v.get('error_class') or 'pass'}, exit {v.get('exit_code')}, {v.get('duration')} s"


def report(a: argparse.Namespace, runs: dict) -> str:
    """The markdown table: per clock, passes idle and loaded, and the verdicts that differ."""
    n = len(runs[("wall", "idle")]["verdicts"])
    lines = ["# Verdicts that load cannot move: idle vs busy loops beside the run", "",
             (f"`python bench/load_verdicts.py --repos {' '.join(a.repos)} --workers {a.workers} --loops {a.loops} "
              f"--backend {a.backend}`: `mlbench eval --gold --mode compat` on the {n} gold answers of these "
              f"repositories (the environments of `mlbench env build --tarballs ../shared/mlbench/repos`), idle and "
              f"with {a.loops} busy loops beside it, on each clock, in one invocation ({a.machine})."), "",
             "| clock | pass idle | pass loaded | differing verdicts | still running at the limit idle / loaded | "
             "seconds idle / loaded |",
             "|---|---|---|---|---|---|"]
    diffs = []
    for clock in CLOCKS:
        idle, loaded = runs[(clock, "idle")], runs[(clock, "loaded")]
        vi, vl = idle["verdicts"], loaded["verdicts"]
        differ = sorted(k for k in vi if k in vl and vi[k]["passed"] != vl[k]["passed"])
        missing = len(set(vi) ^ set(vl))
        diffs += [(clock, k, vi[k], vl[k]) for k in differ]
        lines.append(f"| {clock} | {sum(v['passed'] for v in vi.values())}/{len(vi)} | "
                     f"{sum(v['passed'] for v in vl.values())}/{len(vl)} | **{len(differ)}**"
                     + (f" ({missing} without a verdict on one side)" if missing else "") + " | "
                     f"{sum(bool(v.get('timed_out')) for v in vi.values())} / "
                     f"{sum(bool(v.get('timed_out')) for v in vl.values())} | "
                     f"{idle['seconds']} / {loaded['seconds']} |")
    lines += ["", "## Rows whose verdicts differ", ""]
    if diffs:
        lines += ["| clock | id | repository | idle | loaded |", "|---|---|---|---|---|"]
        lines += [f"| {c} | {k} | {vi['repo']} | {_cause(vi)} | {_cause(vl)} |" for c, k, vi, vl in diffs]
    else:
        lines.append("None.")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="../shared/mlbench/full.jsonl")
    p.add_argument("--envs", default=str(Path(os.environ.get("MLBENCH_CACHE", "~/.cache/mlbench")).expanduser()
                                         / "envs.yaml"))
    p.add_argument("--repos", nargs="+", default=list(REPOS))
    p.add_argument("--out", default="runs/load-verdicts")
    p.add_argument("--md", help="also write the table here")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--loops", type=int, default=2, help="busy loops beside the loaded passes")
    p.add_argument("--backend", default="bwrap")
    p.add_argument("--machine", default=f"{os.cpu_count()} cores, shared", help="the conditions, for the table")
    a = p.parse_args()
    if Path(a.out).exists():
        p.error(f"{a.out} exists: each invocation measures all four passes afresh; pick a new --out")
    runs = {(clock, load): score(a, clock, load) for load in ("idle", "loaded") for clock in CLOCKS}
    if any(r["exit"] != 0 for r in runs.values()):
        return 1
    md = report(a, runs)
    print(md)
    if a.md:
        Path(a.md).write_text(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
