"""Short answers: exact match, the mean over the K candidates beside the oracle, distinct candidates, --dedupe and the
winning-hypothesis table's wins, ties and items no candidate scored; all against values computed by hand."""

import json

import numpy as np
import pytest

from loramcl.metrics import evaluate_candidates, markdown_report, oracle, win_rate_table, win_rates
from loramcl.metrics.oracle import mean_over_candidates
from loramcl.metrics.short_answers import distinct_candidates, exact_match, first_occurrences, normalise_answer

# item 0: two spellings of one right answer and a wrong one; item 1: "the Bank" is "bank" again, "money" is right;
# item 2: nothing right; item 3: three different right answers.
CANDIDATES = [["Deposit", "deposit.", "depositing"], ["bank", "the Bank", "money"], ["x", "y", "z"],
              ["cash", "Money!", "funds"]]
REFERENCES = [["deposit", "lodge"], ["money"], ["w"], ["money", "cash", "funds"]]


def test_normalisation_is_squads():
    assert normalise_answer("  The Deposit. ") == "deposit"
    assert normalise_answer("An   apple, a pear!") == "apple pear"
    assert normalise_answer("l'État «déposé»") == "létat déposé"  # Unicode punctuation too, letters kept
    assert normalise_answer("theme") == "theme"  # articles only as whole words
    assert normalise_answer("depositing") != normalise_answer("deposit")


def test_exact_match_oracle_mean_and_distinct_by_hand():
    scores = np.stack([exact_match([c[k] for c in CANDIDATES], REFERENCES)["exact_match"] for k in range(3)], axis=1)
    assert scores.tolist() == [[1, 1, 0], [0, 0, 1], [0, 0, 0], [1, 1, 1]]
    assert oracle(scores) == pytest.approx((1 + 1 + 0 + 1) / 4)
    assert mean_over_candidates(scores) == pytest.approx((2 / 3 + 1 / 3 + 0 + 1) / 4)
    assert first_occurrences(CANDIDATES).tolist() == [[True, False, True], [True, False, True], [True] * 3, [True] * 3]
    assert distinct_candidates(CANDIDATES) == pytest.approx((2 + 2 + 3 + 3) / 4)
    # each text once: item 0 keeps Deposit, depositing (1/2), item 1 keeps bank, money (1/2)
    assert mean_over_candidates(scores, first_occurrences(CANDIDATES)) == pytest.approx((1 / 2 + 1 / 2 + 0 + 1) / 4)


def test_evaluate_candidates_reports_mean_over_k_beside_every_oracle_and_dedupes():
    report = evaluate_candidates(CANDIDATES, REFERENCES, metrics="exact_match,chrf,distinct")
    assert report["metrics"]["exact_match"] == pytest.approx(0.75)
    assert report["mean_over_candidates"]["exact_match"] == pytest.approx(0.5)
    assert set(report["mean_over_candidates"]) == {"exact_match", "chrf"}  # the oracle metrics, each
    assert report["metrics"]["distinct"] == pytest.approx(2.5)
    table = markdown_report(report)
    assert "| exact_match | 0.75 | 0.5 | ↑ |" in table

    deduped = evaluate_candidates(CANDIDATES, REFERENCES, metrics="exact_match,distinct", dedupe=True)
    assert deduped["metrics"]["exact_match"] == pytest.approx(0.75)  # duplicates never change the best of K
    assert deduped["mean_over_candidates"]["exact_match"] == pytest.approx((1 / 2 + 1 / 2 + 0 + 1) / 4)
    assert "each candidate text counted once per item (10 of the 12" in markdown_report(deduped)
    # a generate --dedupe file: fewer candidates where fewer distinct ones were found
    short = [["deposit", "depositing"], ["money"], ["x", "y", "z"], ["cash", "money", "funds"]]
    report = evaluate_candidates(short, REFERENCES, metrics="exact_match", dedupe=True)
    assert report["mean_over_candidates"]["exact_match"] == pytest.approx((1 / 2 + 1 + 0 + 1) / 4)
    with pytest.raises(ValueError, match="evaluate it with --dedupe true"):
        evaluate_candidates(short, REFERENCES, metrics="exact_match")
    with pytest.raises(ValueError, match="div2 compare the K candidates as decoded"):
        evaluate_candidates(CANDIDATES, REFERENCES, metrics="exact_match,div2", dedupe=True)


def test_the_win_table_separates_wins_ties_and_items_no_candidate_scored():
    scores = np.array([[1.0, 0.0, 0.0],   # h0 wins
                       [0.0, 0.0, 0.0],   # no candidate scored
                       [0.0, 0.0, 0.0],   # no candidate scored
                       [1.0, 1.0, 0.0],   # tied
                       [0.0, 0.0, 1.0]])  # h2 wins
    out = win_rates(scores)
    assert out["win_rate"] == pytest.approx([0.8, 0.0, 0.2])  # ties to the lowest k, as the loss counts them
    assert out["won"] == pytest.approx([0.2, 0.0, 0.2])
    assert out["tied"] == pytest.approx(0.2) and out["none_scored"] == pytest.approx(0.4)
    table = win_rate_table(out, "exact_match")
    assert "| all | 5 | 20.0 | 0.0 | 20.0 | 20.0 | 40.0 |" in table and "h0" in table
    single = win_rate_table(out, "exact_match", positions="beam position")
    assert "| group | items | #0 | #1 | #2 | tied | no candidate scored |" in single
    assert "Winning beam position" in single
    # a duplicate left out cannot tie: [1, 1, 0] with the second a repeat of the first is a win of h0
    kept = np.array([[True, True, True]] * 3 + [[True, False, True]] + [[True, True, True]])
    assert win_rates(scores, kept=kept)["won"] == pytest.approx([0.4, 0.0, 0.2])


def test_evaluate_command_exact_match_with_dedupe(tmp_path, capsys):
    from loramcl.metrics.evaluate import evaluate

    preds, refs = tmp_path / "preds.jsonl", tmp_path / "refs.jsonl"
    preds.write_text("".join(json.dumps({"candidates": c}) + "\n" for c in CANDIDATES))  # no "hypotheses": a beam
    refs.write_text("".join(json.dumps({"prompt": "p", "completion": r}) + "\n" for r in REFERENCES))
    out = evaluate(str(preds), str(refs), metrics="exact_match,distinct", out=str(tmp_path / "eval"), dedupe=True)
    report = json.loads(open(out["json"]).read())
    assert report["metrics"] == pytest.approx({"exact_match": 0.75, "distinct": 2.5})
    assert report["mean_over_candidates"]["exact_match"] == pytest.approx(0.5)
    assert report["specialisation"]["positions"] == "beam position"
    items = [json.loads(line) for line in open(out["items"])]
    assert items[1]["counted"] == [True, False, True] and items[1]["winner"] == 2
    assert "Winning beam position" in capsys.readouterr().out
