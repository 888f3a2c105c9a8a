"""The three WTA losses (paper eq. 2, 4, 5) and their reductions."""

import math

import pytest
import torch

from loramcl import MCLConfig, annealed_weights, mcl_loss, relaxed_weights, temperature_at, wta_weights
from loramcl.mcl.losses import weighted_nll, winners


def _nll(batch=6, k=3, scale=5.0, seed=0):
    return torch.rand(batch, k, generator=torch.Generator().manual_seed(seed)) * scale


def test_wta_is_the_mean_of_the_per_example_minimum_and_ties_go_to_the_lowest_k():
    nll = torch.tensor([[3.0, 1.0, 2.0], [0.5, 0.5, 0.7], [4.0, 4.0, 4.0]])
    loss, weights = mcl_loss(nll, MCLConfig(num_hypotheses=3, loss="wta", tie_break="lowest"))  # the paper's rule
    assert weights.tolist() == [[0, 1, 0], [1, 0, 0], [1, 0, 0]]
    assert loss.item() == pytest.approx((1.0 + 0.5 + 4.0) / 3)


def test_relaxed_weights_follow_eq4():
    nll = _nll(k=4)
    weights = relaxed_weights(nll, epsilon=0.3)
    winners = nll.argmin(dim=1)
    assert torch.allclose(weights.sum(dim=1), torch.ones(6))
    assert torch.allclose(weights[torch.arange(6), winners], torch.full((6,), 0.7))
    others = weights.clone()
    others[torch.arange(6), winners] = float("nan")
    assert torch.allclose(others[~others.isnan()], torch.full((18,), 0.1))


def test_epsilon_auto_is_the_measured_value_for_relaxed_wta_and_none_otherwise():
    """epsilon 'auto' (`loramcl train`'s default, issue 53): AUTO_EPSILON under relaxed WTA with K >= 2, the same
    loss as that number given; 0 under another loss or with one hypothesis, so the command's default leaves
    `--mcl.loss wta` and K = 1 valid; a number keeps being checked against the loss."""
    from loramcl.mcl.config import AUTO_EPSILON

    nll = _nll(k=3)
    auto = MCLConfig(num_hypotheses=3, loss="relaxed", epsilon="auto")
    given = MCLConfig(num_hypotheses=3, loss="relaxed", epsilon=AUTO_EPSILON)
    assert auto.relaxed_epsilon == AUTO_EPSILON == 0.05
    assert torch.equal(mcl_loss(nll, auto)[1], mcl_loss(nll, given)[1])
    assert MCLConfig(num_hypotheses=1, loss="relaxed", epsilon="auto").relaxed_epsilon == 0.0
    assert MCLConfig(loss="wta", epsilon="auto").relaxed_epsilon == 0.0
    assert MCLConfig(loss="annealed", epsilon="auto").relaxed_epsilon == 0.0
    with pytest.raises(ValueError, match="is relaxed WTA's weight, and loss is 'wta'"):
        MCLConfig(loss="wta", epsilon=0.05)
    with pytest.raises(ValueError, match="epsilon must be in"):
        MCLConfig(num_hypotheses=1, loss="relaxed", epsilon=0.05)
    assert MCLConfig.from_dict(auto.to_dict()) == auto  # saved and read back as 'auto'


def test_relaxed_with_zero_epsilon_equals_wta():
    """Against weights written by hand (not built from wta_weights): eq. 4 at epsilon = 0 puts all the weight on the
    winner, ties to the lowest k (the paper's rule), and the loss and its gradient are the winners' NLL alone."""
    nll = torch.tensor([[3.0, 1.0, 2.0],
                        [0.5, 0.5, 0.7],   # a tie between hypotheses 0 and 1
                        [4.0, 4.0, 4.0],   # all tied
                        [2.0, 3.0, 0.25]], requires_grad=True)
    by_hand = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    config = dict(num_hypotheses=3, tie_break="lowest")
    wta, wta_q = mcl_loss(nll, MCLConfig(loss="wta", **config))
    relaxed, weights = mcl_loss(nll, MCLConfig(loss="relaxed", epsilon=0.0, **config))
    assert torch.equal(weights, by_hand) and torch.equal(wta_q, by_hand)
    assert relaxed.item() == wta.item() == pytest.approx((1.0 + 0.5 + 4.0 + 0.25) / 4)
    (grad_wta,) = torch.autograd.grad(wta, nll)
    (grad_relaxed,) = torch.autograd.grad(relaxed, nll)
    assert torch.equal(grad_relaxed, by_hand / 4) and torch.equal(grad_wta, by_hand / 4)


def test_the_gradient_reaches_each_hypothesis_with_its_weight():
    nll = _nll().requires_grad_()
    loss, weights = mcl_loss(nll, MCLConfig(num_hypotheses=3, loss="relaxed", epsilon=0.2))
    (grad,) = torch.autograd.grad(loss, nll)
    torch.testing.assert_close(grad, weights / nll.shape[0])  # q is detached: no gradient through the assignment


@pytest.mark.parametrize("temperature", [1e-4, 1e-6, 1e-8])
def test_annealed_at_tiny_temperature_equals_wta_and_stays_finite(temperature):
    nll = torch.tensor([[1e3, 999.0, 1e3], [0.0, 1e3, 5.0], [3.0, 1e-3, 2.0], [7.0, 7.0 + 1e-2, 1e3]])
    weights = annealed_weights(nll, temperature)
    assert torch.isfinite(weights).all()
    torch.testing.assert_close(weights, wta_weights(nll), atol=1e-12, rtol=0)
    config = MCLConfig(num_hypotheses=3, loss="annealed", temperature0=temperature, temperature_decay=0.999,
                       temperature_min=0.0)
    loss, _ = mcl_loss(nll.clone().requires_grad_(), config)
    assert torch.isfinite(loss) and loss.item() == pytest.approx(nll.min(dim=1).values.mean().item())


@pytest.mark.parametrize("loss", ["wta", "relaxed", "annealed"])
@pytest.mark.parametrize("bad_row", [[float("nan"), 2.0, 3.0], [float("inf")] * 3, [1.0, float("inf"), 3.0],
                                     [1.0, 2.0, -float("inf")]])
def test_any_non_finite_nll_makes_every_loss_non_finite(loss, bad_row):
    # A finite loss here would let MCLTrainer train on (and checkpoint) a broken hypothesis: its guard sees the loss.
    nll = torch.tensor([bad_row, [1.0, 2.0, 3.0]], requires_grad=True)
    config = MCLConfig(num_hypotheses=3, loss=loss, epsilon=0.1 if loss == "relaxed" else 0.0)
    value, _ = mcl_loss(nll, config, total_steps=100)
    assert not torch.isfinite(value)


def test_annealed_at_huge_temperature_is_the_uniform_mean():
    nll = _nll(k=5)
    config = MCLConfig(num_hypotheses=5, loss="annealed", temperature0=1e9, temperature_decay=0.999)
    loss, weights = mcl_loss(nll, config)
    torch.testing.assert_close(weights, torch.full_like(weights, 0.2))
    torch.testing.assert_close(loss, nll.mean())


def test_annealed_weights_are_the_normalised_powers_of_the_likelihoods():
    nll = _nll(k=3, scale=2.0)
    tau = 0.7
    powers = torch.exp(-nll.double()) ** (1 / tau)  # p_k^(1/tau), eq. 5
    torch.testing.assert_close(annealed_weights(nll, tau).double(), powers / powers.sum(dim=1, keepdim=True))


def test_temperature_schedule():
    config = MCLConfig(loss="annealed", temperature0=2.0, temperature_decay=0.999, temperature_min=1e-6)
    assert temperature_at(0, config) == 2.0
    assert temperature_at(1000, config) == pytest.approx(2.0 * 0.999**1000)
    # tau < tau_min from t > log(tau_min / tau0) / log(rho) on: hard WTA (None)
    switch = math.log(1e-6 / 2.0) / math.log(0.999)
    assert temperature_at(math.floor(switch), config) is not None
    assert temperature_at(math.ceil(switch), config) is None
    assert temperature_at(10**9, config) is None
    constant = MCLConfig(loss="annealed", temperature0=0.5, temperature_decay=1.0)
    assert temperature_at(10**9, constant) == 0.5


def test_annealed_loss_switches_to_wta_after_the_schedule():
    nll = _nll()
    config = MCLConfig(num_hypotheses=3, loss="annealed", temperature0=1.0, temperature_decay=0.5,
                       temperature_min=1e-3)
    _, early = mcl_loss(nll, config, step=0)
    _, late = mcl_loss(nll, config, step=20)
    assert not torch.equal(early, wta_weights(nll))
    assert torch.equal(late, wta_weights(nll))


def test_one_hypothesis_makes_every_loss_the_mean_nll():
    nll = _nll(k=1)
    for config in (MCLConfig(num_hypotheses=1, loss="wta"), MCLConfig(num_hypotheses=1, loss="relaxed"),
                   MCLConfig(num_hypotheses=1, loss="annealed")):
        loss, weights = mcl_loss(nll, config)
        assert torch.equal(weights, torch.ones_like(nll))
        torch.testing.assert_close(loss, nll.mean())


def test_random_ties_draw_nothing_with_one_hypothesis():
    """K = 1 (plain LoRA) trains to the bit whatever tie_break: no draw moves torch's RNG (dropout's masks)."""
    state = torch.get_rng_state()
    assert torch.equal(winners(torch.zeros(5, 1), "random"), torch.zeros(5, dtype=torch.long))
    assert torch.equal(torch.get_rng_state(), state)
    winners(torch.zeros(5, 2), "random")
    assert not torch.equal(torch.get_rng_state(), state)


def test_weighted_nll_and_shape_checks():
    nll = _nll()
    torch.testing.assert_close(weighted_nll(nll, torch.full_like(nll, 1 / 3)), nll.mean())
    with pytest.raises(ValueError, match=r"shape \[batch, K=2\]"):
        mcl_loss(nll, MCLConfig(num_hypotheses=2))


@pytest.mark.parametrize("steps", [1, 60, 1000])
def test_auto_decay_brings_tau_to_its_floor_at_the_stated_fraction_of_the_run(steps):
    from loramcl.mcl.losses import AUTO_FLOOR_FRACTION, floor_step, temperature_decay

    assert MCLConfig().temperature_decay == 0.999  # the paper's; `loramcl train`'s default is "auto"
    config = MCLConfig(num_hypotheses=3, loss="annealed", temperature0=2.0, temperature_min=1e-4,
                       temperature_decay="auto")
    floor = floor_step(steps)
    assert floor == max(1, math.ceil(AUTO_FLOOR_FRACTION * steps)) and floor <= steps
    rho = temperature_decay(config, steps)
    assert 2.0 * rho**floor == pytest.approx(1e-4, rel=1e-9)  # tau0 * rho^t reaches tau_min at the floor step
    assert temperature_at(0, config, steps) == 2.0
    assert temperature_at(floor - 1, config, steps) == pytest.approx(2.0 * rho ** (floor - 1))
    assert temperature_at(floor - 1, config, steps) > 1e-4
    assert temperature_at(floor, config, steps) is None and temperature_at(steps, config, steps) is None  # WTA


def test_the_papers_decay_is_kept_when_given_and_auto_needs_the_runs_length():
    from loramcl.mcl.losses import temperature_decay

    paper = MCLConfig(num_hypotheses=3, loss="annealed", temperature_decay=0.999)
    assert temperature_decay(paper, 60) == 0.999
    assert temperature_at(60, paper, 60) == pytest.approx(0.999**60)
    assert round(0.999**60, 2) == 0.94  # the short run never left the soft regime
    auto = MCLConfig(num_hypotheses=3, loss="annealed", temperature_decay="auto")
    with pytest.raises(ValueError, match="temperature_decay 'auto' sets rho from the run's number of optimizer steps"):
        mcl_loss(_nll(), auto)
    _, weights = mcl_loss(_nll(), auto, training=False)  # evaluation: the schedule's end, vanilla WTA
    assert torch.equal(weights, wta_weights(_nll(), "random"))
    with pytest.raises(ValueError, match="temperature_decay 'auto' brings tau to temperature_min, which is 0"):
        MCLConfig(loss="annealed", temperature_min=0.0, temperature_decay="auto")
    with pytest.raises(ValueError, match="'auto' fits it to the run's steps"):
        MCLConfig(loss="annealed", temperature_decay="fast")


def test_every_packaged_annealed_recipe_names_its_decay_and_the_papers_keep_0999():
    from pathlib import Path

    import yaml

    import loramcl.recipes

    decays = {}
    for path in Path(loramcl.recipes.__file__).parent.rglob("*.yaml"):
        mcl = (yaml.safe_load(path.read_text()) or {}).get("mcl") or {}
        if mcl.get("loss") == "annealed":
            decays[path.relative_to(Path(loramcl.recipes.__file__).parent).as_posix()] = mcl.get("temperature_decay")
    assert decays and all(isinstance(decay, float) for decay in decays.values()), decays
    for paper in ("audio_captioning/clotho/mcl-annealed.yaml", "audio_captioning/audiocaps/mcl-annealed.yaml"):
        assert decays[paper] == 0.999
