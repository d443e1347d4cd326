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
from dataclasses import replace
from pathlib import Path, PurePosixPath
from typing import Any

from mlbench_kit.agent_config import AgentConfig
from mlbench_kit.chat_template import render_chat
from mlbench_kit.dataset import Sample, check_no_leak, load_samples, normalized_text
from mlbench_kit.errors import MLBenchError
from mlbench_kit.io import read_jsonl, write_json_atomic, write_jsonl_atomic
from mlbench_kit.records import PrepRecord, output_sha, read_eval_results, valid_text

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


def turn_record(sample: Sample, text: str, reply: str, tokenizer: Any, template: str,
                context_tokens: int) -> tuple[PrepRecord, int]:
    """One model turn as an SFT record in prep's format: ``text`` (the step's prompt, one user turn) rendered as
    the engine receives it (the chat template, or as is for ``plain``), ``reply`` the answer trained on; and the
    reply's token count."""
    messages = [{"role": "user", "content": text}]
    prompt = render_chat(tokenizer, messages) if template == "chat" else text
    n = len(tokenizer(reply, add_special_tokens=False)["input_ids"])
    return PrepRecord(task=3, github_id=sample.github_id, id=sample.id, template=template, prompt=prompt,
                      answer=reply, messages=[*messages, {"role": "assistant", "content": reply}],
                      repo=sample.repo, repo_id=sample.repo_id, path=sample.path, type=sample.type,
                      arguments=dict(sample.arguments), instruction=sample.instruction, output=sample.output,
                      prefix_code=sample.prefix_code, context_tokens=context_tokens,
                      total_tokens=context_tokens + n + 1), n


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
        rec, n = turn_record(sample, p.text, reply, tokenizer, template, len(p.ids))
        out.append(replace(rec, over_budget=n > p.max_new_tokens))
        ep.feed(reply, n, 0.0)
    if ep.exit != "submitted" or ep.answer != sample.output:
        raise MLBenchError(f"the gold episode of github_id={sample.github_id} id={sample.id} ({sample.repo}) ended "
                           f"{ep.exit}: {ep.detail or 'not with its gold answer'}", sample.where,
                           "leave the row out (--rows-of), or raise the limits / max_model_len that ended it")
    return out


MAX_TRANSCRIPT_BYTES = 64 << 20  # one episode's transcript (a run folder is untrusted data)


def own_episode_records(rows: list[Sample], run: Path, results: Path, tokenizer: Any, template: str,
                        max_per_row: int) -> tuple[list[PrepRecord], dict[str, int]]:
    """Expert iteration's data: the turns of an ``mlbench agent`` run's episodes (ml-agent) that passed in
    ``results`` (its ``mlbench eval`` folder, strict verdicts only: compat passes a process still running at the
    limit), up to ``max_per_row`` per row, distinct by their whitespace-normalised answer. Each kept turn is an SFT
    record of the prompt the model saw and the reply it gave; turns whose reply did not parse are left out. Every
    verdict must be on a row of ``rows`` (the training rows) and on the answer its transcript submitted."""
    by_key = {s.key: s for s in rows}
    kept: dict[tuple[int, int], list[str]] = {}
    out: list[PrepRecord] = []
    n = {"verdicts": 0, "passed": 0, "episodes": 0, "records": 0, "rows": 0}
    for r in sorted(read_eval_results(results / "results.jsonl"), key=lambda r: (r.key, r.idx)):
        where = f"{results / 'results.jsonl'} (github_id={r.github_id} id={r.id} sample {r.idx})"
        if r.mode != "strict" or (r.passed and r.timed_out):
            raise MLBenchError(f"a {r.mode} verdict{' passing at the time limit' if r.timed_out else ''}: own "
                               "episodes are kept on strict verdicts only", where,
                               "score the run with `mlbench eval --mode strict` (no --timeout-pass)")
        if r.key not in by_key:
            raise MLBenchError("a verdict on a row outside the training rows", where,
                               "pass the eval folder of an agent run on the training rows (--rows-of)")
        n["verdicts"] += 1
        if not r.passed:
            continue
        n["passed"] += 1
        path = run / "transcripts" / f"{r.github_id}-{r.id}" / f"ep{r.idx}.jsonl"
        if path.is_symlink() or not path.is_file() or path.stat().st_size > MAX_TRANSCRIPT_BYTES:
            raise MLBenchError("the passing episode's transcript is missing, a link or too large", str(path),
                               "pass the agent run folder these verdicts were scored from (--own-episodes)")
        lines = [obj for _, obj in read_jsonl(path)]
        end = lines[-1].get("end") if lines else None
        if not isinstance(end, dict) or end.get("exit") != "submitted" or not isinstance(end.get("answer"), str):
            raise MLBenchError("the transcript does not end with a submitted answer", str(path),
                               "pass the agent run folder these verdicts were scored from (--own-episodes)")
        if output_sha(valid_text(end["answer"])) != r.output_sha:
            raise MLBenchError("the verdict is on another answer than this transcript submitted", str(path),
                               "pass the agent run folder these verdicts were scored from (--own-episodes)")
        norm = normalized_text(end["answer"])
        seen = kept.setdefault(r.key, [])
        if norm in seen or len(seen) >= max_per_row:
            continue
        seen.append(norm)
        n["episodes"] += 1
        for turn in lines[:-1]:
            text, raw, tokens = turn.get("prompt"), turn.get("raw"), turn.get("tokens_in")
            if "messages" in turn:
                raise MLBenchError("a bash episode: own episodes become SFT records for the ml-agent policy only",
                                   str(path), "run the agent with --policy ml-agent")
            if "error" in turn:
                continue
            if not (isinstance(text, str) and isinstance(raw, str) and type(tokens) is int):
                raise MLBenchError("a turn without its prompt, reply or token count", str(path),
                                   "pass a transcript `mlbench agent` wrote, unchanged")
            out.append(turn_record(by_key[r.key], text, raw, tokenizer, template, tokens)[0])
    n["records"], n["rows"] = len(out), len(kept)
    return out, n


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
    own: dict[str, int] | None = None
    if cfg.own_episodes and cfg.own_episodes_eval:  # expert iteration: the model's own passing episodes too
        mine, own = own_episode_records(rows, Path(cfg.own_episodes), Path(cfg.own_episodes_eval), tokenizer,
                                        template, cfg.own_per_row)
        records += mine
    stats = {"rows": len(rows), "records": len(records), "turns": steps, "template": template,
             "config_sha": cfg.sha(), "max_model_len": max_model_len,
             "max_total_tokens": max((r.total_tokens or 0 for r in records), default=0),
             "over_max_new_tokens": sum(r.over_budget for r in records), "own_episodes": own}
    write_jsonl_atomic(out / "sft.jsonl", [r.to_json() for r in records])
    write_json_atomic(out / "gold.json", stats)
    mine_txt = f", {own['records']} of them from {own['episodes']} own passing episodes" if own else ""
    print(f"agent: gold episodes of {len(rows)} training rows -> {len(records)} SFT records{mine_txt} in "
          f"{out / 'sft.jsonl'} (longest {stats['max_total_tokens']} tokens; train with "
          "`mlbench train --set data.path=...`)",
          file=sys.stderr)
    return stats
