"""Hypothesis scores p(k | c), the mixture likelihood, random tie-breaking and the collapse warning (issue 17): all
options, off by default."""

import copy

import pytest
import torch
from conftest import randomize_adapters, wrapped_model
from tiny_models import build_model, token_rows, word_tokenizer
from transformers import TrainingArguments

from loramcl import MCLConfig, MCLTrainer, generate_hypotheses, get_mcl_model, load_mcl_model
from loramcl.mcl.losses import winners
from loramcl.mcl.scores import mixture_nll


def _dataset(n=16, length=8, seed=0):
    return token_rows(n, length, seed, prompt=3)


def _args(tmp_path, **overrides):
    values = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=3, learning_rate=5e-2,
                  report_to=[], use_cpu=True, save_strategy="no", logging_steps=1, disable_tqdm=True, seed=0,
                  data_seed=0)
    return TrainingArguments(**(values | overrides))


@pytest.mark.parametrize("name", ["llama", "t5", "llava_next"])
def test_scores_are_a_distribution_and_the_mixture_nll_a_log_sum_exp(name):
    mcl, _, inputs, labels = wrapped_model(name, scoring=True)
    with torch.no_grad():
        mcl.scoring_head.weight.normal_(0, 1.0)
        mcl.scoring_head.bias.copy_(torch.tensor([0.3, -0.2, 0.1]))
        out = mcl(**inputs, labels=labels)
    p = out.log_scores.exp()  # [B, K]
    torch.testing.assert_close(p.sum(dim=1), torch.ones(p.shape[0]))
    assert not torch.allclose(p, torch.full_like(p, 1 / 3))  # the scores depend on the hidden states
    tokens = (labels[:, 1:] != -100).sum(dim=1) if not mcl.config.is_encoder_decoder else (labels != -100).sum(1)
    direct = -torch.log((p.double() * torch.exp(-out.nll.double() * tokens[:, None])).sum(dim=1)) / tokens
    torch.testing.assert_close(out.mixture_nll.double(), direct, atol=1e-5, rtol=0)
    # oracle <= mixture <= the score-weighted NLL (Jensen)
    assert (out.nll.min(dim=1).values <= out.mixture_nll + 1e-6).all()
    assert (out.mixture_nll <= (p * out.nll).sum(dim=1) + 1e-6).all()


def test_mixture_nll_is_finite_for_extreme_likelihoods():
    log_scores = torch.log(torch.tensor([[0.5, 0.5], [1.0 - 1e-7, 1e-7]]))
    nll = torch.tensor([[1e4, 2e4], [50.0, 1.0]])
    value = mixture_nll(log_scores, nll, torch.tensor([200, 300]))
    assert torch.isfinite(value).all()
    assert value[0].item() == pytest.approx(1e4 + torch.log(torch.tensor(2.0)).item() / 200, rel=1e-6)


@pytest.mark.parametrize("loss, two_pass", [("wta", True), ("wta", False), ("relaxed", False)])
def test_scores_leave_the_hypotheses_training_bit_identical(tmp_path, loss, two_pass):
    trained = {}
    for scoring in (False, True):
        torch.manual_seed(0)
        mcl = get_mcl_model(build_model("llama"), MCLConfig(
            num_hypotheses=3, r=4, alpha=8, dropout=0.1, target_modules=["q_proj", "v_proj"], loss=loss,
            epsilon=0.1 if loss == "relaxed" else 0.0, scoring=scoring))
        randomize_adapters(mcl, std=0.05)
        # clipping active (gradient norms ~0.3): the head's gradients must not shrink the hypotheses' step
        MCLTrainer(mcl, args=_args(tmp_path, max_grad_norm=0.05), train_dataset=_dataset(),
                   two_pass_wta=two_pass).train()
        trained[scoring] = mcl
    for (_, off), (_, on) in zip(trained[False].mcl_layers(), trained[True].mcl_layers(), strict=True):
        assert torch.equal(off.lora_A, on.lora_A) and torch.equal(off.lora_B, on.lora_B)
    assert trained[True].scoring_head.weight.abs().sum() > 0  # the head did learn


def test_scored_candidates_carry_the_prefill_scores_and_sort(tmp_path):
    mcl, _, _, _ = wrapped_model("llama", scoring=True)
    with torch.no_grad():
        mcl.scoring_head.weight.normal_(0, 2.0)
    tok = word_tokenizer()
    prompts = ["w5 w6 w7", "w8 w9 w10"]  # same length: no padding
    outs = generate_hypotheses(mcl, tok, prompts, strategy="greedy", max_new_tokens=3)
    for prompt, candidates in zip(prompts, outs, strict=True):
        ids = tok([prompt], return_tensors="pt")["input_ids"]
        labels = torch.cat([torch.full_like(ids, -100), torch.tensor([[7]])], dim=1)
        with torch.no_grad():
            expected = mcl(input_ids=torch.cat([ids, torch.tensor([[7]])], dim=1), labels=labels).log_scores.exp()[0]
        assert [c.hypothesis for c in candidates] == [0, 1, 2]
        assert [c.score for c in candidates] == pytest.approx(expected.tolist(), abs=1e-5)
    beams = generate_hypotheses(mcl, tok, prompts, strategy="beam", num_beams=2, max_new_tokens=3)
    assert [c.score for c in beams[0]] == pytest.approx([c.score for c in outs[0]], abs=1e-5)
    diverse = generate_hypotheses(mcl, tok, prompts, strategy="diverse_beam", num_beams=2, diversity_penalty=1.0,
                                  max_new_tokens=3)  # diverse MCL decoding reads the same prefill
    assert [c.score for c in diverse[1]] == pytest.approx([c.score for c in outs[1]], abs=1e-5)
    ranked = generate_hypotheses(mcl, tok, prompts, strategy="greedy", max_new_tokens=3, sort_by_score=True)
    for candidates in ranked:
        assert [c.score for c in candidates] == sorted((c.score for c in candidates), reverse=True)
    subset = generate_hypotheses(mcl, tok, prompts, strategy="greedy", max_new_tokens=3, hypotheses=[2, 0])
    assert all(c.score is None for cands in subset for c in cands)  # p(k | c) needs all K hypotheses
    with pytest.raises(ValueError, match="sort_by_score needs an MCL model with hypothesis scores"):
        generate_hypotheses(wrapped_model("llama")[0], tok, prompts, max_new_tokens=2, sort_by_score=True)


def test_the_scoring_head_is_saved_checked_and_not_exported(tmp_path):
    from safetensors.torch import load_file

    mcl, pristine, inputs, labels = wrapped_model("llama", scoring=True)
    with torch.no_grad():
        mcl.scoring_head.weight.normal_()
    mcl.save_pretrained(tmp_path / "a")
    loaded = load_mcl_model(copy.deepcopy(pristine), tmp_path / "a")
    assert torch.equal(loaded.scoring_head.weight, mcl.scoring_head.weight)
    with torch.no_grad():
        expected = mcl(**inputs, labels=labels).mixture_nll
        torch.testing.assert_close(loaded(**inputs, labels=labels).mixture_nll, expected)
    plain = get_mcl_model(copy.deepcopy(pristine), MCLConfig(num_hypotheses=3, r=4, alpha=8,
                                                             target_modules=mcl.mcl_config.target_modules))
    with pytest.raises(ValueError, match="has hypothesis scores"):
        plain.load_adapters(tmp_path / "a")
    mcl.export_hypothesis(1, tmp_path / "peft")
    exported = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    assert exported and not any("scoring" in key for key in exported)  # a standard PEFT LoRA adapter


def test_random_tie_breaking_spreads_the_ties_and_keeps_strict_winners():
    tied = torch.zeros(3000, 3)
    torch.manual_seed(1)
    counts = torch.bincount(winners(tied, "random"), minlength=3)
    assert (counts > 900).all()  # uniform among the tied hypotheses
    assert (winners(tied, "lowest") == 0).all()  # the paper's rule
    nll = torch.tensor([[2.0, 1.0, 1.0], [0.5, 3.0, 0.7], [float("nan"), 1.0, 2.0]])
    picked = {tuple(winners(nll, "random").tolist()) for _ in range(20)}
    assert {p[0] for p in picked} == {1, 2} and {p[1] for p in picked} == {0} and {p[2] for p in picked} == {0}


def test_random_tie_breaking_shares_the_first_step_among_the_hypotheses(tmp_path):
    def first_win_rates(tie_break):
        torch.manual_seed(0)
        mcl = get_mcl_model(build_model("llama"), MCLConfig(num_hypotheses=3, r=4, target_modules=["q_proj"],
                                                            tie_break=tie_break))  # B = 0: every example a tie
        trainer = MCLTrainer(mcl, args=_args(tmp_path, max_steps=1, per_device_train_batch_size=16),
                             train_dataset=_dataset())
        trainer.train()
        log = next(e for e in trainer.state.log_history if "win_rate_h0" in e)
        return [log[f"win_rate_h{k}"] for k in range(3)]

    assert first_win_rates("lowest") == [1.0, 0.0, 0.0]
    assert max(first_win_rates("random")) < 0.7


def test_a_collapse_is_warned_once_and_a_healthy_run_is_not(tmp_path, recwarn):
    def run(collapsing):
        torch.manual_seed(0)
        mcl = get_mcl_model(build_model("llama"), MCLConfig(num_hypotheses=2, r=4, alpha=8, loss="wta",
                                                            tie_break="lowest",
                                                            target_modules=["q_proj", "v_proj", "down_proj"]))
        data = _dataset(32)
        if collapsing:  # the classic collapse: one mode (one example repeated), B = 0 so step 0 is a tie that
            data = data[:1] * 32  # hypothesis 0 wins; each step makes it better on that example, so it keeps winning
        else:
            randomize_adapters(mcl, std=0.05)
        trainer = MCLTrainer(mcl, args=_args(tmp_path, max_steps=8, learning_rate=1e-2), train_dataset=data,
                             collapse_window=4)
        trainer.train()
        return [w for w in recwarn.list if "hypothesis collapse" in str(w.message)]

    collapsed = run(collapsing=True)
    assert len(collapsed) == 1  # once, though the collapse lasts
    message = str(collapsed[0].message)
    assert "h1 (0.0%, NLL " in message and "loss='relaxed'" in message and "annealed" in message
    recwarn.clear()
    assert run(collapsing=False) == []


@pytest.mark.parametrize("values, message", [
    ({"scoring": 1}, "scoring must be True or False"),
    ({"scoring_weight": -1.0}, "scoring_weight must be a finite number"),
    ({"tie_break": "first"}, "tie_break must be one of"),
])
def test_option_validation(values, message):
    with pytest.raises(ValueError, match=message):
        MCLConfig(**values)


def test_ranking_quality_by_hand():
    from loramcl.metrics.ranking import ranking_quality

    scores = [[0.9, 0.1], [0.6, 0.4], [0.2, 0.8], [0.5, 0.5]]
    quality = ranking_quality(scores, [0, 1, 1, 0])  # top-1 right on items 0, 2, 3 (a tie goes to the first)
    assert quality["score_top1"] == 0.75 and quality["score_chance"] == 0.5
    # bins of 0.1: p=0.9 (won), 0.1 (lost), 0.6 (lost), 0.4 (won), 0.2 (lost), 0.8 (won), 0.5 and 0.5 (1 of 2 won)
    gaps = [(1, 0.1), (1, 0.1), (1, 0.6), (1, 0.6), (1, 0.2), (1, 0.2), (2, 0.0)]
    assert quality["score_ece"] == pytest.approx(sum(n * g for n, g in gaps) / 8)
    with pytest.raises(ValueError, match="summing to 1"):
        ranking_quality([[0.9, 0.3]], [0])


def write_base_and_training_pairs(folder) -> None:
    """A tiny random Llama with its tokenizer in folder/base, 24 training pairs in folder/train.jsonl."""
    import json

    torch.manual_seed(0)
    build_model("llama").save_pretrained(folder / "base")
    word_tokenizer().save_pretrained(folder / "base")
    rows = [{"prompt": f"w{5 + i % 7} w{20 + i % 5}", "target": f"w{40 + i % 3} w{60 + i % 4}"} for i in range(24)]
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_the_commands_write_and_read_scores_and_the_mixture_nll(tmp_path):
    import json

    from loramcl import DataConfig, TrainConfig
    from loramcl.decoding.predictions import generate
    from loramcl.metrics.evaluate import evaluate
    from loramcl.training.fit import train
    from loramcl.training.reference_nll import nll

    write_base_and_training_pairs(tmp_path)
    test = [{"id": i, "prompt": f"w{5 + i} w20", "references": [f"w4{i} w60", "w41"]} for i in range(4)]
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in test))
    adapters = train(model=str(tmp_path / "base"), out=str(tmp_path / "mcl"),
                     mcl=MCLConfig(num_hypotheses=2, r=4, alpha=8, target_modules=["q_proj", "v_proj"],
                                   loss="relaxed", epsilon=0.1, scoring=True),
                     data=DataConfig(train_file=str(tmp_path / "train.jsonl")),
                     training=TrainConfig(steps=4, batch_size=8, learning_rate=1e-2, scoring_learning_rate=5e-2),
                     threads=1)
    predictions = generate(model=str(tmp_path / "base"), input=str(tmp_path / "test.jsonl"), adapters=adapters,
                           out=str(tmp_path / "preds.jsonl"), max_new_tokens=3, progress=False)
    for line in open(predictions):
        assert sum(json.loads(line)["scores"]) == pytest.approx(1.0)
    scored = nll(model=str(tmp_path / "base"), adapters=adapters, input=str(tmp_path / "test.jsonl"),
                 out=str(tmp_path / "nll.jsonl"))
    lines = [json.loads(line) for line in open(scored)]
    assert all(len(r["mixture_nll"]) == len(r["nll"]) == 2 for r in lines)
    for record in lines:  # oracle <= mixture for every reference
        assert all(min(row) <= m + 1e-6 for row, m in zip(record["nll"], record["mixture_nll"], strict=True))
    paths = evaluate(predictions, str(tmp_path / "test.jsonl"), metrics="sacrebleu", nll=scored,
                     out=str(tmp_path / "eval"), tokenize=False)
    metrics = json.loads(open(paths["json"]).read())["metrics"]
    assert {"oracle_nll", "mixture_nll", "score_top1", "score_ece"} <= set(metrics)
    assert metrics["oracle_nll"] <= metrics["mixture_nll"]


def test_scores_fitted_to_a_finished_run_leave_its_hypotheses_as_they_were(tmp_path):
    import json

    from safetensors.torch import load_file

    from loramcl import DataConfig, TrainConfig
    from loramcl.mcl.adapter_files import WEIGHTS_NAME
    from loramcl.training.fit import train

    write_base_and_training_pairs(tmp_path)
    data = DataConfig(train_file=str(tmp_path / "train.jsonl"))
    run = train(model=str(tmp_path / "base"), out=str(tmp_path / "mcl"), data=data, threads=1,
                mcl=MCLConfig(num_hypotheses=2, r=4, alpha=8, target_modules=["q_proj", "v_proj"], loss="relaxed",
                              epsilon=0.1),
                training=TrainConfig(steps=4, batch_size=8, learning_rate=1e-2))
    scored = train(model=str(tmp_path / "base"), out=str(tmp_path / "scored"), data=data, threads=1, scores_for=run,
                   training=TrainConfig(steps=4, batch_size=8, learning_rate=1e-2, scoring_learning_rate=5e-2))
    before, after = load_file(f"{run}/{WEIGHTS_NAME}"), load_file(f"{scored}/{WEIGHTS_NAME}")
    assert set(after) - set(before) == {"scoring.weight", "scoring.bias"}
    assert all(torch.equal(before[name], after[name]) for name in before)  # the hypotheses, bit for bit
    assert after["scoring.weight"].abs().sum() > 0  # the head learned (from zero)
    record = json.loads((tmp_path / "scored" / "run.json").read_text())
    assert record["settings"]["mcl"]["scoring"] and record["settings"]["scores_for"] == run
    with pytest.raises(ValueError, match="leave out --mcl"):  # settings of its own (the defaults are no choice)
        train(model=str(tmp_path / "base"), out=str(tmp_path / "x"), data=data, scores_for=run,
              mcl=MCLConfig(num_hypotheses=3))
    with pytest.raises(FileNotFoundError, match="is not a finished LoRA-MCL run"):
        train(model=str(tmp_path / "base"), out=str(tmp_path / "x"), data=data, scores_for=str(tmp_path))
