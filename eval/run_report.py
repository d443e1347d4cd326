"""The markdown report of one eval run (``OUT/report.md``); `mlbench report` compares runs (eval/report/)."""

from __future__ import annotations

from typing import Any

from mlbench_kit.markdown import fmt_rate, md_code, md_text
from mlbench_kit.records import ERROR_CLASSES


def _row(name: str, m: dict[str, Any], ks: list[int]) -> str:
    cells = [md_text(name), str(m["samples"])]
    for k in ks:
        cells.append(fmt_rate(m[f"pass@{k}"], m.get(f"pass@{k}_ci95")))
    cells += [f"{m['param_hit_precision']:.3f}" if m["param_hit_precision"] is not None else "",
              f"{m['type_accuracy']:.3f}" if m["type_accuracy"] is not None else ""]
    return "| " + " | ".join(cells) + " |"


def render_run_report(summary: dict[str, Any]) -> str:
    """One eval run's ``summary.json`` as its ``report.md``."""
    ks = summary["ks"]
    head = "| group | samples | " + " | ".join(f"Pass@{k} [95% CI]" for k in ks) + " | param hit | type acc |"
    sep = "|" + "---|" * (4 + len(ks))
    m = summary["metrics"]
    unscored = summary.get("unscored") or []
    lines = [f"# ML-Bench execution report ({summary['mode']} mode, {summary['backend']} backend)", ""]
    if unscored:
        lines += [f"**INCOMPLETE**: Pass@k below is over {m['overall']['samples']} samples; {len(unscored)} samples "
                  "with outputs that have no verdict (environment or sandbox faults) are reported apart, never "
                  "scored over their remaining outputs: " + ", ".join(md_text(f"{u['github_id']}/{u['id']}")
                                                                       for u in unscored[:10]) + ".", ""]
    lines += [f"Generations: {md_code(str(summary['generations']))}; {summary['n']} outputs per sample; "
             f"{summary['executions']} executions run, {summary['cached_executions']} reused"
             + (f", {summary['threads_per_execution']} OMP/MKL thread(s) each" if summary.get("threads_per_execution")
                else "") + ".", "",
             head, sep, _row("**all**", m["overall"], ks)]
    lines += [_row(f"type: {t}", v, ks) for t, v in m["per_type"].items()]
    lines += [_row(r, v, ks) for r, v in m["per_repo"].items()]
    ub = ", ".join(f"{k}: {m['overall'][f'unbiased_pass@{k}']}" for k in ks)
    lines += ["", f"Unbiased pass@k (Chen et al., over all n outputs): {ub}.", "", "## Error classes", ""]
    classes = sorted(m["overall"]["error_classes"].items())
    lines += ["| class | meaning | outputs |", "|---|---|---|"] if classes else ["None: every output passed."]
    for cls, cnt in classes:
        lines.append(f"| {cls} | {ERROR_CLASSES.get(cls, '')} | {cnt} |")
    gv = summary.get("gold_valid")
    if gv:
        lines += ["", f"## Gold-valid rows ({gv['rows']} rows whose own answer passes in its environment)", "",
                  f"From {md_code(str(gv['source']))}. The table above is the paper's number, over all rows; this "
                  "one is what a model can actually be credited for.", ""]
        lines += [head, sep, _row("**gold-valid**", gv["metrics"], ks)] if gv["metrics"] else [
            "None: no scored sample is a gold-valid row."]
        excluded = sorted(gv["excluded"].items())
        lines += ["", "Excluded rows, by cause:" if excluded else "Excluded rows: none.", ""]
        lines += [f"- {md_text(str(cause))}: {len(keys)} rows (first: {keys[:6]})" for cause, keys in excluded]
    g = summary["gold_ceiling"]
    lines += ["", "## Gold ceiling (ground truth under the benchmark's parameter and type checks)", "",
              "| repository | rows | param ok | type ok | both |", "|---|---|---|---|---|"]
    for repo, c in g.items():
        lines.append(f"| {md_text(repo)} | {c['rows']} | {c['param_ok']} | {c['type_ok']} | {c['both']} |")
    if summary.get("per_sample"):
        lines += ["", "## Per-sample outcomes", "",
                  "Outputs passed (1 per output, in order), and the best output: the arguments it got right (+) and "
                  "wrong (-).", "", "| id | passed | instruction | best output | arguments |", "|---|---|---|---|---|"]
        for s in summary["per_sample"]:
            marks = "".join("1" if p else "0" for p in s["passed"])
            args = md_text(" ".join(("+" if ok else "-") + k for k, ok in s["hits"].items()))
            lines.append(f"| {md_text(str(s['id']))} | {marks} | {md_text(s['instruction'], 110)} "
                         f"| {md_code(s['best'], 110)} | {args} |")
    notes = summary["notes"]
    lines += ["", "## Notes", ""] + [f"- {md_text(n)}" for n in notes]
    return "\n".join(lines) + "\n"
