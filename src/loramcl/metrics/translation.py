"""Diverse machine translation metrics of Shen et al. 2019 (paper App. H.6), computed with sacrebleu.

The semantics are those of fairseq's `examples/translation_moe/score.py` (the paper's "official codebase"): one
corpus-level BLEU over pooled (hypothesis, reference) pairs, in sacrebleu's 0-100 scale, default settings (exp
smoothing); #references covered ranks references with score.py's smoothed sentence BLEU (`bleu_plus_one`). The
tokenization is sacrebleu's 13a, as the paper states (fairseq's script passes pre-tokenized text with
tokenize='none'; give `tokenize="none"` to reproduce that on tokenized text). Inputs are raw (detokenized)
strings: `candidates: list[list[str]]` (N x K), `references: list[list[str]]` (N x R_i: the number of
references may vary from item to item; score.py needs the same R, see ``loo_bleu``).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np

from loramcl.metrics.text import check_candidate_sets, check_pairs


def _corpus_bleu(hypotheses: list[str], reference_streams: list[list[str]], tokenize: str) -> float:
    from sacrebleu.metrics import BLEU

    return float(BLEU(tokenize=tokenize).corpus_score(hypotheses, reference_streams).score)


def loo_items(references: Sequence[Sequence[str]]) -> list[int]:
    """Positions of the items Loo-BLEU scores: those with R_i >= 2 references (holding out the only reference of
    an item would leave none to score its candidates against). A clear error when no item has two."""
    items = [i for i, refs in enumerate(references) if len(refs) >= 2]
    if not items:
        raise ValueError("Loo-BLEU holds out one reference of an item at a time, so it needs items with >= 2 "
                         "references, and every item here has one: leave it out (--exclude loo_bleu); "
                         "Pairwise-BLEU and #references covered are still defined")
    return items


def loo_bleu(
    candidates: Sequence[Sequence[str]], references: Sequence[Sequence[str]], tokenize: str = "13a"
) -> dict[str, float]:
    """Leave-One-Out BLEU (higher = better): in round t = 0 .. R_max - 1 every item holds out its reference
    t mod R_i, and one corpus BLEU scores all candidates against the other R_i - 1 references of their item; the
    mean over the rounds. With the same R for every item, round t holds out reference stream t: Shen et al.'s
    protocol and fairseq score.py's numbers exactly. With different R_i every candidate is still scored against
    all but one of its item's references in every round (an item with R_i < R_max wraps around, so its references
    are held out floor(R_max / R_i) or ceil(R_max / R_i) times). Items with one reference are left out
    (``loo_items``)."""
    num_candidates = check_candidate_sets(candidates)
    check_pairs([c[0] for c in candidates], references)
    items = loo_items(references)
    rounds = max(len(references[i]) for i in items)
    hypotheses = [c for i in items for c in candidates[i]]  # item-major, K per item
    scores = []
    for t in range(rounds):
        kept = [[r for j, r in enumerate(references[i]) if j != t % len(references[i])] for i in items]
        # R_max - 1 streams, each entry repeated for the item's K candidates; None where an item has fewer
        # references (sacrebleu's convention for a varying number of references)
        streams = [[refs[s] if s < len(refs) else None for refs in kept for _ in range(num_candidates)]
                   for s in range(rounds - 1)]
        scores.append(_corpus_bleu(hypotheses, streams, tokenize))
    return {"loo_bleu": float(np.mean(scores))}


def pairwise_bleu(candidates: Sequence[Sequence[str]], tokenize: str = "13a") -> dict[str, float]:
    """Pairwise-BLEU (lower = more diverse): one corpus BLEU over every ordered pair (j, k), j != k, of candidates
    of the same item, candidate k as hypothesis and candidate j as its single reference."""
    num_candidates = check_candidate_sets(candidates)
    if num_candidates < 2:
        raise ValueError("Pairwise-BLEU compares candidates with each other: it needs K >= 2 candidates per item")
    pairs = [(cands[j], cands[k])
             for cands in candidates for j in range(num_candidates) for k in range(num_candidates) if j != k]
    return {"pairwise_bleu": _corpus_bleu([h for _, h in pairs], [[r for r, _ in pairs]], tokenize)}


@lru_cache(maxsize=4)
def _bleu_scorer(tokenize: str):
    from sacrebleu.metrics import BLEU

    return BLEU(tokenize=tokenize)


def bleu_plus_one(hypothesis: str, reference: str, tokenize: str = "13a") -> float:
    """Sentence BLEU as fairseq's score.py ranks references: the n-gram statistics of the single pair, one added to
    the matches and totals of the 2- to 4-grams, then exp smoothing (0-100)."""
    scorer = _bleu_scorer(tokenize)
    stats = scorer.corpus_score([hypothesis], [[reference]])
    correct, total = list(stats.counts), list(stats.totals)
    for n in range(1, 4):
        correct[n] += 1
        total[n] += 1
    return float(scorer.compute_bleu(correct, total, stats.sys_len, stats.ref_len, smooth_method="exp").score)


def references_covered(
    candidates: Sequence[Sequence[str]], references: Sequence[Sequence[str]], tokenize: str = "13a"
) -> dict[str, float | list[int]]:
    """#references covered (Shen et al. 2019, fairseq score.py): each candidate picks the reference it is closest
    to (sentence BLEU with +1 smoothing of the 2- to 4-gram counts); the number of distinct references picked per
    item, averaged over items. K candidates cover at most min(K, R_i) references. Ties go to the lowest reference
    index (fairseq draws one of the tied references at random, so its count varies from run to run and can only
    be higher)."""
    check_candidate_sets(candidates)
    check_pairs([c[0] for c in candidates], references)
    per_item = []
    for cands, refs in zip(candidates, references, strict=True):
        picked = {int(np.argmax([bleu_plus_one(c, r, tokenize) for r in refs])) for c in cands}
        per_item.append(len(picked))
    return {"refs_covered": float(np.mean(per_item)), "refs_covered_per_item": per_item}


def sacrebleu_sentence(
    candidates: Sequence[str], references: Sequence[Sequence[str]], tokenize: str = "13a"
) -> dict[str, np.ndarray]:
    """Sentence BLEU of sacrebleu (exp smoothing, effective order, 0-100) per candidate: a sentence metric for
    `candidate_scores` (e.g. to find which hypothesis wins each translation)."""
    check_pairs(candidates, references)
    from sacrebleu.metrics import BLEU

    scorer = BLEU(tokenize=tokenize, effective_order=True)
    pairs = zip(candidates, references, strict=True)
    return {"sacrebleu": np.array([scorer.sentence_score(c, list(r)).score for c, r in pairs])}


def chrf_sentence(candidates: Sequence[str], references: Sequence[Sequence[str]]) -> dict[str, np.ndarray]:
    """Sentence chrF of sacrebleu (character 6-grams, beta 2, 0-100) per candidate against its references: a
    sentence metric for `candidate_scores`, robust to the rich morphology and short outputs of translation."""
    check_pairs(candidates, references)
    from sacrebleu.metrics import CHRF

    scorer = CHRF()
    pairs = zip(candidates, references, strict=True)
    return {"chrf": np.array([scorer.sentence_score(c, list(r)).score for c, r in pairs])}
