"""The two forms of relaxed WTA's epsilon (MCLConfig.epsilon_form): 'paper' (eq. 4, what the released LoRA-MCL code
computes by summing over k) and 'mean' (the released code's multi-head audio model, which averages over k)."""

import json

import pytest
import torch
from conftest import wrapped_model

from loramcl import MCLConfig, load_mcl_model, mcl_loss, relaxed_weights
from loramcl.mcl.config import saved_values
from loramcl.mcl.losses import relaxed_mean_weights

NLL_K3 = [[1.0, 2.0, 3.0], [3.0, 0.5, 2.0], [2.0, 2.0, 1.5]]
NLL_K2 = [[1.0, 2.0], [3.0, 0.5]]


def _reference_loss(nll: torch.Tensor, epsilon: float, reduce_k) -> torch.Tensor:
    """The released code's relaxed loss, written from its formula (nll here is [B, K], theirs [K, B]):
    (1 - eps - eps/(K-1)) * min_k + eps/(K-1) * reduce_k, reduce_k a sum (its LoRA models) or a mean (multi-head)."""
    k = nll.shape[1]
    return ((1 - epsilon - epsilon / (k - 1)) * torch.min(nll, dim=1).values
            + (epsilon / (k - 1)) * reduce_k(nll, dim=1)).mean()


@pytest.mark.parametrize("nll, epsilon, paper, mean", [
    # K = 3, epsilon 0.3: eq. 4 gives 0.7 / 0.15 each; the mean form 1 - 0.3 - 0.1 = 0.6 / 0.3 / 6 = 0.05 each
    (NLL_K3, 0.3, [[0.7, 0.15, 0.15], [0.15, 0.7, 0.15], [0.15, 0.15, 0.7]],
     [[0.6, 0.05, 0.05], [0.05, 0.6, 0.05], [0.05, 0.05, 0.6]]),
    # K = 2, epsilon 0.2: eq. 4 gives 0.8 / 0.2; the mean form 1 - 0.2 - 0.1 = 0.7 / 0.2 / 2 = 0.1
    (NLL_K2, 0.2, [[0.8, 0.2], [0.2, 0.8]], [[0.7, 0.1], [0.1, 0.7]]),
])
def test_each_form_weighs_the_hypotheses_as_computed_by_hand(nll, epsilon, paper, mean):
    """Weights written by hand: the paper's sum to 1, the mean form's to 1 - epsilon, its losers sharing epsilon/K."""
    nll = torch.tensor(nll)
    k = nll.shape[1]
    for form, expected in (("paper", paper), ("mean", mean)):
        config = MCLConfig(num_hypotheses=k, loss="relaxed", epsilon=epsilon, epsilon_form=form, tie_break="lowest")
        _, weights = mcl_loss(nll, config)
        torch.testing.assert_close(weights, torch.tensor(expected), rtol=0, atol=1e-7)
    totals = relaxed_mean_weights(nll, epsilon).sum(dim=1)
    torch.testing.assert_close(totals, torch.full_like(totals, 1 - epsilon))
    losers = relaxed_mean_weights(nll, epsilon).sum(dim=1) - relaxed_mean_weights(nll, epsilon).max(dim=1).values
    torch.testing.assert_close(losers, torch.full_like(losers, epsilon / k))


@pytest.mark.parametrize("k", [2, 3, 5])
def test_the_gradients_are_those_of_the_reference_codes_formula_ties_and_all(k):
    """The loss and its gradient equal those of the released code's formula, autograd through torch.min (whose
    gradient goes to the first minimum: tie_break 'lowest'): summed over k it is eq. 4, averaged the mean form."""
    nll = torch.rand(6, k, generator=torch.Generator().manual_seed(k)) * 4
    nll[0] = 1.0  # every hypothesis tied
    nll[1, :2] = nll[1].min() - 0.5  # hypotheses 0 and 1 tied for the win
    for form, reduce_k in (("paper", torch.sum), ("mean", torch.mean)):
        config = MCLConfig(num_hypotheses=k, loss="relaxed", epsilon=0.1, epsilon_form=form, tie_break="lowest")
        ours_nll, theirs_nll = nll.clone().requires_grad_(), nll.clone().requires_grad_()
        ours, _ = mcl_loss(ours_nll, config)
        theirs = _reference_loss(theirs_nll, 0.1, reduce_k)
        torch.testing.assert_close(ours, theirs)
        torch.testing.assert_close(torch.autograd.grad(ours, ours_nll)[0], torch.autograd.grad(theirs, theirs_nll)[0])


def test_epsilon_zero_is_vanilla_wta_in_both_forms_and_the_default_is_todays_weights():
    nll = torch.tensor(NLL_K3)
    wta = mcl_loss(nll, MCLConfig(num_hypotheses=3, loss="wta", tie_break="lowest"))[1]
    for form in ("paper", "mean"):
        config = MCLConfig(num_hypotheses=3, loss="relaxed", epsilon=0.0, epsilon_form=form, tie_break="lowest")
        assert torch.equal(mcl_loss(nll, config)[1], wta)
    default = MCLConfig(num_hypotheses=3, loss="relaxed", epsilon=0.05, tie_break="lowest")
    assert default.epsilon_form == "paper"
    assert torch.equal(mcl_loss(nll, default)[1], relaxed_weights(nll, 0.05, "lowest"))  # the same bits as before
    assert torch.equal(relaxed_mean_weights(nll[:, :1], 0.0), relaxed_weights(nll[:, :1], 0.0))  # K = 1: one-hot


def test_the_form_is_checked_with_the_same_epsilon_bound():
    """At (K-1)/K the winner weighs what a loser does in both forms, so both accept the same epsilons."""
    k = 3
    weights = relaxed_mean_weights(torch.tensor(NLL_K3), (k - 1) / k)
    torch.testing.assert_close(weights, torch.full_like(weights, 1 / k**2))
    MCLConfig(num_hypotheses=k, loss="relaxed", epsilon=(k - 1) / k, epsilon_form="mean")
    with pytest.raises(ValueError, match=r"epsilon must be in \[0, \(K-1\)/K\]"):
        MCLConfig(num_hypotheses=k, loss="relaxed", epsilon=0.7, epsilon_form="mean")
    with pytest.raises(ValueError, match=r"epsilon_form must be one of \('paper', 'mean'\), got 'reference'"):
        MCLConfig(num_hypotheses=k, loss="relaxed", epsilon=0.1, epsilon_form="reference")
    with pytest.raises(ValueError, match="epsilon_form 'mean' is how relaxed WTA weighs epsilon, and loss is 'wta'"):
        MCLConfig(num_hypotheses=k, loss="wta", epsilon_form="mean")


def test_the_form_is_saved_read_back_and_an_older_file_reads_as_the_paper_form(tmp_path):
    mcl, pristine, _, _ = wrapped_model("llama", loss="relaxed", epsilon=0.05, epsilon_form="mean")
    mcl.save_pretrained(tmp_path / "mean")
    saved = json.loads((tmp_path / "mean" / "mcl_config.json").read_text())
    assert saved["mcl_config"]["epsilon_form"] == "mean"
    assert load_mcl_model(pristine, tmp_path / "mean").mcl_config.epsilon_form == "mean"
    older = {name: value for name, value in saved["mcl_config"].items() if name != "epsilon_form"}
    assert MCLConfig.from_dict(saved_values(older)).epsilon_form == "paper"  # written before the field existed
    mcl, _, _, _ = wrapped_model("llama", loss="relaxed", epsilon=0.05)
    mcl.save_pretrained(tmp_path / "paper")  # the default form: the file is written as before the field existed
    assert "epsilon_form" not in json.loads((tmp_path / "paper" / "mcl_config.json").read_text())["mcl_config"]
    # a saved form under another loss (the loss edited to continue training) reads as the default, as epsilon does
    assert MCLConfig.from_dict(saved_values({**saved["mcl_config"], "loss": "wta", "epsilon": 0.0})) == MCLConfig(
        **{**saved["mcl_config"], "loss": "wta", "epsilon": 0.0, "epsilon_form": "paper"})


def test_a_run_resumed_with_the_other_form_is_refused(tmp_path):
    """The run's settings hold the form: checkpoints of the mean form do not resume under the paper's."""
    from loramcl.training.config import TrainConfig
    from loramcl.training.runs import SETTINGS_NAME, run_settings, settings_stamp, stale_checkpoint_fields

    def settings(form):
        config = MCLConfig(num_hypotheses=3, loss="relaxed", epsilon=0.05, epsilon_form=form)
        return run_settings("model", config, None, TrainConfig(), "float32")

    checkpoints = tmp_path / "checkpoints"
    (checkpoints / "checkpoint-2").mkdir(parents=True)
    (checkpoints / SETTINGS_NAME).write_text(json.dumps(settings("mean")))
    assert stale_checkpoint_fields(tmp_path, settings("paper")) == ["mcl"]
    assert stale_checkpoint_fields(tmp_path, settings("mean")) == []
    assert "epsilon_form" not in settings("paper")["mcl"]  # the paper form is recorded as before the field existed
    assert settings_stamp(settings("paper")) != settings_stamp(settings("mean"))


def test_the_multihead_baseline_takes_the_form_too():
    """The paper's multi-head rows (App. H.1) came from the code that averages over k: the baseline can train so."""
    from loramcl.baselines.config import MultiHeadConfig

    config = MultiHeadConfig(num_hypotheses=5, loss="relaxed", epsilon=0.05, epsilon_form="mean")
    assert config.loss_config().epsilon_form == "mean"
    assert MultiHeadConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match="epsilon_form 'mean' is how relaxed WTA weighs epsilon"):
        MultiHeadConfig(epsilon_form="mean")
