"""The output verdict (issue 64): what K hypotheses' answers say, from plain strings, without torch."""

import subprocess
import sys

import pytest

from loramcl.analysis.outputs import COPY, MIN_EXAMPLES_PER_HYPOTHESIS, NEAR, NO_VERDICT, _chrf, output_verdict

REFERENCES = [["bonjour le monde", "hallo welt"], ["merci beaucoup", "danke sehr"], ["au revoir", "auf wiedersehen"]]
MODES = [["fr", "de"]] * 3


def test_identical_answers_write_the_same_and_say_what_to_try():
    found = output_verdict([["The cat.", "the cat", "cat"], ["a dog", "dog", "Dog!"]])
    assert found.kind == "write the same" and found.distinct == 1.0 and found.same_rate == 1.0
    assert found.line.startswith("outputs: the hypotheses write the same") and "Try:" in found.line
    assert "--mcl.shared_r" in found.line and "--mcl.balance bias" in found.line and "--mcl.split_after" in found.line
    assert output_verdict([["a", "a"]], remedies="Try: something else.").line.endswith("Try: something else.")


def test_different_answers_differ():
    found = output_verdict([["cat", "dog", "bird"], ["red", "red", "blue"]])
    assert found.kind == "differ" and "Try:" not in found.line
    assert found.distinct == pytest.approx(2.5)  # 3 and 2 distinct answers
    assert found.same_rate == pytest.approx((0 + 1 / 3) / 2)  # one pair of three agrees on the second prompt


def test_without_references_there_is_no_quality():
    found = output_verdict([["cat", "dog"]])
    assert found.quality is found.best_of_k is found.mean_over_k is found.exact_best_of_k is None
    assert set(found.to_dict()) == {"kind", "line", "prompts", "hypotheses", "distinct", "same_rate"}


def test_best_of_k_is_at_least_the_mean_over_k():
    answers = [["bonjour monde", "hallo"], ["merci", "danke sehr"], ["au revoir", "tschüss"]]
    found = output_verdict(answers, REFERENCES)
    assert found.quality == "chrf" and found.best_of_k >= found.mean_over_k > 0
    assert found.exact_best_of_k == pytest.approx(2 / 3)  # "danke sehr", "au revoir"
    assert found.exact_mean_over_k == pytest.approx(2 / 6)
    assert output_verdict([["x", "x"]], [["x"]]).best_of_k == 100.0  # chrF of the reference itself


def test_hypotheses_that_each_write_a_mode_split_by_mode():
    answers = [["bonjour monde", "hallo die welt"], ["merci", "danke"], ["revoir", "wiedersehen"]]
    found = output_verdict(answers, REFERENCES, MODES)
    assert found.kind == "split by mode" and found.majority == ["fr", "de"] and found.purity == [1.0, 1.0]
    assert found.modes == ["de", "fr"] and found.mode_table == [[0, 3], [3, 0]]
    assert found.line.startswith("outputs: split by mode: h0 writes fr (100%), h1 writes de (100%)")


MESSAGES = [("Open the file", "Ouvrir le fichier"), ("Save the document", "Enregistrer le document"),
            ("Close the window", "Fermer la fenêtre"), ("Connection failed", "La connexion a échoué"),
            ("Delete this message", "Supprimer ce message"), ("Print the page", "Imprimer la page"),
            ("Show hidden files", "Afficher les fichiers cachés"), ("Unable to read the file", "Impossible de lire le "
            "fichier"), ("New folder", "Nouveau dossier"), ("Search the web", "Rechercher sur le web")]


def test_a_far_answer_has_the_mode_its_references_resemble_not_its_closest_references():
    """Spoken translation's French hypothesis writes French that misses the message, often closer by chrF to the
    English transcript (names, shared characters) than to the French reference: its mode is the one whose references
    it resembles (a character n-gram classifier fit on the references), its closest reference's only when near."""
    wrong_french = ["Des fenêtres sans nom", "Les documents sont ouverts", "Ce dossier est caché",
                    "Le chat est sur la table", "Le chat est sur la table"]
    answers = [[en, wrong_french[i] if i < len(wrong_french) else fr] for i, (en, fr) in enumerate(MESSAGES)]
    for (en, fr), wrong in zip(MESSAGES, wrong_french):
        assert _chrf(wrong, fr) < _chrf(wrong, en) < NEAR  # by the closest reference alone: English
    found = output_verdict(answers, [list(m) for m in MESSAGES], [["en", "fr"]] * len(MESSAGES))
    assert found.kind == "split by mode" and found.majority == ["en", "fr"] and found.purity == [1.0, 1.0]
    one_mode = output_verdict(answers, [[en] for en, _ in MESSAGES], [["en"]] * len(MESSAGES))  # no classifier
    assert one_mode.mode_table == [[10], [10]]  # every answer shares a character n-gram with its one reference
    assert output_verdict([["", "x"]], [["x", "y"]], [["a", "b"]]).mode_table == [[0, 0, 1], [1, 0, 0]]  # empty

    class Always:  # a classifier given: it names the mode of every far answer, near ones keep their reference's
        def predict(self, texts):
            return ["other"] * len(texts)

    given = output_verdict(answers, [list(m) for m in MESSAGES], [["en", "fr"]] * len(MESSAGES), classifier=Always())
    assert given.modes == ["en", "fr", "other"] and given.mode_table == [[10, 0, 0], [0, 5, 5]]


def test_a_collapsed_run_writing_one_mode_is_no_split():
    """Every hypothesis writes French: pure (purity 1), but no hypothesis owns German."""
    answers = [["bonjour monde", "le monde"], ["merci", "merci bien"], ["revoir", "au revoir"]]
    found = output_verdict(answers, REFERENCES, MODES)
    assert found.kind == "differ" and found.majority == ["fr", "fr"] and found.purity == [1.0, 1.0]
    assert "not split by mode" in found.line
    mixed = [["bonjour monde", "le monde"], ["danke", "danke sehr"], ["revoir", "wiedersehen"]]  # each writes both
    assert output_verdict(mixed, REFERENCES, MODES).kind != "split by mode"


def test_no_verdict_before_the_minimum_of_examples():
    answers = [["bonjour monde", "hallo die welt"], ["merci", "danke"], ["revoir", "wiedersehen"]]
    found = output_verdict(answers, REFERENCES, MODES, examples_seen=8)
    minimum = 2 * MIN_EXAMPLES_PER_HYPOTHESIS
    assert found.kind == NO_VERDICT and found.reason.startswith(f"8 training examples seen, fewer than {minimum}")
    assert found.line.startswith(f"outputs: no verdict: 8 training examples seen, fewer than {minimum}")
    assert found.distinct == 2.0 and found.purity == [1.0, 1.0]  # the numbers are still given
    assert output_verdict(answers, REFERENCES, MODES, examples_seen=minimum).kind == "split by mode"
    assert output_verdict(answers, examples_seen=10, min_examples=10).kind == "differ"


def test_one_hypothesis_or_no_prompt_gives_no_verdict():
    assert output_verdict([["a"], ["b"]]).to_dict() == {
        "kind": NO_VERDICT, "line": "outputs: no verdict: one hypothesis (K = 1), nothing to compare.", "prompts": 2,
        "hypotheses": 1, "reason": "one hypothesis (K = 1), nothing to compare"}
    assert output_verdict([]).reason == "no prompt was decoded"


@pytest.mark.parametrize("answers, references, modes, message", [
    ([["a", "b"], ["c"]], None, None, r"answers\[1\] must hold 2 strings"),
    ([["a", "b"]], [["a"], ["b"]], None, "references must have one list per prompt"),
    ([["a", "b"]], [[]], None, r"references\[0\] must be a non-empty list"),
    ([["a", "b"]], [["a", "b"]], [["fr"]], r"modes\[0\] must name the mode of each of the 2 references"),
    ([["a", "b"]], None, [["fr"]], "give the references too"),
])
def test_bad_input_says_what_to_change(answers, references, modes, message):
    with pytest.raises(ValueError, match=message):
        output_verdict(answers, references, modes)


def test_it_needs_no_torch():
    code = ("import sys; from loramcl.analysis.outputs import output_verdict; "
            "output_verdict([['a', 'b']], [['a']], [['x']]); assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_answers_that_copy_their_prompt_own_no_mode():
    """The defaults study's hypotheses mostly copied the English source after 60 steps; chrF alone calls a copy the
    closest language. With the prompts, a copy is the mode "prompt", and no
    hypothesis owns a language by copying; a right answer found in the prompt is no copy."""
    references, modes = [["ENCODAGE", "KODIERUNG"], ["CHAÎNE", "ZEICHENKETTE"]], [["fr", "de"]] * 2
    answers = [["ENCODING", "KODIERUNG"], ["STRING", "ZEICHENKETTE"]]
    prompts = ["Translate: ENCODING\n", "Translate: STRING\n"]
    assert COPY not in output_verdict(answers, references, modes).majority  # a copy is a language to chrF
    found = output_verdict(answers, references, modes, prompts=prompts)
    assert found.copy_rate == 0.5 and found.majority == [COPY, "de"] and found.kind == "differ"
    assert found.modes == ["de", "fr", COPY] and found.mode_table == [[0, 0, 2], [2, 0, 0]]
    assert "50% of the answers copy their prompt" in found.line and "h0 prompt (100%)" in found.line
    assert output_verdict([["Paris", "Lyon"]], [["Paris"]], prompts=["Paris or Lyon?"]).copy_rate == 0.5
    assert output_verdict([["the cat", "dog"]], prompts=["Is the cat here?"]).copy_rate == 0.5  # no references
    with pytest.raises(ValueError, match="prompts must hold one string per prompt"):
        output_verdict([["a", "b"]], prompts=["p", "q"])
