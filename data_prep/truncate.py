"""Fit a rendered example into a token budget by cutting only the README context."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mlbench_kit.hf import prompt_ids

from .templates import Rendered


@dataclass(frozen=True)
class Fit:
    """The rendered example after fitting, with what the cut cost."""

    rendered: Rendered
    truncated: bool
    context_tokens: int  # tokens of the context before cutting
    dropped_tokens: int  # context tokens cut away
    total_tokens: int  # prompt + answer + EOS after cutting
    over_budget: bool  # instruction + answer alone exceed the budget (context emptied; nothing else is cut)


class TokenBudget:
    """Counts tokens like training will (BOS + prompt, answer, EOS) and cuts the context at a token boundary.

    ``max_context_tokens`` bounds prompt + answer + EOS (a training example). ``max_prompt_tokens``, when given,
    also bounds the prompt alone: at inference the prompt must leave room for the new tokens in the model's
    positions (Llama-2's 4,096 hold a 4,000-token task-1 prompt, but not with 1,024 new tokens after it)."""

    def __init__(self, tokenizer: Any, max_context_tokens: int, template: str) -> None:
        self.tok = tokenizer
        self.max_context_tokens = max_context_tokens
        self.template = template
        self._ctx_cache: dict[str, list[tuple[int, int]]] = {}

    def count(self, r: Rendered) -> tuple[int, int]:
        """``(prompt tokens, prompt + answer + EOS tokens)``."""
        n_prompt = len(prompt_ids(self.tok, r.prompt, self.template))
        n_answer = len(self.tok(r.answer, add_special_tokens=False)["input_ids"])
        return n_prompt, n_prompt + n_answer + 1  # + EOS

    def _offsets(self, context: str) -> list[tuple[int, int]]:
        offs = self._ctx_cache.get(context)
        if offs is None:
            offs = self.tok(context, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
            if len(self._ctx_cache) > 4096:
                self._ctx_cache.clear()
            self._ctx_cache[context] = offs
        return offs

    def fit(self, make: Callable[[str], Rendered], context: str, max_prompt_tokens: int | None = None) -> Fit:
        """Render with ``make(context)``; if over a budget, keep the longest context prefix that fits both."""
        offs = self._offsets(context)

        def excess(n_prompt: int, total: int) -> int:
            over = total - self.max_context_tokens
            return over if max_prompt_tokens is None else max(over, n_prompt - max_prompt_tokens)

        r = make(context)
        n_prompt, total = self.count(r)
        if excess(n_prompt, total) <= 0:
            return Fit(r, False, len(offs), 0, total, False)
        keep = len(offs) - excess(n_prompt, total)
        for _ in range(16):  # token merges at the cut can shift the count by a few tokens
            keep = max(keep, 0)
            cut = context[: offs[keep - 1][1]] if keep > 0 else ""
            r = make(cut)
            n_prompt, total = self.count(r)
            if excess(n_prompt, total) <= 0 or keep == 0:
                break
            keep -= excess(n_prompt, total)
        return Fit(r, True, len(offs), len(offs) - keep, total, excess(n_prompt, total) > 0)
