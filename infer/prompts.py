"""Read data_prep's records and turn them into token ids exactly as training saw them."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from mlbench_kit.chat_template import render_chat
from mlbench_kit.errors import MLBenchError
from mlbench_kit.hf import prompt_ids
from mlbench_kit.records import read_prep_records


@dataclass(frozen=True)
class PromptItem:
    """One prompt to sample from: where it came from, its text, and its token ids (BOS included)."""

    task: int
    github_id: int
    id: int
    text: str
    messages: list[dict[str, str]]
    template: str
    where: str  # file:line of the prep record
    token_ids: tuple[int, ...] = ()

    @property
    def key(self) -> tuple[int, int]:
        return (self.github_id, self.id)

    @property
    def sha(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()[:16]


def task_file(prompts: str | Path, split: str, task: int) -> Path:
    """The prep output file for ``split`` and ``task``; a path to a ``.jsonl`` file is taken as is."""
    p = Path(prompts)
    if p.suffix == ".jsonl":
        return p
    f = p / split / f"task{task}.jsonl"
    if not f.is_file():
        have = sorted(d.name for d in p.iterdir() if d.is_dir() and not d.name.endswith(".hf")) if p.is_dir() else []
        raise MLBenchError(f"no prep records for split {split!r}, task {task}", str(f),
                           f"run `mlbench prep` first, or pick --split from {have or 'the prep output'}")
    return f


def evaluation_split(prompts: str | Path, split: str) -> str:
    """The split infer reads: ``split``, except that the default ``full`` of a ``--build-splits`` prep (which
    writes ``test/``, ``id_train/`` and ``ood_train/``, no ``full/``) is its ``test``."""
    p = Path(prompts)
    if split == "full" and p.is_dir() and not (p / "full").is_dir() and (p / "test").is_dir():
        return "test"
    return split


def load_prompts(path: Path, task: int | None = None) -> list[PromptItem]:
    """Load prep records; duplicates and missing columns fail with file:line."""
    items: list[PromptItem] = []
    seen: dict[tuple[int, int], str] = {}
    for where, rec in read_prep_records(path, task):
        if rec.key in seen:
            raise MLBenchError(f"duplicate sample github_id={rec.github_id} id={rec.id} (first at {seen[rec.key]})",
                               where)
        seen[rec.key] = where
        messages = rec.messages or [{"role": "user", "content": rec.prompt}]
        items.append(PromptItem(rec.task, rec.github_id, rec.id, rec.prompt, messages[:1], rec.template, where))
    return items


def encode(items: list[PromptItem], tokenizer: Any) -> list[PromptItem]:
    """Token ids as training builds them: a chat prompt carries its specials as text, others get BOS."""
    out = []
    for it in items:
        if it.template == "chat":
            check_chat_template(it, tokenizer)
        ids = prompt_ids(tokenizer, it.text, it.template)
        out.append(replace(it, token_ids=tuple(ids)))
    return out


def check_chat_template(item: PromptItem, tokenizer: Any) -> None:
    """A chat-rendered prompt must be what this model's own chat template produces."""
    if not getattr(tokenizer, "chat_template", None):
        raise MLBenchError("the prompts were rendered with a chat template but this model's tokenizer has none",
                           item.where, "re-run `mlbench prep --template paper` (or llama-inst) for this model, "
                                       "or pass a tokenizer with a chat template")
    again = render_chat(tokenizer, item.messages)
    if again != item.text:
        raise MLBenchError("the prompt differs from this model's chat template rendering", item.where,
                           "re-run `mlbench prep --template chat --tokenizer <this model>`")
