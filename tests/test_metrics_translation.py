"""Loo-BLEU and Pairwise-BLEU (Shen et al. 2019; fairseq translation_moe/score.py semantics, sacrebleu 13a)."""

import numpy as np
import pytest
import sacrebleu

from loramcl.metrics import (
    candidate_scores,
    chrf_sentence,
    evaluate_candidates,
    loo_bleu,
    pairwise_bleu,
    sacrebleu_sentence,
)

CANDIDATES = [["Le chat dort sur le canapé.", "Un chat dort sur un sofa.", "Le chat est endormi."],
              ["Il pleut sur la ville.", "La pluie tombe sur la ville.", "Il pleut beaucoup."]]
REFERENCES = [["Le chat dort sur le canapé.", "Un chat est endormi sur le sofa."],
              ["Il pleut sur la ville.", "La pluie tombe sur la ville."]]


def test_loo_bleu_with_two_references_is_the_mean_of_two_single_reference_corpus_bleus():
    # R = 2: hold out reference 1 -> every candidate against its item's reference 2, and the other way round
    hyps = [c for cands in CANDIDATES for c in cands]
    ref = [[refs[r] for refs in REFERENCES for _ in range(3)] for r in range(2)]
    expected = (sacrebleu.corpus_bleu(hyps, [ref[1]]).score + sacrebleu.corpus_bleu(hyps, [ref[0]]).score) / 2
    assert loo_bleu(CANDIDATES, REFERENCES)["loo_bleu"] == pytest.approx(expected)


def test_loo_bleu_with_three_references_keeps_two_streams_each_time():
    refs = [r + ["Le chat dort."] if i == 0 else r + ["Il pleut."] for i, r in enumerate(REFERENCES)]
    hyps = [c for cands in CANDIDATES for c in cands]
    streams = [[item[r] for item in refs for _ in range(3)] for r in range(3)]
    held_out = [sacrebleu.corpus_bleu(hyps, [s for j, s in enumerate(streams) if j != r]).score for r in range(3)]
    assert loo_bleu(CANDIDATES, refs)["loo_bleu"] == pytest.approx(sum(held_out) / 3)


def test_known_values_and_13a_tokenization():
    same = [["a dog runs in the park .", "a dog runs in the park ."]]
    assert loo_bleu(same, [["a dog runs in the park .", "a dog runs in the park ."]])["loo_bleu"] == pytest.approx(100)
    assert pairwise_bleu(same)["pairwise_bleu"] == pytest.approx(100)
    # 13a splits the final period: "park." == "park ." ; without tokenization they differ
    glued = [["a dog runs in the park.", "a dog runs in the park ."]]
    assert pairwise_bleu(glued)["pairwise_bleu"] == pytest.approx(100)
    assert pairwise_bleu(glued, tokenize="none")["pairwise_bleu"] < 100


def test_pairwise_bleu_pools_every_ordered_pair():
    pairs = [(c[j], c[k]) for c in CANDIDATES for j in range(3) for k in range(3) if j != k]
    expected = sacrebleu.corpus_bleu([h for _, h in pairs], [[r for r, _ in pairs]]).score
    assert pairwise_bleu(CANDIDATES)["pairwise_bleu"] == pytest.approx(expected)


def test_loo_bleu_needs_the_same_r_of_at_least_two():
    with pytest.raises(ValueError, match=r"same number R >= 2 of references, got R in \[1, 2\]"):
        loo_bleu(CANDIDATES, [REFERENCES[0][:1], REFERENCES[1]])
    with pytest.raises(ValueError, match="R >= 2"):
        loo_bleu(CANDIDATES, [r[:1] for r in REFERENCES])


def test_sacrebleu_sentence_is_a_k1_oracle_of_sacrebleu():
    scores = candidate_scores(sacrebleu_sentence, CANDIDATES, REFERENCES)["sacrebleu"]  # [2, 3]
    bleu = sacrebleu.metrics.BLEU(effective_order=True)
    assert scores[1, 2] == pytest.approx(bleu.sentence_score(CANDIDATES[1][2], REFERENCES[1]).score)
    assert scores[0, 0] == pytest.approx(100)


def test_chrf_sentence_matches_sacrebleu_and_both_are_oracle_metrics_of_the_suite():
    scores = candidate_scores(chrf_sentence, CANDIDATES, REFERENCES)["chrf"]  # [2, 3]
    chrf = sacrebleu.metrics.CHRF()
    for i, k in [(0, 1), (1, 2)]:
        assert scores[i, k] == pytest.approx(chrf.sentence_score(CANDIDATES[i][k], REFERENCES[i]).score)
    report = evaluate_candidates(CANDIDATES, REFERENCES, metrics="sacrebleu,chrf", winner_metric="chrf")
    assert report["metrics"]["chrf"] == pytest.approx(scores.max(axis=1).mean())  # best of K, mean over items
    bleu = candidate_scores(sacrebleu_sentence, CANDIDATES, REFERENCES)["sacrebleu"]
    assert report["metrics"]["sacrebleu"] == pytest.approx(bleu.max(axis=1).mean())
    assert report["specialisation"]["win_rate"] == pytest.approx(
        (np.bincount(scores.argmax(axis=1), minlength=3) / 2).tolist())
