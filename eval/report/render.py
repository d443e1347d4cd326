"""The side-by-side report's files: report.md, report.csv (long format), report.png and report_repos.png."""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlbench_kit.escape import csv_cell, mathtext_literal, visible
from mlbench_kit.io import write_atomic
from mlbench_kit.markdown import fmt_rate, md_code, md_text
from mlbench_kit.passk import paired_difference
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

    def put(cells: list[Any]) -> None:  # a run's or a repository's name is never a spreadsheet formula
        w.writerow([csv_cell(c) for c in cells])

    put(["run", "task", "seeds", "group_kind", "group", "metric", "value", "low", "high", "source"])
    metrics = [f"pass@{k}" for k in ks] + list(EXTRA)
    for s in settings:
        groups: list[tuple[str, tuple[str, str] | None]] = [("overall", None)]
        groups += [("repo", ("per_repo", g)) for g in _groups([s], "per_repo")]
        groups += [("type", ("per_type", g)) for g in _groups([s], "per_type")]
        for kind, g in groups:
            for m in metrics:
                v, rng = s.metric(m, g)
                if v is not None:
                    put([s.run, s.task if s.agent is None else s.setting, len(s.summaries), kind,
                         g[1] if g else "all", m, round(v, 4), *(rng if rng else ("", "")), "measured"])
        if any(s.checkpoints):  # what was scored: base, SFT, a learned adapter and its round (the runs' files)
            put([s.run, s.task if s.agent is None else s.setting, len(s.summaries), "checkpoint", "all",
                 "checkpoint", s.checkpoint, "", "", "measured"])
        # what the Pass@k above leaves out (faults, unscored samples): always written, 0 included
        for m, n in zip(("faults", "unscored_samples"), s.not_scored, strict=True):
            put([s.run, s.task if s.agent is None else s.setting, len(s.summaries), "overall", "all", m, n,
                 "", "", "measured"])
        for m, v in agent_figures(s).items():  # the agent's own episodes: exits, turns, tokens, the openhands rule
            put([s.run, s.setting, len(s.summaries), "agent", "all", m, v, "", "",
                 OPENHANDS_LABEL if m == "openhands_success_rate" else "measured"])
    for r in refs:
        quoted = ([("overall", "all", r.values)] + [("type", t, v) for t, v in r.per_type.items()]
                  + [("repo", g, v) for g, v in r.per_repo.items()])
        for kind, group, values in quoted:
            for m, v in values.items():
                put([r.name, r.task if r.agent is None else r.setting, "", kind, group, m, round(v, 6), "", "",
                     f"quoted: {r.source}"])
    write_atomic(path, buf.getvalue())


def _table(head: list[str], rows: list[list[str]], empty: str = "none") -> list[str]:
    """A markdown table; with no rows, the one line ``empty`` instead of a header over nothing."""
    if not rows:
        return [empty[0].upper() + empty[1:] + "."]
    return ["| " + " | ".join(map(md_text, head)) + " |", "|" + "---|" * len(head)] + [
        "| " + " | ".join(map(md_text, r)) + " |" for r in rows]


def _verdicts(s: Setting) -> dict[tuple[Any, Any], list[bool]]:
    """A one-seed setting's verdicts per row (its summary's ``per_sample``), in sample order."""
    return {(p.get("github_id"), p.get("id")): [bool(x) for x in p.get("passed") or []]
            for p in s.summaries[0].get("per_sample") or [] if isinstance(p, dict)}


def diff_cell(m: dict[str, Any]) -> str:
    """A paired difference in points: ``+8.3 [+0.0, +16.7] neither``."""
    if m["diff"] is None:
        return "–"
    lo, hi = m["ci95"]
    return f"{100 * m['diff']:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}] {m['shown']}"


def baseline_section(settings: list[Setting], baseline: str, ks: list[int]) -> list[str]:
    """Each other run's settings against the baseline run's same setting (task or agent policy), paired over the
    rows both scored (:func:`mlbench_kit.passk.paired_difference`): the difference and its interval, so a
    gain is read against its baseline's own noise and not from two overlapping intervals."""
    base = {(s.task, s.agent): s for s in settings if s.run == baseline}
    lines = ["", f"## Against the baseline: {md_text(baseline)} (paired over the rows both scored)", "",
             "Each run minus the baseline on the same setting, in points: the mean difference over the rows both "
             "scored, with a paired bootstrap 95% interval (rows resampled together). *better* / *worse*: the "
             "interval excludes 0; *neither*: it holds 0, so these rows do not show a difference.", ""]
    rows, notes = [], []
    for s in settings:
        b = base.get((s.task, s.agent))
        if s.run == baseline or b is None:
            continue
        if len(s.summaries) > 1 or len(b.summaries) > 1:
            notes.append(f"{s.label}: several seeds (paired differences are over one seed each)")
            continue
        d = paired_difference(_verdicts(b), _verdicts(s), ks)
        if not d["rows"]:
            notes.append(f"{s.label}: no row scored by both")
            continue
        rows.append([s.label, s.checkpoint, b.checkpoint, str(d["rows"])]
                    + [diff_cell(d[f"pass@{k}"]) for k in ks] + [diff_cell(d["unbiased_pass@1"])])
    lines += _table(["setting", "checkpoint", "baseline's", "rows"] + [f"Δ Pass@{k}" for k in ks]
                    + ["Δ unbiased pass@1"], rows, "none: no other run shares a setting with the baseline")
    if notes:
        lines += ["", "Not compared: " + "; ".join(md_text(n) for n in notes) + "."]
    return lines


def write_markdown(settings: list[Setting], refs: list[Reference], ks: list[int], plots: list[str],
                   path: Path, baseline: str | None = None) -> None:
    """The report: settings, quality of outputs, repositories, types, error classes, gold ceiling, sources; with
    ``baseline`` (a run's name), every other run against it, paired."""
    lines = ["# ML-Bench runs side by side", "",
             "Pass@k as the paper defines it (a sample passes if one of its first k outputs passes the parameter "
             "check, the type check and runs cleanly); brackets: the 95% bootstrap CI over samples for one seed, "
             "min–max over seeds for several (their mean shown).", "", "## Pass@k by setting", ""]
    # the checkpoint column (base, SFT, a learned method and its round) where the runs' own files say what they scored
    known = any(c for s in settings for c in s.checkpoints)
    rows = [[s.run, s.setting, str(len(s.summaries)), str(s.summaries[0]["metrics"]["overall"]["samples"])]
            + ([s.checkpoint] if known else []) + [fmt_rate(*s.metric(f"pass@{k}")) for k in ks]
            + [s.incomplete or "–"] for s in settings]
    rows += [[f"{r.name} *(quoted)*", r.setting, "", ""] + ([""] if known else [])
             + [fmt_rate(r.values.get(f"pass@{k}")) for k in ks] + [""] for r in refs]
    lines += _table(["run", "task", "seeds", "samples"] + (["checkpoint"] if known else [])
                    + [f"Pass@{k}" for k in ks] + ["not scored"], rows)
    if any(c and c.learned for s in settings for c in s.checkpoints):
        lines += ["", "checkpoint: what each run scored, read from its own files (the generations' `infer.json` "
                  "names the adapter; `mlbench learn`'s `config.yaml` and the adapter's `mlbench_train.json` its "
                  "method, rft's round and dpo's or grpo's optimizer steps): base, SFT (`mlbench train`), or a "
                  "learned adapter."]
    bad = [s for s in settings if s.incomplete]
    if bad:
        lines += ["", "**INCOMPLETE**: " + "; ".join(f"{md_text(s.label)}: {s.incomplete}" for s in bad)
                  + ". Their Pass@k is over the samples that were scored only: faults (faults.jsonl of each run) are "
                  "not verdicts; fix the environment and re-run `mlbench eval` to score them."]
    if refs:
        lines += ["", "Quoted rows are copied from their source, not recomputed here: "
                  + "; ".join(md_text(x) for x in sorted({r.source for r in refs})) + "."]
    if baseline is not None:
        lines += baseline_section(settings, baseline, ks)
    lines += _paper_layout(settings, refs, ks)
    lines += _agent_section(settings, refs, ks)
    lines += ["", "## What the outputs get right", "",
              "param hit: share of the instruction's arguments found in an output; all params: outputs with every "
              "argument; type acc: outputs of the right kind (bash vs Python).", ""]
    lines += _table(["setting", "param hit", "all params", "type acc"],
                    [[s.label] + [fmt_rate(s.metric(m)[0]) for m in EXTRA] for s in settings])
    first, last = f"pass@{ks[0]}", f"pass@{ks[-1]}"
    shown = f"Pass@{ks[0]}" + (f" / Pass@{ks[-1]}" if len(ks) > 1 else "")
    for kind, title in (("per_repo", "repository"), ("per_type", "type")):
        groups = _groups(settings, kind)
        lines += ["", f"## {shown} per {title}", ""]

        def cell(s: Setting, g: str, kind: str = kind) -> str:
            a = fmt_rate(s.metric(first, (kind, g))[0])
            return a if len(ks) == 1 else f"{a} / {fmt_rate(s.metric(last, (kind, g))[0])}"

        lines += _table([title] + [s.label for s in settings], [[g] + [cell(s, g) for s in settings] for g in groups],
                        f"none: the runs have no per-{title} results")
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
                     for c in classes], "none: every output passed")
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


OPENHANDS_LABEL = ("measured under the openhands rule (ML-Agent-Bench's: `timeout 120 bash run.sh` in the task "
                   "folder of the episode's own files; exit 0 or 124, or KeyboardInterrupt = success; one attempt)")


def agent_figures(s: Setting) -> dict[str, Any]:
    """An agent setting's episodes over its seeds: count, answers, exits, mean turns, tokens and seconds per
    episode, and the openhands rule's success rate where the run applied it (the bash policy)."""
    if not s.agents:
        return {}
    eps = sum(a.get("episodes", 0) for a in s.agents) or 1

    def mean(key: str) -> float:
        return round(sum(a.get(key, 0) * a.get("episodes", 0) for a in s.agents) / eps, 3)
    out: dict[str, Any] = {"episodes": eps, "answered": sum(a.get("answered", 0) for a in s.agents),
                           "mean_turns": mean("mean_turns"), "mean_tokens_in": mean("mean_tokens_in"),
                           "mean_tokens_out": mean("mean_tokens_out"), "mean_seconds": mean("mean_seconds")}
    for a in s.agents:
        for e, n in (a.get("exits") or {}).items():
            out[f"exit_{e}"] = out.get(f"exit_{e}", 0) + n
    oh = [a["openhands"] for a in s.agents if a.get("openhands")]
    if oh:
        scored = sum(o["scored"] for o in oh)
        out["openhands_success_rate"] = round(sum(o["passed"] for o in oh) / scored, 4) if scored else None
        out["openhands_faults"] = sum(o["faults"] for o in oh)
    return out


def _agent_section(settings: list[Setting], refs: list[Reference], ks: list[int]) -> list[str]:
    """The agent runs' episodes (exits, turns, tokens, time, the openhands rule) and the paper's agent rows."""
    agents = [s for s in settings if s.agents]
    quoted = [r for r in refs if r.agent]
    if not agents and not quoted:
        return []
    lines = ["", "## Agent runs", "",
             "Their answers are scored above like every generation (the paper's checker, Pass@k); here their "
             "episodes: exits, mean turns, prompt and new tokens and seconds per episode. The `openhands` column is "
             "a different rule, labelled as such: " + OPENHANDS_LABEL + "; the paper's checker runs the same answer "
             "in the pristine repository instead.", ""]
    rows = []
    for s in agents:
        f = agent_figures(s)
        exits = ", ".join(f"{k[5:]} {v}" for k, v in f.items() if k.startswith("exit_"))
        oh = f.get("openhands_success_rate", "–")
        rows.append([s.label, str(f["episodes"]), str(f["answered"]), exits, f"{f['mean_turns']:.2f}",
                     f"{f['mean_tokens_in']:.0f} / {f['mean_tokens_out']:.0f}", f"{f['mean_seconds']:.1f}",
                     fmt_rate(oh) if isinstance(oh, float) else str(oh)])
    lines += _table(["setting", "episodes", "answered", "exits", "mean turns", "tokens in / out", "seconds",
                     "openhands (success rate)"], rows, "no agent runs measured here")
    repos = [r for r in quoted if r.per_repo]
    if repos:
        lines += ["", "Quoted per repository (the paper's agent, its repository names; not recomputed):", ""]
        names = sorted({g for r in repos for g in r.per_repo})
        metric = sorted({m for r in repos for v in r.per_repo.values() for m in v})
        lines += _table(["repository"] + [f"{r.name} *(quoted)* {m.replace('pass@', 'Pass@')}" for r in repos
                                          for m in metric],
                        [[g] + [fmt_rate(r.per_repo.get(g, {}).get(m)) for r in repos for m in metric]
                         for g in names])
    return lines


def _gold(s: Setting) -> dict[str, Any]:
    return s.summaries[0]["gold_ceiling"].get("ALL", {"rows": 0, "param_ok": 0, "type_ok": 0, "both": 0})


def _label(text: str) -> str:
    """A run's or a repository's name as a plot label: as typed (no mathtext), control characters as escapes."""
    return mathtext_literal(visible(text, keep=""))


_ZERO_LW = 2.5  # points: the marker a zero bar gets, so that it reads as measured 0, not missing


def _bars(ax: Any, pos: list[float], vals: list[float | None], rngs: list[tuple | None], width: float, label: str,
          color: Any, horizontal: bool = False) -> None:
    """One series of bars with their intervals as whiskers and each value written at its end: a bar of 0 gets a
    thick line of its width at the axis and the label "0.00"; a missing value (no such metric) gets no bar and "n/a"
    so the two never look alike."""
    size = [v or 0.0 for v in vals]
    err = None
    if any(rngs):
        err = [[max(0.0, s - r[0]) if r else 0.0 for s, r in zip(size, rngs, strict=True)],
               [max(0.0, r[1] - s) if r else 0.0 for s, r in zip(size, rngs, strict=True)]]
    style = dict(color=color, label=label, edgecolor=color, linewidth=0.8)
    whisker = dict(ecolor="0.15", capsize=3, error_kw={"elinewidth": 1.0, "capthick": 1.0})
    if horizontal:
        ax.barh(pos, size, width, xerr=err, **style, **whisker)
    else:
        ax.bar(pos, size, width, yerr=err, **style, **whisker)
    for p, v, r in zip(pos, vals, rngs, strict=True):
        end = max(v or 0.0, r[1] if r else 0.0) + 0.015
        text = "n/a" if v is None else f"{v:.2f}"
        if v == 0:
            ends = [p - 0.45 * width, p + 0.45 * width]  # a gap between neighbours: one mark per bar
            if horizontal:
                ax.plot([0, 0], ends, color=color, lw=_ZERO_LW, solid_capstyle="butt", clip_on=False)
            else:
                ax.plot(ends, [0, 0], color=color, lw=_ZERO_LW, solid_capstyle="butt", clip_on=False)
        if horizontal:
            ax.text(end, p, text, va="center", ha="left", fontsize=6.5, color="0.2")
        else:
            ax.text(p, end, text, va="bottom", ha="center", fontsize=6.5, color="0.2", rotation=90 if width < 0.2
                    else 0)


def _legend_above(ax: Any, n: int) -> None:
    """The legend in a row above the axes, under the title: never over a bar."""
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=min(n, 4), fontsize=8, frameon=False,
              borderaxespad=0.2, handlelength=1.2, columnspacing=1.0)


def pass_figure(settings: list[Setting], ks: list[int]) -> Any:
    """report.png's figure: Pass@k per setting with its intervals; parameter hits and type accuracy."""
    import matplotlib.pyplot as plt

    labels = [_label(s.label) + ("\n(INCOMPLETE)" if s.incomplete else "") for s in settings]
    colors = [f"C{i}" for i in range(10)]  # the default cycle, named
    fig, axes = plt.subplots(1, 2, figsize=(max(8.0, 2.0 * len(settings) + 3), 4.4), layout="constrained")
    pk = f"Pass@{ks[0]}" if len(ks) == 1 else "Pass@k"
    panels = ((axes[0], [f"pass@{k}" for k in ks], f"{pk} by setting", f"{pk} (whiskers: 95% CI, or seed range)"),
              (axes[1], ["param_hit_precision", "type_accuracy"], "What the outputs get right", None))
    for (ax, metrics, title, note), offset in zip(panels, (0, len(ks)), strict=True):
        width = 0.8 / len(metrics)
        for j, m in enumerate(metrics):
            got = [s.metric(m) for s in settings]
            rngs: list[tuple | None] = [r if m.startswith("pass@") else None for _, r in got]
            _bars(ax, [i + j * width for i in range(len(settings))], [v for v, _ in got], rngs, width,
                  m.replace("_", " ").replace("pass@", "Pass@"), colors[(offset + j) % len(colors)])
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(settings))], labels, rotation=30, ha="right", fontsize=8)
        ax.set_ylim(0, 1.12)
        ax.set_yticks([0, 0.2, 0.4, 0.6, 0.8, 1.0])
        ax.spines[["top", "right"]].set_visible(False)
        ax.set_title(title, pad=22)
        if note:
            ax.set_ylabel(note, fontsize=8)
        _legend_above(ax, len(metrics))
    return fig


def repo_figure(settings: list[Setting], ks: list[int]) -> Any:
    """report_repos.png's figure: Pass@k (the smallest k) per repository and setting, with its intervals."""
    import matplotlib.pyplot as plt

    repos = _groups(settings, "per_repo")
    colors = [f"C{i}" for i in range(10)]  # the default cycle, named
    fig, ax = plt.subplots(figsize=(7, max(2.8, 0.35 * len(repos) * max(1, len(settings) / 3) + 1.6)),
                           layout="constrained")
    h = 0.8 / len(settings)
    metric = f"pass@{ks[0]}"
    for i, s in enumerate(settings):
        got = [s.metric(metric, ("per_repo", g)) for g in repos]
        _bars(ax, [r + i * h for r in range(len(repos))], [v for v, _ in got], [r for _, r in got], h,
              _label(s.label) + (" (INCOMPLETE)" if s.incomplete else ""), colors[i % len(colors)],
              horizontal=True)
    ax.set_yticks([r + 0.4 - h / 2 for r in range(len(repos))], [_label(r) for r in repos], fontsize=8)
    ax.invert_yaxis()  # repositories top to bottom in name order, settings in the order given
    ax.set_xlim(0, 1.15)
    ax.set_xticks([0, 0.2, 0.4, 0.6, 0.8, 1.0])
    ax.spines[["top", "right"]].set_visible(False)
    ax.set_xlabel(f"Pass@{ks[0]} (whiskers: 95% bootstrap CI for one seed, seed range for several)", fontsize=8)
    ax.set_title(f"Pass@{ks[0]} per repository", pad=22)
    _legend_above(ax, len(settings))
    return fig


def write_plots(settings: list[Setting], ks: list[int], out: Path) -> list[str]:
    """report.png: Pass@k, parameter hits and type accuracy per setting; report_repos.png: Pass@k per repository."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    for name, fig in (("report.png", pass_figure(settings, ks)), ("report_repos.png", repo_figure(settings, ks))):
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
    return ["report.png", "report_repos.png"]
