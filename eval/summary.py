"""What a run says about its verdicts: ``summary.json`` (metrics, the gold ceiling, per-sample outcomes, the
gold-valid rows, notes on what was not scored), ``report.md``, ``config.yaml``, and its last lines on the console."""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from mlbench_kit.config import save_resolved
from mlbench_kit.dataset import Sample, prefix_exports
from mlbench_kit.errors import MLBenchError
from mlbench_kit.escape import visible
from mlbench_kit.eval_config import EvalConfig
from mlbench_kit.io import write_atomic, write_json_atomic
from mlbench_kit.records import EvalResult

from .checks import check_output
from .execution import MAX_FAULTS
from .generations import Generations
from .metrics import score_results
from .run_report import fmt_rate, render_run_report
from .scoring import clip, pass_ks, set_apart_unscored

PER_SAMPLE_MAX = 60  # runs this small list every sample's outcome in report.md


def summarize(cfg: EvalConfig, threads: int, samples: dict[tuple[int, int], Sample], gens: Generations,
              results: list[EvalResult], n_faults: int) -> dict[str, Any]:
    """The run's ``summary.json``: Pass@k over the samples every output of which has a verdict, the rest apart."""
    ks = pass_ks(cfg.k, gens.n)
    scored = [samples[k] for k in gens.outputs]
    results, unscored = set_apart_unscored(results, gens.outputs)
    task = next(iter(gens.tasks)) if len(gens.tasks) == 1 else None
    summary = {"generations": "gold" if cfg.gold else str(cfg.generations), "task": task, "mode": cfg.mode,
               "backend": cfg.backend, "n": gens.n, "ks": ks,
               "executions": sum(r.executed and not r.cached for r in results),
               "cached_executions": sum(r.cached for r in results),
               "metrics": score_results(results, ks, ci=cfg.ci), "gold_ceiling": gold_ceiling(scored),
               "reference_would_drop": gens.reference_would_drop, "missing": gens.missing,
               "notes": notes(cfg, gens, scored, n_faults, unscored), "threads_per_execution": threads}
    if cfg.validation:
        summary["gold_valid"] = gold_valid_metrics(cfg.validation, results, ks, cfg.ci)
    if len(gens.outputs) <= PER_SAMPLE_MAX:
        summary["per_sample"] = per_sample_outcomes(results, samples, gens.outputs)
    summary["faults"] = n_faults
    summary["unscored"] = unscored
    return summary


def notes(cfg: EvalConfig, gens: Generations, scored: list[Sample], n_faults: int,
          unscored: list[dict[str, int]]) -> list[str]:
    """What a reader of the numbers must know: what was not scored, and what the benchmark's checker does
    differently."""
    out = []
    if unscored:
        out.append(f"INCOMPLETE: Pass@k is over {len(gens.outputs) - len(unscored)} of {len(gens.outputs)} "
                   f"samples; {len(unscored)} samples with outputs not scored are reported apart (`unscored`), "
                   "never scored over their remaining outputs")
    if n_faults:
        out.append(f"INCOMPLETE: {n_faults} generations hit environment or sandbox faults and are not scored "
                   f"(faults.jsonl); fix the environment and re-run the same command to score them")
    out += [f"{len(gens.missing)} dataset rows have no generations and are not scored "
            f"(first: {gens.missing[:5]})" if gens.missing else "every dataset row has generations",
            f"{len(gens.reference_would_drop)} rows have a number of outputs other than 5: the benchmark's "
            f"checker silently drops them; here they are scored (first: {gens.reference_would_drop[:3]})"
            if gens.reference_would_drop and not cfg.gold else "no rows the benchmark's checker would drop",
            f"{sum(bool(s.prefix_code.strip()) for s in scored)} rows carry prefix_code (environment preparation): "
            "it is not run per generation (installs and downloads belong to building the repository's env); only "
            "its `export NAME=VALUE` lines are applied, to the "
            f"{sum(bool(prefix_exports(s.prefix_code)) for s in scored)}"
            " rows that have them"]
    if gens.invalid_unicode:
        out.append(f"{len(gens.invalid_unicode)} rows hold text UTF-8 cannot encode (lone surrogates, bytes that "
                   f"are not UTF-8): scored with U+FFFD in their place (first: {gens.invalid_unicode[:5]})")
    return out


def gold_ceiling(samples: list[Sample]) -> dict[str, dict[str, int]]:
    """How the ground truth itself fares under the benchmark's parameter and type checks, per repository."""
    out: dict[str, dict[str, int]] = {}
    for s in samples:
        ch = check_output(s.output, s.arguments, s.type, "compat")
        for repo in (s.repo, "ALL"):
            c = out.setdefault(repo, {"rows": 0, "param_ok": 0, "type_ok": 0, "both": 0})
            c["rows"] += 1
            c["param_ok"] += ch.params_ok
            c["type_ok"] += ch.type_ok
            c["both"] += ch.params_ok and ch.type_ok
    return dict(sorted(out.items(), key=lambda kv: (kv[0] == "ALL", kv[0])))


def per_sample_outcomes(results: list[EvalResult], samples: dict[tuple[int, int], Sample],
                        outputs: dict[tuple[int, int], list[str]]) -> list[dict[str, Any]]:
    """Per sample: which outputs passed, and the best output with the arguments it got right (a passing one,
    else the one with the most parameter hits), so a reader sees what the model got right."""
    by: dict[tuple[int, int], list[EvalResult]] = defaultdict(list)
    for r in results:
        by[r.key].append(r)
    out = []
    for key, recs in sorted(by.items()):
        recs.sort(key=lambda r: r.idx)
        best = max(recs, key=lambda r: (bool(r.passed), sum(r.param_hits.values())))
        s = samples[key]
        out.append({"github_id": key[0], "id": key[1], "instruction": s.instruction, "gold": s.output,
                    "passed": [bool(r.passed) for r in recs], "best": clip(outputs[key][best.idx]),
                    "hits": best.param_hits, "error_class": best.error_class})
    return out


def gold_valid_metrics(path: str, results: list[EvalResult], ks: list[int], ci: bool) -> dict[str, Any]:
    """Pass@k over the rows whose own gold answer passes in its environment, and the excluded rows' causes."""
    from .envs.validate import gold_valid
    if not Path(path).is_file():
        raise MLBenchError("validation file not found", path, "run `mlbench env validate` first")
    valid = gold_valid(path)
    keep = [r for r in results if valid.get(r.key, "not validated") is None]
    excluded: dict[str, list[list[int]]] = {}
    for key in sorted({r.key for r in results}):
        cause = valid.get(key, "not validated")
        if cause is not None:
            excluded.setdefault(cause, []).append(list(key))
    return {"source": str(path), "rows": len({r.key for r in keep}),
            "metrics": score_results(keep, ks, ci=ci)["overall"] if keep else None, "excluded": excluded}


def write_run(out: Path, cfg: EvalConfig, summary: dict[str, Any]) -> None:
    """``summary.json``, ``config.yaml`` and ``report.md``, and the result on the console."""
    write_json_atomic(out / "summary.json", summary)
    save_resolved(cfg, out / "config.yaml")  # `mlbench eval --config` on it replays (resumes) the run
    write_atomic(out / "report.md", render_run_report(summary))
    o, ks, unscored = summary["metrics"]["overall"], summary["ks"], summary["unscored"]
    print(f"eval: {o['samples']} samples" + (f" ({len(unscored)} unscored, apart)" if unscored else "") + ", "
          + ", ".join(f"Pass@{k} {fmt_rate(o[f'pass@{k}'])}" for k in ks) + f"; report: {out / 'report.md'}",
          file=sys.stderr)


def fault_exit(out: Path, faults: list[EvalResult]) -> int:
    """Exit status 3, and what to do: generations were left unscored by environment or sandbox faults."""
    first = faults[0]
    stopped = f" (stopped after {MAX_FAULTS})" if len(faults) >= MAX_FAULTS else ""
    print(f"error: {len(faults)} generations were not scored{stopped}: the environment or the sandbox failed, not "
          f"the model (first: github_id={first.github_id} id={first.id}: {visible(str(first.fault))})\n"
          f"  fix: see {out / 'faults.jsonl'}; after fixing, re-run the same command (only those run again)",
          file=sys.stderr)
    return 3
