"""The oracle reduction of paper eq. (oracle), App. E.2: per item the best of the K candidates, then the mean.

    M_oracle = 1/N sum_i max_k M(x_i^k, X_i)

A *sentence metric* is any function `metric(candidates: list[str], references: list[list[str]]) -> dict[str,
array[N]]` (one candidate per item, as in aac-metrics' functional API). `candidate_scores` runs it on every
candidate of every item and `oracle` reduces the [N, K] matrices; all oracle metrics go through these two.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from loramcl.metrics.text import check_candidate_sets, check_pairs

SentenceMetric = Callable[..., dict[str, np.ndarray]]


def uses_corpus_statistics(metric: SentenceMetric) -> SentenceMetric:
    """Mark a sentence metric whose score depends on the whole reference corpus (CIDEr-D's idf).

    Such a metric is run once per candidate position k on the N items, so the corpus it sees has N reference
    groups, as in the COCO protocol. Giving it the N*K (item, k) pairs at once would count every reference group K
    times; the ratio N/df is unchanged but n-grams absent from all references get log(N*K) instead of log(N) in
    the candidate's tf-idf norm, which changes the score (tests/metrics/test_metrics_quality.py checks both facts).
    """
    metric.uses_corpus_statistics = True  # type: ignore[attr-defined]
    return metric


def candidate_scores(
    metric: SentenceMetric, candidates: Sequence[Sequence[str]], references: Sequence[Sequence[str]], **kwargs
) -> dict[str, np.ndarray]:
    """Score each of the K candidates of each item against that item's references: name -> array [N, K].

    Metrics without corpus statistics get all N*K pairs in one call (one JVM / one encoder batch for all);
    corpus-level ones (see `uses_corpus_statistics`) get K calls of N items.
    """
    num_candidates = check_candidate_sets(candidates)
    check_pairs([c[0] for c in candidates], references)
    num_items = len(candidates)
    if getattr(metric, "uses_corpus_statistics", False):
        per_position = [metric([c[k] for c in candidates], references, **kwargs) for k in range(num_candidates)]
        return {name: np.stack([p[name] for p in per_position], axis=1) for name in per_position[0]}
    flat_candidates = [c for cands in candidates for c in cands]  # item-major: row i*K + k
    flat_references = [refs for refs in references for _ in range(num_candidates)]
    scores = metric(flat_candidates, flat_references, **kwargs)
    return {name: np.asarray(s, dtype=float).reshape(num_items, num_candidates) for name, s in scores.items()}


def oracle(
    scores: np.ndarray | Mapping[str, np.ndarray], higher_is_better: bool = True, kept: np.ndarray | None = None
) -> float | dict[str, float]:
    """Mean over items of the best candidate's score: [N, K] -> float (a dict of matrices -> a dict of floats).

    Each metric takes its own best candidate (the paper's eq. is per metric), so the oracle BLEU-4 and the oracle
    CIDEr-D of one run may come from different candidates of the same item. ``kept`` ([N, K] bool, e.g.
    ``short_answers.first_occurrences``): the candidates that count; the others are left out.
    """
    if isinstance(scores, Mapping):
        return {name: oracle(s, higher_is_better, kept) for name, s in scores.items()}
    scores = _checked(scores, kept)
    best = np.nanmax(scores, axis=1) if higher_is_better else np.nanmin(scores, axis=1)
    return float(best.mean())


def mean_over_candidates(scores: np.ndarray, kept: np.ndarray | None = None) -> float:
    """Mean over items of the mean over the K candidates (the kept ones): what one candidate drawn at random
    scores, beside the oracle's best of K. [N, K] -> float."""
    return float(np.nanmean(_checked(scores, kept), axis=1).mean())


def _checked(scores: np.ndarray, kept: np.ndarray | None) -> np.ndarray:
    """[N, K] float scores, the candidates outside ``kept`` set to NaN (at least one kept per item)."""
    scores = np.asarray(scores, dtype=float)
    if scores.ndim != 2 or scores.shape[1] == 0:
        raise ValueError(f"oracle expects a score matrix [items, candidates], got shape {scores.shape}")
    if np.isnan(scores).any():
        raise ValueError("the score matrix has NaN entries: the oracle of an undefined score is undefined")
    if kept is None:
        return scores
    kept = np.asarray(kept, dtype=bool)
    if kept.shape != scores.shape or not kept.any(axis=1).all():
        raise ValueError(f"kept must be [items, candidates] = {scores.shape} with a kept candidate per item")
    return np.where(kept, scores, np.nan)


def winners(scores: np.ndarray, higher_is_better: bool = True, kept: np.ndarray | None = None) -> np.ndarray:
    """Index of the best candidate per item, [N, K] -> [N]; ties go to the lowest k (as the training loss does);
    only the ``kept`` candidates ([N, K] bool) can win."""
    scores = _checked(scores, kept)
    return np.nanargmax(scores, axis=1) if higher_is_better else np.nanargmin(scores, axis=1)
