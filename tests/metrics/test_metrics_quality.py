"""Quality metrics: parity with the libraries (K = 1 oracle == the library's sentence score), hand-checked values,
CIDEr-D's corpus statistics, and the clear errors for SPICE / Java."""

import json
import math

import numpy as np
import pytest

from loramcl.metrics import bleu, candidate_scores, cider_d, meteor, oracle, ptb_tokenize, quality, rouge_l, sbert_sim
from loramcl.metrics.suite import evaluate_candidates

# Hand-checkable corpus (already tokenized): item A is a perfect candidate; item B shares "the dog runs".
CANDIDATES = ["a cat sat on the mat", "the dog runs fast"]
REFERENCES = [["a cat sat on the mat"], ["the dog runs slowly"]]


def coco(candidates, references):
    return {i: list(r) for i, r in enumerate(references)}, {i: [c] for i, c in enumerate(candidates)}


def test_bleu_hand_values_sentence_and_corpus():
    from pycocoevalcap.bleu.bleu import Bleu

    scores = bleu(CANDIDATES, REFERENCES)
    # item B: p1 = 3/4, p2 = 2/3, p3 = 1/2, p4 = 0 (up to the library's 1e-9 smoothing), equal lengths -> BP = 1
    assert scores["bleu1"] == pytest.approx([1, 0.75], abs=1e-8)
    assert scores["bleu2"] == pytest.approx([1, math.sqrt(0.75 * 2 / 3)], abs=1e-8)
    assert scores["bleu3"] == pytest.approx([1, (0.75 * 2 / 3 * 0.5) ** (1 / 3)], abs=1e-8)
    assert scores["bleu4"][0] == pytest.approx(1, abs=1e-8) and scores["bleu4"][1] < 1e-3
    # the oracle (K = 1) is the mean of the sentence scores; the library's corpus BLEU pools the counts instead:
    # n-gram matches 9/10, 7/8, 5/6, 3/4 over both items, total length 10 = reference length
    corpus, _ = Bleu(4).compute_score(*coco(CANDIDATES, REFERENCES), verbose=0)
    assert corpus == pytest.approx([0.9, (0.9 * 7 / 8) ** 0.5, (0.9 * 7 / 8 * 5 / 6) ** (1 / 3),
                                    (0.9 * 7 / 8 * 5 / 6 * 3 / 4) ** 0.25], abs=1e-8)
    assert oracle(candidate_scores(bleu, [[c] for c in CANDIDATES], REFERENCES))["bleu1"] == pytest.approx(0.875)


def test_rouge_l_and_cider_d_hand_values_equal_the_library_corpus_score():
    from pycocoevalcap.cider.cider import Cider
    from pycocoevalcap.rouge.rouge import Rouge

    # ROUGE-L: LCS "the dog runs" = 3 of 4 words both ways -> F = 0.75
    assert rouge_l(CANDIDATES, REFERENCES)["rouge_l"] == pytest.approx([1.0, 0.75])
    # CIDEr-D, N = 2 documents: "the" is in both (idf 0), every other reference n-gram in one (idf log 2); the
    # unseen "fast" n-grams also get log 2. Item B's cosines per n: 2/3, 2/3, 1/2, 0; x10 / 4 -> 4.5833
    assert cider_d(CANDIDATES, REFERENCES)["cider_d"] == pytest.approx([10.0, 10 * (2 / 3 + 2 / 3 + 1 / 2) / 4])
    for metric, library in ((rouge_l, Rouge()), (cider_d, Cider())):
        corpus, _ = library.compute_score(*coco(CANDIDATES, REFERENCES))  # the library's corpus score is a mean
        k1 = oracle(candidate_scores(metric, [[c] for c in CANDIDATES], REFERENCES))
        assert list(k1.values())[0] == pytest.approx(corpus)


def test_perfect_candidate_has_oracle_bleu4_one_whatever_the_other_candidates():
    candidates = [["a cat sat on the mat", "zzz"], ["x y", "the dog runs very slowly"]]
    references = [["a cat sat on the mat"], ["the dog runs very slowly", "a dog"]]
    assert oracle(candidate_scores(bleu, candidates, references))["bleu4"] == pytest.approx(1.0, abs=1e-8)


def test_cider_d_document_frequencies_come_from_the_n_reference_groups():
    from pycocoevalcap.cider.cider import Cider

    refs = [["a dog runs on the grass", "a brown dog runs"], ["a man rides a horse", "a person on a horse"],
            ["people walk in the street", "a busy street"]]
    # candidate 1 of each item has words seen in no reference ("zebra", "piano"...)
    cands = [["a dog runs", "a zebra runs fast"], ["rides a horse", "a piano plays"], ["the street", "the moon"]]
    scores = candidate_scores(cider_d, cands, refs)["cider_d"]  # [3, 2]
    for k in range(2):  # == the library run on the N items' k-th candidates: idf over the N reference groups
        _, direct = Cider().compute_score(*coco([c[k] for c in cands], refs))
        assert scores[:, k] == pytest.approx(direct)
    # Scoring all N*K pairs in one library call duplicates every reference group K times: N and df both scale by K,
    # so only candidates with n-grams unseen in the references change (their idf becomes log(N*K)).
    _, flat = Cider().compute_score(*coco([c for cs in cands for c in cs], [r for r in refs for _ in range(2)]))
    flat = np.asarray(flat).reshape(3, 2)
    assert flat[:, 0] == pytest.approx(scores[:, 0])  # only seen n-grams: identical
    assert not np.allclose(flat[:, 1], scores[:, 1])  # unseen n-grams: the idf of the naive call differs


def test_cider_d_refuses_a_single_item():
    with pytest.raises(ValueError, match="at least 2 items"):
        cider_d(["a dog"], [["a dog"]])


def test_ptb_tokenizer_keeps_one_output_per_input():
    texts = ["A man, riding a horse.", "", "line\rbreak and\u2028separator", "Don't stop!", "A man, riding a horse."]
    assert ptb_tokenize(texts) == ["a man riding a horse", "", "line break and separator", "do n't stop",
                                   "a man riding a horse"]


@pytest.fixture(scope="module")
def captions():
    """Raw captions, K = 1, through evaluate_candidates and through the libraries directly."""
    cands = ["A dog is running across the grass.", "A man rides a horse on the beach.", "People walk down a street.",
             "A cat sleeps on the sofa."]
    refs = [["A dog is running on the grass.", "A brown dog runs across a field."],
            ["A man is riding a horse on the beach.", "Someone riding a horse by the ocean.", "A horse."],
            ["Many people walk down a busy street."], ["A cat is sleeping on a couch.", "The cat sleeps."]]
    report = evaluate_candidates([[c] for c in cands], refs, metrics="bleu1,bleu4,meteor,rouge_l,cider_d,sbert_sim")
    return cands, refs, report


@pytest.fixture(scope="module")
def library_meteor():
    """One METEOR JVM of the library for the parity tests (each start loads the paraphrase table: seconds)."""
    from pycocoevalcap.meteor.meteor import Meteor

    return Meteor()


def test_k1_oracle_equals_the_library_sentence_scores(captions, library_meteor):
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider
    from pycocoevalcap.rouge.rouge import Rouge
    from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

    cands, refs, report = captions
    tokenizer = PTBTokenizer()  # the library's own pipeline: tokenize, then score
    res = tokenizer.tokenize({i: [{"caption": c}] for i, c in enumerate(cands)})
    gts = tokenizer.tokenize({i: [{"caption": r} for r in rs] for i, rs in enumerate(refs)})
    _, bleu_lib = Bleu(4).compute_score(gts, res, verbose=0)
    _, meteor_lib = library_meteor.compute_score(gts, res)
    _, rouge_lib = Rouge().compute_score(gts, res)
    _, cider_lib = Cider().compute_score(gts, res)
    expected = {"bleu1": bleu_lib[0], "bleu4": bleu_lib[3], "meteor": meteor_lib, "rouge_l": rouge_lib,
                "cider_d": cider_lib}
    for name, library in expected.items():
        assert report["candidate_scores"][name][:, 0] == pytest.approx(library, abs=1e-12), name
        assert report["metrics"][name] == pytest.approx(np.mean(library), abs=1e-12), name


def test_k1_sbert_similarity_equals_sentence_transformers(captions):
    cands, refs, report = captions
    encoder = quality.load_sentence_encoder(None)
    tokenized = ptb_tokenize(cands + [r for rs in refs for r in rs])  # the metric sees PTB text, as aac-metrics
    tok_cands, tok_refs = tokenized[: len(cands)], iter(tokenized[len(cands):])
    expected = []
    for c, rs in zip(tok_cands, refs, strict=True):
        r_tok = [next(tok_refs) for _ in rs]
        e = encoder.encode([c, *r_tok], convert_to_numpy=True)
        e = e / np.linalg.norm(e, axis=1, keepdims=True)
        expected.append(float((e[1:] @ e[0]).mean()))
    assert report["candidate_scores"]["sbert_sim"][:, 0] == pytest.approx(expected, abs=1e-5)
    assert report["metrics"]["sbert_sim"] == pytest.approx(np.mean(expected), abs=1e-5)
    assert report["settings"]["sbert_model"].endswith("model")  # the packaged all-MiniLM-L6-v2


def test_meteor_streaming_matches_the_library_on_odd_input(library_meteor):
    cands = ["a dog runs", "", "a b c ||| d", "the cat"]
    refs = [["a dog is running", "dogs run"], ["something"], ["a b c d"], ["the cat", "a cat sat"]]
    _, library = library_meteor.compute_score(*coco(cands, refs))
    assert meteor(cands, refs)["meteor"] == pytest.approx(library, abs=1e-12)


def test_sbert_scores_identical_text_one():
    scores = sbert_sim(["a dog runs", "a cat"], [["a dog runs"], ["a cat", "a cat"]])["sbert_sim"]
    assert scores == pytest.approx([1.0, 1.0], abs=1e-5)


def test_spice_without_jars_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.delenv(quality.SPICE_ENV, raising=False)
    with pytest.raises(RuntimeError, match="LORAMCL_SPICE_DIR.*--exclude spice,spider"):
        quality.spice(["a dog"], [["a dog"]])
    with pytest.raises(RuntimeError, match="lacks stanford-corenlp-3.6.0.jar"):
        quality.spice(["a dog"], [["a dog"]], spice_dir=str(tmp_path))
    for jar in quality.CORENLP_JARS:
        (tmp_path / jar).write_bytes(b"")
    monkeypatch.setenv(quality.SPICE_ENV, str(tmp_path))
    with pytest.raises(RuntimeError, match="Java 17, which has no JavaScript engine"):  # this machine's Java
        quality.spice_command()
    (tmp_path / "nashorn-core-15.4.jar").write_bytes(b"")
    command = quality.spice_command()
    assert command[-1] == "edu.anu.spice.SpiceScorer" and str(tmp_path / quality.CORENLP_JARS[0]) in command[3]
    monkeypatch.delenv(quality.SPICE_ENV)
    for asked in ("spice", "bleu1,spider"):  # named (not brought by a preset): an error, not a silent omission
        with pytest.raises(RuntimeError, match="SPICE is not set up"):
            evaluate_candidates([["a dog"], ["a cat"]], [["a dog"], ["a cat"]], metrics=asked)


def test_spice_output_parsing_and_spider():
    results = json.loads('[{"image_id": 1, "scores": {"All": {"f": 0.25, "pr": 0.5, "re": 0.1}}},'
                         ' {"image_id": 0, "scores": {"All": {"f": 0.5, "pr": 0.5, "re": 0.5}}},'
                         ' {"image_id": 2, "scores": {"All": {"f": "NaN", "pr": "NaN", "re": "NaN"}}}]')
    with pytest.warns(UserWarning, match="undefined for 1 captions"):
        assert quality.parse_spice_output(results, 3) == pytest.approx([0.5, 0.25, 0.0])
    with pytest.raises(RuntimeError, match="2 scores for 3"):
        quality.parse_spice_output(results[:2], 3)


def test_missing_java_is_a_clear_error(monkeypatch):
    monkeypatch.setattr("shutil.which", lambda _: None)
    with pytest.raises(RuntimeError, match="no `java` is on PATH"):
        meteor(["a dog"], [["a dog"]])
    with pytest.raises(RuntimeError, match="no `java` is on PATH"):
        ptb_tokenize(["a dog"])


def test_bad_input_says_what_to_change():
    with pytest.raises(ValueError, match="2 candidates but 1 reference lists"):
        bleu(["a", "b"], [["a"]])
    with pytest.raises(ValueError, match="item 0 has no reference"):
        bleu(["a"], [[]])
    with pytest.raises(TypeError, match=r"candidates\[0\] must be a string"):
        bleu([None], [["a"]])
    with pytest.raises(ValueError, match="same number K of candidates"):
        candidate_scores(bleu, [["a", "b"], ["c"]], [["a"], ["c"]])


def test_the_ptb_tokenizer_leaves_no_line_on_stderr(capfd):
    """The jar reports "PTBTokenizer tokenized N tokens at ..." on stderr at every call; `evaluate` shows none."""
    assert ptb_tokenize(["A cat, on the mat."]) == ["a cat on the mat"]
    assert "PTBTokenizer" not in capfd.readouterr().err
