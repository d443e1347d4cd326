"""The report of one `scripts/real.sh --learn` run: ``RUN/learning.md`` (committed as
bench/results/2026-11-28-learning.md).

Reads only what the stages wrote: eval's summaries and results of every model on the test rows, each learning run's
own files (rft's rounds, DPO's pairs and log, GRPO's rewards and log), the per-stage timings.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
from collections import defaultdict
from pathlib import Path
from typing import Any

from real_report import PAIRED_HEAD, ROOT, _ci, _jsonl, _pct, paired_row, stage_times, train_facts, tsv

VARIANTS = ("base", "sft")


def _json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def compat_only_at_limit(run: Path, v: str) -> tuple[int, int]:
    """(answers compat passes only because they were still running at the limit, answers compat passes)."""
    rows = _jsonl(run / "eval-compat" / "learn" / v / "results.jsonl")
    return sum(1 for r in rows if r.get("passed") and r.get("timed_out")), sum(1 for r in rows if r.get("passed"))


def executions(run: Path, method: str) -> int:
    """Sandbox executions a method's learning cost (its own files)."""
    d = run / f"learn-{method}"
    if method == "rft":
        return sum(r.get("answers", 0) for r in _jsonl(d / "rounds.jsonl"))
    if method == "grpo":  # every process's lines; an evaluated row's answer is not executed
        return sum(not r.get("evaluated_answer") for r in _rewards(d))
    return 0  # dpo reads rft's first-round verdicts: no execution of its own


def _rewards(d: Path) -> list[dict[str, Any]]:
    """GRPO's reward lines, every process's (``rewards.jsonl``, ``rewards-rankR.jsonl``)."""
    return [r for f in sorted(d.glob("rewards*.jsonl")) for r in _jsonl(f)]


def grpo_curve(run: Path) -> list[str]:
    """Mean reward and pass rate per GRPO step, from its rewards.jsonl: per step and process the last batch (a
    resumed run replays the steps after its checkpoint; the replaced batches still count as executions)."""
    batches: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for r in _rewards(run / "learn-grpo"):
        batches[(r.get("rank", 0), r.get("batch"))].append(r)
    last = {}
    for (rank, b), rs in sorted(batches.items(), key=lambda x: (x[0][0], x[0][1] or 0)):
        step = rs[0].get("step")
        last[(b if step is None else step, rank)] = rs
    by_step: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for (step, _), rs in last.items():
        by_step[step] += rs
    out = ["| step | answers | mean reward | passed | faults |", "|---|---|---|---|---|"]
    for b, rs in sorted(by_step.items()):
        vals = [r["reward"] for r in rs if r.get("reward") is not None]
        out.append(f"| {b} | {len(rs)} | {sum(vals) / max(1, len(vals)):.2f} | {sum(bool(r.get('passed')) for r in rs)}"
                   f" | {sum(r.get('reward') is None for r in rs)} |")
    return out


def method_lines(run: Path, rft: list[dict[str, Any]], kept: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """One line of the setting per method, from each method's own settings (its learn.json): (method, line)."""
    dpo_pairs = _jsonl(run / "learn-dpo" / "pairs.jsonl")
    g = _json(run / "learn-grpo" / "learn.json").get("grpo", {})
    k = _json(run / "learn-rft" / "learn.json").get("rft", {}).get("k", "?")
    rates = ", ".join(f"{r['pass_rate']:.1f}" for r in kept)
    return [
        ("rft", f"  - rft: {len(rft)} round(s): k = {k} samples per ID-train prompt "
                "from the SFT adapter -> executed -> the distinct passing answers plus the gold ones -> SFT from the "
                "base model;"),
        ("dpo", f"  - dpo: {len(dpo_pairs)} pass/fail pairs from rft's first-round samples (gold as chosen where no "
                "sample passed), the SFT adapter as policy and frozen reference, beta "
                f"{_json(run / 'learn-dpo' / 'learn.json').get('dpo', {}).get('beta', '?')};"),
        ("grpo", f"  - grpo: {g.get('max_steps', '?')} steps at learning rate {g.get('lr', '?')}, groups of "
                 f"{g.get('num_generations', '?')} samples per ID-train prompt, each executed in the sandbox for its "
                 "reward (TRL 1.16, transformers' generate); "
                 + (f"curriculum `mixed`: the {len(kept)} ID-train rows where rft's first-round samples both passed "
                    f"and failed (pass rates {rates})." if kept else "every ID-train prompt.")),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--run", type=Path, required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--methods", nargs="+", required=True)
    ap.add_argument("--modes", nargs="+", required=True)
    ap.add_argument("--n", type=int, required=True)
    ap.add_argument("--test-repos", nargs="+", required=True)
    ap.add_argument("--baselines", nargs="+", default=list(VARIANTS), help="the models beside the methods")
    ap.add_argument("--quick", type=int, default=0)
    a = ap.parse_args()
    run = a.run
    variants = [*a.baselines, *a.methods]
    times = tsv(run / "timings.tsv")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    f = train_facts(run, "id", 3)
    test = _jsonl(run / "learn-test" / "test" / "task3.jsonl")
    split = _jsonl(run / "prep" / "test" / "task3.jsonl")
    every = set(a.test_repos) == {r["repo"] for r in split}
    chosen = " --learn-test-repos all" if every and len(a.test_repos) > 1 else (
        "" if a.test_repos == ["External-Attention-pytorch"] else f" --learn-test-repos '{' '.join(a.test_repos)}'")
    if a.methods != ["rft", "dpo", "grpo"]:
        chosen += f" --learn-methods '{' '.join(a.methods)}'"
    if a.quick:
        chosen = " --quick" + chosen
    train = _jsonl(run / "prep" / "id_train" / "task3.jsonl")
    rft = _jsonl(run / "learn-rft" / "rounds.jsonl")
    kept = _jsonl(run / "learn-grpo" / "curriculum.jsonl")
    L = [f"# Learning from execution on ML-Bench: SmolLM2-135M, the real loop's rows{' (quick)' if a.quick else ''}",
         "",
         f"Made by `bash scripts/real.sh --learn{chosen} --data {a.data} --repos ../shared/mlbench/repos` on "
         f"{dt.date.today()}, commit {commit or 'unknown'}, {os.cpu_count()} CPU cores ({platform.machine()}), no GPU. "
         f"Every number below comes from this run's own files in `{run}`.", "",
         "## Setting", "",
         f"- **Rows**: the real loop's split of the real rows (`mlbench prep --build-splits`, seed 0): {len(train)} "
         f"ID-train rows of External-Attention-pytorch, PyTorch-GAN and Time-Series-Library (all that learning reads; "
         f"the leak check against the test split ran first in every learning run); every model is sampled on "
         + (f"all {len(test)} test rows ({', '.join(a.test_repos)})." if every else
            f"the {len(test)} test rows of {', '.join(a.test_repos)} of the split's {len(split)} (`--learn-test-repos "
            "all`: every test row)."),
         "- **SFT** (the baseline every method starts from): the ID LoRA, `configs/train/smollm2-135m-cpu.yaml` on the "
         f"ID-train rows' gold answers (mean loss {f.get('loss_first', 0):.3f} -> {f.get('loss_last', 0):.3f}).",
         "- **Methods** (`configs/learn/smollm2-135m-cpu.yaml`; rewards and data from **strict** verdicts):",
         *[line for m, line in method_lines(run, rft, kept) if m in a.methods],
         f"- **Test sampling**: the paper's (temperature 1.0, top-p 1.0, top-k 50), n = {a.n}, every adapter and the "
         "model as released in one vLLM engine; `mlbench eval` in the bwrap sandbox, modes "
         f"{', '.join(a.modes)}.", "",
         "## Results", "",
         "Pass@k in percent over the test rows with bootstrap 95% intervals (the paper's: a row passes at k if one of "
         "its first k answers passes), the unbiased estimate of pass@1 from all n answers of each row (Chen et al. "
         "2021); parameter-hit precision and type accuracy over all outputs.", "",
         "| model | mode | Pass@1 | Pass@2 | Pass@5 | unbiased pass@1 | param hit | type acc |",
         "|---|---|---|---|---|---|---|---|"]
    for v in variants:
        for mode in a.modes:
            m = _json(run / f"eval-{mode}" / "learn" / v / "summary.json").get("metrics", {}).get("overall")
            if not m:
                L.append(f"| {v} | {mode} | – | – | – | – | – | – |")
                continue
            L.append(f"| {v} | {mode} | {_ci(m, 1)} | {_ci(m, 2)} | {_ci(m, 5)} | "
                     f"{_pct(m.get('unbiased_pass@1'))} | "
                     f"{m.get('param_hit_precision', 0):.2f} | {m.get('type_accuracy', 0):.2f} |")
    if len(a.test_repos) > 1:
        L += ["", "Per test repository (strict):", "",
              "| model | repository | rows | Pass@1 | Pass@5 |", "|---|---|---|---|---|"]
        for v in variants:
            per = _json(run / "eval-strict" / "learn" / v / "summary.json").get("metrics", {}).get("per_repo", {})
            L += [f"| {v} | {g} | {m.get('samples', '–')} | {_ci(m, 1)} | {_ci(m, 5)} |"
                  for g, m in sorted(per.items())]
    L += ["", "Each model against SFT and the model as released on the same rows (strict), **paired**: the mean "
          "per-row difference in points with a paired bootstrap 95% interval (`mlbench report --baseline`); "
          "*better* / *worse* only when the interval excludes 0.", "", *PAIRED_HEAD]
    strict = {v: _json(run / "eval-strict" / "learn" / v / "summary.json") or None for v in variants}
    for v, against in [("sft", "base")] + [(m, b) for m in a.methods for b in ("sft", "base")]:
        line = paired_row(v, against, strict.get(against), strict.get(v))
        if line:
            L.append(line)
    L += ["", "## What each method cost", "",
          "| method | executions while learning | learning wall time (s) |", "|---|---|---|"]
    for m in a.methods:
        L.append(f"| {m} | {executions(run, m)} | {times.get(f'learn-{m}', '–')} |")
    L += ["", "rft's rounds (the SFT adapter's samples on the ID-train rows):", "",
          "| round | answers | passed | rows with a pass | SFT records |", "|---|---|---|---|---|"]
    L += [f"| {r['round']} | {r['answers']} | {r['passed']} | {r['rows_with_pass']}/{r['rows']} | "
          f"{r.get('sft_records', '–')} |" for r in rft]
    if "grpo" in a.methods:
        L += ["", "GRPO's reward curve (per optimizer step, the last batch of each process; reward = the strict "
              "verdict):", "", *grpo_curve(run)]
    L += ["", "## Reward hacking check", "",
          "Answers that compat passes only because they were still running at the time limit (strict fails them):",
          "", "| model | compat passes at the limit | compat passes |", "|---|---|---|"]
    for v in variants:
        at_limit, passes = compat_only_at_limit(run, v)
        L.append(f"| {v} | {at_limit} | {passes} |")
    L += ["", *stage_times(run, [f"learn-{m}" for m in (*a.methods, "infer", "eval")])]
    out = run / "learning.md"
    out.write_text("\n".join(L) + "\n")
    print(f"real: {out}")


if __name__ == "__main__":
    main()
