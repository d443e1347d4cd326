"""The ``bash`` policy: ML-Agent-Bench offline, one episode as a state machine the harness drives turn by turn.

The paper's interactive setting ran OpenHands' CodeAct agent in a Linux sandbox holding the repository (at most 10
iterations; the agent is asked to write ``run.sh`` in the task folder; success when ``timeout 120 bash run.sh``
exits 0 or 124, or prints ``KeyboardInterrupt``). This is that task with mini-swe-agent's small loop, so that any
model can play it with text alone:

- the prompt is the task (OpenHands' ML-Bench instruction: repository, task, "create a script named run.sh under
  the specified path") and the action format (one fenced ``bash`` block per reply);
- each reply's one command runs as one sandboxed execution (:class:`mlbench_kit.sandbox.Sandbox`) in the row's
  environment, network off, in the task folder, over the episode's writable layer (:attr:`Job.layer`): files
  persist between actions, processes and ``cd`` do not, and the layer is disk-capped and removed when the episode
  ends;
- the observation is the action's exit status and its output (stdout + stderr), control characters escaped and
  cut to ``bash.observation_chars`` characters and ``bash.observation_tokens`` tokens (head and tail); it goes
  back as the next user message;
- a reply without exactly one ``bash`` block is a format error, answered with a message saying so (as
  mini-swe-agent does); ``limits.max_format_errors`` in a row end the episode;
- the episode ends ``submitted`` when the model says so, with the action ``submit`` alone (OpenHands' finish
  action, mini-swe-agent's submit command), while ``<task folder>/run.sh`` is a regular file in the layer; a
  ``submit`` without it is told so and the episode goes on. The answer is what run.sh runs
  (:func:`agent.runsh.read_runsh`: the Python program it runs, or its text as a shell script), a generation
  ``mlbench eval`` scores like any other. With ``bash.openhands_check`` the OpenHands rule is then applied to the
  episode's own files (``timeout 120 bash run.sh`` in the task folder) and recorded beside the answer as
  ``openhands``.

The harness counts every limit (turns, new tokens, the episode's generation plus action time, the context,
format errors); the model is never asked to. A sandbox fault ends the episode as ``fault``: reported apart, never
a verdict about the model."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from mlbench_kit.agent_config import AgentConfig
from mlbench_kit.dataset import Sample, prefix_exports
from mlbench_kit.escape import visible
from mlbench_kit.io import read_jsonl_tolerant
from mlbench_kit.sandbox import Env, ExecResult, Job, Limits, Sandbox

from .episode import BaseEpisode, Prepared, sha, turn_seed
from .parse import FormatError
from .repo import Refused, RepoView
from .runsh import read_runsh

# OpenHands' ML-Bench instruction (evaluation/benchmarks/ml_bench/run_infer.py), its sentences kept; the repository
# path is the sandbox's and the "finish tool" sentence is replaced by this harness's submit command
TASK = ("Please complete the Machine Learning task in the following repository: {repo}\n\n"
        "{instruction}\n\n"
        "You should create a script named `run.sh` under the specified path in the repo to run the task.\n\n"
        "You can find the task repo at: /sandbox/work/{path}\n\n"
        "{prefix}"
        "You should terminate the subprocess after running the task (e.g., call subprocess.Popen(args).wait()).\n")
PREFIX = "Here is the prefix code for the task:\n```bash\n{prefix_code}\n```\n\n"
# mini-swe-agent's action format, with this harness's facts
FORMAT = ("\nYou work in a Linux shell without network access. Reply with a short thought and then exactly ONE "
          "bash code block holding one command (join several with && or ;):\n\n"
          "```bash\nyour_command_here\n```\n\n"
          "Each command runs in a new shell in /sandbox/work/{path}: files you write persist between commands, "
          "processes and `cd` do not. A command may run at most {wall:g} seconds; its output is cut to {chars} "
          "characters and {tokens} tokens. When {runsh} is ready (write it, run it, fix it), reply with the command "
          "`{submit}` alone: the task ends and run.sh is your answer (`timeout {check} bash run.sh` is run there "
          "to check it). The task also ends after {turns} replies.")
SUBMIT = "submit"
NO_RUNSH = ("<returncode>1</returncode>\n<output>\n{runsh} does not exist (or is not a regular file): write it "
            "before you submit.\n</output>")
FORMAT_ERROR = ("Format error: {why}. Reply with a short thought and exactly ONE ```bash code block holding your "
                "next command.")
_BLOCK = re.compile(r"```(?:bash|sh|shell)[ \t]*\n(.*?)```", re.DOTALL)


def parse_action(text: str) -> str:
    """The one command of a reply: exactly one fenced ``bash`` block, not empty; else :class:`FormatError`."""
    blocks = _BLOCK.findall(text)
    if len(blocks) != 1:
        raise FormatError(f"the reply has {len(blocks)} ```bash blocks, not exactly one")
    cmd = blocks[0].strip()
    if not cmd:
        raise FormatError("the ```bash block is empty")
    return cmd


def _longest(text: str, fits: Callable[[str], bool], from_end: bool) -> int:
    """The most characters of ``text``'s head (or tail) that ``fits`` accepts (binary search; fits is monotone)."""
    lo, hi = 0, len(text)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(text[len(text) - mid:] if from_end else text[:mid]):
            lo = mid
        else:
            hi = mid - 1
    return lo


def observation(res: ExecResult, chars: int, tokens: int | None = None,
                count: Callable[[str], int] | None = None) -> str:
    """What the model sees of one execution: its exit status and output, escaped (control characters but newlines and
    tabs shown as escapes, :func:`mlbench_kit.escape.visible`; nothing it prints can close the ``<output>``
    element) and cut to ``chars`` characters, then to ``tokens`` tokens as ``count`` counts them (the model's
    tokenizer): the head and the tail, each at most half, the middle elided and said so."""
    out = visible(res.log, keep="\n\t").replace("</output>", "<\\/output>")
    if len(out) > chars:
        half = chars // 2
        out = f"{out[:half]}\n[... {len(out) - 2 * half} characters elided ...]\n{out[-half:]}"
    if tokens is not None and count is not None:
        n = count(out)
        if n > tokens:
            def fits(part: str) -> bool:
                return count(part) <= tokens // 2
            head, tail = _longest(out, fits, False), _longest(out, fits, True)
            tail = min(tail, len(out) - head)
            out = (f"{out[:head]}\n[... {max(0, n - count(out[:head]) - count(out[len(out) - tail:]))} tokens "
                   f"({len(out) - head - tail} characters) elided ...]\n{out[len(out) - tail:]}")
    if res.timed_out:
        status = f"timeout (stopped after {res.duration:.0f} s; its changes were discarded)"
    elif res.limit:
        status = f"{res.exit_code} ({res.limit} limit hit)"
    else:
        status = str(res.exit_code)
    return f"<returncode>{status}</returncode>\n<output>\n{out}</output>"


def openhands_passed(res: ExecResult) -> bool:
    """OpenHands' ML-Bench rule: ``timeout 120 bash run.sh`` exits 0 or 124, or prints ``KeyboardInterrupt``."""
    return res.fault is None and (res.exit_code in (0, 124) or "KeyboardInterrupt" in res.log)


def task_folder(path: str) -> str:
    """A row's ``path`` as a folder inside the repository (``./`` -> ``""``)."""
    return "/".join(p for p in PurePosixPath(path.strip() or ".").parts if p not in (".", ""))


@dataclass
class BashEpisode(BaseEpisode):
    """One ML-Agent-Bench episode: :meth:`prepare` gives the conversation so far, :meth:`feed` runs the reply's
    command in the episode's sandboxed layer and answers with its observation."""

    sample: Sample
    env: Env
    sandbox: Sandbox
    cfg: AgentConfig
    episode: int
    encode: Callable[[str | list[dict[str, str]]], list[int]]
    max_model_len: int
    turns: list[dict[str, Any]] = field(default_factory=list)
    exit: str | None = None
    answer: str | None = None
    detail: str = ""

    def __post_init__(self) -> None:
        folder = task_folder(self.sample.path)
        self.runsh = f"{folder}/run.sh" if folder else "run.sh"
        b, lim = self.cfg.bash, self.cfg.limits
        prefix = PREFIX.format(prefix_code=self.sample.prefix_code.strip()) if self.sample.prefix_code.strip() else ""
        task = TASK.format(repo=self.env.name, instruction=self.sample.instruction, path=folder, prefix=prefix)
        task += FORMAT.format(path=folder, wall=b.action_wall_s, chars=b.observation_chars, tokens=b.observation_tokens,
                              runsh=self.runsh, submit=SUBMIT, check=b.openhands_timeout_s, turns=lim.max_turns)
        self.messages: list[dict[str, str]] = [{"role": "user", "content": task}]
        self.format_errors = 0
        self.tokens_out = 0
        self.tokens_in = 0
        self.seconds = 0.0
        self.openhands: dict[str, Any] | None = None
        self.run_sh: str | None = None  # run.sh's text as submitted; the answer is what it runs
        self.answer_kind: str | None = None
        self.layer: Path | None = None
        self.cleanup: str | None = None  # what of the layer could not be removed
        self.exports = prefix_exports(self.sample.prefix_code)
        self._empty = len(self.encode(""))
        self._prepared: Prepared | None = None

    # -- the sandbox -------------------------------------------------------------------------------------------
    def _limits(self, wall: float) -> Limits:
        b = self.cfg.bash
        return Limits(wall_s=wall, mem_mb=b.action_mem_mb, pids=b.action_pids, disk_mb=b.disk_mb,
                      tmp_mb=min(256, b.disk_mb), log_bytes=max(4 * b.observation_chars, 16384), threads=1)

    def _run(self, code: str, wall: float) -> ExecResult:
        if self.layer is None:
            self.layer = self.sandbox.new_layer()
        # the row's prefix_code applies as eval applies it to every execution: its `export NAME=VALUE` lines
        return self.sandbox.run(Job(code, True, self.env, self.sample.path or ".", self.exports, layer=self.layer),
                                self._limits(wall))

    def _own(self, path: str) -> str | None:
        """A file of the episode's own (in its layer; links not followed), by its path in the repository."""
        if self.layer is None or not (self.layer / "upper").is_dir():
            return None
        try:
            return RepoView(self.layer / "upper", self.env.name, self.cfg.read.max_file_bytes).read(path)
        except Refused:
            return None

    def _count(self, text: str) -> int:
        """Tokens of ``text`` as the model reads it: a user turn's tokens less an empty turn's."""
        return len(self.encode(text)) - self._empty

    # -- prompts -----------------------------------------------------------------------------------------------
    def prepare(self) -> Prepared | None:
        """The next turn's prompt (the whole conversation), or None when the episode has ended. A conversation
        over the context with this turn's new tokens ends the episode (``context_exceeded``): nothing is cut."""
        if self.exit is not None:
            return None
        if self._prepared is not None:
            return self._prepared
        room = self.cfg.limits.max_episode_tokens - self.tokens_out
        new = min(self.cfg.sampling.max_new_tokens, room)
        ids = self.encode(self.messages)
        if len(ids) + new > self.max_model_len:
            self._end("context_exceeded", f"the conversation is {len(ids)} tokens; with {new} new tokens it "
                                          f"exceeds max_model_len {self.max_model_len}")
            return None
        new = self._total_room(len(ids), new)
        if new < 1:
            return None
        seed = turn_seed(self.cfg.sampling.seed, self.sample.key, self.episode, len(self.turns))
        self._prepared = Prepared(json.dumps(self.messages), ids, seed, new,
                                  {"step": "bash", "messages": len(self.messages)},
                                  messages=[dict(m) for m in self.messages])
        return self._prepared

    # -- replies -----------------------------------------------------------------------------------------------
    def feed(self, raw: str, n_tokens: int, wall_s: float, truncated: bool = False,
             tool_calls: tuple[tuple[str, str], ...] = (), prompt_tokens: int | None = None,
             replayed: dict[str, Any] | None = None) -> dict[str, Any]:
        """Take the model's reply: run its action, record the turn. ``replayed``: the turn's transcript record
        on resume; the action runs again (to rebuild the layer) and the recorded observation is what the model
        is shown, so the conversation is the one the model saw. ``tool_calls``, ``prompt_tokens``: not given
        (this policy offers no tools: its config refuses ``actions: tools``)."""
        p = self._prepared
        assert p is not None and self.exit is None, "feed() without a prepared prompt"
        self._prepared = None
        rec: dict[str, Any] = {"turn": len(self.turns), "step": "bash", "seed": p.seed, "prompt_sha": sha(p.text),
                               "inputs": p.inputs, "tokens_in": len(p.ids), "raw": raw, "tokens_out": n_tokens,
                               "truncated": truncated, "wall_s": round(wall_s, 4)}
        if not self.turns:  # the conversation's start; each later message is a turn's raw reply and its feedback
            rec["messages"] = self.messages[:1]
        self.tokens_in += len(p.ids)
        self.tokens_out += n_tokens
        self.seconds += wall_s
        self.messages.append({"role": "assistant", "content": raw})
        action: dict[str, Any] | None = None
        try:
            cmd = parse_action(raw)
        except FormatError as exc:
            self.format_errors += 1
            rec["error"] = str(exc)
            rec["observation"] = FORMAT_ERROR.format(why=exc)
            self.messages.append({"role": "user", "content": rec["observation"]})
        else:
            self.format_errors = 0
            if cmd == SUBMIT:
                return self._submit(rec, replayed)
            action = {"kind": "bash", "command": cmd}
            res = self._run(cmd, self.cfg.bash.action_wall_s)
            rec["exec"] = {"exit_code": res.exit_code, "timed_out": res.timed_out, "limit": res.limit,
                           "fault": res.fault, "seconds": round(res.duration, 3)}
            self.seconds += res.duration
            if replayed is not None and "exec" in replayed:  # the time the model's episode was charged, not now's
                self.seconds += replayed["exec"]["seconds"] - res.duration
                rec["exec"] = replayed["exec"]
            obs = replayed["observation"] if replayed is not None else observation(
                res, self.cfg.bash.observation_chars, self.cfg.bash.observation_tokens, self._count)
            rec["observation"] = obs
            self.messages.append({"role": "user", "content": obs})
            if res.fault and replayed is None:
                rec["action"] = action
                self.turns.append(rec)
                self._end("fault", res.fault)
                rec["exit"] = self.exit
                return rec
        rec["action"] = action
        return self._close_turn(rec, "generation and actions")

    def _submit(self, rec: dict[str, Any], replayed: dict[str, Any] | None) -> dict[str, Any]:
        """The model's ``submit``: with run.sh, the episode ends and its answer is what run.sh runs; without it,
        the model is told so and the episode goes on."""
        rec["action"] = {"kind": "submit"}
        text = self._own(self.runsh)
        if text is None:
            obs = replayed["observation"] if replayed is not None else NO_RUNSH.format(runsh=self.runsh)
            rec["observation"] = obs
            self.messages.append({"role": "user", "content": obs})
            return self._close_turn(rec, "generation and actions")
        ran = read_runsh(text, task_folder(self.sample.path), self._own)
        self.answer, self.run_sh, self.answer_kind = ran.answer, text, ran.kind
        rec["answer_kind"] = ran.kind
        self.turns.append(rec)
        self._end("submitted", "" if ran.kind != "unscorable" else
                  "run.sh is a shell script the benchmark would run as Python (no '.sh ' nor '.py '): not scorable")
        rec["exit"] = self.exit
        return rec

    def replay(self, rec: dict[str, Any]) -> None:
        """Feed a transcript's turn record again: its action runs again (the layer), its observation is the one
        recorded."""
        self.feed(rec["raw"], rec["tokens_out"], rec["wall_s"], rec.get("truncated", False), replayed=rec)

    def resume(self, path: Path) -> bool:
        """An episode whose transcript has its end line is taken as recorded (nothing run again); one that had not
        ended runs its recorded actions again, to rebuild its files (:meth:`replay`)."""
        recs = read_jsonl_tolerant(path)
        end = next((r["end"] for r in recs if "end" in r), None)
        if end is None:
            return super().resume(path)
        self.turns = [r for r in recs if "end" not in r]
        self.exit, self.detail, self.answer = end["exit"], end.get("detail", ""), end.get("answer")
        self.tokens_in, self.tokens_out = end["tokens_in"], end["tokens_out"]
        self.seconds, self.openhands = end["seconds"], end.get("openhands")
        self.run_sh, self.answer_kind = end.get("run_sh"), end.get("answer_kind")
        return True

    def _end(self, status: str, detail: str) -> None:
        """End the episode; with an answer and ``bash.openhands_check``, check it by OpenHands' rule on the
        episode's own files first. The layer is removed either way."""
        super()._end(status, detail)
        b = self.cfg.bash
        if self.answer is not None and b.openhands_check:
            res = self._run(f"timeout {b.openhands_timeout_s} bash run.sh", b.openhands_timeout_s + 10)
            self.openhands = {"passed": openhands_passed(res), "exit_code": res.exit_code,
                              "timed_out": res.timed_out, "fault": res.fault, "seconds": round(res.duration, 3),
                              "log_tail": res.log[-400:]}
        self.discard()

    def discard(self) -> None:
        """Remove the episode's layer (also of an episode left unfinished: the run stopped; a resume rebuilds it).
        A layer that cannot be removed is recorded (``cleanup`` in the summary), never raised."""
        if self.layer is not None:
            self.cleanup = self.sandbox.drop_layer(self.layer)
            self.layer = None

    def summary(self) -> dict[str, Any]:
        """The episode's end line, with run.sh and its kind once submitted and the OpenHands check when on."""
        out: dict[str, Any] = {"episode": self.episode, "exit": self.exit, "detail": self.detail, "answer": self.answer,
               "turns": len(self.turns), "tokens_in": self.tokens_in, "tokens_out": self.tokens_out,
               "seconds": round(self.seconds, 4), **self.cost_fields()}
        if self.answer_kind is not None:
            out["answer_kind"], out["run_sh"] = self.answer_kind, self.run_sh
        if self.cfg.bash.openhands_check:
            out["openhands"] = self.openhands
        if self.cleanup:
            out["cleanup"] = self.cleanup
        return out
