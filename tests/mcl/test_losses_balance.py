"""Balanced assignment (MCLConfig.balance) and the staged split (split_after) in the losses: off, the weights and
winners are today's to the bit; on, the equations of docs/guide/scores.md ("Balanced assignment and a staged split"),
checked against values written by hand."""

import json
import math

import pytest
import torch

from loramcl import MCLConfig, annealed_weights, mcl_loss, relaxed_weights, wta_weights
from loramcl.mcl.adapter_files import TRAINING_SETTINGS
from loramcl.mcl.losses import balanced, shared_phase, split_step
from loramcl.training.balance import bias_step

LOSSES = [dict(loss="wta", tie_break="lowest"), dict(loss="wta", tie_break="random"),
          dict(loss="relaxed", epsilon=0.1), dict(loss="annealed", temperature0=0.5, temperature_decay=0.9)]


def _nll(batch=8, k=3, seed=0):
    nll = torch.rand(batch, k, generator=torch.Generator().manual_seed(seed)) * 3.0
    nll[0] = 1.0  # a row of exact ties: the random tie-break draws
    return nll


def _today(nll, config, step):
    """The weights as the losses computed them before these options: each loss's own function on the NLL."""
    if config.loss == "wta":
        return wta_weights(nll, config.tie_break)
    if config.loss == "relaxed":
        return relaxed_weights(nll, config.relaxed_epsilon, config.tie_break)
    return annealed_weights(nll, config.temperature0 * config.temperature_decay ** step)


@pytest.mark.parametrize("options", LOSSES, ids=lambda o: "-".join(map(str, o.values())))
@pytest.mark.parametrize("step", [0, 3])
def test_off_the_weights_and_loss_are_todays_to_the_bit(options, step):
    config = MCLConfig(num_hypotheses=3, **options)
    assert (config.balance, config.split_after) == ("none", 0.0)
    nll = _nll()
    results = []
    for bias in (None, torch.zeros(3)):  # a zero bias (a run's first steps) picks exactly what no bias picks
        torch.manual_seed(7)
        results.append(mcl_loss(nll, config, step, total_steps=10, bias=bias))
    torch.manual_seed(7)
    expected = _today(nll, config, step)
    for loss, weights in results:
        assert torch.equal(weights, expected)
        assert torch.equal(loss, (expected * nll).sum(dim=1).mean())
    assert torch.equal(balanced(nll, None), nll)


def test_the_bias_shifts_the_winners_as_argmin_of_nll_minus_bias():
    """Written by hand: b = (0, 0.3, 0) makes hypothesis 1 win example 0 (1.2 - 0.3 = 0.9 < 1.0) and not example 1
    (2.5 - 0.3 = 2.2 > 2.0); without it hypothesis 0 wins both."""
    nll = torch.tensor([[1.0, 1.2, 3.0], [2.0, 2.5, 2.1]])
    bias = torch.tensor([0.0, 0.3, 0.0])
    wta = MCLConfig(num_hypotheses=3, loss="wta", balance="bias")
    assert mcl_loss(nll, wta)[1].tolist() == [[1, 0, 0], [1, 0, 0]]
    loss, weights = mcl_loss(nll, wta, bias=bias)
    assert weights.tolist() == [[0, 1, 0], [1, 0, 0]]
    assert loss.item() == pytest.approx((1.2 + 2.0) / 2)  # the bias picks the winner; the loss is its plain NLL
    relaxed = MCLConfig(num_hypotheses=3, loss="relaxed", epsilon=0.2, balance="bias")
    assert torch.allclose(mcl_loss(nll, relaxed, bias=bias)[1], torch.tensor([[0.1, 0.8, 0.1], [0.8, 0.1, 0.1]]))
    annealed = MCLConfig(num_hypotheses=3, loss="annealed", temperature0=0.5, temperature_decay=1.0, balance="bias")
    logits = [[-2.0, -1.8, -6.0], [-4.0, -4.4, -4.2]]  # -(nll - b) / 0.5
    expected = torch.tensor([[math.exp(v) / sum(math.exp(u) for u in row) for v in row] for row in logits])
    torch.testing.assert_close(mcl_loss(nll, annealed, bias=bias)[1], expected)


def test_the_bias_step_moves_toward_equal_shares():
    """b_k += rate * sign(1/K - share_k): up for a hypothesis under its fair share, down above it, not at it."""
    assert bias_step(torch.tensor([5, 1, 0]), 0.01).tolist() == pytest.approx([-0.01, 0.01, 0.01])
    assert bias_step(torch.tensor([4, 2, 0]), 0.01).tolist() == pytest.approx([-0.01, 0.0, 0.01])  # 2 of 6: fair
    assert bias_step(torch.tensor([3, 3, 3]), 0.5).tolist() == [0.0, 0.0, 0.0]
    assert bias_step(torch.tensor([7]), 0.5).tolist() == [0.0]  # one hypothesis: nothing to balance
    # Hypothesis 0 is better on every example by 0.5 nats: WTA gives it everything; the bias gives each a fair share.
    g = torch.Generator().manual_seed(0)
    nll = 2 * torch.rand(300, 1, generator=g) + 0.3 * torch.rand(300, 3, generator=g) + torch.tensor([0.0, 0.5, 0.5])
    config = MCLConfig(num_hypotheses=3, loss="wta", tie_break="lowest", balance="bias")
    bias = torch.zeros(3)
    assert mcl_loss(nll, config, bias=bias)[1].sum(dim=0).tolist() == [300, 0, 0]
    shares = []
    for _ in range(150):
        weights = mcl_loss(nll, config, bias=bias)[1]  # [B, K] one-hot
        shares.append(weights.mean(dim=0))
        bias += bias_step(weights.sum(dim=0).long(), 0.01)
    shares = torch.stack(shares[-50:]).mean(dim=0)  # the sign update keeps the bias moving by one step around it
    assert (shares - 1 / 3).abs().max() < 0.03, shares
    assert bias[1] - bias[0] == pytest.approx(0.5, abs=0.05)  # the bias has learnt the margin


def test_the_staged_split_trains_every_hypothesis_on_every_example_then_the_configured_loss():
    config = MCLConfig(num_hypotheses=3, loss="relaxed", epsilon=0.1, split_after=0.5)
    plain = MCLConfig(num_hypotheses=3, loss="relaxed", epsilon=0.1)
    nll = _nll()
    assert split_step(config, 10) == 5 and split_step(plain, 10) == 0
    for step in range(10):
        torch.manual_seed(step)
        loss, weights = mcl_loss(nll, config, step, total_steps=10)
        torch.manual_seed(step)
        configured = mcl_loss(nll, plain, step, total_steps=10)
        if step < 5:
            assert torch.equal(weights, torch.full_like(weights, 1 / 3))  # q = 1/K: the mean of the K NLLs
            torch.testing.assert_close(loss, nll.mean(), rtol=1e-6, atol=0)
        else:
            assert torch.equal(weights, configured[1]) and torch.equal(loss, configured[0])
        torch.manual_seed(step)
        tensor = mcl_loss(nll, config, torch.tensor(step), total_steps=10)  # a compiled forward's step
        assert torch.equal(tensor[1], weights)
    # outside training (evaluation) and with one hypothesis there is nothing to split
    evaluation, configured = [(torch.manual_seed(0), mcl_loss(nll, c, 0, 10, training=training))[1][1]
                              for c, training in ((config, False), (plain, True))]
    assert torch.equal(evaluation, configured)
    one = MCLConfig(num_hypotheses=1, split_after=0.5)
    assert mcl_loss(nll[:, :1], one, 0)[1].tolist() == [[1.0]] * 8


def test_the_switch_step_and_its_unknown_length():
    def at(share, total):
        return split_step(MCLConfig(split_after=share), total)

    assert [at(0.1, 30), at(0.5, 7), at(0.01, 10), at(0.9, 10)] == [3, 4, 1, 9]  # ceil, 0.1 * 30 read as 3
    assert shared_phase(2, MCLConfig(split_after=0.1), 30) and not shared_phase(3, MCLConfig(split_after=0.1), 30)
    with pytest.raises(ValueError, match="split_after 0.5 is a share of the run's optimizer steps, and none is known"):
        mcl_loss(_nll(), MCLConfig(num_hypotheses=3, split_after=0.5), 0)


@pytest.mark.parametrize("values,message", [
    (dict(balance="sinkhorn"), r"balance must be one of \('none', 'bias'\), got 'sinkhorn'"),
    (dict(balance="bias", balance_rate=0.0), r"balance_rate must be a finite number in \(0, inf\)"),
    (dict(balance="bias", balance_rate=float("nan")), "balance_rate must be a finite number"),
    (dict(balance_rate=0.1), "balance_rate 0.1 is the balancing bias's step, and balance is 'none'"),
    (dict(split_after=1.0), r"split_after must be a finite number in \[0, 1\)"),
    (dict(split_after=-0.1), r"split_after must be a finite number in \[0, 1\)"),
    (dict(split_after=0.5, split_noise=-1.0), r"split_noise must be a finite number in \[0, inf\)"),
    (dict(split_noise=0.5), "split_noise 0.5 breaks the symmetry at a staged split, and split_after is 0"),
])
def test_bad_values_are_refused_saying_what_to_change(values, message):
    with pytest.raises(ValueError, match=message):
        MCLConfig(**values)


def test_the_options_are_saved_and_read_back_and_an_older_file_reads_them_as_off(tmp_path):
    from tiny_models import build_model

    from loramcl import get_mcl_model, load_mcl_model

    config = MCLConfig(num_hypotheses=2, r=2, target_modules=["q_proj"], balance="bias", balance_rate=0.02,
                       split_after=0.25, split_noise=0.3)
    assert MCLConfig.from_dict(config.to_dict()) == config
    # off (the defaults), a configuration writes the same fields as before these options existed
    assert not {"balance", "balance_rate", "split_after", "split_noise"} & set(MCLConfig().to_dict())
    assert set(MCLConfig(balance="bias").to_dict()) - set(MCLConfig().to_dict()) == {"balance"}
    assert {"balance", "balance_rate", "split_after", "split_noise"} <= TRAINING_SETTINGS  # no output changes
    torch.manual_seed(0)
    get_mcl_model(build_model("llama"), config).save_pretrained(tmp_path / "a")
    saved = json.loads((tmp_path / "a" / "mcl_config.json").read_text())["mcl_config"]
    assert {k: saved[k] for k in ("balance", "balance_rate", "split_after", "split_noise")} == dict(
        balance="bias", balance_rate=0.02, split_after=0.25, split_noise=0.3)
    torch.manual_seed(0)
    assert load_mcl_model(build_model("llama"), tmp_path / "a").mcl_config == config
    older = {k: v for k, v in config.to_dict().items() if k not in ("balance", "balance_rate", "split_after",
                                                                     "split_noise")}
    assert MCLConfig.from_dict(older) == MCLConfig.from_dict({**older, "balance": "none", "split_after": 0.0})
    bad = json.loads((tmp_path / "a" / "mcl_config.json").read_text())
    bad["mcl_config"]["split_after"] = 2.0  # a training setting: outside the checksum, checked by MCLConfig itself
    (tmp_path / "a" / "mcl_config.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="split_after must be a finite number"):
        load_mcl_model(build_model("llama"), tmp_path / "a")


def test_the_compiled_forward_reads_the_bias_and_the_shared_phase_as_values():
    """The bias [K] and the step are tensors of the compiled forward: one graph for every step and bias, through the
    shared phase and after it, with eager's weights (tie_break lowest: no random draw inside the graph)."""
    import torch._dynamo
    from conftest import wrapped_model
    from torch._dynamo.utils import counters

    from loramcl.mcl.batch import checked_target_index

    mcl, _, inputs, labels = wrapped_model("llama", num_hypotheses=3, loss="relaxed", epsilon=0.1, balance="bias",
                                           split_after=0.5, tie_break="lowest")
    mcl.train()
    index = checked_target_index(mcl, inputs, labels)  # as MCLTrainer gives it compiled: no host read inside
    torch._dynamo.reset()
    compiled = torch.compile(mcl, backend="eager", fullgraph=True)
    counters.clear()
    try:
        for step, bias in ((0, [0.0, 0.0, 0.0]), (1, [0.0, 0.1, -0.1]), (2, [0.0, 0.2, -0.2]), (3, [5.0, 0.0, 0.0])):
            bias = torch.tensor(bias)
            with torch.no_grad():
                traced = compiled(**inputs, labels=labels, target_index=index, step=torch.tensor(step), total_steps=4,
                                  balance_bias=bias)
                eager = mcl(**inputs, labels=labels, target_index=index, step=step, total_steps=4, balance_bias=bias)
            torch.testing.assert_close(traced.weights, eager.weights, rtol=0, atol=0)
            torch.testing.assert_close(traced.loss, eager.loss)
        assert eager.weights.argmax(dim=1).tolist() == [0] * labels.shape[0]  # the last bias hands h0 every example
        assert counters["stats"]["unique_graphs"] == 1
    finally:
        torch._dynamo.reset()
