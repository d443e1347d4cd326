"""One ML-Agent episode on one row, as a state machine the harness drives turn by turn.

Steps 3-4 of the paper, as the benchmark's evaluation ran them (its ``run_choose_repo.py``), on the row's own
repository, executing nothing:

- ``plan`` (Table 22): repository name, main README (the shortest README path), task -> ``Yes`` with the README
  files ranked, or ``No`` (the episode ends: ``rejected``).
- ``code_or_file`` (Table 23), once per ranked README in turn: directory index, the README, task -> ``CODE``
  (the answer: ``submitted``), ``No`` (this README is rejected: the next ranked one), or ``FILE`` with a path.
- after ``FILE``: ``read_args`` (the requested file as the harness read it, or its refusal) -> the argument code,
  then ``write_code`` (README, argument code, task) -> ``CODE`` (``submitted``) or ``No`` (the next README).
- every README rejected: ``no_answer``.

A turn is one model call. A reply the harness cannot parse is a format error: the same prompt is asked again at
the next turn (with that turn's seed); ``limits.max_format_errors`` in a row end the episode. The other limits
(turns, new tokens, generation time, context) end it too; each ending is the episode's recorded exit.

The machine is deterministic given the replies, so a transcript replays it exactly (resume)."""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlbench_kit.agent_config import AgentConfig
from mlbench_kit.dataset import Sample
from mlbench_kit.errors import MLBenchError
from mlbench_kit.io import read_jsonl_tolerant

from . import prompts as P
from .constrain import schema_text
from .parse import FormatError, parse_reply
from .repo import Refused, RepoView, cut, readme_window
from .tools import function_name, parse_call, tools_text

# prompt text (a user turn), or a conversation of user and assistant messages -> the token ids the engine gets
Encoder = Callable[[str | list[dict[str, str]]], list[int]]

EXITS = ("submitted", "rejected", "no_answer", "turn_limit", "token_limit", "time_limit", "cost_limit",
         "context_exceeded", "format_errors", "fault")



def turn_seed(seed: int, key: tuple[int, int], episode: int, turn: int) -> int:
    """The seed of one turn, from the sampling seed, the row, the episode and the turn: the same tokens whether
    the turn ran in a batch with others, alone, or after a resume."""
    h = hashlib.sha256(f"{seed}/{key[0]}/{key[1]}/{episode}/{turn}".encode()).digest()
    return int.from_bytes(h[:8], "big") % (2**31 - 1)


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass
class Prepared:
    """The next turn's prompt: text, token ids, seed and the cap on its new tokens."""

    text: str
    ids: list[int]
    seed: int
    max_new_tokens: int
    inputs: dict[str, Any]
    json_schema: str | None = None  # decoding: json: the JSON schema the reply is constrained to (agent/constrain.py)
    # actions: tools: the tools offered (JSON text of the list) and the function the reply must call (agent/tools.py)
    tools: str | None = None
    tool_choice: str | None = None
    # a chat endpoint's messages (openai.api: chat); None: the text as one user message
    messages: list[dict[str, str]] | None = None


class BaseEpisode(ABC):
    """What the lockstep loop (:func:`agent.run.run_episodes`) knows of an episode, whatever its policy: ask it for
    the next turn's prompt (:meth:`prepare`: None once it has ended), give it the model's reply (:meth:`feed`: the
    turn's transcript record) or end it for a bad reply (:meth:`fault`), resume it from its transcript
    (:meth:`resume`), read its outcome (``exit``, ``answer``, ``turns``, ``tokens_out``, :meth:`summary`) and
    release what it holds (:meth:`discard`). The hard limits and their order are kept here once
    (:meth:`_close_turn`, :meth:`_total_room`) for every policy."""

    cfg: AgentConfig
    episode: int
    turns: list[dict[str, Any]]
    exit: str | None
    answer: str | None
    detail: str
    format_errors: int
    tokens_in: int
    tokens_out: int
    seconds: float
    _prepared: Prepared | None

    @abstractmethod
    def prepare(self) -> Prepared | None:
        """The next turn's prompt, or None when the episode has ended (possibly now: a limit before the call)."""
        raise NotImplementedError

    @abstractmethod
    def feed(self, raw: str, n_tokens: int, wall_s: float, truncated: bool = False,
             tool_calls: tuple[tuple[str, str], ...] = (), prompt_tokens: int | None = None) -> dict[str, Any]:
        """Take the model's reply to the prepared prompt (``tool_calls``: its function calls; ``prompt_tokens``:
        the prompt's tokens as the server counted them; both given only for a turn whose prompt offered tools,
        ``actions: tools``); returns the turn's transcript record."""
        raise NotImplementedError

    @abstractmethod
    def replay(self, rec: dict[str, Any]) -> None:
        """Feed a transcript's turn record again (resume)."""
        raise NotImplementedError

    @abstractmethod
    def summary(self) -> dict[str, Any]:
        """The episode's end line: its exit, answer, turns, tokens and seconds (and what its policy adds)."""
        raise NotImplementedError

    def resume(self, path: Path) -> bool:
        """Replay a transcript into this fresh episode (every prompt's hash and seed checked); True when it had
        ended. A prompt or seed that differs is an error naming the transcript."""
        recs = read_jsonl_tolerant(path)
        end = next((r["end"] for r in recs if "end" in r), None)
        ended = False
        for rec in recs:
            if "end" in rec:
                ended = True
                break
            p = self.prepare()
            if p is None or sha(p.text) != rec["prompt_sha"] or p.seed != rec["seed"]:
                raise MLBenchError(f"turn {rec.get('turn')} of this transcript does not replay: its prompt or seed "
                                   "differs from what this run builds (the repository or the code changed)",
                                   str(path), "use a new --out")
            self.replay(rec)
        if ended and self.exit is None and end is not None:  # a fault or a limit outside the turns (in the end line)
            self.exit, self.detail = end["exit"], end.get("detail", "")
        return ended

    def fault(self, detail: str) -> None:
        """End the episode as ``fault``: not the model's doing (the engine's reply was refused, the sandbox)."""
        self._end("fault", detail)

    def discard(self) -> None:  # noqa: B027 - a hook: an episode of most policies holds nothing outside itself
        """Release what the episode holds outside itself (the run stopped, or it ended); nothing by default."""

    def _end(self, status: str, detail: str) -> None:
        assert status in EXITS
        self.exit, self.detail = status, detail
        self._prepared = None

    def _close_turn(self, rec: dict[str, Any], timed: str) -> dict[str, Any]:
        """Record a turn and apply the harness's hard limits, counted after each turn in this order (format errors,
        tokens, seconds, turns): the first one reached ends the episode. ``timed`` names what its seconds count.
        Returns the turn record, with the exit if it ended."""
        self.turns.append(rec)
        lim = self.cfg.limits
        if self.exit is None:
            if self.format_errors >= lim.max_format_errors:
                self._end("format_errors", f"{self.format_errors} unparseable replies in a row")
            elif self.tokens_out >= lim.max_episode_tokens:
                self._end("token_limit", f"{self.tokens_out} new tokens (limit {lim.max_episode_tokens})")
            elif lim.max_episode_cost is not None and self.cost() >= lim.max_episode_cost:
                self._end("cost_limit", f"cost {self.cost():.6g} (limit {lim.max_episode_cost:g})")
            elif self.seconds >= lim.max_episode_seconds:
                self._end("time_limit", f"{self.seconds:.1f} s of {timed} (limit {lim.max_episode_seconds})")
            elif lim.max_turns is not None and len(self.turns) >= lim.max_turns:
                self._end("turn_limit", f"{len(self.turns)} turns (limit {lim.max_turns})")
        if self.exit is not None:
            rec["exit"] = self.exit
        return rec

    def cost(self) -> float:
        """What the episode's turns cost so far at ``limits.prompt_price`` and ``completion_price`` (per million
        prompt and new tokens; the prompt's count is the server's where it sent one)."""
        lim = self.cfg.limits
        return (self.tokens_in * lim.prompt_price + self.tokens_out * lim.completion_price) / 1e6

    def _total_room(self, prompt_tokens: int, new: int) -> int:
        """The new tokens the next turn may have under ``limits.max_episode_total_tokens`` (prompt and new tokens
        summed over the episode's turns, this prompt included) and ``limits.max_episode_cost`` (the cost so far,
        this prompt's, and its new tokens'); below 1, the episode has ended (``token_limit``, ``cost_limit``)
        unsent. This prompt is counted with the tokenizer (a server's own count may differ by a few tokens)."""
        lim = self.cfg.limits
        if lim.max_episode_total_tokens is not None:
            room = lim.max_episode_total_tokens - self.tokens_in - self.tokens_out - prompt_tokens
            if room < 1:
                self._end("token_limit", f"{self.tokens_in + self.tokens_out} prompt and new tokens; the next "
                                         f"prompt's {prompt_tokens} leave no room (limit "
                                         f"{lim.max_episode_total_tokens})")
                return room
            new = min(new, room)
        if lim.max_episode_cost is not None:
            left = lim.max_episode_cost - self.cost() - prompt_tokens * lim.prompt_price / 1e6
            afford = new if lim.completion_price == 0 else int(left * 1e6 / lim.completion_price)
            if left <= 0 or afford < 1:
                self._end("cost_limit", f"cost {self.cost():.6g}; the next prompt's {prompt_tokens} tokens and one "
                                        f"new token would pass the limit {lim.max_episode_cost:g}")
                return 0
            new = min(new, afford)
        return new

    def cost_fields(self) -> dict[str, float]:
        """``{"cost": ...}`` for the episode's summary when prices are set, else nothing."""
        lim = self.cfg.limits
        return {"cost": round(self.cost(), 8)} if lim.prompt_price or lim.completion_price else {}


@dataclass
class Episode(BaseEpisode):
    """One ML-Agent episode (steps 3-4, or 1-4 with ``pool``): :meth:`prepare` builds the step's prompt from the
    repository, :meth:`feed` parses the reply and acts on it."""

    sample: Sample
    repo: RepoView
    cfg: AgentConfig
    episode: int
    encode: Callable[[str], list[int]]
    max_model_len: int
    turns: list[dict[str, Any]] = field(default_factory=list)
    exit: str | None = None
    answer: str | None = None
    detail: str = ""
    # steps "1-4": the candidate repositories, name -> (view, URL, description), the row's among them
    pool: dict[str, tuple[RepoView, str, str]] | None = None

    def __post_init__(self) -> None:
        self.step = "keywords" if self.cfg.steps == "1-4" else "plan"
        self.keywords: list[str] = []
        self.repo_order: list[str] = []  # step 2's ranking: step 3 tries these in turn
        self.repo_at = -1
        self.ranked: list[str] = []
        self.readme_at = -1
        self.py_text = ""  # the file FILE asked for, whole (cut when shown), or the harness's refusal
        self.py_readable = False
        self.args_code = ""
        self.format_errors = 0
        self.tokens_out = 0
        self.tokens_in = 0
        self.seconds = 0.0
        self._prepared: Prepared | None = None

    # -- prompts -----------------------------------------------------------------------------------------------
    def _readme(self, rel: str, cap: int) -> tuple[str, dict[str, Any], int]:
        """The README as shown (cut to ``cap`` characters), what was cut, and its full length."""
        try:
            text = self.repo.read(rel)
        except Refused as exc:
            return str(exc), {"readme": self.repo.display(rel), "refused": str(exc)}, 0
        if self.cfg.read.readme_window == "relevant":
            shown, dropped = readme_window(text, cap, self.sample.instruction)
        else:
            shown, dropped = cut(text, cap)
        return shown, {"readme": self.repo.display(rel), "readme_cut_chars": dropped}, len(text)

    def _build(self, caps: dict[str, int]) -> tuple[str, dict[str, Any], dict[str, int]]:
        """The step's prompt with the repository's texts cut to ``caps`` (characters); also the full length of
        each cuttable part it holds (what fitting to the context can take from)."""
        s = self.sample
        sizes: dict[str, int] = {}
        inputs: dict[str, Any]
        if self.step == "keywords":
            prompt, inputs = P.KEYWORDS.format(sentence=s.instruction), {"keywords": True}
        elif self.step == "rank":
            assert self.pool is not None
            urls = ",\n".join(f"'{url}': {desc}" if desc else f"'{url}'" for _, url, desc in self.pool.values())
            prompt = P.RANK.format(keywords=", ".join(self.keywords), urls=urls)
            inputs = {"candidates": len(self.pool)}
        elif self.step == "plan":
            readmes = self.repo.readmes()
            text, inputs, sizes["readme"] = self._readme(readmes[0], caps["readme"])
            prompt = P.PLAN.format(repo_name=self.repo.name, readme=text, instruction=s.instruction)
            if self.pool is not None:
                inputs["repo"] = self.repo.name
            if self.cfg.list_readmes:
                prompt += P.PLAN_LIST.format(readmes=", ".join(self.repo.display(x) for x in readmes))
        elif self.step == "code_or_file":
            index, left = self.repo.index(s.path, caps["index"])
            sizes["index"] = sum(len(f) + 1 for f in self.repo.files())
            text, inputs, sizes["readme"] = self._readme(self.ranked[self.readme_at], caps["readme"])
            inputs["index_files_left_out"] = left
            prompt = P.CODE_OR_FILE.format(index=index, readme=text, instruction=s.instruction)
        elif self.step == "read_args":
            shown, dropped = cut(self.py_text, caps["file"]) if self.py_readable else (self.py_text, 0)
            sizes["file"] = len(self.py_text) if self.py_readable else 0
            prompt, inputs = P.READ_ARGS.format(py_file=shown), {"file_cut_chars": dropped}
        elif self.cfg.write_code_readme == "path":  # the released agent's code_function prompt got the name
            rel = self.ranked[self.readme_at]
            inputs = {"readme": self.repo.display(rel), "readme_as": "path"}
            prompt = P.WRITE_CODE.format(readme=self.repo.display(rel), args=self.args_code, instruction=s.instruction)
        else:
            text, inputs, sizes["readme"] = self._readme(self.ranked[self.readme_at], caps["readme"])
            prompt = P.WRITE_CODE.format(readme=text, args=self.args_code, instruction=s.instruction)
        if self.cfg.actions == "tools":  # the answer format is the tool the turn offers
            return prompt, {"step": self.step, **inputs}, sizes
        return P.with_format(prompt, self.step, self.cfg.answer_format), {"step": self.step, **inputs}, sizes

    def prepare(self) -> Prepared | None:
        """The next turn's prompt, or None when the episode has ended (possibly now: context exceeded).

        A prompt over the context (with this turn's new tokens) has its repository texts cut further when
        ``fit_context`` is on: the characters to take off are estimated from the prompt's characters per token and
        taken from the README, index and file in proportion to what each shows, until it fits (at most 8 tries;
        the caps used are recorded in the turn's ``inputs.fitted``). The task, the step's instructions and the
        answer format are never cut: a prompt that does not fit without its repository texts ends the episode
        (``context_exceeded``)."""
        if self.exit is not None:
            return None
        if self._prepared is not None:
            return self._prepared
        while self.step == "plan" and not self.repo.readmes():
            if self.pool is None:
                self._end("no_answer", "the repository has no README.md")
                return None
            self._next_repo("has no README.md")
            if self.exit is not None:
                return None
        r = self.cfg.read
        caps = {"readme": r.max_readme_chars, "index": r.max_index_chars, "file": r.max_file_chars}
        new = min(self.cfg.sampling.max_new_tokens, self.cfg.limits.max_episode_tokens - self.tokens_out)
        fitted = False
        tools = tools_text(self.step) if self.cfg.actions == "tools" else None
        for _ in range(8):
            text, inputs, sizes = self._build(caps)
            # with a tool, the prompt's tokens are counted with the tool's JSON after it (the server's template
            # renders it somewhere in the prompt: an estimate of the same size)
            ids = self.encode(text if tools is None else f"{text}\n\n{tools}")
            over = len(ids) + new - self.max_model_len
            shown = {k: min(v, caps[k]) for k, v in sizes.items() if min(v, caps[k]) > 0}
            if over <= 0 or not self.cfg.fit_context or not shown:
                break
            take = int(over * len(text) / max(len(ids), 1) * 1.02) + 8  # characters, with a small margin
            total = sum(shown.values())
            for k, v in shown.items():
                caps[k] = max(0, v - -(-take * v // total))
            fitted = True
        if fitted:
            inputs["fitted"] = {k: caps[k] for k in sizes}
        if len(ids) + new > self.max_model_len:
            self._end("context_exceeded", f"the {inputs['step']} prompt is {len(ids)} tokens; with {new} new tokens "
                                          f"it exceeds max_model_len {self.max_model_len}")
            return None
        new = self._total_room(len(ids), new)
        if new < 1:
            return None
        seed = turn_seed(self.cfg.sampling.seed, self.sample.key, self.episode, len(self.turns))
        schema = schema_text(self.step, self._offered(caps)) if self.cfg.decoding == "json" else None
        self._prepared = Prepared(text, ids, seed, new, inputs, schema, tools,
                                  function_name(self.step) if tools is not None else None)
        return self._prepared

    def _offered(self, caps: dict[str, int]) -> list[str]:
        """The names the step's prompt (built with ``caps``) offers to choose from: step 3's README files as
        listed, step 4's index files as shown, step 2's candidate URLs; none for the other steps."""
        if self.step == "plan":
            return [self.repo.display(x) for x in self.repo.readmes()]
        if self.step == "code_or_file":
            return self.repo.listed(self.sample.path, caps["index"])
        if self.step == "rank":
            assert self.pool is not None
            return [url for _, url, _ in self.pool.values()]
        return []

    # -- replies -----------------------------------------------------------------------------------------------
    def feed(self, raw: str, n_tokens: int, wall_s: float, truncated: bool = False,
             tool_calls: tuple[tuple[str, str], ...] = (), prompt_tokens: int | None = None) -> dict[str, Any]:
        """Take the model's reply to the prepared prompt; returns the turn's transcript record. With
        ``actions: tools`` the reply is its ``tool_calls`` (``raw``: its text besides them, usually none); the
        record's ``raw`` is then the call's arguments, ``tool_calls`` every call, ``content`` that text; and the
        prompt's tokens are the server's count when it sent one (``prompt_tokens``: the template it rendered the
        tool with is its own), the estimate made here kept as ``tokens_in_estimate``."""
        p = self._prepared
        assert p is not None and self.exit is None, "feed() without a prepared prompt"
        self._prepared = None
        rec: dict[str, Any] = {"turn": len(self.turns), "step": self.step, "seed": p.seed,
                               "prompt_sha": sha(p.text), "prompt": p.text, "inputs": p.inputs,
                               "tokens_in": len(p.ids), "raw": raw, "tokens_out": n_tokens, "truncated": truncated,
                               "wall_s": round(wall_s, 4)}
        if p.json_schema is not None:
            rec["json_schema"] = p.json_schema
        if p.tool_choice is not None:
            rec["tool_calls"] = [{"name": n, "arguments": a} for n, a in tool_calls]
            if tool_calls:
                rec["raw"] = tool_calls[0][1]
                if raw:
                    rec["content"] = raw
            if prompt_tokens is not None:
                rec["tokens_in"], rec["tokens_in_estimate"] = prompt_tokens, len(p.ids)
        self.tokens_in += rec["tokens_in"]
        self.tokens_out += n_tokens
        self.seconds += wall_s
        action: dict[str, Any] | None = None
        try:
            if p.tool_choice is not None:
                action = parse_call(list(tool_calls), self.step, p.max_new_tokens)
            else:
                action = parse_reply(raw, self.step)
        except FormatError as exc:
            self.format_errors += 1
            rec["error"] = str(exc)
        else:
            self.format_errors = 0
            rec["observation"] = self._act(action)
        rec["action"] = action
        return self._close_turn(rec, "generation")

    def replay(self, rec: dict[str, Any]) -> None:
        """Feed a transcript's turn record again (resume)."""
        calls = tuple((str(c["name"]), str(c["arguments"])) for c in rec.get("tool_calls") or ())
        raw = rec.get("content", "") if calls else rec["raw"]
        counted = rec["tokens_in"] if "tokens_in_estimate" in rec else None  # the server's count, as recorded
        self.feed(raw, rec["tokens_out"], rec["wall_s"], rec.get("truncated", False), calls, counted)

    def _next_readme(self) -> None:
        self.readme_at += 1
        if self.readme_at >= len(self.ranked):
            self._end("no_answer", "every ranked README was rejected")
        else:
            self.step = "code_or_file"

    def _act(self, action: dict[str, Any]) -> str | None:
        """Apply a parsed action; returns the observation it produces (text the next prompt shows), if any."""
        kind = action["kind"]
        if kind == "keywords":
            self.keywords = action["keywords"]
            self.step = "rank"
            return None
        if kind == "rank":
            self.repo_order = self._ranked_repos(action)
            self._next_repo("")
            return None
        if kind == "plan":
            if action["flag"] == "No":
                if self.pool is not None:
                    self._next_repo("answered No")
                else:
                    self._end("rejected", "step 3 answered No")
                return None
            known = set(self.repo.readmes())
            ranked = []
            for name in action["readmes"]:
                try:
                    rel = self.repo.resolve_name(name)
                except Refused:
                    continue
                if rel in known and rel not in ranked:
                    ranked.append(rel)
            if not ranked:  # the released agent would have crashed opening them
                ranked = self.repo.readmes()
                action["fallback"] = "no ranked README is a README of the repository: all of them, shortest first"
            self.ranked = ranked
            self._next_readme()
            return None
        if kind == "code":
            self.answer = action["code"]
            self._end("submitted", "")
            return None
        if kind == "reject":
            self._next_readme()
            return None
        if kind == "file":
            try:
                self.py_text, self.py_readable = self.repo.read(action["path"]), True
                shown, dropped = cut(self.py_text, self.cfg.read.max_file_chars)
                action["cut_chars"] = dropped
            except Refused as exc:
                self.py_text, self.py_readable = str(exc), False
                shown = self.py_text
            self.step = "read_args"
            return shown
        if kind == "args":
            self.args_code = action["args"]
            self.step = "write_code"
            return None
        raise AssertionError(kind)

    def _ranked_repos(self, action: dict[str, Any]) -> list[str]:
        """Step 2's answer as candidate names: a URL, its last part or the name (any case); unknown ones dropped;
        none left: every candidate in the order shown (recorded in the action as ``fallback``)."""
        assert self.pool is not None
        known: dict[str, str] = {}
        for cand, (_, url, _) in self.pool.items():
            for alias in (cand, url, url.rstrip("/").rsplit("/", 1)[-1]):
                known[alias.strip().lower()] = cand
        out: list[str] = []
        for given in action["repos"]:
            g = given.strip().strip("'\"").rstrip("/").lower()
            name = known.get(g) or known.get(g.rsplit("/", 1)[-1])
            if name is not None and name not in out:
                out.append(name)
        if not out:
            out = list(self.pool)
            action["fallback"] = "no ranked repository is a candidate: all of them, in the order shown"
        action["resolved"] = out
        return out

    def _next_repo(self, why: str) -> None:
        """Step 3 on the next ranked repository; none left: ``rejected``."""
        assert self.pool is not None
        self.repo_at += 1
        if self.repo_at >= len(self.repo_order):
            self._end("rejected", "step 3 answered No (or found no README) for every ranked repository")
            return
        self.repo = self.pool[self.repo_order[self.repo_at]][0]
        self.ranked, self.readme_at, self.step = [], -1, "plan"

    def summary(self) -> dict[str, Any]:
        """The episode's end line (with steps 1-4, the repository its answer was written for)."""
        out: dict[str, Any] = {"episode": self.episode, "exit": self.exit, "detail": self.detail, "answer": self.answer,
               "turns": len(self.turns), "tokens_in": self.tokens_in, "tokens_out": self.tokens_out,
               "seconds": round(self.seconds, 4), **self.cost_fields()}
        if self.pool is not None:  # steps 1-4: the repository the answer was written for (its row's or another)
            out["repository"] = self.repo.name if self.repo_at >= 0 else None
        return out
