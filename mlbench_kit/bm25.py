"""BM25 (``rank_bm25.BM25Okapi``) over tokenised documents, each query term's scores computed once.

One implementation for the toolkit: task 2's retrieval (``data_prep/retrieval.py``: sentence windows of a README)
and the agent's README window (``agent/readme.py``: sections of a README) both rank with :class:`BM25Index`. Scores
are computed term by term with the same numpy expressions as ``BM25Okapi.get_scores``, so they are bit-identical
and ties break the same way."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from rank_bm25 import BM25Okapi


class BM25Index:
    """A BM25Okapi index over ``docs`` (each a list of tokens), built once and queried many times."""

    def __init__(self, docs: list[list[str]]) -> None:
        self.docs = docs
        self.bm25 = BM25Okapi(docs) if docs else None
        self._doc_len = np.array(self.bm25.doc_len) if self.bm25 else None
        self._term_scores: dict[str, np.ndarray | None] = {}

    def _term(self, q: str) -> np.ndarray | None:
        vec = self._term_scores.get(q)
        if vec is None and q not in self._term_scores:
            bm = self.bm25
            if bm is None:  # no document to score
                return None
            idf = bm.idf.get(q) or 0
            if idf == 0:
                vec = None  # contributes exact zeros in the reference: adding them changes nothing
            else:
                q_freq = np.array([(doc.get(q) or 0) for doc in bm.doc_freqs])
                vec = idf * (q_freq * (bm.k1 + 1) / (q_freq + bm.k1 * (1 - bm.b + bm.b * self._doc_len / bm.avgdl)))
            self._term_scores[q] = vec
        return vec

    def term_scores(self, terms: Iterable[str]) -> np.ndarray:
        """BM25Okapi scores of every document for the query ``terms``, bit-identical to
        ``BM25Okapi.get_scores(list(terms))``."""
        score = np.zeros(len(self.docs))
        for q in terms:
            vec = self._term(q)
            if vec is not None:
                score += vec
        return score

    def best(self, terms: Iterable[str]) -> int:
        """The index of the best document (``BM25Okapi.get_top_n``'s first: the same tie-breaking); -1 if none."""
        if not self.docs:
            return -1
        return int(np.argsort(self.term_scores(terms))[::-1][0])
