"""Pass@k (the paper's and the unbiased estimator), parameter hit precision, type accuracy, error classes,
per repository and per type, with bootstrap 95% confidence intervals."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

from mlbench_kit.passk import bootstrap_ci, paper_pass_at_k, unbiased_pass_at_k
from mlbench_kit.records import EvalResult


def _group_metrics(samples: list[dict[str, Any]], ks: list[int], ci: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"samples": len(samples)}
    for k in ks:
        vals = [paper_pass_at_k(s["passed"], k) for s in samples]
        out[f"pass@{k}"] = round(sum(vals) / len(vals), 4) if vals else None
        if ci:
            out[f"pass@{k}_ci95"] = bootstrap_ci(vals)
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
