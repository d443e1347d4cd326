"""Task 2 retrieval, exactly as the paper: Punkt sentences, 10-sentence windows (stride 1) over at most the
first 1,000 sentences, whitespace tokens, ``rank_bm25.BM25Okapi``, top-1 window joined with spaces.

:class:`WindowIndex` builds each README's index once; scores are computed term by term with the same numpy
expressions as ``BM25Okapi.get_scores``, so they are bit-identical and ties break the same way.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable

import numpy as np
from rank_bm25 import BM25Okapi

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


class WindowIndex:
    """A BM25 index over one README's sentence windows, built once and queried many times."""

    def __init__(self, readme: str, n_sentence: int = N_SENTENCE, max_sentences: int = MAX_SENTENCES,
                 splitter: Callable[[str], list[str]] = punkt_split) -> None:
        self.docs = windows(splitter(readme)[:max_sentences], n_sentence)
        self.bm25 = BM25Okapi(self.docs) if self.docs else None
        self._doc_len = np.array(self.bm25.doc_len) if self.bm25 else None
        self._term_scores: dict[str, np.ndarray | None] = {}

    def _term(self, q: str) -> np.ndarray | None:
        vec = self._term_scores.get(q)
        if vec is None and q not in self._term_scores:
            bm = self.bm25
            if bm is None:  # an empty README: no window to score
                return None
            idf = bm.idf.get(q) or 0
            if idf == 0:
                vec = None  # contributes exact zeros in the reference: adding them changes nothing
            else:
                q_freq = np.array([(doc.get(q) or 0) for doc in bm.doc_freqs])
                vec = idf * (q_freq * (bm.k1 + 1) / (q_freq + bm.k1 * (1 - bm.b + bm.b * self._doc_len / bm.avgdl)))
            self._term_scores[q] = vec
        return vec

    def scores(self, query: str) -> np.ndarray:
        """BM25Okapi scores of every window, bit-identical to ``BM25Okapi.get_scores(query.split())``."""
        score = np.zeros(len(self.docs))
        for q in query.split():
            vec = self._term(q)
            if vec is not None:
                score += vec
        return score

    def top1(self, query: str) -> str:
        """The best window for ``query`` joined with spaces (``""`` for an empty README)."""
        if not self.docs:
            return ""
        best = np.argsort(self.scores(query))[::-1][0]  # same call as BM25.get_top_n: same tie-breaking
        return " ".join(self.docs[best])
