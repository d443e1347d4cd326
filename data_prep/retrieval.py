"""Task 2 retrieval, exactly as the paper: Punkt sentences, 10-sentence windows (stride 1) over at most the
first 1,000 sentences, whitespace tokens, ``rank_bm25.BM25Okapi``, top-1 window joined with spaces.

:class:`WindowIndex` builds each README's index once, on the core's :class:`mlbench_kit.bm25.BM25Index` (scores
bit-identical to ``BM25Okapi.get_scores``, ties broken the same way).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable

import numpy as np
from rank_bm25 import BM25Okapi

from mlbench_kit.bm25 import BM25Index
from mlbench_kit.errors import MLBenchError

N_SENTENCE = 10
MAX_SENTENCES = 1000
SPLITTERS = ("punkt", "regex")


def punkt_split(text: str) -> list[str]:
    """NLTK's English Punkt splitter (``sent_tokenize``); fails clearly when the model is not installed."""
    import nltk
    try:
        return nltk.tokenize.sent_tokenize(text)
    except LookupError:
        raise punkt_missing(list(nltk.data.path)) from None


def punkt_missing(searched: list[str]) -> MLBenchError:
    """The error for a missing Punkt model: where NLTK looked, and the three ways out."""
    shown = ", ".join(searched[:4]) + (f" and {len(searched) - 4} more" if len(searched) > 4 else "")
    return MLBenchError(f"NLTK's English Punkt model (punkt_tab), which task 2 splits READMEs with, is not installed: "
                        f"no tokenizers/punkt_tab/english in {shown or 'any folder'}",
                        f"NLTK_DATA={os.environ.get('NLTK_DATA', '(unset)')}",
                        "set NLTK_DATA to a folder holding tokenizers/punkt_tab/english (the benchmark's shared data "
                        "has one: shared/mlbench/nltk_data), or download it once: `python3 -m nltk.downloader -d "
                        "~/nltk_data punkt_tab`; --splitter regex is an explicit, non-paper fallback")


def check_punkt() -> None:
    """Fail now, before anything is written, when task 2's Punkt model is missing."""
    punkt_split("A first sentence. A second one.")


def regex_split(text: str) -> list[str]:
    """A crude fallback splitter (not the paper's): split after ., ! or ? followed by white space."""
    return [s for s in re.split(r"(?<=[.!?])\s+", text.strip()) if s]


def get_splitter(name: str) -> Callable[[str], list[str]]:
    """Return the sentence splitter called ``name`` (``punkt`` is the paper's)."""
    if name == "punkt":
        return punkt_split
    if name == "regex":
        return regex_split
    raise MLBenchError(f"unknown sentence splitter {name!r}", "--splitter", f"use one of {SPLITTERS}")


def windows(sentences: list[str], n_sentence: int = N_SENTENCE) -> list[list[str]]:
    """Whitespace-tokenised windows ``sentences[i:i+n]`` for every i (the last ones are shorter, as in the paper)."""
    return [" ".join(sentences[i:i + n_sentence]).split() for i in range(len(sentences))]


def reference_top1(query: str, readme: str, n_sentence: int = N_SENTENCE, max_sentences: int = MAX_SENTENCES,
                   splitter: Callable[[str], list[str]] = punkt_split) -> str:
    """The benchmark's own per-row algorithm (split, index and rank from scratch). Kept as the oracle for tests
    and the baseline for ``bench/``."""
    docs = windows(splitter(readme)[:max_sentences], n_sentence)
    if not docs:
        return ""
    return " ".join(BM25Okapi(docs).get_top_n(query.split(), docs, n=1)[0])


class WindowIndex(BM25Index):
    """A BM25 index over one README's sentence windows (whitespace tokens), built once and queried many times."""

    def __init__(self, readme: str, n_sentence: int = N_SENTENCE, max_sentences: int = MAX_SENTENCES,
                 splitter: Callable[[str], list[str]] = punkt_split) -> None:
        super().__init__(windows(splitter(readme)[:max_sentences], n_sentence))

    def scores(self, query: str) -> np.ndarray:
        """BM25Okapi scores of every window, bit-identical to ``BM25Okapi.get_scores(query.split())``."""
        return self.term_scores(query.split())

    def top1(self, query: str) -> str:
        """The best window for ``query`` joined with spaces (``""`` for an empty README)."""
        best = self.best(query.split())
        return " ".join(self.docs[best]) if best >= 0 else ""
