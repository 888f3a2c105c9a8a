"""Diversity among the K candidates of an item (paper App. E.4): Div-n and mBLEU-n. No references involved.

Both take `candidates: list[list[str]]` (N items x K candidates) of PTB-tokenized text (`ptb_tokenize`) and split
words on whitespace, as the COCO metrics do.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from loramcl.metrics.text import check_candidate_sets


def _ngrams(words: list[str], n: int) -> list[tuple[str, ...]]:
    return [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]


def div_n(
    candidates: Sequence[Sequence[str]], n: int | Sequence[int] = (1, 2), denominator: str = "ngrams"
) -> dict[str, float]:
    """Div-n (higher = more diverse): per item, distinct n-grams over the K candidates / total n-grams over the K
    candidates; mean over items. Keys div1, div2, ...

    K identical candidates give 1/K, candidates sharing no n-gram give 1. `denominator="words"` divides by the
    number of words instead (the DivStats script of Aneja et al. / Wang & Chan); for n = 1 both are the same.
    Items whose candidates hold no n-gram at all (all shorter than n words) are left out of the mean.
    """
    check_candidate_sets(candidates)
    if denominator not in ("ngrams", "words"):
        raise ValueError(f"denominator must be 'ngrams' (paper App. E.4) or 'words' (DivStats), got {denominator!r}")
    orders = [n] if isinstance(n, int) else list(n)
    tokenized = [[c.split() for c in cands] for cands in candidates]
    result = {}
    for order in orders:
        if order < 1:
            raise ValueError(f"n-gram order must be >= 1, got {order}")
        ratios = []
        for cands in tokenized:
            grams = [g for words in cands for g in _ngrams(words, order)]
            total = len(grams) if denominator == "ngrams" else sum(len(words) for words in cands)
            if total:
                ratios.append(len(set(grams)) / total)
        if not ratios:
            raise ValueError(f"no item has a candidate of {order} words or more: Div-{order} is undefined")
        result[f"div{order}"] = float(np.mean(ratios))
    return result


def mbleu(candidates: Sequence[Sequence[str]], n: int = 4, level: str = "sentence") -> dict[str, float]:
    """mBLEU-1..n (lower = more diverse): each candidate's BLEU against the other K-1 candidates of its item.

    level="sentence" (default; paper App. E.4 eq.): per item, mean over k of the sentence-level BLEU_n(x^k,
    {x^s, s != k}) of pycocoevalcap (closest-length brevity penalty), then mean over items.
    level="corpus": for each k, pycocoevalcap's corpus BLEU of all items' k-th candidates against their other
    candidates, then mean over k (the DivStats script used by the diverse-captioning literature).
    K identical candidates give 1 (up to the library's 1e-9 smoothing), candidates sharing no word give ~0.
    """
    num_candidates = check_candidate_sets(candidates)
    if num_candidates < 2:
        raise ValueError("mBLEU compares each candidate with the other ones: it needs K >= 2 candidates per item")
    if level not in ("sentence", "corpus"):
        raise ValueError(f"level must be 'sentence' or 'corpus', got {level!r}")
    from pycocoevalcap.bleu.bleu import Bleu

    def others(cands: Sequence[str], k: int) -> list[str]:
        return [c for s, c in enumerate(cands) if s != k]

    if level == "sentence":
        # one scorer over all N*K (candidate, its K-1 siblings) pairs; row i*K + k
        rows = [(i * num_candidates + k, cands, k) for i, cands in enumerate(candidates) for k in range(num_candidates)]
        gts = {row: others(cands, k) for row, cands, k in rows}
        res = {row: [cands[k]] for row, cands, k in rows}
        _, per_sentence = Bleu(n).compute_score(gts, res, verbose=0)  # n lists of [N*K]
        return {f"mbleu{m + 1}": float(np.mean(per_sentence[m])) for m in range(n)}
    per_position = []  # [K][n]
    for k in range(num_candidates):
        gts = {i: others(cands, k) for i, cands in enumerate(candidates)}
        res = {i: [cands[k]] for i, cands in enumerate(candidates)}
        corpus, _ = Bleu(n).compute_score(gts, res, verbose=0)
        per_position.append(corpus)
    return {f"mbleu{m + 1}": float(np.mean([p[m] for p in per_position])) for m in range(n)}
