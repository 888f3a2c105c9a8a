"""Candidates' log-probabilities from the chosen tokens only: recorded step by step for greedy search and sampling
(no ``output_logits``), in blocks of rows for beam search and teacher-forced re-scoring; equal to the full
log-softmax of every step's logits that they replace."""

import pytest
import torch
from conftest import wrapped_model
from test_generation import NEW_TOKENS, K, mcl_case

from loramcl.decoding import candidates, generate_hypotheses, strategies
from loramcl.decoding.token_log_probs import ChosenTokenLogProbs
from loramcl.mcl.nll import token_log_probs


def test_token_log_probs_equal_the_full_log_softmax_in_blocks(monkeypatch):
    """Any number of rows and blocks, with and without a row index, fewer or more chosen rows than logits rows (beam
    search: each logits row's log-softmax once), in fp32 and bf16 logits."""
    from loramcl.mcl import nll

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(13, 50, generator=g) * 4
    tokens = torch.randint(0, 50, (9,), generator=g)
    rows = torch.randint(0, 13, (9,), generator=g)
    full = logits.log_softmax(-1)
    monkeypatch.setattr(nll, "BLOCK_ELEMENTS", 120)  # 2 rows a block
    assert torch.allclose(token_log_probs(logits, tokens, rows), full[rows, tokens], atol=1e-6)
    assert torch.allclose(token_log_probs(logits[:9], tokens), full[torch.arange(9), tokens], atol=1e-6)
    many_rows, many_tokens = torch.randint(0, 13, (30,), generator=g), torch.randint(0, 50, (30,), generator=g)
    assert torch.allclose(token_log_probs(logits, many_tokens, many_rows), full[many_rows, many_tokens], atol=1e-6)
    half = logits.bfloat16()
    expected = half.float().log_softmax(-1)[rows, tokens]
    assert token_log_probs(half, tokens, rows).dtype == torch.float32
    assert torch.allclose(token_log_probs(half, tokens, rows), expected, atol=1e-6)
    expected = half.float().log_softmax(-1)[many_rows, many_tokens]
    assert torch.allclose(token_log_probs(half, many_tokens, many_rows), expected, atol=1e-6)


def decode_both_ways(monkeypatch, mcl, inputs, **settings):
    """(the candidates as decoded now, the candidates with transformers' step logits kept as before), and the
    output_logits values each generate was called with."""
    asked = []
    generate = type(mcl.base_model).generate

    def spy(self, *args, **kwargs):
        asked.append(kwargs.get("output_logits"))
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(type(mcl.base_model), "generate", spy)
    rescore = candidates.Decoder._rescore
    monkeypatch.setattr(candidates.Decoder, "_rescore", lambda *args: pytest.fail("re-scored instead of recorded"))
    now = generate_hypotheses(mcl, None, inputs, **settings)
    monkeypatch.setattr(candidates.Decoder, "_rescore", rescore)
    keeping = strategies._generate_kwargs

    def with_step_logits(*args):
        return {**keeping(*args), "output_logits": True}

    monkeypatch.setattr(strategies, "_generate_kwargs", with_step_logits)
    before = generate_hypotheses(mcl, None, inputs, **settings)
    return now, before, asked


@pytest.mark.parametrize("name", ["llama", "t5"])
@pytest.mark.parametrize("strategy,num_beams", [("greedy", 1), ("sample", 1), ("beam", 3)])
def test_log_probs_are_recorded_as_they_were_read_from_step_logits(monkeypatch, name, strategy, num_beams):
    """The recorded log-probs equal those read from transformers' kept step logits (the computation they replace),
    with a repetition penalty and candidates ending early; generate is asked for no step logits, and nothing is
    re-scored. Beam search: its candidates matched to the beams they continue, without beam indices."""
    mcl, inputs = mcl_case(name)
    settings = dict(strategy=strategy, num_beams=num_beams, max_new_tokens=NEW_TOKENS, repetition_penalty=1.3,
                    pad_token_id=0, seed=3)
    first = generate_hypotheses(mcl, None, inputs, log_probs=False, eos_token_id=10**6, **settings)[0][0]
    settings["eos_token_id"] = first.token_ids[2]  # so that candidate ends after 3 tokens, its EOS counted
    now, before, asked = decode_both_ways(monkeypatch, mcl, inputs, **settings)
    assert asked == [False, True]
    assert [c.token_ids for row in now for c in row] == [c.token_ids for row in before for c in row]
    assert [c.log_prob for row in now for c in row] == pytest.approx([c.log_prob for row in before for c in row],
                                                                      abs=1e-5)
    lengths = {len(c.token_ids) for row in now for c in row}
    assert min(lengths) < NEW_TOKENS


@pytest.mark.parametrize("strategy,num_beams", [("sample", None), ("beam", 3)])
def test_baselines_with_several_sequences_per_input_are_recorded(monkeypatch, strategy, num_beams):
    """num_return_sequences > 1: sampling expands the rows (one output row per row still); beam search returns the
    best of the beams of each input."""
    mcl, inputs = mcl_case("llama")
    settings = dict(strategy=strategy, num_beams=num_beams, num_sequences=2, hypotheses=[1],
                    max_new_tokens=NEW_TOKENS, seed=5, pad_token_id=0, eos_token_id=7)
    now, before, asked = decode_both_ways(monkeypatch, mcl, inputs, **settings)
    assert asked == [False, True]
    assert [c.log_prob for row in now for c in row] == pytest.approx([c.log_prob for row in before for c in row],
                                                                      abs=1e-5)


def test_a_generate_whose_steps_cannot_be_told_apart_is_rescored(monkeypatch):
    """A step without its own forward (or rows that do not match) leaves the recorder unusable: the candidates are
    scored by teacher forcing instead, to the same values."""
    mcl, inputs = mcl_case("llama")
    settings = dict(max_new_tokens=NEW_TOKENS, pad_token_id=0)
    expected = generate_hypotheses(mcl, None, inputs, **settings)
    monkeypatch.setattr(ChosenTokenLogProbs, "keep_logits", lambda self, module, args, output: None)
    rescored = generate_hypotheses(mcl, None, inputs, **settings)
    assert [c.log_prob for row in rescored for c in row] == pytest.approx(
        [c.log_prob for row in expected for c in row], abs=1e-4)


@pytest.mark.parametrize("name", ["llama", "t5"])
def test_teacher_forced_rescoring_of_a_plain_model_equals_the_step_log_probs(name):
    """A model without hypotheses is re-scored from its last L + 1 positions' logits, one position at a time: the
    same values as beam search's step logits, left padding and EOS included."""
    from loramcl.decoding import Decoding, candidates

    _, plain, _, _ = wrapped_model(name, num_hypotheses=K)
    _, inputs = mcl_case(name)
    beam = Decoding(strategy="beam", num_beams=3, num_sequences=2, max_new_tokens=NEW_TOKENS)
    outs = generate_hypotheses(plain, None, inputs, decoding=beam, pad_token_id=0, eos_token_id=7)
    batch = strategies._prepare_inputs(plain, None, inputs)
    kwargs = strategies._generate_kwargs(plain, None, beam, 3, True, {"pad_token_id": 0, "eos_token_id": 7})
    decoder = candidates.Decoder(plain, None, kwargs, seed=None, log_probs=True, routing=None)
    with torch.no_grad():
        output = plain.generate(**batch, **kwargs, num_return_sequences=2)
        rescored = decoder._rescore(batch, output.sequences, output.beam_indices >= 0, per_input=2)
    assert rescored == pytest.approx([c.log_prob for row in outs for c in row], abs=1e-4)
