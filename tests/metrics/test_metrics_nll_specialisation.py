"""Oracle NLL / perplexity (paper App. E.1) and the per-hypothesis win-rate tables."""

import math

import numpy as np
import pytest
import torch

from loramcl.metrics import likelihood_wins, oracle, oracle_nll, win_rate_table, win_rates, winners


def test_oracle_nll_is_the_mean_over_references_of_the_best_hypothesis():
    nll = np.array([[2.0, 1.0], [0.5, 3.0], [1.5, 1.5]])  # 3 references, K = 2
    out = oracle_nll(nll)
    assert out["oracle_nll"] == pytest.approx((1.0 + 0.5 + 1.5) / 3)
    assert out["oracle_ppl"] == pytest.approx(math.exp(1.0))
    assert out["hypothesis_nll"] == pytest.approx([4 / 3, 11 / 6])
    assert out["hypothesis_ppl"] == pytest.approx([math.exp(4 / 3), math.exp(11 / 6)])
    assert out["win_rate"] == pytest.approx([2 / 3, 1 / 3])  # the tie goes to h0


def test_oracle_nll_inputs_per_item_and_torch():
    per_item = [np.array([[2.0, 1.0]]), np.array([[0.5, 3.0], [1.5, 1.5]])]  # R_1 = 1, R_2 = 2
    assert oracle_nll(per_item)["oracle_nll"] == pytest.approx(1.0)
    tensor = torch.tensor([[2.0, 1.0], [0.5, 3.0]], requires_grad=True)  # as MCLModel(...).nll gives it
    assert oracle_nll(tensor)["oracle_nll"] == pytest.approx(0.75)
    # K = 1: the plain test NLL / perplexity of LoRA-MLE
    single = oracle_nll([[2.0], [1.0]])
    assert single["oracle_nll"] == pytest.approx(1.5) and single["oracle_ppl"] == pytest.approx(math.exp(1.5))


def test_oracle_nll_bad_input():
    with pytest.raises(ValueError, match="num_references, K"):
        oracle_nll(np.zeros(3))
    with pytest.raises(ValueError, match="NaN or infinite"):
        oracle_nll([[1.0, float("nan")]])
    with pytest.raises(ValueError, match="K columns"):
        oracle_nll([np.zeros((1, 2)), np.zeros((1, 3))])
    with pytest.raises(ValueError, match="negative entries"):
        oracle_nll([[1.0, -0.5]])  # log-likelihoods given instead of NLLs would change the oracle in silence


def test_oracle_reduction_and_winners():
    scores = np.array([[0.1, 0.9, 0.5], [0.7, 0.7, 0.2]])
    assert oracle(scores) == pytest.approx(0.8)
    assert oracle(scores, higher_is_better=False) == pytest.approx(0.15)
    assert winners(scores).tolist() == [1, 0]  # tie -> lowest k
    assert oracle({"m": scores[:, :1]}) == {"m": pytest.approx(0.4)}  # K = 1: the plain mean
    with pytest.raises(ValueError, match="NaN"):
        oracle(np.array([[np.nan, 1.0]]))


def test_likelihood_wins_give_each_reference_to_its_most_likely_hypothesis():
    """The paper's winner (Table 7): the hypothesis with the lowest NLL of the reference, each reference counted."""
    nll = [np.array([[0.4, 2.0], [3.0, 0.2]]),  # item 0: a French reference won by h0, a German one by h1
           np.array([[1.0, 0.9], [2.0, 2.0], [0.1, 0.3]])]  # item 1: French -> h1, German (tie) -> h0, French -> h0
    groups = [["fr", "de"], ["fr", "de", "fr"]]
    out = likelihood_wins(nll, groups)
    assert out["num_items"] == 5 and out["tie_rate"] == pytest.approx(0.2)
    assert out["by_group"]["fr"]["win_rate"] == pytest.approx([2 / 3, 1 / 3])
    assert out["by_group"]["de"]["win_rate"] == pytest.approx([0.5, 0.5])
    assert out["win_rate"] == pytest.approx([0.6, 0.4])
    assert "by_group" not in likelihood_wins(nll) and oracle_nll(np.concatenate(nll))["win_rate"] == out["win_rate"]


def test_win_rates_per_group():
    scores = np.array([[0.9, 0.1], [0.8, 0.2], [0.3, 0.6], [0.1, 0.7], [0.5, 0.5]])
    groups = ["fr", "fr", "en", "en", "en"]
    out = win_rates(scores, groups)
    assert out["win_rate"] == pytest.approx([0.6, 0.4])
    assert out["tie_rate"] == pytest.approx(0.2)
    assert out["by_group"]["fr"] == {"win_rate": [1.0, 0.0], "won": [1.0, 0.0], "tied": 0.0, "none_scored": 0.0,
                                     "num_items": 2}
    assert out["by_group"]["en"]["win_rate"] == pytest.approx([1 / 3, 2 / 3])
    table = win_rate_table(out, "cider_d")
    assert "| fr | 2 | 100.0 | 0.0 |" in table and "| all | 5 | 40.0 | 40.0 | 20.0 | 0.0 |" in table  # the tie apart
    assert win_rates(-scores, higher_is_better=False)["win_rate"] == out["win_rate"]
    with pytest.raises(ValueError, match="one label per item"):
        win_rates(scores, ["fr"])
