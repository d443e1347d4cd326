"""Gold episodes: the turns of a correct ML-Agent episode for a training row, built from its gold answer by the
harness's own episode code, as SFT records in prep's format (``mlbench agent --gold-episodes``).

Each row's episode is the real :class:`~.episode.Episode` state machine, fed the correct reply at every turn:

- ``plan``: ``{"task_flag": "Yes", "ranked_readmefiles": [the row's own README]}`` (the README nearest the row's
  task folder, walking up to the root, as prep picks a task's README);
- ``code_or_file``: ``{"flag": "CODE", "file_path": "", "code": the row's gold answer}``.

So each record's ``prompt`` is exactly the text the harness sends at that turn (the step's prompt with the README
window, index, caps and context fitting of this config), rendered as the engine receives it (the model's chat
template, one user turn; ``plain``: the text as is), and its ``answer`` the correct reply: one record per model turn.
The episode must end ``submitted`` with the gold answer as its answer, or the row is an error (nothing written).

Training rows only: the rows models are scored on (``--eval-rows``) are refused, and so is a training row sharing an
instruction or an answer with them (:func:`mlbench_kit.dataset.check_no_leak`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path, PurePosixPath
from typing import Any

from mlbench_kit.agent_config import AgentConfig
from mlbench_kit.chat_template import render_chat
from mlbench_kit.dataset import Sample, check_no_leak, load_samples
from mlbench_kit.errors import MLBenchError
from mlbench_kit.io import write_json_atomic, write_jsonl_atomic
from mlbench_kit.records import PrepRecord

from .episode import Episode
from .repo import RepoView


def own_readme(repo: RepoView, path: str) -> str | None:
    """The row's own README: the README.md nearest its task folder, walking up to the repository's root."""
    parts = [p for p in PurePosixPath(path).parts if p not in (".", "")]
    found = {str(PurePosixPath(r).parent): r for r in repo.readmes()}
    for depth in range(len(parts), -1, -1):
        rel = found.get("/".join(parts[:depth]) or ".")
        if rel is not None:
            return rel
    return None


def gold_reply(ep: Episode) -> str:
    """The correct reply to the episode's current step, as one JSON object (what the step's function asks for)."""
    s = ep.sample
    if ep.step == "plan":
        rel = own_readme(ep.repo, s.path)
        return json.dumps({"task_flag": "Yes", "ranked_readmefiles": [ep.repo.display(rel)] if rel else []},
                          ensure_ascii=False)
    if ep.step == "code_or_file":
        return json.dumps({"flag": "CODE", "file_path": "", "code": s.output}, ensure_ascii=False)
    raise AssertionError(f"a gold episode never reaches step {ep.step!r}")


def gold_records(sample: Sample, repo: RepoView, cfg: AgentConfig, tokenizer: Any, encode: Any, template: str,
                 max_model_len: int) -> list[PrepRecord]:
    """The records of one row's gold episode: one per model turn, ``prompt`` as the engine receives it (rendered
    with the chat template when ``template`` is ``chat``), ``answer`` the correct reply. A row whose episode does
    not end ``submitted`` with its gold answer (no README, a prompt over the context, an answer over the token
    limits) is an error naming it."""
    ep = Episode(sample, repo, cfg, 0, encode, max_model_len)
    out: list[PrepRecord] = []
    while (p := ep.prepare()) is not None:
        reply = gold_reply(ep)
        messages = [{"role": "user", "content": p.text}]
        prompt = render_chat(tokenizer, messages) if template == "chat" else p.text
        n = len(tokenizer(reply, add_special_tokens=False)["input_ids"])
        out.append(PrepRecord(task=3, github_id=sample.github_id, id=sample.id, template=template, prompt=prompt,
                              answer=reply, messages=[*messages, {"role": "assistant", "content": reply}],
                              repo=sample.repo, repo_id=sample.repo_id, path=sample.path, type=sample.type,
                              arguments=dict(sample.arguments), instruction=sample.instruction,
                              output=sample.output, prefix_code=sample.prefix_code, context_tokens=len(p.ids),
                              total_tokens=len(p.ids) + n + 1, over_budget=n > p.max_new_tokens))
        ep.feed(reply, n, 0.0)
    if ep.exit != "submitted" or ep.answer != sample.output:
        raise MLBenchError(f"the gold episode of github_id={sample.github_id} id={sample.id} ({sample.repo}) ended "
                           f"{ep.exit}: {ep.detail or 'not with its gold answer'}", sample.where,
                           "leave the row out (--rows-of), or raise the limits / max_model_len that ended it")
    return out


def check_training_rows(cfg: AgentConfig, rows: list[Sample]) -> None:
    """Refuse any row models are scored on (``--eval-rows``), and any training row that shares an instruction or
    an answer with them."""
    from .run import rows_named
    if not cfg.eval_rows:
        raise MLBenchError("--gold-episodes writes training data: it needs --eval-rows, the rows models are scored "
                           "on, to refuse them", "--eval-rows", "e.g. --eval-rows RUN/prep/test/task3.jsonl")
    keys = rows_named(cfg.eval_rows)
    shared = sorted(keys & {s.key for s in rows})
    if shared:
        raise MLBenchError(f"{len(shared)} of these rows are evaluation rows (first: github_id={shared[0][0]} "
                           f"id={shared[0][1]}): gold episodes are training data", str(cfg.eval_rows),
                           "select training rows only, e.g. --rows-of RUN/prep/id_train/task3.jsonl")
    evaluated = [s for s in load_samples(str(cfg.data), cfg.split) if s.key in keys]
    if len(evaluated) != len(keys):
        raise MLBenchError(f"{len(keys) - len(evaluated)} evaluation rows named here are not in --data, so the "
                           "leak check cannot see them", str(cfg.eval_rows), "name rows of the same data")
    check_no_leak(rows, evaluated)


def write_gold_episodes(cfg: AgentConfig, rows: list[Sample], repos: dict[str, Path], tokenizer: Any, encode: Any,
                        template: str, max_model_len: int, out: Path) -> dict[str, Any]:
    """Every row's gold episode into ``out/sft.jsonl`` (prep's records: ``mlbench train --set data.path=...``) and
    the counts into ``out/gold.json``; all rows or nothing is written. Returns the counts."""
    if cfg.policy != "ml-agent" or cfg.steps != "3-4":
        raise MLBenchError(f"gold episodes are built for the ml-agent policy, steps 3-4 (here {cfg.policy}, steps "
                           f"{cfg.steps})", "--gold-episodes", "use --policy ml-agent with steps: \"3-4\"")
    check_training_rows(cfg, rows)
    views = {name: RepoView(path, name, cfg.read.max_file_bytes) for name, path in repos.items()}
    records = [r for s in rows for r in gold_records(s, views[s.repo], cfg, tokenizer, encode, template,
                                                     max_model_len)]
    steps: dict[str, int] = {}
    for r in records:
        step = "plan" if r.answer.startswith('{"task_flag"') else "code_or_file"
        steps[step] = steps.get(step, 0) + 1
    stats = {"rows": len(rows), "records": len(records), "turns": steps, "template": template,
             "config_sha": cfg.sha(), "max_model_len": max_model_len,
             "max_total_tokens": max((r.total_tokens or 0 for r in records), default=0),
             "over_max_new_tokens": sum(r.over_budget for r in records)}
    write_jsonl_atomic(out / "sft.jsonl", [r.to_json() for r in records])
    write_json_atomic(out / "gold.json", stats)
    print(f"agent: gold episodes of {len(rows)} training rows -> {len(records)} SFT records in {out / 'sft.jsonl'} "
          f"(longest {stats['max_total_tokens']} tokens; train with `mlbench train --set data.path=...`)",
          file=sys.stderr)
    return stats
