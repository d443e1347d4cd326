"""``mlbench agent show RUN [--row ID] [--episode K]``: one episode of an agent run, rendered for a terminal.

Read from the run's transcript alone (``RUN/transcripts/<github_id>-<id>/ep<K>.jsonl``): each turn's messages as
the model saw them (the whole prompt of an ML-Agent step; the conversation of a ``bash`` episode: its task, then
each reply and the harness's feedback), what the harness did with the reply, and the episode's end. Transcripts
are untrusted text: control characters are shown as escapes, so nothing a model wrote can drive the terminal."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, TextIO

from mlbench_kit.errors import MLBenchError
from mlbench_kit.escape import visible
from mlbench_kit.io import read_jsonl_tolerant


def _clip(text: str, chars: int) -> str:
    """``text`` escaped for a terminal, its middle elided past ``chars`` characters (0: whole)."""
    text = visible(text, keep="\n\t")
    if chars and len(text) > chars:
        half = chars // 2
        return f"{text[:half]}\n[... {len(text) - 2 * half} characters not shown (--full shows them) ...]\n" \
               f"{text[-half:]}"
    return text


def _folder(run: Path, row: str | None) -> Path:
    """The transcript folder of ``row`` (``ID`` or ``GITHUB_ID-ID``; default: the run's first row)."""
    base = run / "transcripts"
    if base.is_symlink():
        raise MLBenchError("the transcripts folder is a link: a run folder's links are not followed", str(base),
                           "give the --out folder of `mlbench agent` itself")
    rows = sorted((p for p in base.iterdir() if p.is_dir() and not p.is_symlink()),
                  key=lambda p: [int(x) if x.isdigit() else 0 for x in p.name.split("-")]) if base.is_dir() else []
    if not rows:
        raise MLBenchError("no transcripts in this folder", str(base), "give the --out folder of `mlbench agent`")
    if row is None:
        return rows[0]
    hits = [p for p in rows if p.name == row or p.name.split("-")[-1] == row]
    if len(hits) != 1:
        names = ", ".join(p.name for p in rows[:20]) + (f" and {len(rows) - 20} more" if len(rows) > 20 else "")
        why = f"{len(hits)} rows match --row {row!r}" if hits else f"no row {row!r} in this run"
        raise MLBenchError(why, str(base), f"rows (GITHUB_ID-ID): {names}")
    return hits[0]


class _Visible:
    """A stream that shows every control character it is given as an escape (new lines kept)."""

    def __init__(self, out: TextIO) -> None:
        self.out = out

    def write(self, text: str) -> int:
        return self.out.write(visible(text))

    def flush(self) -> None:
        self.out.flush()


def _say(out: Any, role: str, text: str, chars: int) -> None:
    print(f"[{role}]", file=out)
    print(_clip(text, chars), file=out)


def render(run: Path, row: str | None = None, episode: int = 0, chars: int = 4000, out: TextIO | None = None
           ) -> None:
    """Print one episode of the agent run in ``run`` (to ``out``, default stdout)."""
    safe = _Visible(out if out is not None else sys.stdout)  # every value of the (untrusted) run folder, escaped
    folder = _folder(run, row)
    path = folder / f"ep{episode}.jsonl"
    if not path.is_file() or path.is_symlink():
        have = sorted(p.name for p in folder.glob("ep*.jsonl"))
        raise MLBenchError(f"no episode {episode} for row {folder.name}", str(path), f"episodes: {', '.join(have)}")
    try:
        records = [r for r in read_jsonl_tolerant(path) if isinstance(r, dict)]
    except (UnicodeDecodeError, ValueError) as exc:
        raise MLBenchError(f"not a transcript: {exc}", str(path), "pass a folder `mlbench agent` wrote") from None
    turns = [r for r in records if "turn" in r]
    end: dict[str, Any] = next((r["end"] for r in records if isinstance(r.get("end"), dict)), {})
    status = end.get("exit", "not ended (the run stopped; re-running it resumes)")
    print(f"== row {folder.name}, episode {episode}: {len(turns)} turns, exit {status}", file=safe)
    for t in turns:
        print(f"\n-- turn {t.get('turn')} · {t.get('step')} · {t.get('tokens_in')} prompt / {t.get('tokens_out')} new "
              f"tokens{' (cut at the cap)' if t.get('truncated') else ''} · {t.get('wall_s')} s", file=safe)
        for m in t.get("messages") or []:  # a bash episode's start
            if isinstance(m, dict):
                _say(safe, str(m.get("role", "user")), str(m.get("content", "")), chars)
        if "prompt" in t:
            _say(safe, "user", str(t["prompt"]), chars)
        elif t.get("step") != "bash":
            print(f"[user] (prompt not recorded in this transcript; sha {t.get('prompt_sha')})", file=safe)
        calls = t.get("tool_calls")
        if isinstance(calls, list):  # actions: tools: the reply is its function calls (and any text besides)
            if t.get("content"):
                _say(safe, "assistant", str(t["content"]), chars)
            for c in calls:
                c = c if isinstance(c, dict) else {}
                _say(safe, f"assistant: call {c.get('name')}", str(c.get("arguments", "")), chars)
            if not calls:
                _say(safe, "assistant (no function call)", str(t.get("raw", "")), chars)
        else:
            _say(safe, "assistant", str(t.get("raw", "")), chars)
        if t.get("error"):
            print(f"[harness] format error: {visible(str(t['error']))}", file=safe)
        if t.get("action") is not None:
            print(f"[harness] action: {visible(str(t['action']))[:chars or None]}", file=safe)
        if t.get("observation") is not None:
            _say(safe, "user" if t.get("step") == "bash" else "observation", str(t["observation"]), chars)
        if t.get("exit"):
            print(f"[harness] exit: {t['exit']}", file=safe)
    if end:
        print(f"\n== end: {end.get('exit')}{' (' + visible(str(end['detail'])) + ')' if end.get('detail') else ''}; "
              f"{end.get('tokens_in')} prompt / {end.get('tokens_out')} new tokens, {end.get('seconds')} s", file=safe)
        if end.get("run_sh") is not None:
            _say(safe, f"run.sh (its answer: {end.get('answer_kind')})", str(end["run_sh"]), chars)
        if end.get("answer") is not None:
            _say(safe, "answer", str(end["answer"]), chars)
        if isinstance(end.get("openhands"), dict):
            oh = end["openhands"]
            print(f"[openhands rule] passed {oh.get('passed')}, exit {oh.get('exit_code')}", file=safe)


def run(args: argparse.Namespace) -> int:
    """``mlbench agent show``'s entry."""
    if args.episode < 0:
        raise MLBenchError(f"--episode {args.episode} is negative", "--episode", "episodes count from 0")
    render(Path(args.run), args.row, args.episode, 0 if args.full else 4000)
    return 0
