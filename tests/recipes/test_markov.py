"""Markov mixtures (paper §3.3, App. C-D): theory values, sampling, chains files, the `loramcl markov` command."""

import itertools
import json
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from loramcl.recipes.markov.chains import MarkovMixture, preset_mixture, stationary_distribution, two_state
from loramcl.recipes.markov.experiment import learned_transitions, transition_error
from loramcl.recipes.markov.theory import (
    average_transition,
    bigram_cross_entropy,
    chain_posterior,
    conditional_entropy,
    entropy_rate,
    mixture_entropy,
    optimal_nll,
    sequence_log_likelihoods,
    theory,
)


def exact_mixture_entropy(mixture: MarkovMixture) -> float:
    """H(x_2..x_T | x_1) / (T-1) by enumerating every sequence (small V and T only)."""
    x = np.array(list(itertools.product(range(mixture.num_states), repeat=mixture.seq_len)))
    log_joint = (np.log(mixture.weights)[None, :] + np.log(mixture.stationary[:, x[:, 0]].T)
                 + sequence_log_likelihoods(mixture, x))  # [N, K]
    log_p = np.logaddexp.reduce(log_joint, axis=1)
    log_p_x1 = np.log((mixture.weights[:, None] * mixture.stationary).sum(0))[x[:, 0]]
    return float(-(np.exp(log_p) * (log_p - log_p_x1)).sum() / (mixture.seq_len - 1))


# ---- theory -------------------------------------------------------------------------------------------------


def test_stationary_distribution_of_two_state_chains_is_q_p_over_p_plus_q():
    for p, q in ((0.2, 0.9), (0.8, 0.25), (0.7, 0.8)):
        np.testing.assert_allclose(stationary_distribution(np.array(two_state(p, q))), [q / (p + q), p / (p + q)])


def test_entropy_rate_by_hand():
    assert entropy_rate(np.array(two_state(0.5, 0.5)), np.array([0.5, 0.5])) == pytest.approx(np.log(2))
    p, q = 0.2, 0.9
    pi = np.array([q, p]) / (p + q)
    h = lambda a: -(a * np.log(a) + (1 - a) * np.log(1 - a))  # noqa: E731
    assert entropy_rate(np.array(two_state(p, q)), pi) == pytest.approx(pi[0] * h(p) + pi[1] * h(q))
    assert entropy_rate(np.eye(3)[[1, 2, 0]], np.ones(3) / 3) == 0  # a deterministic cycle


def test_average_transition_is_the_posterior_weighted_rows_of_eq_7():
    mixture = preset_mixture("fig2")
    (p1, p2), (pi1, pi2) = mixture.chains, mixture.stationary
    expected = (pi1[:, None] * p1 + pi2[:, None] * p2) / (pi1 + pi2)[:, None]  # uniform weights: eq. 7
    np.testing.assert_allclose(average_transition(mixture), expected)
    weighted = MarkovMixture(mixture.chains, weights=[0.25, 0.75])
    expected = (0.25 * pi1[:, None] * p1 + 0.75 * pi2[:, None] * p2) / (0.25 * pi1 + 0.75 * pi2)[:, None]
    np.testing.assert_allclose(average_transition(weighted), expected)


@pytest.mark.parametrize("preset,upper,h_x,bigram", [("fig2", 0.5081, 0.5240, 0.6491),
                                                     ("fig6", 0.5535, 0.5736, 0.6484)])
def test_theory_matches_the_design_table(preset, upper, h_x, bigram):
    th = theory(preset_mixture(preset))
    assert round(th.mcl_upper, 4) == upper
    assert round(th.bigram_cross_entropy, 4) == bigram
    # DESIGN's H(x) is a plain Monte Carlo estimate; ours has a far smaller variance (both within 0.001)
    assert th.mle_optimum == pytest.approx(h_x, abs=1e-3)
    assert th.mcl_lower == pytest.approx(th.mle_optimum - np.log(2) / 31)
    assert th.mcl_lower <= th.mcl_upper <= th.mle_optimum <= th.bigram_cross_entropy


@pytest.mark.parametrize("chains,weights", [
    ([two_state(0.2, 0.9), two_state(0.8, 0.25)], None),
    ([two_state(0.7, 0.8), two_state(0.8, 0.25)], [0.3, 0.7]),
    ([[[0.1, 0.8, 0.1], [0.1, 0.1, 0.8], [0.8, 0.1, 0.1]], [[0.6, 0.2, 0.2], [0.3, 0.3, 0.4], [0.2, 0.5, 0.3]]], None),
])
def test_monte_carlo_h_x_matches_exact_enumeration(chains, weights):
    mixture = MarkovMixture(np.array(chains), weights=weights, seq_len=7)
    estimate, stderr = mixture_entropy(mixture, num_samples=50_000, seed=0)
    assert estimate == pytest.approx(exact_mixture_entropy(mixture), abs=max(4 * stderr, 2e-4))


def test_conditional_entropy_is_the_weighted_entropy_rates():
    mixture = MarkovMixture(preset_mixture("fig6").chains, weights=[0.2, 0.8])
    rates = [entropy_rate(p, pi) for p, pi in zip(mixture.chains, mixture.stationary, strict=True)]
    assert conditional_entropy(mixture) == pytest.approx(0.2 * rates[0] + 0.8 * rates[1])


def test_bigram_cross_entropy_equals_monte_carlo_of_predicting_p_bar():
    mixture = preset_mixture("fig6")
    x, _ = mixture.sample(20_000, seed=1)
    log_pbar = np.log(average_transition(mixture))
    empirical = -log_pbar[x[:, :-1], x[:, 1:]].mean()
    assert bigram_cross_entropy(mixture) == pytest.approx(empirical, abs=0.005)


# ---- sampling -----------------------------------------------------------------------------------------------


def test_samples_follow_the_chains_weights_and_stationary_start():
    mixture = MarkovMixture(np.array(preset_mixture("three").chains), weights=[0.2, 0.3, 0.5], seq_len=16)
    x, z = mixture.sample(30_000, seed=0)
    assert x.shape == (30_000, 16) and x.dtype == np.int64 and set(np.unique(x)) == {0, 1, 2}
    np.testing.assert_allclose(np.bincount(z) / len(z), mixture.weights, atol=0.01)
    for k in range(3):
        chain = x[z == k]
        np.testing.assert_allclose(np.bincount(chain[:, 0], minlength=3) / len(chain), mixture.stationary[k],
                                   atol=0.02)
        counts = np.zeros((3, 3))
        np.add.at(counts, (chain[:, :-1], chain[:, 1:]), 1)
        np.testing.assert_allclose(counts / counts.sum(1, keepdims=True), mixture.chains[k], atol=0.01)


def test_sampling_is_seeded():
    mixture = preset_mixture("fig2")
    np.testing.assert_array_equal(mixture.sample(50, 3)[0], mixture.sample(50, 3)[0])
    assert (mixture.sample(50, 3)[0] != mixture.sample(50, 4)[0]).any()


# ---- chains files -------------------------------------------------------------------------------------------


def write(tmp_path, spec) -> str:
    path = tmp_path / "chains.json"
    path.write_text(spec if isinstance(spec, str) else json.dumps(spec))
    return str(path)


def test_chains_file_round_trip(tmp_path):
    spec = {"chains": [two_state(0.1, 0.3), two_state(0.6, 0.6)], "weights": [0.4, 0.6], "seq_len": 12}
    mixture = MarkovMixture.from_json(write(tmp_path, spec))
    assert mixture.to_dict() == {**spec, "chains": np.array(spec["chains"]).tolist()}
    default = MarkovMixture.from_json(write(tmp_path, {"chains": spec["chains"]}))
    assert default.seq_len == 32 and default.weights.tolist() == [0.5, 0.5]


@pytest.mark.parametrize("spec,message", [
    ({"chains": [[[0.5, 0.6], [0.5, 0.5]]]}, "row 0 of chain 0 sums to 1.1"),
    ({"chains": [[[1.2, -0.2], [0.5, 0.5]]]}, "non-negative"),
    ({"chains": [[[0.5, 0.5, 0.0], [0.5, 0.5, 0.0]]]}, "square"),
    ({"chains": [[[0.5, 0.5], [0.5]]]}, "nested lists of numbers, all the same size"),
    ({"chains": [[["0.5", "0.5"], [0.5, 0.5]]]}, "numbers only (not text"),  # never coerced
    ({"chains": [two_state(0.1, 0.2)] * 2, "weights": ["0.5", "0.5"]}, "weights must hold numbers only"),
    ({"chains": [two_state(0.1, 0.2)] * 2, "weights": [float("nan"), 0.5]}, "positive numbers summing to 1"),
    ({"chains": [two_state(0.1, 0.2)], "seq_len": True}, "seq_len must be an integer"),
    ({"chains": [[[1.0]]]}, "at least 2 states"),
    ({"chains": [two_state(0.1, 0.2)], "weights": [0.5, 0.5]}, "one per chain"),
    ({"chains": [two_state(0.1, 0.2)] * 2, "weights": [0.7, 0.7]}, "summing to 1"),
    ({"chains": [two_state(0.1, 0.2)], "seq_len": 1}, "seq_len"),
    ({"chains": [[[1.0, 0.0], [0.0, 1.0]]]}, "reducible"),
    ({"matrices": []}, 'must hold an object {"chains"'),
    ({"chains": [two_state(0.1, 0.2)], "weight": [1.0]}, "unknown keys ['weight']"),
    ("{not json", "not valid JSON"),
])
def test_bad_chains_files_say_what_to_fix(tmp_path, spec, message):
    with pytest.raises(ValueError, match="chains file .*") as error:
        MarkovMixture.from_json(write(tmp_path, spec))
    assert message in str(error.value)


def test_a_chains_file_that_is_not_utf8_is_named_with_its_line(tmp_path):
    path = tmp_path / "chains.json"
    path.write_bytes('{"chains": [[[0.5, 0.5], [0.5, 0.5]]],\n "note": "caf\u00e9"}'.encode("latin-1"))
    with pytest.raises(ValueError, match=r"chains.json:2 is not UTF-8 text \(byte 0xe9 at column 14\)"):
        MarkovMixture.from_json(str(path))


@pytest.mark.parametrize("arguments, message", [
    ({"steps": 0}, "steps must be an integer >= 1, got 0"),
    ({"seeds": 0, "quick": True}, "seeds must be an integer >= 1, got 0"),  # used to run one seed and exit 0
    ({"learning_rate": float("nan")}, "learning_rate must be a finite number"),
    ({"chains": {"chains": [two_state(0.2, 0.9), two_state(0.8, 0.25)], "seq_len": 2000}},
     "seq_len 2000 is longer than the toy model's 1024 positions"),  # used to fail after the first minute
])
def test_markov_command_checks_its_arguments_before_training(tmp_path, arguments, message):
    from loramcl.recipes.markov.reproduce import markov

    if "chains" in arguments:
        arguments = {**arguments, "chains": write(tmp_path, arguments["chains"])}
    with pytest.raises(ValueError, match=message):
        markov(out=str(tmp_path / "out"), **arguments)
    assert not (tmp_path / "out").exists()


def test_missing_chains_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        MarkovMixture.from_json(tmp_path / "nope.json")


# ---- matching hypotheses to chains --------------------------------------------------------------------------


def test_transition_error_takes_the_best_permutation():
    chains = preset_mixture("three").chains
    learned = chains[[2, 0, 1]] + 0.01
    error, assignment = transition_error(learned, chains)
    assert error == pytest.approx(0.01) and assignment == [1, 2, 0]
    extra = np.concatenate([learned, np.full((1, 3, 3), 1 / 3)])  # a fourth hypothesis left unmatched
    assert transition_error(extra, chains) == (pytest.approx(0.01), [1, 2, 0])
    unseen = learned.copy()
    unseen[0, 1] = np.nan  # a hypothesis that never won a sequence passing through state 1
    assert transition_error(unseen, chains)[0] == 1.0
    with pytest.raises(ValueError, match="cannot be matched"):
        transition_error(learned[:2], chains)


def test_transition_error_equals_brute_force_over_permutations():
    rng = np.random.default_rng(0)
    for _ in range(100):
        k = int(rng.integers(1, 6))
        c, v = int(rng.integers(1, k + 1)), int(rng.integers(2, 4))
        learned, true = rng.random((k, v, v)), rng.random((c, v, v))
        brute = min(max(np.abs(learned[h] - true[i]).max() for i, h in enumerate(assignment))
                    for assignment in itertools.permutations(range(k), c))
        error, assignment = transition_error(learned, true)
        assert error == pytest.approx(min(brute, 1.0)) and len(set(assignment)) == c
        assert max(np.abs(learned[h] - true[i]).max() for i, h in enumerate(assignment)) == pytest.approx(error)


class ChainPredictors:
    """A stand-in MCL model whose hypothesis k predicts exactly P_k[x_t] at every position: [N, K, T, V] logits."""

    def __init__(self, chains: np.ndarray) -> None:
        self.log_chains = torch.log(torch.tensor(chains))  # [K, V, V]

    def eval(self):
        return self

    def __call__(self, input_ids):
        return SimpleNamespace(logits=self.log_chains[:, input_ids].permute(1, 0, 2, 3))  # [N, K, T, V]


def test_learned_transitions_average_each_hypothesis_by_current_state():
    mixture = preset_mixture("three")
    x, z = mixture.sample(2000, seed=0)
    won, everywhere = learned_transitions(ChainPredictors(mixture.chains), torch.from_numpy(x), 3)
    np.testing.assert_allclose(won, mixture.chains, atol=1e-12)  # a Markov predictor's rows, whatever the context
    np.testing.assert_allclose(everywhere, mixture.chains, atol=1e-12)
    # hypotheses predicting the other chains' rows: each wins the sequences of the chain it predicts
    swapped = ChainPredictors(mixture.chains[[1, 2, 0]])
    won, _ = learned_transitions(swapped, torch.from_numpy(x), 3)
    np.testing.assert_allclose(won, mixture.chains[[1, 2, 0]], atol=1e-12)
    assert transition_error(won, mixture.chains) == (pytest.approx(0.0, abs=1e-12), [2, 0, 1])


def test_learned_transitions_leave_unseen_states_empty():
    chains = np.array([[[0.9, 0.1], [0.5, 0.5]], [[0.5, 0.5], [0.1, 0.9]]])
    x = torch.zeros(4, 6, dtype=torch.long)  # only state 0: hypothesis 0 (0.9 on staying) wins everything
    won, everywhere = learned_transitions(ChainPredictors(chains), x, 2)
    assert np.isnan(won[1]).all() and np.isnan(won[0][1]).all()  # hypothesis 1 won nothing; state 1 never seen
    np.testing.assert_allclose(won[0][0], [0.9, 0.1])
    assert transition_error(won, chains)[0] == 1.0


def test_learned_transitions_copy_to_the_host_before_numpy(monkeypatch):
    """``.numpy()`` of a CUDA tensor raises: every array the function returns must come through ``.cpu()`` (a no-op
    here, on the CPU, which the check records)."""
    copied, cpu, numpy = set(), torch.Tensor.cpu, torch.Tensor.numpy

    def tracked_cpu(self, *args, **kwargs):
        result = cpu(self, *args, **kwargs)
        copied.add(id(result))
        return result

    def host_only_numpy(self, *args, **kwargs):
        assert id(self) in copied, "numpy() of a tensor that was not copied to the host (fails on a GPU)"
        return numpy(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "cpu", tracked_cpu)
    monkeypatch.setattr(torch.Tensor, "numpy", host_only_numpy)
    chains = np.array([[[0.9, 0.1], [0.5, 0.5]], [[0.5, 0.5], [0.1, 0.9]]])
    won, _ = learned_transitions(ChainPredictors(chains), torch.zeros(4, 6, dtype=torch.long), 2)
    np.testing.assert_allclose(won[0][0], [0.9, 0.1])


# ---- the command --------------------------------------------------------------------------------------------


def test_quick_markov_command_writes_its_outputs_and_separates_mcl_from_mle(tmp_path):
    command = [sys.executable, "-m", "loramcl.cli", "markov", "--quick", "true", "--out", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"Wrote {tmp_path}/report.json" in result.stdout
    report = json.loads((tmp_path / "report.json").read_text())
    for key in ("mle_optimum", "mcl_lower", "mcl_upper", "mle_final_loss", "mcl_final_loss", "mcl_transition_error",
                "mle_transition_error_vs_pbar", "settings"):
        assert key in report, key
    assert report["mcl_final_loss"] < report["mle_final_loss"] - 0.005
    assert report["runs"][0]["trainable_parameters"] == report["runs"][1]["trainable_parameters"] == 65_536
    assert report["runs"][0]["total_parameters"] == 230_912
    assert (tmp_path / "figure.png").stat().st_size > 10_000
    assert "LoRA-MCL" in (tmp_path / "report.md").read_text()


def test_chain_posterior_and_the_optimal_loss_of_a_sample():
    mixture = preset_mixture("fig2-weighted")
    posterior = chain_posterior(mixture)  # [V, K] = w_k pi_k(v) / sum_j w_j pi_j(v)
    pi1, pi2 = np.array([0.9, 0.2]) / 1.1, np.array([0.25, 0.8]) / 1.05  # stationary (q, p) / (p + q)
    expected = np.stack([0.7 * pi1, 0.3 * pi2], axis=1)
    np.testing.assert_allclose(posterior, expected / expected.sum(axis=1, keepdims=True), rtol=1e-12)
    x, _ = mixture.sample(200_000, 5)
    assert optimal_nll(mixture, x) == pytest.approx(theory(mixture).mle_optimum, abs=1e-3)  # its expectation: H(x)


@pytest.mark.slow  # 3 x 500 steps: about 22 minutes on a shared 2-core CPU (docs/guide/scores.md has the measurement)
def test_random_ties_keep_vanilla_wta_on_three_chains(tmp_path):
    from loramcl.recipes.markov.reproduce import markov

    report = markov(out=str(tmp_path), preset="three", loss="wta", tie_break="random", skip_mle=True, threads=1)
    assert report["checks"]["mcl_recovers_chains"] and report["checks"]["mcl_in_band"]  # on every seed (worst)


def test_quick_scores_recover_the_chain_posterior_and_a_density_as_good_as_mle(tmp_path):
    from loramcl.recipes.markov.reproduce import markov

    report = markov(out=str(tmp_path), preset="scores", quick=True, skip_mle=True, threads=1)
    assert report["checks"]["scores_recover_posterior"] and report["mcl_score_error"] < 0.05
    assert report["checks"]["mixture_as_good_as_mle"]  # within 0.005 of the true mixture's loss on these sequences
    assert report["checks"]["mcl_in_band"]  # the oracle loss still in the MCL band
    assert "p(z\\|x_1)" in (tmp_path / "report.md").read_text()


def test_markov_command_rejects_a_bad_chains_file(tmp_path):
    path = write(tmp_path, {"chains": [[[0.5, 0.6], [0.5, 0.5]]]})
    command = [sys.executable, "-m", "loramcl.cli", "markov", "--chains", path, "--out", str(tmp_path / "out")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "row 0 of chain 0 sums to 1.1" in result.stderr


def test_cli_help_lists_the_commands():
    result = subprocess.run([sys.executable, "-m", "loramcl.cli", "--help"], capture_output=True, text=True)
    assert result.returncode == 0
    for command in ("markov", "generate", "evaluate", "plot-tradeoff"):
        assert command in result.stdout
