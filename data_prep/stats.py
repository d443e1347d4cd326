"""Token-length and truncation statistics per repository and setting (cf. the paper's tables 7, 8, 13)."""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

from mlbench_kit.markdown import md_text


def prompt_stats(records_by: dict[tuple[str, int], list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per (split, task, repository) plus an ``ALL`` row per (split, task)."""
    rows = []
    for (split, task), records in sorted(records_by.items()):
        groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for r in records:
            groups[r["repo"]].append(r)
            groups["ALL"].append(r)
        for repo in sorted(groups, key=lambda k: (k == "ALL", k)):
            g = groups[repo]
            toks = [r["total_tokens"] for r in g if r["total_tokens"] is not None]
            ctx = [r["context_tokens"] for r in g if r["context_tokens"] is not None]
            rows.append({
                "split": split, "task": task, "repo": repo, "rows": len(g),
                "context_chars_mean": round(statistics.fmean(r["context_chars"] for r in g), 1),
                "context_tokens_mean": round(statistics.fmean(ctx), 1) if ctx else None,
                "context_tokens_max": max(ctx) if ctx else None,
                "total_tokens_mean": round(statistics.fmean(toks), 1) if toks else None,
                "total_tokens_max": max(toks) if toks else None,
                "truncated_share": round(sum(r["truncated"] for r in g) / len(g), 4),
            })
    return rows


def prompt_stats_markdown(rows: list[dict[str, Any]], tokenized: bool, budget: str | None = None) -> str:
    """A markdown table of :func:`prompt_stats` rows; ``budget`` says what the token budget was and why."""
    lines = ["# Prompt statistics", ""]
    if budget:
        lines += [budget, ""]
    if not tokenized:
        lines += ["No tokenizer was given: lengths are in characters and nothing was truncated.", ""]
    cols = ["split", "task", "repo", "rows", "context_chars_mean", "context_tokens_mean", "context_tokens_max",
            "total_tokens_mean", "total_tokens_max", "truncated_share"]
    lines.append("| " + " | ".join(cols) + " |")
    lines.append("|" + "---|" * len(cols))
    for r in rows:
        lines.append("| " + " | ".join("" if r[c] is None else md_text(str(r[c])) for c in cols) + " |")
    return "\n".join(lines) + "\n"
