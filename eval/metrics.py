"""Pass@k (the paper's and the unbiased estimator), parameter hit precision, type accuracy, error classes,
per repository and per type, with bootstrap 95% confidence intervals."""

from __future__ import annotations

import random
from collections import Counter, defaultdict
from collections.abc import Callable
from math import comb
from typing import Any

from mlbench_kit.records import EvalResult


def paper_pass_at_k(passed: list[bool], k: int) -> float:
    """The paper's Pass@k: 1 if any of the first k outputs passes."""
    return float(any(passed[:k]))


def unbiased_pass_at_k(passed: list[bool], k: int) -> float | None:
    """Chen et al.'s estimator 1 - C(n-c, k) / C(n, k); ``None`` when fewer than k outputs exist."""
    n, c = len(passed), sum(passed)
    if n < k:
        return None
    return 1.0 - comb(n - c, k) / comb(n, k)


def _bootstrap(values: list[float], iters: int = 1000, seed: int = 0) -> tuple[float, float]:
    if not values:
        return (0.0, 0.0)
    rng = random.Random(seed)
    n = len(values)
    means = sorted(sum(values[rng.randrange(n)] for _ in range(n)) / n for _ in range(iters))
    return (round(means[int(0.025 * iters)], 4), round(means[int(0.975 * iters) - 1], 4))


def _group_metrics(samples: list[dict[str, Any]], ks: list[int], ci: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"samples": len(samples)}
    for k in ks:
        vals = [paper_pass_at_k(s["passed"], k) for s in samples]
        out[f"pass@{k}"] = round(sum(vals) / len(vals), 4) if vals else None
        if ci:
            out[f"pass@{k}_ci95"] = _bootstrap(vals)
        ub = [v for v in (unbiased_pass_at_k(s["passed"], k) for s in samples) if v is not None]
        out[f"unbiased_pass@{k}"] = round(sum(ub) / len(ub), 4) if ub else None
    gens: list[EvalResult] = [g for s in samples for g in s["gens"]]
    hits = [h for g in gens for h in g.param_hits.values()]
    out["param_hit_precision"] = round(sum(hits) / len(hits), 4) if hits else None
    out["param_all_hit_rate"] = round(sum(g.params_ok for g in gens) / len(gens), 4) if gens else None
    out["type_accuracy"] = round(sum(g.type_ok for g in gens) / len(gens), 4) if gens else None
    out["error_classes"] = dict(Counter(g.error_class for g in gens if g.error_class))
    return out


def score_results(results: list[EvalResult], ks: list[int], ci: bool = True) -> dict[str, Any]:
    """Metrics from the verdicts of a run (``results.jsonl``): overall, per repository, per type."""
    per_sample: dict[tuple[int, int], dict[str, Any]] = {}
    for r in sorted(results, key=lambda r: (r.github_id, r.id, r.idx)):
        s = per_sample.setdefault(r.key, {"repo": r.repo, "type": r.type, "passed": [], "gens": []})
        s["passed"].append(r.passed)
        s["gens"].append(r)
    samples = list(per_sample.values())

    def by(key: Callable[[dict], str]) -> dict[str, Any]:
        groups: dict[str, list] = defaultdict(list)
        for s in samples:
            groups[key(s)].append(s)
        return {g: _group_metrics(v, ks, ci) for g, v in sorted(groups.items())}

    return {"overall": _group_metrics(samples, ks, ci), "per_repo": by(lambda s: s["repo"]),
            "per_type": by(lambda s: s["type"])}
