"""`mlbench report RUN...`: eval run folders side by side (markdown, CSV, PNG). Reads each run's summary.json."""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys
from pathlib import Path
from typing import Any

from mlbench_kit.errors import MLBenchError
from mlbench_kit.io import write_atomic

COLUMNS = ("pass@1", "pass@2", "pass@5", "type_accuracy", "param_hit_precision", "param_all_hit_rate")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", help="eval output folders (each with summary.json); NAME=DIR to label one")
    p.add_argument("--out", required=True, help="folder for report.md, report.csv, report.png")


def _load(spec: str) -> tuple[str, dict[str, Any]]:
    name, _, path = spec.rpartition("=") if "=" in spec else (Path(spec).name, "", spec)
    f = Path(path) / "summary.json"
    if not f.is_file():
        raise MLBenchError("no summary.json in this run folder", str(f), "pass folders written by `mlbench eval`")
    return name, json.loads(f.read_text())


def run(args: argparse.Namespace) -> int:
    runs = [_load(s) for s in args.runs]
    rows = [{"run": name, "samples": s["metrics"]["overall"]["samples"], "mode": s["mode"],
             **{c: s["metrics"]["overall"].get(c) for c in COLUMNS}} for name, s in runs]
    out = Path(args.out)
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(rows[0]))
    w.writeheader()
    w.writerows(rows)
    write_atomic(out / "report.csv", buf.getvalue())
    fmt = lambda v: "–" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))  # noqa: E731
    lines = ["# ML-Bench runs side by side", "", "| " + " | ".join(rows[0]) + " |",
             "|" + "---|" * len(rows[0])]
    lines += ["| " + " | ".join(fmt(v) for v in r.values()) + " |" for r in rows]
    lines += ["", "Pass@k: the paper's (a sample passes if any of its first k outputs passes). type_accuracy: "
              "share of outputs of the right kind (bash vs Python). param_hit_precision: share of the expected "
              "arguments found in an output. Each run's own report.md has per-repository rows, CIs and error classes.",
              "", "![runs](report.png)", ""]
    write_atomic(out / "report.md", "\n".join(lines))
    _plot(rows, out / "report.png")
    print(f"report: {out / 'report.md'}", file=sys.stderr)
    return 0


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(1.6 * len(COLUMNS) + 2, 3.6))
    width = 0.8 / len(rows)
    for i, r in enumerate(rows):
        ax.bar([j + i * width for j in range(len(COLUMNS))], [r[c] or 0 for c in COLUMNS], width, label=r["run"])
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(COLUMNS))], COLUMNS, rotation=15)
    ax.set_ylim(0, 1)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
