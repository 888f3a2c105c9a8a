"""How well hypothesis scores p(k | c) rank the K candidates (issue 17): how often the top-scored candidate is the
oracle winner, and the calibration error of p(k | c) against how often hypothesis k wins.

Pure numpy: the scores come from a predictions file (``loramcl generate`` writes them for models with scores) and
the winners from the evaluation's candidate-level metric.
"""

from __future__ import annotations

import numpy as np


def ranking_quality(scores, winners, bins: int = 10) -> dict[str, float]:
    """scores: [N, K] p(k | c) per item (rows sum to 1); winners: [N] the index of each item's oracle winner.

    Returns score_top1 (share of items whose most probable candidate is the winner), score_chance (1/K, what a
    uniform ranking gets), score_ece (expected calibration error over all N*K (item, hypothesis) pairs: pairs binned
    by p into ``bins`` equal-width bins, then sum over bins of (pairs in bin / N*K) * |mean p - share of winners|).
    """
    scores = np.asarray(scores, dtype=float)
    winners = np.asarray(winners, dtype=int)
    if scores.ndim != 2 or scores.shape[0] != winners.shape[0] or scores.shape[0] == 0:
        raise ValueError(f"scores must be [N, K] with one winner per item, got scores {scores.shape} and winners "
                         f"{winners.shape}")
    if not np.isfinite(scores).all() or (scores < 0).any() or not np.allclose(scores.sum(axis=1), 1.0, atol=1e-3):
        raise ValueError("scores must be probabilities p(k | c): finite, >= 0, each item's summing to 1")
    n, k = scores.shape
    if (winners < 0).any() or (winners >= k).any():
        raise ValueError(f"winners must be hypothesis indices in [0, {k - 1}]")
    won = np.zeros_like(scores)
    won[np.arange(n), winners] = 1.0
    which = np.minimum((scores * bins).astype(int), bins - 1).ravel()  # bin of each pair
    p, hit = scores.ravel(), won.ravel()
    ece = sum(abs(p[which == b].mean() - hit[which == b].mean()) * (which == b).sum()
              for b in range(bins) if (which == b).any()) / p.size
    return {"score_top1": float((scores.argmax(axis=1) == winners).mean()), "score_chance": 1.0 / k,
            "score_ece": float(ece)}
