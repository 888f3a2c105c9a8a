"""The MCL forward compiles whole (issue 54, DESIGN decision 13): no graph break and no host read inside the training
forward (every loss, two-pass WTA's two passes) and the decoding forward (every routing generate_hypotheses uses),
the same numbers as eager (MCLTrainer compiled: tests/training/test_trainer_compile.py). Traced with dynamo's ``eager`` / ``aot_eager`` backends
(no C++ compilation); docs/architecture.md, "Compiling the forward"."""

import pytest
import torch
import torch._dynamo
from conftest import wrapped_model
from torch._dynamo.utils import counters

from loramcl.mcl.batch import batch_target_index, checked_target_index

LOSSES = {"wta": {}, "relaxed": {"epsilon": 0.1}, "annealed": {"temperature_decay": 0.9}}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _breaks(fn) -> list[str]:
    """The graph breaks of one call of ``fn`` (their reasons, where in our code), with dynamo's explain."""
    torch._dynamo.reset()
    explained = torch._dynamo.explain(fn)()
    return [f"{reason.reason.splitlines()[0]} @ {reason.user_stack[-1] if reason.user_stack else '?'}"
            for reason in explained.break_reasons]


def _training_model(loss="wta", **config):
    mcl, _, inputs, labels = wrapped_model("llama", num_hypotheses=3, loss=loss, **LOSSES[loss], **config)
    return mcl.train(), inputs, labels, checked_target_index(mcl, inputs, labels)


@pytest.mark.parametrize("loss,scoring", [("wta", False), ("relaxed", False), ("annealed", True)])
def test_the_training_forward_has_no_graph_break(loss, scoring):
    mcl, inputs, labels, index = _training_model(loss, scoring=scoring)
    assert _breaks(lambda: mcl(**inputs, labels=labels, target_index=index).loss) == []


@pytest.mark.parametrize("hypotheses,copies", [(1, False), (torch.tensor([0, 2]), False),
                                               (torch.tensor([0, 1, 2]), True)],
                         ids=["one-for-all-rows", "one-per-row", "copies"])
def test_the_decoding_forward_has_no_graph_break(hypotheses, copies):
    """Inside use_hypotheses, as generate_hypotheses routes: the base model's forward (what generate calls) and the
    MCL forward."""
    mcl, _, inputs, _ = wrapped_model("llama", num_hypotheses=3)
    if copies:
        inputs = {name: value.repeat(3, 1) for name, value in inputs.items()}
    with torch.no_grad(), mcl.use_hypotheses(hypotheses, copies=copies):
        assert _breaks(lambda: mcl.base_model(**inputs).logits) == []
        # fullgraph: a graph break fails; compiled, the indices route by a gather (no shortcut read from their
        # values): the same logits
        compiled = torch.compile(mcl, backend="eager", fullgraph=True)
        torch.testing.assert_close(compiled(**inputs).logits, mcl(**inputs).logits)


def test_given_its_target_index_the_forward_reads_nothing_on_the_host(monkeypatch):
    """Eager too: the count of host reads of ours (test_host_syncs) is 0 once the first forward checked the probe."""
    from test_host_syncs import host_syncs

    mcl, inputs, labels, index = _training_model("relaxed")
    mcl(**inputs, labels=labels, target_index=index)
    with host_syncs(monkeypatch) as reads:
        mcl(**inputs, labels=labels, target_index=index)
    assert sum(reads.values()) == 0, reads


def _loss_and_gradients(mcl, forward):
    mcl.zero_grad()
    loss = forward()
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in mcl.named_parameters() if p.grad is not None}


def test_the_compiled_forward_gives_the_eager_loss_and_gradients():
    """Relaxed WTA (annealed: test_the_annealed_forward_compiles_once_for_every_step)."""
    mcl, inputs, labels, index = _training_model("relaxed")
    compiled = torch.compile(mcl, backend="aot_eager", fullgraph=True)
    eager = _loss_and_gradients(mcl, lambda: mcl(**inputs, labels=labels, target_index=index, step=3).loss)
    traced = _loss_and_gradients(mcl, lambda: compiled(**inputs, labels=labels, target_index=index, step=3).loss)
    torch.testing.assert_close(traced[0], eager[0])
    assert traced[1].keys() == eager[1].keys() and traced[1]
    for name, gradient in eager[1].items():
        torch.testing.assert_close(traced[1][name], gradient, msg=name)


def test_each_pass_of_two_pass_wta_compiles_whole_with_the_eager_numbers():
    """fullgraph (a graph break fails): the scoring pass (all K, no gradient) gives the eager nll, the winners' pass
    (one hypothesis per example, a tensor) the eager loss and gradients."""
    mcl, inputs, labels, index = _training_model("wta")
    winners = torch.tensor([2, 0])
    compiled = torch.compile(mcl, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(**inputs, labels=labels, target_index=index).nll,
                                   mcl(**inputs, labels=labels, target_index=index).nll)
    eager = _loss_and_gradients(mcl, lambda: mcl(**inputs, labels=labels, hypotheses=winners, target_index=index).loss)
    traced = _loss_and_gradients(mcl, lambda: compiled(**inputs, labels=labels, hypotheses=winners,
                                                       target_index=index).loss)
    torch.testing.assert_close(traced[0], eager[0])
    for name, gradient in eager[1].items():
        torch.testing.assert_close(traced[1][name], gradient, msg=name)


def test_the_annealed_forward_compiles_once_for_every_step():
    """The temperature tau(t) is read as a value (the step as a 0-dim tensor, as MCLTrainer passes it compiled): one
    graph for all steps, each step's loss."""
    mcl, inputs, labels, index = _training_model("annealed")
    compiled = torch.compile(mcl, backend="eager", fullgraph=True)
    counters.clear()
    for step in (0, 1, 5, 400):  # tau = 0.9^400 < temperature_min: hard WTA, in the same graph
        with torch.no_grad():
            traced = compiled(**inputs, labels=labels, target_index=index, step=torch.tensor(step))
            eager = mcl(**inputs, labels=labels, target_index=index, step=step)
        torch.testing.assert_close(traced.loss, eager.loss)
        torch.testing.assert_close(traced.weights, eager.weights)
    assert counters["stats"]["unique_graphs"] == 1


def test_bad_token_ids_are_refused_where_the_batch_is_checked():
    """The forward given its target_index checks nothing; the batch's check (the trainer's, once per batch) raises the
    error the forward raised."""
    mcl, inputs, labels, _ = _training_model("wta")
    inputs["input_ids"][1, 2] = 500
    message = r"input_ids holds 500 \(row 1, position 2\), outside this model's vocabulary of 97 tokens"
    with pytest.raises(ValueError, match=message):
        checked_target_index(mcl, inputs, labels)
    with pytest.raises(ValueError, match=message):
        mcl(**inputs, labels=labels)  # without a target_index, the forward checks as before


def test_batches_of_other_lengths_reuse_the_compiled_forward():
    """batch_target_index (MCLTrainer's) marks the sequence length and N dynamic: one graph for every batch."""
    mcl, _, _, _ = _training_model("relaxed")
    compiled = torch.compile(mcl, backend="eager", fullgraph=True)
    generator = torch.Generator().manual_seed(0)
    counters.clear()
    for length, prompt in [(8, 3), (10, 2), (12, 5)]:
        ids = torch.randint(3, 80, (2, length), generator=generator)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                 "labels": ids.masked_fill(torch.arange(length) < prompt, -100)}
        index = batch_target_index(mcl, batch, compiled=True)
        with torch.no_grad():
            torch.testing.assert_close(compiled(**batch, target_index=index).loss,
                                       mcl(**batch, target_index=index).loss)
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("method", ["moe", "multihead"])
def test_the_baselines_training_forward_has_no_graph_break(method):
    """The baselines keep MCLModel's forward: LoRA-MoE and multi-head MCL, all K stacked. (Multi-head MCL's
    winners' pass does not compile whole: its heads group the rows by hypothesis, sizes read from the values.)"""
    from tiny_models import build_batch, build_model

    from loramcl.baselines.config import MoEConfig, MultiHeadConfig
    from loramcl.baselines.moe import get_moe_model
    from loramcl.baselines.multihead import get_multihead_model

    base = build_model("llama")
    inputs, labels = build_batch("llama", base)
    model = (get_moe_model(base, MoEConfig(num_experts=3, r=4, target_modules=["q_proj", "v_proj"])) if method == "moe"
             else get_multihead_model(base, MultiHeadConfig(num_hypotheses=3, module="lm_head"))).train()
    index = checked_target_index(model, inputs, labels)
    assert _breaks(lambda: model(**inputs, labels=labels, target_index=index).loss) == []
