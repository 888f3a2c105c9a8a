"""Div-n and mBLEU-n (paper App. E.4): known values and the two limits (identical / disjoint candidates)."""

import itertools
import math

import pytest

from loramcl.metrics import div_n, mbleu, pairwise_bleu

# no word repeats inside a candidate, so identical -> Div-n = 1/K and disjoint -> 1 exactly
IDENTICAL = [["one man rides his horse on the beach"] * 3, ["two dogs play in the snow"] * 3]
DISJOINT = [["one man rides his horse", "waves crash on rocks", "seagulls fly over sand"],
            ["two dogs play", "children build snowmen", "the snowy street is quiet"]]


def test_div_n_limits_and_hand_values():
    assert div_n(IDENTICAL, n=(1, 2)) == pytest.approx({"div1": 1 / 3, "div2": 1 / 3})  # K identical -> 1/K
    assert div_n(DISJOINT, n=(1, 2)) == {"div1": 1.0, "div2": 1.0}
    # unigrams a b a a c: 3 distinct of 5; bigrams (a b) (b a) (a c): 3 of 3, or 3 of 5 words (DivStats' denominator)
    assert div_n([["a b a", "a c"]], n=(1, 2)) == pytest.approx({"div1": 0.6, "div2": 1.0})
    assert div_n([["a b a", "a c"]], n=2, denominator="words") == pytest.approx({"div2": 0.6})


def test_div_n_leaves_out_items_without_ngrams():
    assert div_n([["a b", "a b"], ["x", "y"]], n=2) == {"div2": 0.5}  # item 2 has no bigram
    with pytest.raises(ValueError, match="Div-3 is undefined"):
        div_n([["a b", "c"]], n=3)


def test_mbleu_limits_and_hand_values():
    identical, disjoint = mbleu(IDENTICAL), mbleu(DISJOINT)
    assert identical["mbleu4"] == pytest.approx(1.0, abs=1e-6)  # maximal: every candidate is its siblings
    assert disjoint["mbleu1"] < 1e-6 and disjoint["mbleu4"] < 1e-6  # no shared word
    # K = 2, "a b c d" vs "a b c e" both ways: p1 = 3/4, p2 = 2/3, p3 = 1/2, same lengths (BP = 1)
    pair = mbleu([["a b c d", "a b c e"]])
    assert pair["mbleu1"] == pytest.approx(0.75) and pair["mbleu2"] == pytest.approx(math.sqrt(0.5))
    assert pair["mbleu3"] == pytest.approx((0.75 * 2 / 3 * 0.5) ** (1 / 3))


def test_mbleu_sentence_level_is_the_mean_of_library_sentence_bleus():
    from pycocoevalcap.bleu.bleu import Bleu

    cands = [["the cat sat on the mat", "the cat sat on a mat", "a dog lay on the rug"],
             ["a man rides a horse", "a man rides a brown horse", "a horse runs"]]
    expected = []
    for item in cands:
        for k, c in enumerate(item):
            others = [o for s, o in enumerate(item) if s != k]
            _, per_sentence = Bleu(4).compute_score({0: others}, {0: [c]}, verbose=0)
            expected.append(per_sentence[3][0])
    assert mbleu(cands)["mbleu4"] == pytest.approx(sum(expected) / len(expected))


def test_mbleu_corpus_level_pools_the_items():
    # item 1: identical 6-word candidates (sentence BLEU 1); item 2: disjoint 2-word ones (sentence BLEU ~0)
    cands = [["a b c d e f", "a b c d e f"], ["x y", "z w"]]
    assert mbleu(cands, n=1)["mbleu1"] == pytest.approx(0.5)  # mean over items of the sentence scores
    assert mbleu(cands, n=1, level="corpus")["mbleu1"] == pytest.approx(6 / 8)  # pooled counts: 6 of 8 unigrams


def test_mbleu4_and_pairwise_bleu_are_different_definitions():
    """Same candidates, two numbers. mBLEU-4: each candidate against its K-1 siblings *together* (multi-reference
    clipping, closest-length brevity penalty), sentence level, averaged; 0-1; PTB words. Pairwise-BLEU: every
    ordered pair (j, k) as a single-reference segment, counts pooled over all pairs and items (corpus BLEU);
    0-100; 13a tokens."""
    cands = [["the cat sat on the mat", "the cat sat on a mat", "a dog lay on the rug"],
             ["a man rides a horse", "a man rides a brown horse", "a horse runs"]]
    import sacrebleu

    pairs = [(ref, hyp) for item in cands for ref, hyp in itertools.permutations(item, 2)]
    expected_pairwise = sacrebleu.corpus_bleu([h for _, h in pairs], [[r for r, _ in pairs]]).score
    m4, pairwise = mbleu(cands)["mbleu4"], pairwise_bleu(cands)["pairwise_bleu"]
    assert pairwise == pytest.approx(expected_pairwise)
    assert m4 == pytest.approx(0.3832, abs=1e-4) and pairwise == pytest.approx(26.88, abs=1e-2)
    assert abs(m4 - pairwise / 100) > 0.1  # not a rescaling of each other
    # both go the same way at the limits: identical -> max, disjoint -> 0
    assert pairwise_bleu(IDENTICAL)["pairwise_bleu"] == pytest.approx(100.0)
    assert pairwise_bleu(DISJOINT)["pairwise_bleu"] == pytest.approx(0.0, abs=1e-9)


def test_mbleu_needs_two_candidates():
    with pytest.raises(ValueError, match="K >= 2"):
        mbleu([["a b"], ["c d"]])
