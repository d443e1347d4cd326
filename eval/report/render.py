"""The side-by-side report's files: report.md, report.csv (long format), report.png and report_repos.png."""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlbench_kit.io import write_atomic
from mlbench_kit.markdown import fmt_rate, md_code, md_text
from mlbench_kit.records import ERROR_CLASSES

if TYPE_CHECKING:
    from .data import Reference, Setting

EXTRA = ("param_hit_precision", "param_all_hit_rate", "type_accuracy")


def _groups(settings: list[Setting], kind: str) -> list[str]:
    return sorted({g for s in settings for summ in s.summaries for g in summ["metrics"][kind]})


def write_csv(settings: list[Setting], refs: list[Reference], ks: list[int], path: Path) -> None:
    """One row per (run, task, group, metric): overall, per repository, per type, and the quoted rows."""
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["run", "task", "seeds", "group_kind", "group", "metric", "value", "low", "high", "source"])
    metrics = [f"pass@{k}" for k in ks] + list(EXTRA)
    for s in settings:
        groups: list[tuple[str, tuple[str, str] | None]] = [("overall", None)]
        groups += [("repo", ("per_repo", g)) for g in _groups([s], "per_repo")]
        groups += [("type", ("per_type", g)) for g in _groups([s], "per_type")]
        for kind, g in groups:
            for m in metrics:
                v, rng = s.metric(m, g)
                if v is not None:
                    w.writerow([s.run, s.task, len(s.summaries), kind, g[1] if g else "all", m, round(v, 4),
                                *(rng if rng else ("", "")), "measured"])
        # what the Pass@k above leaves out (faults, unscored samples): always written, 0 included
        for m, n in zip(("faults", "unscored_samples"), s.not_scored, strict=True):
            w.writerow([s.run, s.task, len(s.summaries), "overall", "all", m, n, "", "", "measured"])
    for r in refs:
        quoted = [("overall", "all", r.values)] + [("type", t, v) for t, v in r.per_type.items()]
        for kind, group, values in quoted:
            for m, v in values.items():
                w.writerow([r.name, r.task, "", kind, group, m, round(v, 6), "", "", f"quoted: {r.source}"])
    write_atomic(path, buf.getvalue())


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(map(md_text, head)) + " |", "|" + "---|" * len(head)] + [
        "| " + " | ".join(map(md_text, r)) + " |" for r in rows]


def write_markdown(settings: list[Setting], refs: list[Reference], ks: list[int], plots: list[str],
                   path: Path) -> None:
    """The report: settings, quality of outputs, repositories, types, error classes, gold ceiling, sources."""
    lines = ["# ML-Bench runs side by side", "",
             "Pass@k as the paper defines it (a sample passes if one of its first k outputs passes the parameter "
             "check, the type check and runs cleanly); brackets: the 95% bootstrap CI over samples for one seed, "
             "min–max over seeds for several (their mean shown).", "", "## Pass@k by setting", ""]
    rows = [[s.run, str(s.task or "–"), str(len(s.summaries)), str(s.summaries[0]["metrics"]["overall"]["samples"])]
            + [fmt_rate(*s.metric(f"pass@{k}")) for k in ks] + [s.incomplete or "–"] for s in settings]
    rows += [[f"{r.name} *(quoted)*", str(r.task or "–"), "", ""] + [fmt_rate(r.values.get(f"pass@{k}")) for k in ks]
             + [""] for r in refs]
    lines += _table(["run", "task", "seeds", "samples"] + [f"Pass@{k}" for k in ks] + ["not scored"], rows)
    bad = [s for s in settings if s.incomplete]
    if bad:
        lines += ["", "**INCOMPLETE**: " + "; ".join(f"{md_text(s.label)}: {s.incomplete}" for s in bad)
                  + ". Their Pass@k is over the samples that were scored only: faults (faults.jsonl of each run) are "
                  "not verdicts; fix the environment and re-run `mlbench eval` to score them."]
    if refs:
        lines += ["", "Quoted rows are copied from their source, not recomputed here: "
                  + "; ".join(sorted({r.source for r in refs})) + "."]
    lines += _paper_layout(settings, refs, ks)
    lines += ["", "## What the outputs get right", "",
              "param hit: share of the instruction's arguments found in an output; all params: outputs with every "
              "argument; type acc: outputs of the right kind (bash vs Python).", ""]
    lines += _table(["setting", "param hit", "all params", "type acc"],
                    [[s.label] + [fmt_rate(s.metric(m)[0]) for m in EXTRA] for s in settings])
    first, last = f"pass@{ks[0]}", f"pass@{ks[-1]}"
    for kind, title in (("per_repo", "repository"), ("per_type", "type")):
        groups = _groups(settings, kind)
        lines += ["", f"## Pass@{ks[0]} / Pass@{ks[-1]} per {title}", ""]
        lines += _table([title] + [s.label for s in settings],
                        [[g] + [f"{fmt_rate(s.metric(first, (kind, g))[0])} / {fmt_rate(s.metric(last, (kind, g))[0])}"
                                for s in settings] for g in groups])
        if kind == "per_type" and any(r.per_type for r in refs):
            lines += ["", "Quoted per type (the paper's split, not recomputed):", ""]
            lines += _table(["quoted row", "task", "type"] + [f"Pass@{k}" for k in ks],
                            [[f"{r.name} *(quoted)*", str(r.task or "–"), t]
                             + [fmt_rate(v.get(f"pass@{k}")) for k in ks]
                             for r in refs for t, v in r.per_type.items()])
    classes = sorted({c for s in settings for summ in s.summaries for c in summ["metrics"]["overall"]["error_classes"]})
    lines += ["", "## Error classes (outputs, summed over seeds)", ""]
    lines += _table(["class", "meaning"] + [s.label for s in settings],
                    [[c, ERROR_CLASSES.get(c, "")] + [str(sum(summ["metrics"]["overall"]["error_classes"].get(c, 0)
                                                             for summ in s.summaries)) for s in settings]
                     for c in classes])
    lines += ["", "## Gold ceiling", "",
              "How the dataset's own answers fare under the same parameter and type checks (rows that pass both "
              "are the most any model can score). For the execution ceiling, score the answers themselves with "
              "`mlbench eval --gold` and add that folder as a run.", ""]
    lines += _table(["setting", "rows", "param ok", "type ok", "both"],
                    [[s.label] + [str(_gold(s)[k]) for k in ("rows", "param_ok", "type_ok", "both")]
                     for s in settings])
    lines += ["", "## Sources", ""] + [f"- {md_text(s.label)}: " + ", ".join(md_code(str(d)) for d in s.dirs)
                                       for s in settings]
    lines += [""] + [f"![{p}]({p})" for p in plots] + [""]
    write_atomic(path, "\n".join(lines))


_PAPER_ORDER = {3: "Oracle Segment", 1: "Raw README", 2: "BM25 Retrieval"}  # Table 1's column groups


def _paper_layout(settings: list[Setting], refs: list[Reference], ks: list[int]) -> list[str]:
    """Table 1 of the paper: one row per run, Pass@k per task in its column order, in percent."""
    tasks = [t for t in _PAPER_ORDER if any(s.task == t for s in settings) or any(r.task == t for r in refs)]
    if not tasks:
        return []
    runs: dict[str, dict[int, Any]] = {}
    for s in settings:
        if s.task is not None:
            runs.setdefault(s.run, {})[s.task] = {k: s.metric(f"pass@{k}")[0] for k in ks}
    for r in refs:
        if r.task is not None:
            runs.setdefault(f"{r.name} *(quoted)*", {})[r.task] = {k: r.values.get(f"pass@{k}") for k in ks}

    def pct(v: float | None) -> str:
        return "/" if v is None else f"{100 * v:.2f}"

    head = ["model"] + [f"{_PAPER_ORDER[t]} Pass@{k}" for t in tasks for k in ks]
    rows = [[name] + [pct(cells.get(t, {}).get(k)) for t in tasks for k in ks] for name, cells in runs.items()]
    return ["", "## As the paper's Table 1 (percent)", "",
            "Runs as rows, the paper's settings as columns; `/` where a run has no such setting (as the paper "
            "marks the settings it did not run)."] + [""] + _table(head, rows)


def _gold(s: Setting) -> dict[str, Any]:
    return s.summaries[0]["gold_ceiling"].get("ALL", {"rows": 0, "param_ok": 0, "type_ok": 0, "both": 0})


def write_plots(settings: list[Setting], ks: list[int], out: Path) -> list[str]:
    """report.png: Pass@k, parameter hits and type accuracy per setting; report_repos.png: Pass@1 per repository."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    labels = [s.label + ("\n(INCOMPLETE)" if s.incomplete else "") for s in settings]
    fig, axes = plt.subplots(1, 2, figsize=(max(8.0, 2.0 * len(settings) + 3), 3.8))
    for ax, metrics, title in ((axes[0], [f"pass@{k}" for k in ks], "Pass@k by setting"),
                               (axes[1], ["param_hit_precision", "type_accuracy"], "What the outputs get right")):
        width = 0.8 / len(metrics)
        for j, m in enumerate(metrics):
            vals = [s.metric(m)[0] or 0 for s in settings]
            ax.bar([i + j * width for i in range(len(settings))], vals, width, label=m.replace("_", " "))
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(settings))], labels, rotation=30, ha="right", fontsize=8)
        ax.set_ylim(0, 1)
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "report.png", dpi=100)
    plt.close(fig)

    repos = _groups(settings, "per_repo")
    fig, ax = plt.subplots(figsize=(7, max(2.5, 0.35 * len(repos) * max(1, len(settings) / 3) + 1)))
    h = 0.8 / len(settings)
    for i, s in enumerate(settings):
        ax.barh([r + i * h for r in range(len(repos))],
                [s.metric(f"pass@{ks[0]}", ("per_repo", g))[0] or 0 for g in repos], h,
                label=s.label + (" (INCOMPLETE)" if s.incomplete else ""))
    ax.set_yticks([r + 0.4 - h / 2 for r in range(len(repos))], repos, fontsize=8)
    ax.set_xlim(0, 1)
    ax.set_xlabel(f"Pass@{ks[0]}")
    ax.set_title("Pass@1 per repository")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(out / "report_repos.png", dpi=100)
    plt.close(fig)
    return ["report.png", "report_repos.png"]
