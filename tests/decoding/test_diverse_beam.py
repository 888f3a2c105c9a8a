"""Diverse beam search: token-for-token parity with transformers 4.56.2's group beam search (fixture made by
tests/fixtures/diverse_beam/make_reference.py), the lambda = 0 reduction, PEFT models, and argument errors."""

import copy
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from loramcl.decoding.diverse_beam import diverse_beam_search, generate_diverse_beam

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "diverse_beam"
REFERENCE = json.loads((FIXTURES / "reference.json").read_text())
CASES = REFERENCE["cases"]
GROUP_ARGS = ("num_beams", "num_beam_groups", "diversity_penalty", "num_return_sequences")


def _make_reference_module():
    spec = importlib.util.spec_from_file_location("make_reference", FIXTURES / "make_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


make_reference = _make_reference_module()


@pytest.fixture(scope="module")
def models():
    return {name: make_reference.build_model(spec) for name, spec in REFERENCE["models"].items()}


def inputs_of(model_name: str) -> dict:
    return {key: torch.tensor(value) for key, value in REFERENCE["inputs"][model_name].items()}


def run(model, case: dict, **overrides):
    kwargs = {**case["generate_kwargs"], **overrides}
    return generate_diverse_beam(model, inputs_of(case["model"]), **kwargs)


def case_id(case: dict) -> str:
    kwargs = case["generate_kwargs"]
    extras = [f"{k}={v}" for k, v in kwargs.items() if k not in (*GROUP_ARGS, "eos_token_id", "pad_token_id",
                                                                "max_new_tokens")]
    return "-".join([case["model"], f"N{kwargs['num_beams']}G{kwargs['num_beam_groups']}",
                     f"lam{kwargs['diversity_penalty']}", f"R{kwargs['num_return_sequences']}", *extras])


def test_models_are_the_reference_models(models):
    assert REFERENCE["made_with"]["transformers"] == "4.56.2"
    for name, spec in REFERENCE["models"].items():
        assert make_reference.state_dict_sha256(models[name]) == spec["state_dict_sha256"], (
            f"{name}: the seeded initialisation differs from the one the fixture was made with")


def test_fixture_exercises_what_it_should():
    def generated(case):
        causal = case["model"] == "llama"
        start = len(REFERENCE["inputs"][case["model"]]["input_ids"][0]) if causal else 1
        return [row[start:] for row in case["sequences"]]

    finished_early = sum(row[:-1].count(case["generate_kwargs"]["eos_token_id"]) > 0
                         for case in CASES for row in generated(case))
    assert finished_early >= 10  # hypotheses that ended with eos before max_new_tokens
    assert {case["model"] for case in CASES} == {"llama", "bart"}
    kwargs = [case["generate_kwargs"] for case in CASES]
    assert any(k["num_return_sequences"] == k["num_beams"] for k in kwargs)
    assert any(k["num_return_sequences"] < k["num_beams"] for k in kwargs)
    assert any(k.get("repetition_penalty", 1.0) != 1.0 for k in kwargs)
    assert {0.0, 0.5, 1.0, 10.0} <= {k["diversity_penalty"] for k in kwargs}
    assert {2, 3, 4} <= {k["num_beam_groups"] for k in kwargs}


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_matches_transformers_4_56_group_beam_search(models, case):
    out = run(models[case["model"]], case)
    assert out.sequences.tolist() == case["sequences"]
    torch.testing.assert_close(out.sequences_scores, torch.tensor(case["sequences_scores"]), atol=1e-4, rtol=0)


@pytest.mark.parametrize("index", [1, 7])  # llama N6 G3 R3 and bart N6 G3 R2, both with repetition_penalty
def test_generate_hypotheses_gives_transformers_4_56_group_beam_search(models, index):
    """The single-model baseline as the library calls it (``generate_hypotheses(strategy="diverse_beam")``): each
    input's candidates are transformers 4.56.2's returned sequences, in its order, without the prompt, the end token
    and the padding after it, with a log-probability."""
    from loramcl.decoding import generate_hypotheses

    case = CASES[index]
    kwargs, model = case["generate_kwargs"], models[case["model"]]
    inputs = inputs_of(case["model"])
    outs = generate_hypotheses(model, None, inputs, strategy="diverse_beam", num_beams=kwargs["num_beams"],
                               num_beam_groups=kwargs["num_beam_groups"], num_sequences=kwargs["num_return_sequences"],
                               diversity_penalty=kwargs["diversity_penalty"], max_new_tokens=kwargs["max_new_tokens"],
                               repetition_penalty=kwargs["repetition_penalty"], eos_token_id=kwargs["eos_token_id"],
                               pad_token_id=kwargs["pad_token_id"])
    start = inputs["input_ids"].shape[1] if case["model"] == "llama" else 1  # the prompt, or the decoder start
    expected = []
    for row in case["sequences"]:
        tokens = row[start:]
        # a generated pad token (the random model's) stays; padding only follows the end token
        expected.append(tokens[:tokens.index(kwargs["eos_token_id"])] if kwargs["eos_token_id"] in tokens else tokens)
    returned = kwargs["num_return_sequences"]
    assert [[c.token_ids for c in row] for row in outs] == [expected[i:i + returned]
                                                           for i in range(0, len(expected), returned)]
    assert all(c.log_prob < 0 for row in outs for c in row)


@pytest.mark.parametrize("index", [1, 7])  # a causal and an encoder-decoder case, both with repetition_penalty
def test_without_cache_gives_the_same(models, index):
    """The KV cache is reordered by beam correctly: recomputing everything at each step agrees."""
    case = CASES[index]
    out = run(models[case["model"]], case, use_cache=False)
    assert out.sequences.tolist() == case["sequences"]
    torch.testing.assert_close(out.sequences_scores, torch.tensor(case["sequences_scores"]), atol=1e-4, rtol=0)


def test_as_custom_generate_callable(models):
    case = CASES[0]
    sequences = models["llama"].generate(**inputs_of("llama"), **case["generate_kwargs"],
                                         custom_generate=diverse_beam_search)
    assert sequences.tolist() == case["sequences"]


@pytest.mark.parametrize("model_name", ["llama", "bart"])
@pytest.mark.parametrize("group_size, groups", [(2, 2), (3, 2), (2, 3)])
def test_zero_penalty_is_copies_of_plain_beam_search(models, model_name, group_size, groups):
    """lambda = 0: the G groups decode identically (4.56.2 refused this setting; its loop gives the same), each
    group being transformers' own beam search with num_beams / G beams (checked here with transformers 5)."""
    model, config = models[model_name], REFERENCE["models"][model_name]["config"]
    inputs = inputs_of(model_name)
    kwargs = dict(max_new_tokens=10, eos_token_id=config["eos_token_id"], pad_token_id=config["pad_token_id"])
    ours = generate_diverse_beam(model, inputs, num_beams=group_size * groups, num_beam_groups=groups,
                                 diversity_penalty=0.0, num_return_sequences=group_size * groups, **kwargs)
    plain = model.generate(**inputs, num_beams=group_size, num_return_sequences=group_size,
                           return_dict_in_generate=True, output_scores=True, **kwargs)
    batch = inputs["input_ids"].shape[0]
    sequences = ours.sequences.view(batch, group_size, groups, -1)  # [B, S, G, L]: each hypothesis G times
    assert torch.equal(sequences, sequences[:, :, :1].expand_as(sequences))
    assert torch.equal(sequences[:, :, 0].reshape(batch * group_size, -1), plain.sequences)
    scores = ours.sequences_scores.view(batch, group_size, groups)[..., 0].reshape(-1)
    torch.testing.assert_close(scores, plain.sequences_scores, atol=1e-5, rtol=0)


def test_peft_model(models):
    """A PEFT LoRA model decodes through its adapters; with fresh adapters (B = 0) it equals the base model."""
    from peft import LoraConfig, get_peft_model

    case = CASES[0]
    peft = get_peft_model(copy.deepcopy(models["llama"]), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    out = run(peft, case)
    assert out.sequences.tolist() == case["sequences"]
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 1.0, generator=torch.Generator().manual_seed(0))
    changed = run(peft, case)
    assert changed.sequences.shape[0] == len(case["sequences"])
    assert changed.sequences.tolist() != case["sequences"]


@pytest.mark.parametrize("overrides, message", [
    (dict(num_beams=4, num_beam_groups=3), "divisible"),
    (dict(num_beams=4, num_return_sequences=5), "num_return_sequences"),
    (dict(diversity_penalty=-0.5), "diversity_penalty"),
    (dict(do_sample=True), "sampling"),
    (dict(temperature=0.7), "sampling"),
    (dict(top_p=0.9), "sampling"),
])
def test_bad_settings(models, overrides, message):
    case = CASES[0]
    with pytest.raises(ValueError, match=message):
        run(models["llama"], case, **overrides)


def test_sampling_through_generate_is_refused(models):
    with pytest.raises(ValueError, match="do_sample"):
        models["llama"].generate(**inputs_of("llama"), **CASES[0]["generate_kwargs"], do_sample=True,
                                 custom_generate=diverse_beam_search)


@pytest.mark.parametrize("name", ["qwen2_audio", "llava_next"])
def test_multimodal_models_with_and_without_cache(name):
    """Audio/image inputs go through generate's own preparation; cached and uncached decoding agree."""
    from tiny_models import build_batch, build_model

    model = build_model(name).eval()
    inputs, _ = build_batch(name, model)
    kwargs = dict(num_beams=4, num_beam_groups=2, diversity_penalty=1.0, num_return_sequences=3, max_new_tokens=5,
                  pad_token_id=0)
    cached = generate_diverse_beam(model, inputs, **kwargs)
    uncached = generate_diverse_beam(model, inputs, use_cache=False, **kwargs)
    assert cached.sequences.shape == (2 * 3, inputs["input_ids"].shape[1] + 5)
    assert torch.equal(cached.sequences, uncached.sequences)
    torch.testing.assert_close(cached.sequences_scores, uncached.sequences_scores, atol=1e-5, rtol=0)


def test_neutral_sampling_values_are_accepted(models):
    case = CASES[0]
    out = run(models["llama"], case, do_sample=False, temperature=1.0, top_k=0, top_p=1.0)
    assert out.sequences.tolist() == case["sequences"]


# ---- groups as copies of the batch (diverse MCL decoding's layout) -------------------------------------------------


@pytest.mark.parametrize("index", [1, 4, 7])  # 3 groups with a repetition penalty; length_penalty 2 and "never"; BART
def test_groups_as_copies_give_the_groups_of_the_classic_layout(models, index):
    """G copies of the batch, copy g being group g (copy-major rows), run the same search as the classic layout (the
    G groups of each example's beams): with every hypothesis returned, each group of each example returns the same
    hypotheses with the same scores; only where they sit differs (copy-major, per group)."""
    from loramcl.decoding.diverse_beam import generate_diverse_copies
    from loramcl.mcl.copies import repeat_examples

    case = CASES[index]
    kwargs = dict(case["generate_kwargs"])
    beams, groups = kwargs.pop("num_beams"), kwargs.pop("num_beam_groups")
    kwargs.pop("num_return_sequences")
    group_size = beams // groups
    inputs = inputs_of(case["model"])
    batch = inputs["input_ids"].shape[0]
    classic = generate_diverse_beam(models[case["model"]], inputs, num_beams=beams, num_beam_groups=groups,
                                    num_return_sequences=beams, **kwargs)
    copied = {name: repeat_examples(value, groups, batch, name) for name, value in inputs.items()}
    ours = generate_diverse_copies(models[case["model"]], copied, copies=groups, num_beams=group_size,
                                   num_return_sequences=group_size, **kwargs)
    assert ours.sequences.shape == classic.sequences.shape
    # copy-major rows: [G, B, S] -> per example, the G*S hypotheses of all groups
    per_example = ours.sequences.view(groups, batch, group_size, -1).transpose(0, 1).reshape(batch, beams, -1)
    scores = ours.sequences_scores.view(groups, batch, group_size).transpose(0, 1).reshape(batch, beams)
    expected = classic.sequences.view(batch, beams, -1)
    expected_scores = classic.sequences_scores.view(batch, beams)
    for b in range(batch):
        mine = sorted(zip(per_example[b].tolist(), scores[b].tolist(), strict=True))
        theirs = sorted(zip(expected[b].tolist(), expected_scores[b].tolist(), strict=True))
        assert [tokens for tokens, _ in mine] == [tokens for tokens, _ in theirs]
        assert [s for _, s in mine] == pytest.approx([s for _, s in theirs], abs=1e-5)
    # each group's hypotheses best first, and the penalty made the groups differ
    by_group = scores.view(batch, groups, group_size)
    assert bool((by_group[..., :-1] >= by_group[..., 1:]).all())
    assert len({tuple(row) for row in per_example[0].tolist()}) > group_size


@pytest.mark.parametrize("overrides, message", [
    (dict(copies=0), "copies must be a positive integer"),
    (dict(num_beam_groups=2), "leave num_beam_groups"),
    (dict(num_return_sequences=3), "num_return_sequences"),
    (dict(diversity_penalty=-1.0), "diversity_penalty"),
    (dict(top_k=5), "sampling"),
    (dict(copies=2, inputs_rows=3), "not 2 copies"),
])
def test_bad_copies_settings(models, overrides, message):
    from loramcl.decoding.diverse_beam import generate_diverse_copies

    settings = dict(copies=3, num_beams=2, diversity_penalty=1.0, max_new_tokens=4, pad_token_id=4) | overrides
    inputs = {name: value[:settings.pop("inputs_rows", 3)] for name, value in inputs_of("llama").items()}
    with pytest.raises(ValueError, match=message):
        generate_diverse_copies(models["llama"], inputs, **settings)


@pytest.mark.parametrize("model_name", ["llama", "bart"])
def test_one_beam_per_group_is_greedy_but_its_repetition_penalty_acts_on_log_probs(models, model_name):
    """With one beam per group and lambda = 0, every group is greedy decoding, except for the logits processors:
    beam search (transformers' and ours) applies them to log-probabilities, greedy decoding to logits, so a
    repetition penalty of 1.1 is a weaker push in beam search (docs/experiments/translation.md measured what that
    changes)."""
    model, config = models[model_name], REFERENCE["models"][model_name]["config"]
    inputs = inputs_of(model_name)
    kwargs = dict(max_new_tokens=10, eos_token_id=config["eos_token_id"], pad_token_id=config["pad_token_id"])
    for penalty in (1.0, 1.3):
        ours = generate_diverse_beam(model, inputs, num_beams=2, num_beam_groups=2, diversity_penalty=0.0,
                                     num_return_sequences=1, repetition_penalty=penalty, **kwargs).sequences
        beam = model.generate(**inputs, num_beams=1, do_sample=False, repetition_penalty=penalty, **kwargs)
        length = min(ours.shape[1], beam.shape[1])
        if penalty == 1.0:
            assert torch.equal(ours[:, :length], beam[:, :length])
    # the penalised search on log-probs: transformers' own greedy loop with the penalty moved onto them
    from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor

    on_log_probs = LogitsProcessorList([_OnLogProbs(RepetitionPenaltyLogitsProcessor(1.3))])
    reference = model.generate(**inputs, num_beams=1, do_sample=False, logits_processor=on_log_probs, **kwargs)
    length = min(ours.shape[1], reference.shape[1])
    assert torch.equal(ours[:, :length], reference[:, :length])
    assert not torch.equal(ours[:, :length], beam[:, :length]), "the fixture should show the two penalties differ"


class _OnLogProbs:
    """A logits processor applied to the log-softmax of the scores, as beam search applies every processor."""

    def __init__(self, processor) -> None:
        self.processor = processor

    def __call__(self, input_ids, scores):
        return self.processor(input_ids, torch.log_softmax(scores, dim=-1))
