"""Gold episodes: the turns of a correct agent episode for a training row, built from its gold answer by the
harness's own episode code, as SFT records in prep's format (``mlbench agent --gold-episodes``).

Each row's episode is the policy's real state machine, fed the correct reply at every turn. ``ml-agent``
(:class:`~.episode.Episode`):

- ``plan``: ``{"task_flag": "Yes", "ranked_readmefiles": [the row's own README]}`` (the README nearest the row's
  task folder, walking up to the root, as prep picks a task's README);
- ``code_or_file``: ``{"flag": "CODE", "file_path": "", "code": the row's gold answer}``.

``bash`` (:class:`~.bash.BashEpisode`, CodeAct's explore, write, run, submit), each action run in the sandbox of
the row's environment as any model's action is, so every observation is the real one:

- ``look``: ``ls`` in the task folder;
- ``write``: ``cat > run.sh`` of the gold answer (a Bash Script row's command as is; a Python Code row's program as
  ``python - <<'TAG'`` inside run.sh, which the scorer reads back as that program: :mod:`.runsh`);
- ``run``: ``bash run.sh`` (its exit, a timeout included, is what the model sees, and is counted in ``gold.json``);
- ``submit``.

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
from mlbench_kit.dataset import Sample, check_no_leak, instruction_finder, load_samples, normalized_text, runs_as_shell
from mlbench_kit.envspec import EnvConfig
from mlbench_kit.errors import MLBenchError
from mlbench_kit.io import read_jsonl, write_json_atomic, write_jsonl_atomic
from mlbench_kit.records import PrepRecord, output_sha, read_scored_folder, transcript_file, valid_text
from mlbench_kit.sandbox import Sandbox

from .bash import SUBMIT, BashEpisode
from .episode import Episode, sha
from .prompts import render_prompt
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


def turn_record(sample: Sample, conversation: str | list[dict[str, str]], reply: str, tokenizer: Any, template: str,
                context_tokens: int) -> tuple[PrepRecord, int]:
    """One model turn as an SFT record in prep's format: ``conversation`` (the step's prompt, one user turn, or the
    bash policy's messages so far) rendered as the engine receives it (:func:`.prompts.render_prompt`), ``reply``
    the answer trained on; and the reply's token count."""
    messages = [{"role": "user", "content": conversation}] if isinstance(conversation, str) else list(conversation)
    prompt = render_prompt(tokenizer, conversation, template == "chat")
    n = len(tokenizer(reply, add_special_tokens=False)["input_ids"])
    return PrepRecord(task=3, github_id=sample.github_id, id=sample.id, template=template, prompt=prompt,
                      answer=reply, messages=[*messages, {"role": "assistant", "content": reply}],
                      repo=sample.repo, repo_id=sample.repo_id, path=sample.path, type=sample.type,
                      arguments=dict(sample.arguments), instruction=sample.instruction, output=sample.output,
                      prefix_code=sample.prefix_code, context_tokens=context_tokens,
                      total_tokens=context_tokens + n + 1), n


def _not_gold(sample: Sample, exit: str | None, detail: str) -> MLBenchError:
    return MLBenchError(f"the gold episode of github_id={sample.github_id} id={sample.id} ({sample.repo}) ended "
                        f"{exit}: {detail or 'not with its gold answer'}", sample.where,
                        "leave the row out (--rows-of), or raise the limits / max_model_len that ended it")


def gold_records(sample: Sample, repo: RepoView, cfg: AgentConfig, tokenizer: Any, encode: Any, template: str,
                 max_model_len: int) -> list[tuple[str, PrepRecord]]:
    """The records of one row's ml-agent gold episode, each with its step: one per model turn, ``prompt`` as the
    engine receives it (rendered with the chat template when ``template`` is ``chat``), ``answer`` the correct
    reply. A row whose episode does not end ``submitted`` with its gold answer (no README, a prompt over the
    context, an answer over the token limits) is an error naming it."""
    ep = Episode(sample, repo, cfg, 0, encode, max_model_len)
    out: list[tuple[str, PrepRecord]] = []
    while (p := ep.prepare()) is not None:
        reply = gold_reply(ep)
        rec, n = turn_record(sample, p.text, reply, tokenizer, template, len(p.ids))
        out.append((ep.step, replace(rec, over_budget=n > p.max_new_tokens)))
        ep.feed(reply, n, 0.0)
    if ep.exit != "submitted" or ep.answer != sample.output:
        raise _not_gold(sample, ep.exit, ep.detail)
    return out


BASH_STEPS = ("look", "write", "run", "submit")


def _heredoc_tag(text: str, base: str) -> str:
    """A heredoc delimiter that is no line of ``text``."""
    lines = {ln.strip() for ln in text.splitlines()}
    tag, i = base, 0
    while tag in lines:
        i += 1
        tag = f"{base}_{i}"
    return tag


def bash_gold_replies(sample: Sample) -> list[str]:
    """The four replies of a correct bash episode (:data:`BASH_STEPS`), each a short thought and one ``bash`` block:
    look at the task folder, write run.sh holding the gold answer (a Python Code row's program as ``python -``
    heredoc), run it, submit."""
    code = sample.output.strip("\n")
    body = code if runs_as_shell(sample.output) else f"python - <<'{(t := _heredoc_tag(code, 'PY'))}'\n{code}\n{t}"
    outer = _heredoc_tag(body, "EOF")
    return ["First I look at the task folder.\n```bash\nls\n```",
            f"I write run.sh to run the task.\n```bash\ncat > run.sh <<'{outer}'\n{body}\n{outer}\n```",
            "Now I run it to check it.\n```bash\nbash run.sh\n```",
            f"run.sh is ready, so I submit it.\n```bash\n{SUBMIT}\n```"]


def bash_gold_records(sample: Sample, box: tuple[Sandbox, EnvConfig], cfg: AgentConfig, tokenizer: Any, encode: Any,
                      template: str, max_model_len: int) -> tuple[list[tuple[str, PrepRecord]], dict[str, Any]]:
    """The records of one row's bash gold episode (one per turn: the conversation so far as the engine receives
    it, the gold reply), and how its ``run`` action ended (``exit_code``, ``timed_out``). The episode must end
    ``submitted`` with run.sh's answer equal to the gold answer (whitespace aside), or the row is an error."""
    ep = BashEpisode(sample, box[1].for_repo(sample.repo), box[0], cfg, 0, encode, max_model_len)
    out: list[tuple[str, PrepRecord]] = []
    ran: dict[str, Any] = {}
    try:
        for step, reply in zip(BASH_STEPS, bash_gold_replies(sample), strict=True):
            p = ep.prepare()
            if p is None or p.messages is None:
                break
            rec, n = turn_record(sample, p.messages, reply, tokenizer, template, len(p.ids))
            out.append((step, replace(rec, over_budget=n > p.max_new_tokens)))
            turn = ep.feed(reply, n, 0.0)
            if step == "run":
                ran = {k: turn.get("exec", {}).get(k) for k in ("exit_code", "timed_out")}
    finally:
        ep.discard()
    if ep.exit != "submitted" or normalized_text(ep.answer or "") != normalized_text(sample.output):
        raise _not_gold(sample, ep.exit, ep.detail)
    return out, ran


MAX_TRANSCRIPT_BYTES = 64 << 20  # one episode's transcript (a run folder is untrusted data)


def own_episode_records(rows: list[Sample], run: Path, results: Path, tokenizer: Any, template: str,
                        max_per_row: int, evaluated: list[Sample] | None = None
                        ) -> tuple[list[PrepRecord], dict[str, int]]:
    """Expert iteration's data: the turns of an ``mlbench agent`` run's episodes (either policy) that passed in
    ``results`` (its ``mlbench eval`` folder, strict verdicts only: compat passes a process still running at the
    limit), up to ``max_per_row`` per row, distinct by their whitespace-normalised answer. Each kept turn is an SFT
    record of the prompt the model saw and the reply it gave; turns whose reply did not parse are left out. Every
    verdict must be on a row of ``rows`` (the training rows) and on the answer its transcript submitted.

    Against ``evaluated`` (the rows models are scored on): an episode whose submitted answer is one of theirs is
    left out (counted; a model may write it on a training row), and a kept turn whose prompt holds one of their
    instructions is an error (an ml-agent turn's prompt is read from the transcript as written)."""
    by_key = {s.key: s for s in rows}
    answers = {normalized_text(s.output) for s in evaluated or []}
    held = instruction_finder(evaluated or [])
    kept: dict[tuple[int, int], list[str]] = {}
    out: list[PrepRecord] = []
    n = {"verdicts": 0, "passed": 0, "episodes": 0, "records": 0, "rows": 0, "evaluated_answers_left_out": 0}
    results_file, verdicts = read_scored_folder(results, "--own-episodes-eval")
    for r in sorted(verdicts, key=lambda r: (r.key, r.idx)):
        where = f"{results_file} (github_id={r.github_id} id={r.id} sample {r.idx})"
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
        path = transcript_file(run, r.key, r.idx)
        if path is None or not path.is_file() or path.stat().st_size > MAX_TRANSCRIPT_BYTES:
            raise MLBenchError("the passing episode's transcript is missing, a link (or under one) or too large",
                               str(path or run / "transcripts"),
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
        if norm in answers:
            n["evaluated_answers_left_out"] += 1
            continue
        seen = kept.setdefault(r.key, [])
        if norm in seen or len(seen) >= max_per_row:
            continue
        seen.append(norm)
        n["episodes"] += 1
        turns = _episode_turns(by_key[r.key], lines[:-1], path, tokenizer, template)
        for rec in turns:
            hit = held(rec.prompt)
            if hit is not None:
                raise MLBenchError(f"a turn's prompt holds the instruction of evaluated row id {hit.id}", str(path),
                                   "pass the transcripts `mlbench agent` wrote on the training rows, unchanged")
        out += turns
    n["records"], n["rows"] = len(out), len(kept)
    return out, n


def _episode_turns(sample: Sample, turns: list[Any], path: Path, tokenizer: Any, template: str) -> list[PrepRecord]:
    """A passing episode's turns as SFT records: each turn's prompt and the reply the model gave, turns whose reply
    did not parse left out. An ml-agent turn holds its prompt; a bash episode's conversation is rebuilt from its
    first message and each turn's reply and observation, and must hash to each turn's recorded ``prompt_sha``."""
    bad = MLBenchError("a turn without its prompt, reply or token count, or a conversation that does not rebuild "
                       "the prompt the model saw", str(path), "pass a transcript `mlbench agent` wrote, unchanged")
    out: list[PrepRecord] = []
    conversation: list[dict[str, str]] | None = None
    for turn in turns:
        if not isinstance(turn, dict):
            raise bad
        raw, tokens = turn.get("raw"), turn.get("tokens_in")
        if turn.get("step") == "bash":
            if conversation is None:
                conversation = turn.get("messages")
                if not (isinstance(conversation, list) and conversation
                        and all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in conversation)):
                    raise bad
                conversation = [{"role": str(m.get("role")), "content": m["content"]} for m in conversation]
            if not isinstance(raw, str) or type(tokens) is not int or sha(json.dumps(conversation)) != turn.get(
                    "prompt_sha"):
                raise bad
            if "error" not in turn:
                out.append(turn_record(sample, list(conversation), raw, tokenizer, template, tokens)[0])
            conversation.append({"role": "assistant", "content": raw})
            if isinstance(turn.get("observation"), str):
                conversation.append({"role": "user", "content": turn["observation"]})
            continue
        text = turn.get("prompt")
        if "error" in turn:
            continue
        if not (isinstance(text, str) and isinstance(raw, str) and type(tokens) is int):
            raise bad
        out.append(turn_record(sample, text, raw, tokenizer, template, tokens)[0])
    return out


def check_training_rows(cfg: AgentConfig, rows: list[Sample]) -> list[Sample]:
    """Refuse any row models are scored on (``--eval-rows``), and any training row that shares an instruction or
    an answer with them. Returns the evaluation rows."""
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
    return evaluated


def write_gold_episodes(cfg: AgentConfig, rows: list[Sample], repos: dict[str, Path], tokenizer: Any, encode: Any,
                        template: str, max_model_len: int, out: Path,
                        box: tuple[Sandbox, EnvConfig] | None = None) -> dict[str, Any]:
    """Every row's gold episode into ``out/sft.jsonl`` (prep's records: ``mlbench train --set data.path=...``) and
    the counts into ``out/gold.json``; all rows or nothing is written. ``box``: the bash policy's sandbox and
    environments (:func:`.run.sandbox_for`), where its actions run. Returns the counts."""
    if cfg.policy == "ml-agent" and cfg.steps != "3-4":
        raise MLBenchError(f"ml-agent gold episodes are built for steps 3-4 (here steps {cfg.steps})",
                           "--gold-episodes", "use steps: \"3-4\"")
    if cfg.actions != "text":  # a record is a prompt and a text reply; a tool call's record is not built
        raise MLBenchError("gold episodes are text turns (prompt, JSON reply); actions: tools has no such records",
                           "actions", "use actions: text with --gold-episodes")
    evaluated = check_training_rows(cfg, rows)
    stepped: list[tuple[str, PrepRecord]] = []
    runs: dict[str, int] | None = None
    if cfg.policy == "bash":
        if box is None:
            raise MLBenchError("bash gold episodes run their actions in the sandbox", "policy",
                               "pass box= (agent.run.sandbox_for)")
        quiet = replace(cfg, bash=replace(cfg.bash, openhands_check=False))  # the run step already ran run.sh
        runs = {"exit 0": 0, "timed out": 0, "failed": 0}
        for s in rows:
            recs, ran = bash_gold_records(s, box, quiet, tokenizer, encode, template, max_model_len)
            stepped += recs
            runs["timed out" if ran.get("timed_out") else "exit 0" if ran.get("exit_code") == 0 else "failed"] += 1
    else:
        views = {name: RepoView(path, name, cfg.read.max_file_bytes) for name, path in repos.items()}
        stepped = [r for s in rows for r in gold_records(s, views[s.repo], cfg, tokenizer, encode, template,
                                                         max_model_len)]
    records = [r for _, r in stepped]
    steps: dict[str, int] = {}
    for step, _ in stepped:
        steps[step] = steps.get(step, 0) + 1
    own: dict[str, int] | None = None
    if cfg.own_episodes and cfg.own_episodes_eval:  # expert iteration: the model's own passing episodes too
        mine, own = own_episode_records(rows, Path(cfg.own_episodes), Path(cfg.own_episodes_eval), tokenizer,
                                        template, cfg.own_per_row, evaluated)
        records += mine
    stats = {"rows": len(rows), "records": len(records), "turns": steps, "template": template,
             "config_sha": cfg.sha(), "max_model_len": max_model_len,
             "max_total_tokens": max((r.total_tokens or 0 for r in records), default=0),
             "over_max_new_tokens": sum(r.over_budget for r in records), "own_episodes": own,
             "policy": cfg.policy, "run_step": runs}
    write_jsonl_atomic(out / "sft.jsonl", [r.to_json() for r in records])
    write_json_atomic(out / "gold.json", stats)
    mine_txt = f", {own['records']} of them from {own['episodes']} own passing episodes" if own else ""
    print(f"agent: gold episodes of {len(rows)} training rows -> {len(records)} SFT records{mine_txt} in "
          f"{out / 'sft.jsonl'} (longest {stats['max_total_tokens']} tokens; train with "
          "`mlbench train --set data.path=...`)",
          file=sys.stderr)
    return stats
