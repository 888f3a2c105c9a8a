"""Decoding: K hypotheses in one batched generate, the single-model baselines, sampling statistics, errors."""

import copy
import math

import pytest
import torch
from conftest import peft_reference, randomize_adapters, wrapped_model
from tiny_models import VOCAB, build_batch, build_model, word_tokenizer
from torch import nn

from loramcl.decoding import Candidate, equal_budget, generate_hypotheses

K = 3
NEW_TOKENS = 6


def left_padded_prompts(lengths=(3, 7, 5), seed=1) -> dict:
    """A decoder-only batch of prompts of different lengths, left-padded with 0."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    input_ids = torch.zeros(len(lengths), width, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, n in enumerate(lengths):
        input_ids[row, width - n:] = torch.randint(3, 80, (n,), generator=g)
        attention_mask[row, width - n:] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def mcl_case(name: str):
    """(MCL model with K random non-zero hypotheses, a generation batch with padding or multimodal inputs)."""
    mcl, _, inputs, _ = wrapped_model(name, num_hypotheses=K)
    randomize_adapters(mcl, std=0.5)  # hypotheses far enough apart to decode different tokens
    if name in ("llama", "gpt2"):
        inputs = left_padded_prompts()
    elif name in ("t5", "bart"):
        inputs = {**inputs, **{k: torch.cat([v, v[:1]]) for k, v in inputs.items()}}  # 3 sources, one padded
        inputs["attention_mask"][2, -4:] = 0
    return mcl, inputs


def generated_tokens(model, sequences: torch.Tensor, inputs: dict) -> list[list[int]]:
    """The generated tokens of each row of a plain ``generate`` output, up to (not including) the first EOS."""
    config = model.config
    start = 1 if config.is_encoder_decoder else inputs["input_ids"].shape[1]
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    rows = []
    for row in sequences[:, start:].tolist():
        cut = next((t for t, token in enumerate(row) if token in eos), len(row))
        rows.append(row[:cut])
    return rows


def decode_alone(mcl, inputs: dict, k: int, **kwargs) -> list[list[int]]:
    """Hypothesis k alone, through transformers' generate directly (no generate_hypotheses)."""
    with torch.no_grad(), mcl.use_hypotheses(k):
        sequences = mcl.generate(**inputs, max_new_tokens=NEW_TOKENS, pad_token_id=0, **kwargs)
    return generated_tokens(mcl.base_model, sequences, inputs)


# ---- MCL: batched == alone ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama", "gpt2", "t5", "bart", "llava_next", "qwen2_audio"])
@pytest.mark.parametrize("strategy,num_beams", [("greedy", 1), ("beam", 3)])
def test_batched_hypotheses_equal_each_hypothesis_alone(name, strategy, num_beams):
    """One generate over K*B hypothesis-major rows gives, token for token, what each hypothesis gives alone:
    rows (and their beams) never leak across hypotheses."""
    mcl, inputs = mcl_case(name)
    settings = dict(num_beams=num_beams, max_new_tokens=NEW_TOKENS, pad_token_id=0,
                    min_new_tokens=2)  # the random tied BART would end at once
    outs = generate_hypotheses(mcl, None, inputs, strategy=strategy, **settings)
    rows = inputs["input_ids"].shape[0]
    assert len(outs) == rows and all(len(candidates) == K for candidates in outs)
    alone = [decode_alone(mcl, inputs, k, num_beams=num_beams, min_new_tokens=2, do_sample=False) for k in range(K)]
    for i in range(rows):
        for k in range(K):
            assert outs[i][k].hypothesis == k
            assert outs[i][k].token_ids == alone[k][i], (i, k)
    # the hypotheses really differ, so the equality above is not vacuous
    assert any(len({tuple(outs[i][k].token_ids) for k in range(K)}) > 1 for i in range(rows))
    # the same log-probs as one hypothesis at a time through generate_hypotheses
    for k in range(K):
        single = generate_hypotheses(mcl, None, inputs, strategy=strategy, hypotheses=[k], **settings)
        for i in range(rows):
            assert single[i][0].token_ids == outs[i][k].token_ids
            assert single[i][0].log_prob == pytest.approx(outs[i][k].log_prob, abs=1e-4)


def test_subset_of_hypotheses_in_the_asked_order():
    mcl, inputs = mcl_case("llama")
    full = generate_hypotheses(mcl, None, inputs, max_new_tokens=NEW_TOKENS)
    subset = generate_hypotheses(mcl, None, inputs, hypotheses=[2, 0], max_new_tokens=NEW_TOKENS)
    for i in range(len(full)):
        assert [c.hypothesis for c in subset[i]] == [2, 0]
        assert [c.token_ids for c in subset[i]] == [full[i][2].token_ids, full[i][0].token_ids]


@pytest.mark.parametrize("strategy,num_beams", [("greedy", 1), ("beam", 2), ("sample", 1)])
def test_log_prob_is_the_raw_model_likelihood_of_the_candidate(strategy, num_beams):
    """log_prob = sum of log p_k(token | prefix) under hypothesis k, unprocessed (here with a repetition penalty),
    end-of-sequence token included, as recorded during generate for greedy search, beam search and sampling:
    checked by a teacher-forced forward of each candidate alone."""
    mcl, _, _, _ = wrapped_model("llama", num_hypotheses=K)
    randomize_adapters(mcl, std=0.5)
    prompts = torch.randint(3, 80, (2, 5), generator=torch.Generator().manual_seed(3))
    inputs = {"input_ids": prompts, "attention_mask": torch.ones_like(prompts)}
    settings = dict(strategy=strategy, num_beams=num_beams, max_new_tokens=NEW_TOKENS, repetition_penalty=1.3,
                    pad_token_id=0, seed=4)
    first = generate_hypotheses(mcl, None, inputs, log_probs=False, eos_token_id=10**6, **settings)[0][0]
    eos = first.token_ids[2]  # so that some candidates end early, their EOS counted
    outs = generate_hypotheses(mcl, None, inputs, eos_token_id=eos, **settings)
    ended = 0
    for i in range(2):
        for k in range(K):
            candidate = outs[i][k]
            tokens = candidate.token_ids + ([eos] if len(candidate.token_ids) < NEW_TOKENS else [])
            ended += len(tokens) > len(candidate.token_ids)
            sequence = torch.tensor([prompts[i].tolist() + tokens])
            with torch.no_grad():
                logits = mcl(input_ids=sequence, hypotheses=k).logits[0]  # [T, V]
            log_probs = logits[4:-1].log_softmax(-1)  # predictions of the generated positions
            expected = log_probs.gather(1, torch.tensor(tokens).unsqueeze(1)).sum().item()
            assert candidate.log_prob == pytest.approx(expected, abs=1e-4)
    assert ended > 0


@pytest.mark.parametrize("name", ["llama", "t5"])
def test_teacher_forced_rescoring_equals_the_step_log_probs(name):
    """Diverse beam search keeps no step logits, so its log-probs come from one teacher-forced forward
    (``_rescore``): on beam-search outputs it must give the step logits' value, left padding and EOS included."""
    from loramcl.decoding import Decoding, candidates, strategies

    mcl, inputs = mcl_case(name)
    beam = Decoding(strategy="beam", num_beams=3, num_sequences=2, hypotheses=[1], max_new_tokens=NEW_TOKENS)
    outs = generate_hypotheses(mcl, None, inputs, decoding=beam, pad_token_id=0, eos_token_id=7)
    batch = strategies._prepare_inputs(mcl, None, inputs)
    kwargs = strategies._generate_kwargs(mcl, None, beam, 3, True, {"pad_token_id": 0, "eos_token_id": 7})
    decoder = candidates.Decoder(mcl, None, kwargs, seed=None, log_probs=True, routing=1)
    with decoder._routed():
        output = mcl.generate(**batch, **kwargs, num_return_sequences=2)
        generated = output.beam_indices >= 0  # [N, L]
        rescored = decoder._rescore(batch, output.sequences, generated, per_input=2)
    assert rescored == pytest.approx([c.log_prob for row in outs for c in row], abs=1e-4)


def test_string_prompts_are_left_padded_and_the_tokenizer_restored():
    tokenizer = word_tokenizer()
    mcl, _, _, _ = wrapped_model("llama", num_hypotheses=K)
    prompts = ["w5 w6 w7", "w9", "w10 w11 w12 w13 w14"]
    outs = generate_hypotheses(mcl, tokenizer, prompts, max_new_tokens=NEW_TOKENS)
    assert tokenizer.padding_side == "right"
    encoded = [tokenizer(p)["input_ids"] for p in prompts]
    for i, ids in enumerate(encoded):
        alone = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}
        for k in range(K):
            assert outs[i][k].token_ids == decode_alone(mcl, alone, k, do_sample=False)[0]
            assert outs[i][k].text == tokenizer.decode(outs[i][k].token_ids, skip_special_tokens=True)


def test_budget_gives_beam_b_over_k_per_hypothesis():
    mcl, inputs = mcl_case("llama")
    by_budget = generate_hypotheses(mcl, None, inputs, strategy="beam", budget=6, max_new_tokens=NEW_TOKENS)
    by_beams = generate_hypotheses(mcl, None, inputs, strategy="beam", num_beams=2, max_new_tokens=NEW_TOKENS)
    assert by_budget == by_beams


def test_decoding_runs_in_eval_mode_and_restores_the_mode():
    mcl, _, _, _ = wrapped_model("llama", num_hypotheses=K, dropout=0.5)
    inputs = left_padded_prompts()
    reference = generate_hypotheses(mcl.eval(), None, inputs, max_new_tokens=NEW_TOKENS)
    mcl.train()
    assert generate_hypotheses(mcl, None, inputs, max_new_tokens=NEW_TOKENS) == reference
    assert mcl.training


# ---- sampling ------------------------------------------------------------------------------------------------


def test_mcl_sampling_is_reproducible_and_leaves_the_global_rng_alone():
    mcl, inputs = mcl_case("llama")
    state = torch.get_rng_state()
    first = generate_hypotheses(mcl, None, inputs, strategy="sample", seed=3, max_new_tokens=NEW_TOKENS)
    assert torch.equal(torch.get_rng_state(), state)
    assert generate_hypotheses(mcl, None, inputs, strategy="sample", seed=3, max_new_tokens=NEW_TOKENS) == first
    other = generate_hypotheses(mcl, None, inputs, strategy="sample", seed=4, max_new_tokens=NEW_TOKENS)
    assert [[c.token_ids for c in row] for row in other] != [[c.token_ids for c in row] for row in first]


# A known next-token distribution over 6 tokens (the others get ~1e-13 in all).
SUPPORT = [10, 11, 12, 13, 14, 15]
PROBS = [0.40, 0.25, 0.15, 0.10, 0.06, 0.04]
# chi-square quantile 0.999 by degrees of freedom: a fixed-seed test that a correct sampler passes by far
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}


@pytest.fixture(scope="module")
def fixed_distribution_model():
    """A tiny Llama whose LM head ignores the hidden state: every step's logits are log(PROBS) on SUPPORT."""
    model = build_model("llama").eval()
    head = nn.Linear(model.config.hidden_size, VOCAB, bias=True)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.fill_(-30.0)
        head.bias[SUPPORT] = torch.tensor(PROBS).log()
    model.lm_head = head
    return model


def draw(model, draws_per_row=8, rows=500, **sampling) -> torch.Tensor:
    """Token frequencies over rows x draws_per_row draws ([VOCAB] counts); each step draws from the same law."""
    prompt = {"input_ids": torch.tensor([[5, 6]]), "attention_mask": torch.ones(1, 2, dtype=torch.long)}
    outs = generate_hypotheses(model, None, prompt, strategy="sample", num_sequences=rows, seed=0,
                               max_new_tokens=draws_per_row, min_new_tokens=draws_per_row, log_probs=False,
                               **sampling)
    tokens = torch.tensor([c.token_ids for c in outs[0]])  # [rows, draws]
    assert tokens.shape == (rows, draws_per_row)
    return torch.bincount(tokens.flatten(), minlength=VOCAB)


def assert_matches(counts: torch.Tensor, kept: list[int], weights: list[float]) -> None:
    """Only ``kept`` tokens drawn, with frequencies matching ``weights`` renormalised (chi-square at 0.999)."""
    total = counts.sum().item()
    assert counts[kept].sum().item() == total, f"tokens outside {kept} were drawn"
    expected = torch.tensor(weights, dtype=torch.float64) / sum(weights) * total
    chi2 = (((counts[kept].double() - expected) ** 2) / expected).sum().item()
    if len(kept) > 1:
        assert chi2 < CHI2_999[len(kept) - 1], (counts[kept].tolist(), expected.tolist())


def test_pure_sampling_matches_the_distribution(fixed_distribution_model):
    assert_matches(draw(fixed_distribution_model), SUPPORT, PROBS)


def test_top_k_keeps_the_k_most_likely_tokens(fixed_distribution_model):
    assert_matches(draw(fixed_distribution_model, top_k=3), SUPPORT[:3], PROBS[:3])


def test_top_p_keeps_the_smallest_nucleus(fixed_distribution_model):
    # cumulative mass 0.40, 0.65, 0.80: the smallest set with mass >= 0.7 is the 3 most likely tokens
    assert_matches(draw(fixed_distribution_model, top_p=0.7), SUPPORT[:3], PROBS[:3])


def test_typical_keeps_the_tokens_whose_surprise_is_closest_to_the_entropy(fixed_distribution_model):
    entropy = -sum(p * math.log(p) for p in PROBS)
    by_typicality = sorted(range(len(PROBS)), key=lambda j: abs(-math.log(PROBS[j]) - entropy))
    kept, mass = [], 0.0
    for j in by_typicality:  # the smallest typical set holding mass 0.35
        kept.append(j)
        mass += PROBS[j]
        if mass >= 0.35:
            break
    assert 0 not in kept  # the most likely token is not typical here: unlike top-k / top-p
    assert_matches(draw(fixed_distribution_model, typical_p=0.35), [SUPPORT[j] for j in kept],
                   [PROBS[j] for j in kept])


def test_temperature_sharpens_or_flattens(fixed_distribution_model):
    flattened = [p ** 0.5 for p in PROBS]  # temperature 2: p^(1/2), renormalised
    assert_matches(draw(fixed_distribution_model, temperature=2.0), SUPPORT, flattened)


# ---- single-model baselines -----------------------------------------------------------------------------------


def test_beam_baseline_returns_the_k_best_beams_of_one_generate():
    model = build_model("llama").eval()
    inputs = left_padded_prompts()
    outs = generate_hypotheses(model, None, inputs, strategy="beam", num_beams=4, num_sequences=3,
                               max_new_tokens=NEW_TOKENS, pad_token_id=0)
    with torch.no_grad():
        sequences = model.generate(**inputs, num_beams=4, num_return_sequences=3, max_new_tokens=NEW_TOKENS,
                                   do_sample=False, pad_token_id=0)
    expected = generated_tokens(model, sequences, inputs)
    assert [[c.token_ids for c in row] for row in outs] == [expected[3 * i:3 * i + 3] for i in range(3)]
    for row in outs:
        assert all(c.hypothesis is None for c in row)
        assert len({tuple(c.token_ids) for c in row}) == 3


def test_sampling_baseline_gives_k_reproducible_samples():
    model = build_model("llama").eval()
    inputs = left_padded_prompts()
    first = generate_hypotheses(model, None, inputs, strategy="sample", num_sequences=4, seed=0,
                                max_new_tokens=NEW_TOKENS)
    assert [len(row) for row in first] == [4, 4, 4]
    assert generate_hypotheses(model, None, inputs, strategy="sample", num_sequences=4, seed=0,
                               max_new_tokens=NEW_TOKENS) == first
    assert len({tuple(c.token_ids) for c in first[0]}) > 1


def test_baseline_on_one_hypothesis_of_an_mcl_model():
    mcl, inputs = mcl_case("llama")
    outs = generate_hypotheses(mcl, None, inputs, strategy="beam", num_beams=3, num_sequences=2, hypotheses=[1],
                               max_new_tokens=NEW_TOKENS, pad_token_id=0)
    with torch.no_grad(), mcl.use_hypotheses(1):
        sequences = mcl.generate(**inputs, num_beams=3, num_return_sequences=2, max_new_tokens=NEW_TOKENS,
                                 do_sample=False, pad_token_id=0)
    expected = generated_tokens(mcl.base_model, sequences, inputs)
    assert [[c.token_ids for c in row] for row in outs] == [expected[2 * i:2 * i + 2] for i in range(3)]
    assert all(c.hypothesis == 1 for row in outs for c in row)


def shift_tokens(inputs: dict, k: int) -> dict:
    """A text 'augmentation': shift every non-padding token id by k (k=0: the input itself)."""
    ids = torch.where(inputs["attention_mask"].bool(), (inputs["input_ids"] - 3 + k) % 77 + 3, inputs["input_ids"])
    return {**inputs, "input_ids": ids}


def pad_more(inputs: dict, k: int) -> dict:
    """Shifted tokens, plus k more left-padding columns: the perturbed batches differ in shape."""
    shifted = shift_tokens(inputs, k)
    pad = torch.zeros(shifted["input_ids"].shape[0], k, dtype=torch.long)
    return {"input_ids": torch.cat([pad, shifted["input_ids"]], 1),
            "attention_mask": torch.cat([pad, shifted["attention_mask"]], 1)}


@pytest.mark.parametrize("augment", [shift_tokens, pad_more])
def test_tta_decodes_each_perturbed_context_with_its_best_beam(augment):
    """Equal shapes: one generate over K*B rows; different shapes: one generate per context. Both equal
    decoding each perturbed context on its own."""
    model = build_model("llama").eval()
    inputs = left_padded_prompts()
    outs = generate_hypotheses(model, None, inputs, strategy="tta", augment=augment, num_sequences=K, num_beams=2,
                               max_new_tokens=NEW_TOKENS, pad_token_id=0)
    for k in range(K):
        perturbed = augment(inputs, k)
        with torch.no_grad():
            sequences = model.generate(**perturbed, num_beams=2, max_new_tokens=NEW_TOKENS, do_sample=False,
                                       pad_token_id=0)
        expected = generated_tokens(model, sequences, perturbed)
        assert [outs[i][k].token_ids for i in range(3)] == expected


def test_tta_with_spec_augment_on_audio_features():
    """K SpecAugment-masked copies of the audio features; with no generator of its own, spec_augment draws from
    torch's RNG, which ``seed`` makes reproducible."""
    from loramcl.decoding.augment import spec_augment

    model = build_model("qwen2_audio").eval()
    inputs, _ = build_batch("qwen2_audio", model)
    inputs = {k: v[:, :28] if k in ("input_ids", "attention_mask") else v for k, v in inputs.items()}  # audio + prompt
    seen = []

    def augment(batch, k):
        features = spec_augment(batch["input_features"], lengths=batch["feature_attention_mask"].sum(-1),
                                max_freq_width=4, max_time_width=20)
        seen.append(features)
        return {**batch, "input_features": features}

    settings = dict(strategy="tta", augment=augment, num_sequences=K, max_new_tokens=NEW_TOKENS, pad_token_id=0)
    outs = generate_hypotheses(model, None, inputs, **settings)
    assert [len(row) for row in outs] == [K, K]
    assert all(isinstance(c, Candidate) and c.log_prob < 0 for row in outs for c in row)
    assert not torch.equal(seen[0], seen[1]) and not torch.equal(seen[0], inputs["input_features"])
    assert generate_hypotheses(model, None, inputs, **settings) == outs
    assert all(torch.equal(a, b) for a, b in zip(seen[:K], seen[K:], strict=True))


# ---- diverse MCL decoding: hypothesis k is group k of one diverse beam search ----------------------------------------


def diverse_mcl_case(name: str):
    """An MCL model whose hypotheses differ a little (they often agree on a token, so the penalty acts) and its
    generation settings: a repetition penalty, and an end-of-sequence token that some candidates choose early."""
    mcl, inputs = mcl_case(name)
    randomize_adapters(mcl, std=0.05)
    settings = dict(num_beams=2, max_new_tokens=NEW_TOKENS, repetition_penalty=1.3, pad_token_id=0)
    settings |= dict(eos_token_id=49) if name == "llama" else dict(min_new_tokens=2)  # the random BART ends at once
    return mcl, inputs, settings


@pytest.mark.parametrize("name", ["llama", "bart"])
def test_diverse_mcl_without_penalty_is_beam_search_per_hypothesis(name):
    """λ = 0: hypothesis k's candidate is its best beam of a plain beam search with num_beams beams, token for
    token, with the same log-probability (here read from the step logits, there rescored by teacher forcing)."""
    mcl, inputs, settings = diverse_mcl_case(name)
    beam = generate_hypotheses(mcl, None, inputs, strategy="beam", **settings)
    diverse = generate_hypotheses(mcl, None, inputs, strategy="diverse_beam", diversity_penalty=0.0, **settings)
    for plain_row, diverse_row in zip(beam, diverse, strict=True):
        assert [c.hypothesis for c in diverse_row] == list(range(K))
        assert [c.token_ids for c in diverse_row] == [c.token_ids for c in plain_row]
        assert [c.log_prob for c in diverse_row] == pytest.approx([c.log_prob for c in plain_row], abs=1e-4)
    assert any(len({tuple(c.token_ids) for c in row}) > 1 for row in beam)  # the hypotheses differ
    if name == "llama":
        assert any(len(c.token_ids) < NEW_TOKENS for row in beam for c in row)  # some ended with eos


@pytest.mark.parametrize("name", ["llama", "bart"])
def test_diverse_mcl_hypothesis_depends_only_on_those_decoded_before_it(name):
    """Group k is penalised by groups 0..k-1 only, so the first hypothesis decoded is its own plain beam search and
    each prefix of the hypotheses decodes as it would alone, whatever λ; the later ones are pushed away."""
    mcl, inputs, settings = diverse_mcl_case(name)
    order = [2, 0, 1]
    diverse = generate_hypotheses(mcl, None, inputs, strategy="diverse_beam", diversity_penalty=2.0,
                                  hypotheses=order, **settings)
    prefix = generate_hypotheses(mcl, None, inputs, strategy="diverse_beam", diversity_penalty=2.0,
                                 hypotheses=order[:2], **settings)
    beam = generate_hypotheses(mcl, None, inputs, strategy="beam", hypotheses=order, **settings)
    for i, row in enumerate(diverse):
        assert [c.hypothesis for c in row] == order
        assert row[0].token_ids == beam[i][0].token_ids
        assert row[0].log_prob == pytest.approx(beam[i][0].log_prob, abs=1e-4)
        assert [c.token_ids for c in row[:2]] == [c.token_ids for c in prefix[i]]
    assert any(diverse[i][c].token_ids != beam[i][c].token_ids for i in range(len(beam)) for c in (1, 2))


def test_diverse_mcl_penalises_earlier_hypotheses_tokens_as_the_formula_says():
    """Hand-checkable: K = 3 identical hypotheses (fresh adapters, B = 0), greedy (one beam each), one new token.
    With the model's next-token log-probs ordered a > b > c (gaps g1 = a - b < g2 = a - c), hypothesis k takes
    argmax_y log p(y) - λ * #{hypotheses before k that took y}:
      λ < g1/2: a, a, a (even a - 2λ beats b);   g1/2 < λ < g1: a, a, b (a - 2λ < b);
      g1 < λ < g2: a, b, a (a - λ < b, then a - λ > b - λ and > c);   λ > g2: a, b, c (all different)."""
    mcl, _, _, _ = wrapped_model("llama", num_hypotheses=K)
    with torch.no_grad():
        for _, layer in mcl.mcl_layers():
            layer.lora_B.zero_()
    prompt = torch.tensor([[5, 9, 23, 41]])
    inputs = {"input_ids": prompt, "attention_mask": torch.ones_like(prompt)}
    with torch.no_grad():
        log_p = mcl(**inputs, hypotheses=0).logits[0, -1].log_softmax(-1)  # [V], every hypothesis alike
    top = log_p.topk(5)
    a, b, c = top.indices[:3].tolist()
    g1, g2 = (top.values[0] - top.values[1]).item(), (top.values[0] - top.values[2]).item()
    assert 0 < g1 < g2
    eos = top.indices[4].item()  # not among the tokens chosen here
    cases = [(0.4 * g1, [a, a, a]), (0.75 * g1, [a, a, b]), ((g1 + g2) / 2, [a, b, a]), (g2 + 1.0, [a, b, c]),
             (0.0, [a, a, a])]
    for penalty, expected in cases:
        outs = generate_hypotheses(mcl, None, inputs, strategy="diverse_beam", num_beams=1, max_new_tokens=1,
                                   diversity_penalty=penalty, eos_token_id=eos, pad_token_id=0)
        assert [cand.token_ids for cand in outs[0]] == [[t] for t in expected], penalty
        assert [cand.log_prob for cand in outs[0]] == pytest.approx([log_p[t].item() for t in expected], abs=1e-5)


# ---- equal budget and errors -------------------------------------------------------------------------------------


def test_equal_budget():
    budget = equal_budget(6, 3)
    assert (budget.mle_num_beams, budget.mcl_num_beams, budget.tta_num_beams) == (6, 2, 2)
    assert budget.num_beams("beam", mcl=True) == 2 and budget.num_beams("diverse_beam", mcl=False) == 6
    assert equal_budget(5, 5).mcl_num_beams == 1
    with pytest.raises(ValueError, match="cannot be split among K=3.*e.g. 6 or 9"):
        equal_budget(8, 3)
    with pytest.raises(ValueError, match="budget must be an integer >= 1"):
        equal_budget(0, 3)


@pytest.fixture(scope="module")
def mcl_and_plain():
    mcl, _, _, _ = wrapped_model("llama", num_hypotheses=K)
    return mcl, build_model("llama").eval(), left_padded_prompts()


@pytest.mark.parametrize("call,error,match", [
    (dict(inputs=[]), ValueError, "inputs is empty"),
    (dict(inputs={"input_ids": torch.zeros(0, 4, dtype=torch.long)}), ValueError, "empty batch"),
    (dict(inputs="one prompt"), TypeError, "wrap it in a list"),
    (dict(inputs=["a prompt"]), ValueError, "need a tokenizer"),
    (dict(strategy="nucleus"), ValueError, "unknown strategy 'nucleus'"),
    (dict(hypotheses=[0, 3]), ValueError, r"hypotheses \[3\] do not exist: this model has K=3"),
    (dict(hypotheses=[]), ValueError, "hypotheses is empty"),
    (dict(num_sequences=5), ValueError, "num_sequences=5 does not match the 3 hypotheses"),
    (dict(strategy="tta", num_beams=4), ValueError, "single-model baseline.*hypotheses=\\[k\\]"),
    (dict(strategy="diverse_beam", num_beams=2), ValueError, "needs diversity_penalty >= 0"),
    (dict(strategy="diverse_beam", num_beams=2, diversity_penalty=-0.5), ValueError,
     r"diversity_penalty must be a finite number in \[0, inf\), got -0.5"),
    (dict(strategy="diverse_beam", diversity_penalty=1.0), ValueError, "needs num_beams"),
    (dict(strategy="diverse_beam", budget=4, diversity_penalty=1.0), ValueError, "cannot be split among K=3"),
    (dict(strategy="diverse_beam", num_beams=2, diversity_penalty=1.0, num_beam_groups=2), ValueError,
     "groups are the 3 hypotheses"),
    (dict(strategy="diverse_beam", num_beams=2, diversity_penalty=1.0, hypotheses=[1]), ValueError,
     "needs 2 or more hypotheses.*hypotheses=\\[k\\] and num_sequences"),
    (dict(strategy="beam"), ValueError, "needs num_beams"),
    (dict(strategy="beam", budget=7), ValueError, "cannot be split among K=3"),
    (dict(strategy="beam", budget=6, num_beams=2), ValueError, "not both"),
    (dict(strategy="greedy", num_beams=2), ValueError, "one beam"),
    (dict(num_return_sequences=2), ValueError, "set by generate_hypotheses"),
    (dict(augment=shift_tokens), ValueError, "augment belongs to strategy='tta'"),
])
def test_mcl_errors(mcl_and_plain, call, error, match):
    mcl, _, inputs = mcl_and_plain
    call = {"inputs": inputs, **call}
    with pytest.raises(error, match=match):
        generate_hypotheses(mcl, None, **call)


def test_a_decoding_object_and_its_fields_as_keywords_decode_alike(mcl_and_plain):
    """``decoding=Decoding(...)`` is the keywords' call; a keyword replaces that field of ``decoding``, and any other
    keyword goes to transformers' generate."""
    from loramcl.decoding import Decoding

    mcl, _, inputs = mcl_and_plain
    beam = Decoding(strategy="beam", num_beams=2, max_new_tokens=NEW_TOKENS, repetition_penalty=1.3)
    by_object = generate_hypotheses(mcl, None, inputs, decoding=beam, pad_token_id=0)
    by_keywords = generate_hypotheses(mcl, None, inputs, strategy="beam", num_beams=2, max_new_tokens=NEW_TOKENS,
                                      repetition_penalty=1.3, pad_token_id=0)
    assert [[c.token_ids for c in row] for row in by_object] == [[c.token_ids for c in row] for row in by_keywords]
    greedy = generate_hypotheses(mcl, None, inputs, decoding=beam, strategy="greedy", num_beams=None, pad_token_id=0,
                                 min_new_tokens=NEW_TOKENS)
    alone = decode_alone(mcl, inputs, 1, num_beams=1, do_sample=False, repetition_penalty=1.3,
                         min_new_tokens=NEW_TOKENS)
    assert [row[1].token_ids for row in greedy] == alone
    assert all(len(c.token_ids) == NEW_TOKENS for row in greedy for c in row)  # min_new_tokens reached generate
    with pytest.raises(ValueError, match="unknown strategy 'nucleus'"):
        Decoding(strategy="nucleus")
    with pytest.raises(TypeError, match="must be a loramcl.decoding.Decoding"):
        generate_hypotheses(mcl, None, inputs, decoding={"strategy": "beam"})


def test_diverse_beam_on_a_one_hypothesis_mcl_model_is_the_single_model_baseline():
    """K = 1 is LoRA-MLE: no hypotheses to diversify, so diverse MCL decoding is refused, while diverse beam search
    of the single model (num_sequences) runs, through the adapter."""
    mcl, pristine, _, _ = wrapped_model("llama", num_hypotheses=1)
    plain = generate_hypotheses(copy.deepcopy(pristine), None, left_padded_prompts(), num_sequences=2,
                                strategy="diverse_beam", num_beams=2, diversity_penalty=1.0, max_new_tokens=3,
                                pad_token_id=0)
    settings = dict(strategy="diverse_beam", num_beams=2, diversity_penalty=1.0, max_new_tokens=3, pad_token_id=0)
    with pytest.raises(ValueError, match="needs 2 or more hypotheses.*has K=1"):
        generate_hypotheses(mcl, None, left_padded_prompts(), **settings)
    outs = generate_hypotheses(mcl, None, left_padded_prompts(), num_sequences=2, **settings)
    assert [len(row) for row in outs] == [2, 2, 2]
    # the same adapter as a PEFT LoRA on the same base: the same candidates
    reference = generate_hypotheses(peft_reference(pristine, mcl).eval(), None, left_padded_prompts(),
                                    num_sequences=2, **settings)
    assert [[c.token_ids for c in row] for row in outs] == [[c.token_ids for c in row] for row in reference]
    assert [c.log_prob for row in outs for c in row] == pytest.approx([c.log_prob for row in reference for c in row],
                                                                      abs=1e-4)
    assert [c.log_prob for row in outs for c in row] != pytest.approx([c.log_prob for row in plain for c in row],
                                                                      abs=1e-4)  # the adapter acts


@pytest.mark.parametrize("call,match", [
    (dict(strategy="greedy", num_sequences=3), "greedy decoding gives one sequence"),
    (dict(strategy="beam", num_beams=4), "needs num_sequences=K"),
    (dict(strategy="beam", num_beams=2, num_sequences=3), "num_beams=2 < num_sequences=3"),
    (dict(strategy="tta", num_sequences=3), "needs augment"),
    (dict(strategy="diverse_beam", num_beams=5, num_sequences=3, diversity_penalty=1.0), "multiple of"),
    (dict(strategy="diverse_beam", num_beams=6, num_sequences=3), "needs diversity_penalty"),
    (dict(strategy="diverse_beam", num_beams=6, diversity_penalty=1.0), "needs num_sequences=K"),
    (dict(strategy="sample", num_sequences=3, hypotheses=[0]), "selects adapter sets of an MCLModel"),
    (dict(strategy="beam", num_sequences=2, budget=5), "cannot be split among K=2"),
])
def test_baseline_errors(mcl_and_plain, call, match):
    _, plain, inputs = mcl_and_plain
    with pytest.raises(ValueError, match=match):
        generate_hypotheses(plain, None, inputs, **call)


def test_right_padded_batch_for_a_decoder_only_model_is_an_error(mcl_and_plain):
    mcl, _, _ = mcl_and_plain
    inputs, _ = build_batch("llama", mcl.base_model)  # a training batch: right-padded
    with pytest.raises(ValueError, match="right-padded.*pad on the left"):
        generate_hypotheses(mcl, None, inputs)


@pytest.mark.parametrize("bad_id", [500, -3])
def test_token_ids_outside_the_vocabulary_are_named_before_the_model_runs(bad_id):
    """torch's embedding lookup says only 'IndexError: index out of range in self'; the id, its row and the vocabulary
    size are named instead, in generate and in the scoring forward alike (-100 stays legal in labels)."""
    mcl, inputs = mcl_case("llama")
    inputs["input_ids"][1, 5] = bad_id
    message = rf"input_ids holds {bad_id} \(row 1, position 5\), outside this model's vocabulary of {VOCAB} tokens"
    with pytest.raises(ValueError, match=message):
        generate_hypotheses(mcl, None, inputs, max_new_tokens=NEW_TOKENS)
    with pytest.raises(ValueError, match=message), mcl.use_hypotheses(0):
        mcl.generate(inputs["input_ids"], max_new_tokens=NEW_TOKENS, pad_token_id=0)  # given positionally
    labels = torch.full_like(inputs["input_ids"], -100)
    labels[:, -1] = 5
    with pytest.raises(ValueError, match=message), torch.no_grad():
        mcl(**inputs, labels=labels)
    with pytest.raises(ValueError, match=message):  # a single model (no adapters, or PEFT's) too
        generate_hypotheses(build_model("llama"), None, inputs, strategy="beam", num_beams=2, num_sequences=2,
                            max_new_tokens=NEW_TOKENS)
    inputs["input_ids"][1, 5] = 7
    with torch.no_grad():
        assert torch.isfinite(mcl(**inputs, labels=labels).nll).all()


def test_a_placeholder_token_past_the_embeddings_is_not_out_of_vocabulary():
    """LLaVA-style configs may put the image token past the text embeddings (the model swaps it for image features
    before the lookup): that id passes the check, any other id past the vocabulary still fails."""
    from loramcl.mcl.compat import check_token_ids

    model = build_model("llava_next")
    model.config.image_token_id = 200
    check_token_ids(model, torch.tensor([[3, 200, 200, 5]]))
    with pytest.raises(ValueError, match=rf"input_ids holds 201 \(row 0, position 2\).*vocabulary of {VOCAB} tokens"):
        check_token_ids(model, torch.tensor([[3, 200, 201, 5]]))


def test_beams_come_best_first_by_the_length_normalised_beam_score_not_by_log_prob():
    """docs/guide/decoding.md: a single model's beams come in beam search's order, its score per generated token
    (length_penalty 1, EOS counted) after the logits processors; log_prob is the raw sum, so a shorter candidate with
    a higher log_prob may come later. length_penalty=0 ranks by the sum. Checked over end tokens that end beams early."""
    model = build_model("llama").eval()
    inputs = left_padded_prompts()
    unordered = 0
    for eos in range(3, 40, 3):
        for length_penalty in (1.0, 0.0):
            outs = generate_hypotheses(model, None, inputs, strategy="beam", num_beams=6, num_sequences=4,
                                       max_new_tokens=NEW_TOKENS, pad_token_id=0, eos_token_id=eos,
                                       length_penalty=length_penalty)
            for row in outs:
                lengths = [len(c.token_ids) + (len(c.token_ids) < NEW_TOKENS) for c in row]  # EOS counted
                scores = [c.log_prob / n ** length_penalty for c, n in zip(row, lengths, strict=True)]
                assert all(a >= b - 1e-4 for a, b in zip(scores, scores[1:])), (eos, length_penalty, scores)
                log_probs = [c.log_prob for c in row]
                unordered += any(a < b - 1e-4 for a, b in zip(log_probs, log_probs[1:]))
    assert unordered  # the default ranking differs from log_prob's somewhere: the test can tell them apart
