"""Short answers (one word, a name, a number): exact match, distinct candidates and duplicate candidates.

The normalisation is the one of the SQuAD evaluation, the field's usual for short answers: lower case, punctuation
removed (every Unicode punctuation character), the English articles "a", "an", "the" removed as words, white space
collapsed. So "The Deposit." and "deposit" are one answer; "deposits" and "depositing" are not.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence

import numpy as np

from loramcl.metrics.text import check_pairs

_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalise_answer(text: str) -> str:
    """``text`` lower-cased, without punctuation or the articles a/an/the, white space collapsed (SQuAD's rule)."""
    text = "".join(c for c in text.lower() if not unicodedata.category(c).startswith("P"))
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(candidates: Sequence[str], references: Sequence[Sequence[str]]) -> dict[str, np.ndarray]:
    """1 where the candidate equals one of its item's references after ``normalise_answer``, else 0: {"exact_match":
    array[N]} (a sentence metric: ``candidate_scores`` and ``oracle`` give its best of K and mean over K)."""
    check_pairs(candidates, references)
    return {"exact_match": np.array([float(normalise_answer(c) in {normalise_answer(r) for r in refs})
                                     for c, refs in zip(candidates, references, strict=True)])}


def first_occurrences(candidates: Sequence[Sequence[str]]) -> np.ndarray:
    """[N, K] bool: True where a candidate's normalised text is not among the earlier candidates of its item, so a
    text given twice (two token splits of one word, two hypotheses agreeing) is counted once, at its first place."""
    kept = np.zeros((len(candidates), max(len(c) for c in candidates)), dtype=bool)
    for i, cands in enumerate(candidates):
        kept[i, deduplicate(cands)] = True
    return kept


def distinct_candidates(candidates: Sequence[Sequence[str]]) -> float:
    """Mean over items of the number of different candidates after ``normalise_answer`` (K when all differ)."""
    return float(first_occurrences(candidates).sum(axis=1).mean())


def deduplicate(texts: Sequence[str]) -> list[int]:
    """Indices of ``texts`` to keep, in order: the first of each normalised text."""
    seen: set[str] = set()
    keep = []
    for i, text in enumerate(texts):
        key = normalise_answer(text)
        if key not in seen:
            seen.add(key)
            keep.append(i)
    return keep
