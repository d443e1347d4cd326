"""Render samples into task 1/2/3 records: context, prompt, answer and truncation statistics."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from tqdm import tqdm

from mlbench_kit.dataset import Sample
from mlbench_kit.records import PrepRecord

from .corpus import ReadmeCorpus
from .retrieval import MAX_SENTENCES, N_SENTENCE, WindowIndex, get_splitter
from .templates import render
from .truncate import TokenBudget


@dataclass
class Renderer:
    """Holds what is shared across rows: the README corpus, one BM25 index per README, the token budget."""

    corpus: ReadmeCorpus | None
    template: str = "paper"
    tokenizer: Any | None = None
    max_context_tokens: int = 8192  # prompt + answer + EOS (a training example)
    max_prompt_tokens: int | None = None  # for the splits inference reads: the model's positions - new tokens
    splitter: str = "punkt"
    n_sentence: int = N_SENTENCE
    max_sentences: int = MAX_SENTENCES
    _indexes: dict[str, WindowIndex] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._split = get_splitter(self.splitter)
        self.budget = (TokenBudget(self.tokenizer, self.max_context_tokens, self.template)
                       if self.tokenizer is not None else None)

    def context(self, sample: Sample, task: int) -> tuple[str, str | None]:
        """The context for ``task`` and the README it came from (``None`` for task 3)."""
        if task == 3:
            return sample.oracle, None
        if self.corpus is None:
            from mlbench_kit.errors import MLBenchError
            raise MLBenchError(f"task {task} needs README text", "--readmes",
                               "pass --readmes DIR or --repos-dir DIR (task 3 alone needs neither)")
        readme = self.corpus.readme_for(sample.repo, sample.path)
        if task == 1:
            return readme.text, readme.relpath
        key = f"{sample.repo}/{readme.relpath}"
        index = self._indexes.get(key)
        if index is None:
            index = self._indexes[key] = WindowIndex(readme.text, self.n_sentence, self.max_sentences, self._split)
        return index.top1(sample.instruction), readme.relpath

    def record(self, sample: Sample, task: int, for_inference: bool = False) -> dict[str, Any]:
        """One output row with every column later stages need; ``for_inference`` also bounds the prompt alone."""
        context, readme_path = self.context(sample, task)
        make: Callable = partial(self._render, sample)
        stats: dict[str, Any]  # PrepRecord's budget fields
        if self.budget is None:
            r = make(context)
            stats = {"truncated": False, "context_tokens": None, "dropped_tokens": 0, "total_tokens": None,
                     "over_budget": False}
        else:
            fit = self.budget.fit(make, context, self.max_prompt_tokens if for_inference else None)
            r = fit.rendered
            stats = {"truncated": fit.truncated, "context_tokens": fit.context_tokens,
                     "dropped_tokens": fit.dropped_tokens, "total_tokens": fit.total_tokens,
                     "over_budget": fit.over_budget}
        return PrepRecord(
            task=task, github_id=sample.github_id, id=sample.id, repo=sample.repo, repo_id=sample.repo_id,
            path=sample.path, type=sample.type, arguments=sample.arguments, instruction=sample.instruction,
            readme_path=readme_path, context=context, context_chars=len(context), template=self.template,
            prompt=r.prompt, answer=r.answer, messages=r.messages, output=sample.output,
            prefix_code=sample.prefix_code, **stats).to_json()

    def _render(self, sample: Sample, context: str):
        return render(self.template, sample.instruction, context, sample.output, sample.type, self.tokenizer)

    def render_task(self, samples: list[Sample], task: int, desc: str = "", for_inference: bool = False
                    ) -> list[dict[str, Any]]:
        """Render every sample for one task, with a progress bar."""
        return [self.record(s, task, for_inference) for s in tqdm(samples, desc=desc or f"task {task}", unit="row",
                                                   leave=False, mininterval=1.0)]
