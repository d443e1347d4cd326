"""The paper's Pass@k, Chen et al.'s unbiased pass@k, and bootstrap 95% intervals (one row's verdicts resampled
whole): pure estimators that scoring (eval/), the report and the scripts share."""

from __future__ import annotations

import random
from math import comb
from typing import Any


def paper_pass_at_k(passed: list[bool], k: int) -> float:
    """The paper's Pass@k: 1 if any of the first k outputs passes."""
    return float(any(passed[:k]))


def unbiased_pass_at_k(passed: list[bool], k: int) -> float | None:
    """Chen et al.'s estimator 1 - C(n-c, k) / C(n, k); ``None`` when fewer than k outputs exist."""
    n, c = len(passed), sum(passed)
    if n < k:
        return None
    return 1.0 - comb(n - c, k) / comb(n, k)


def bootstrap_ci(values: list[float], iters: int = 1000, seed: int = 0) -> tuple[float, float]:
    """The 2.5th and 97.5th percentiles of ``iters`` resampled means of ``values`` (seeded: reruns agree)."""
    if not values:
        return (0.0, 0.0)
    rng = random.Random(seed)
    n = len(values)
    means = sorted(sum(values[rng.randrange(n)] for _ in range(n)) / n for _ in range(iters))
    return (round(means[int(0.025 * iters)], 4), round(means[int(0.975 * iters) - 1], 4))


def paired_difference(base: dict[Any, list[bool]], other: dict[Any, list[bool]], ks: list[int],
                      iters: int = 1000, seed: int = 0) -> dict[str, Any]:
    """``other`` minus ``base`` over the rows both scored (each a row's verdicts in sample order): per row the
    paper's Pass@k and the unbiased pass@1, their mean difference, and a paired bootstrap 95% interval (the rows
    resampled together, so a row both pass or both fail adds no noise). An interval above 0 shows ``other`` better
    on these rows, below 0 worse; one holding 0 shows neither."""
    rows = sorted(set(base) & set(other), key=str)
    out: dict[str, Any] = {"rows": len(rows)}
    for name, k in [(f"pass@{k}", k) for k in ks] + [("unbiased_pass@1", 0)]:
        diffs = []
        for r in rows:
            a, b = ((paper_pass_at_k(v, k) if k else unbiased_pass_at_k(v, 1)) for v in (base[r], other[r]))
            if a is not None and b is not None:
                diffs.append(b - a)
        lo, hi = bootstrap_ci(diffs, iters, seed)
        out[name] = {"diff": round(sum(diffs) / len(diffs), 4) if diffs else None, "ci95": (lo, hi),
                     "shown": "better" if diffs and lo > 0 else "worse" if diffs and hi < 0 else "neither"}
    return out
