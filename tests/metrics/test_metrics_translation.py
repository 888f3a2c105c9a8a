"""Loo-BLEU, Pairwise-BLEU and #references covered (Shen et al. 2019; fairseq translation_moe/score.py semantics,
sacrebleu 13a or none)."""

import itertools

import numpy as np
import pytest
import sacrebleu

from loramcl.metrics import (
    bleu_plus_one,
    candidate_scores,
    chrf_sentence,
    evaluate_candidates,
    loo_bleu,
    markdown_report,
    pairwise_bleu,
    references_covered,
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


# Varying R: candidates equal to reference X of item 0 (R = 2: X, W) and to Y of item 1 (R = 3: Y, Y, Z), no word in
# common with W. Round t holds out reference t mod R_i: item 1 always keeps a Y (its 8 words match), item 0 keeps X
# only in round 1. Rounds 0 and 2: half of every n-gram order matches (8/16, 6/12, 4/8, 2/4), equal lengths: BLEU
# 50; round 1: 100. Loo-BLEU = (50 + 100 + 50) / 3. Other generalisations give other numbers: score.py's zip (the
# first R_min = 2 references of every item) 75, an item with fewer references keeping all of them in the rounds
# past its count 83.3, rounds balanced over lcm(2, 3) = 6 75.
X, W, Y, Z = "the cat sat down", "a dog ran off", "it rains in paris", "snow falls on rome"
UNEQUAL_CANDIDATES, UNEQUAL_REFERENCES = [[X, X], [Y, Y]], [[X, W], [Y, Y, Z]]


def loo_from_statistics(candidates, references):
    """Loo-BLEU by its definition, without padded reference streams: round t holds out reference t mod R_i of item
    i; a round's corpus BLEU from the sum of sacrebleu's statistics of each item's candidates against the
    references it keeps (corpus BLEU sums them)."""
    bleu, rounds = sacrebleu.metrics.BLEU(), []
    for t in range(max(len(r) for r in references)):
        stats = np.zeros(10, dtype=int)
        for cands, refs in zip(candidates, references, strict=True):
            kept = [r for j, r in enumerate(refs) if j != t % len(refs)]
            score = bleu.corpus_score(cands, [[r] * len(cands) for r in kept])
            stats += [*score.counts, *score.totals, score.sys_len, score.ref_len]
        counts, totals, sys_len, ref_len = stats[:4].tolist(), stats[4:8].tolist(), int(stats[8]), int(stats[9])
        rounds.append(bleu.compute_bleu(counts, totals, sys_len, ref_len).score)
    return rounds


def test_loo_bleu_with_a_varying_number_of_references_holds_out_reference_t_mod_r():
    assert loo_from_statistics(UNEQUAL_CANDIDATES, UNEQUAL_REFERENCES) == pytest.approx([50, 100, 50])
    assert loo_bleu(UNEQUAL_CANDIDATES, UNEQUAL_REFERENCES)["loo_bleu"] == pytest.approx(200 / 3)


def test_loo_bleu_with_varying_r_on_real_sentences():
    # the German fixture with one item's third reference removed; with equal R the definition is score.py's
    assert np.mean(loo_from_statistics(GERMAN_CANDIDATES, GERMAN_REFERENCES)) == pytest.approx(
        fairseq_loo(GERMAN_CANDIDATES, GERMAN_REFERENCES, "13a"))
    fewer = [refs[:2] if i == 1 else refs for i, refs in enumerate(GERMAN_REFERENCES)]
    value = loo_bleu(GERMAN_CANDIDATES, fewer)["loo_bleu"]
    assert value == pytest.approx(np.mean(loo_from_statistics(GERMAN_CANDIDATES, fewer)))
    assert value != pytest.approx(fairseq_loo(GERMAN_CANDIDATES, fewer, "13a"))  # score.py: 2 references each


def test_items_with_one_reference_are_left_out_of_loo_bleu_and_said_so():
    candidates = [*UNEQUAL_CANDIDATES, ["Ungültiges Argument.", "Argument"]]
    references = [*UNEQUAL_REFERENCES, ["Ungültiges Argument."]]
    assert loo_bleu(candidates, references)["loo_bleu"] == pytest.approx(200 / 3)
    report = evaluate_candidates(candidates, references, metrics="translation")
    assert report["metrics"]["loo_bleu"] == pytest.approx(200 / 3)
    assert report["notes"]["loo_bleu"].startswith("over the 2 of 3 items with >= 2 references; the 1 with one ")
    assert "loo_bleu: over the 2 of 3 items" in markdown_report(report)
    assert evaluate_candidates(CANDIDATES, REFERENCES, metrics="translation")["notes"] == {}
    with pytest.raises(ValueError, match=r"needs items with >= 2 references, and every item here has one: leave it "
                                         r"out \(--exclude loo_bleu\)"):
        evaluate_candidates(CANDIDATES, [r[:1] for r in REFERENCES], metrics="translation")
    one_each = evaluate_candidates(CANDIDATES, [r[:1] for r in REFERENCES], metrics="translation",
                                   exclude="loo_bleu")
    assert one_each["metrics"]["refs_covered"] == 1  # min(K, R_i) = 1


def test_references_covered_with_a_varying_number_of_references():
    refs = [["Datei öffnen"], ["Datei öffnen", "Öffne die Datei", "Datei wird geöffnet"]]
    cands = [["Datei öffnen", "Öffne die Datei"], ["Öffne die Datei", "Datei wird geöffnet"]]
    covered = references_covered(cands, refs)
    assert covered["refs_covered_per_item"] == [1, 2] and covered["refs_covered"] == 1.5


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


# Parity with fairseq's examples/translation_moe/score.py (the paper's "official codebase"), re-implemented here from
# its semantics: the same sacrebleu corpus BLEU, on the same streams as score.py builds them.
GERMAN_CANDIDATES = [
    ["Die Katze schläft auf dem Sofa.", "Eine Katze schläft auf dem Sofa.", "Die Katze döst, auf dem Sofa."],
    ["Es regnet in der Stadt.", "In der Stadt regnet es!", "Es regnet (stark) in der Stadt."],
    ["Datei konnte nicht geöffnet werden.", "Die Datei lässt sich nicht öffnen.", "Öffnen der Datei fehlgeschlagen."],
    ["Ungültiges Argument.", "Ungültiges Argument.", "Argument ist ungültig."],
]
GERMAN_REFERENCES = [
    ["Die Katze schläft auf dem Sofa.", "Eine Katze schläft auf der Couch.", "Die Katze pennt auf dem Sofa."],
    ["Es regnet in der Stadt.", "In der Stadt regnet es.", "Über der Stadt regnet es."],
    ["Die Datei konnte nicht geöffnet werden.", "Datei kann nicht geöffnet werden.", "Öffnen fehlgeschlagen."],
    ["Ungültiges Argument", "Ungültiges Argument.", "Das Argument ist ungültig."],
]


def fairseq_pairwise(candidates, tokenize):
    """score.py `pairwise`: for every ordered pair of an item's candidates, the first is the reference of the
    second; one corpus BLEU over all pairs."""
    from itertools import permutations

    pairs = [pair for cands in candidates for pair in permutations(cands, 2)]
    return sacrebleu.corpus_bleu([hyp for _, hyp in pairs], [[ref for ref, _ in pairs]], tokenize=tokenize).score


def fairseq_loo(candidates, references, tokenize):
    """score.py `multi_ref`: the references transposed into streams (zip: the shortest item's count), hypotheses
    flattened item by item, each stream's entry repeated once per candidate; the mean of the corpus BLEUs with one
    stream held out."""
    num_candidates = len(candidates[0])
    streams = [[ref for ref in stream for _ in range(num_candidates)] for stream in zip(*references, strict=False)]
    hypotheses = [hyp for cands in candidates for hyp in cands]
    held_out = [sacrebleu.corpus_bleu(hypotheses, streams[:m] + streams[m + 1:], tokenize=tokenize).score
                for m in range(len(streams))]
    return float(np.mean(held_out))


def fairseq_sentence_bleu(hypothesis, reference, tokenize):
    """score.py `sentence_bleu`, from n-gram counts: +1 on the matches and totals of orders 2-4, exp smoothing of a
    zero order (never order 2-4 after the +1), brevity penalty, 0-100."""
    from collections import Counter

    from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a

    split = (Tokenizer13a() if tokenize == "13a" else str)
    hyp, ref = split(hypothesis).split(), split(reference).split()
    log_precision, smooth = 0.0, 1.0
    for n in range(1, 5):
        hyp_grams = Counter(tuple(hyp[i:i + n]) for i in range(len(hyp) - n + 1))
        ref_grams = Counter(tuple(ref[i:i + n]) for i in range(len(ref) - n + 1))
        matches, total = sum((hyp_grams & ref_grams).values()), max(len(hyp) - n + 1, 0)
        if n > 1:
            matches, total = matches + 1, total + 1
        if matches == 0:
            smooth *= 2
            precision = 1 / (smooth * total)
        else:
            precision = matches / total
        log_precision += np.log(precision) / 4
    penalty = 1.0 if len(hyp) >= len(ref) else np.exp(1 - len(ref) / len(hyp))
    return 100 * penalty * np.exp(log_precision)


@pytest.mark.parametrize("tokenize", ["13a", "none"])
def test_parity_with_fairseq_score_py(tokenize):
    candidates, references = GERMAN_CANDIDATES, GERMAN_REFERENCES
    assert loo_bleu(candidates, references, tokenize=tokenize)["loo_bleu"] == pytest.approx(
        fairseq_loo(candidates, references, tokenize), abs=1e-9)
    assert pairwise_bleu(candidates, tokenize=tokenize)["pairwise_bleu"] == pytest.approx(
        fairseq_pairwise(candidates, tokenize), abs=1e-9)
    # score.py ranks references with its own sentence BLEU (13a in its sacrebleu call); ties: the first reference
    expected = [len({int(np.argmax([fairseq_sentence_bleu(c, r, tokenize) for r in refs])) for c in cands})
                for cands, refs in zip(candidates, references, strict=True)]
    for cands, refs in zip(candidates, references, strict=True):
        for candidate, reference in itertools.product(cands, refs):
            assert bleu_plus_one(candidate, reference, tokenize) == pytest.approx(
                fairseq_sentence_bleu(candidate, reference, tokenize), abs=1e-9), (candidate, reference)
    covered = references_covered(candidates, references, tokenize=tokenize)
    assert covered["refs_covered_per_item"] == expected and covered["refs_covered"] == pytest.approx(np.mean(expected))


def test_the_fixture_tells_the_two_tokenizations_apart():
    # punctuation glued to words: 13a splits it off, 'none' keeps it, so every score differs
    assert fairseq_pairwise(GERMAN_CANDIDATES, "13a") != pytest.approx(fairseq_pairwise(GERMAN_CANDIDATES, "none"))
    assert fairseq_loo(GERMAN_CANDIDATES, GERMAN_REFERENCES, "13a") != pytest.approx(
        fairseq_loo(GERMAN_CANDIDATES, GERMAN_REFERENCES, "none"))


def test_references_covered_known_values():
    refs = [["Datei öffnen", "Öffne die Datei", "Datei wird geöffnet"]]
    # a candidate equal to a reference covers it; three copies of one reference cover one
    assert references_covered([["Öffne die Datei", "Datei wird geöffnet", "Datei öffnen"]], refs)["refs_covered"] == 3
    assert references_covered([["Öffne die Datei"] * 3], refs)["refs_covered_per_item"] == [1]
    assert references_covered([["Datei öffnen", "Datei öffnen"]], [["Datei öffnen"]])["refs_covered"] == 1  # <= R
    # no word in common with any reference: the brevity penalty favours the shortest reference
    assert references_covered([["xyz", "uvw"]], refs)["refs_covered"] == 1
    report = evaluate_candidates([["Datei öffnen", "Öffne die Datei"]], [refs[0]], metrics="translation")
    assert report["metrics"]["refs_covered"] == 2 and report["metrics"]["pairwise_bleu"] < 100


def test_fig4_plot_has_a_marker_per_method_and_a_colour_per_decoding(tmp_path, monkeypatch):
    import matplotlib.axes

    from loramcl.metrics.plot import tradeoff_plot

    drawn, scatter = [], matplotlib.axes.Axes.scatter

    def recording(self, x, y, *args, **kwargs):
        drawn.append((kwargs.get("marker"), str(kwargs.get("color")), kwargs.get("label"), len(np.atleast_1d(x))))
        return scatter(self, x, y, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "scatter", recording)
    reports = [{"metrics": {"pairwise_bleu": 60 - 10 * i, "loo_bleu": 30 + i}} for i in range(4)]
    methods = ["LoRA-MLE r=16", "LoRA-MLE r=16", "LoRA-MLE r=48", "LoRA-MCL K=3"]
    decodings = ["beam search", "diverse beam search", "beam search", "beam search"]
    path = tradeoff_plot(reports, x="pairwise_bleu", y="loo_bleu", out=tmp_path / "fig4.png", labels=["B=3"] * 4,
                         methods=methods, decodings=decodings)
    assert path.stat().st_size > 1000
    points, legend = [d for d in drawn if d[3] == 1], [d for d in drawn if d[3] == 0]
    assert points[0][0] == points[1][0] != points[2][0] != points[3][0]  # marker: the method
    assert points[0][1] == points[2][1] == points[3][1] != points[1][1]  # colour: the decoding
    assert [d[2] for d in legend] == ["LoRA-MLE r=16", "LoRA-MLE r=48", "LoRA-MCL K=3", "beam search",
                                      "diverse beam search"]
    with pytest.raises(ValueError, match="give both methods and decodings"):
        tradeoff_plot(reports, x="pairwise_bleu", y="loo_bleu", out=tmp_path / "x.png", methods=methods)
