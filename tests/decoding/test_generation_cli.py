"""`loramcl generate`: a JSONL of prompts in, the K candidates per prompt out (the format `loramcl evaluate` reads)."""

import json

import pytest
import torch
from conftest import randomize_adapters
from jsonargparse import CLI
from tiny_models import build_model, word_tokenizer
from transformers import AutoModelForCausalLM

from loramcl import MCLConfig, get_mcl_model, load_mcl_model
from loramcl.decoding import generate_hypotheses
from loramcl.decoding.predictions import generate

PROMPTS = ["w5 w6 w7", "w9", "w10 w11 w12 w13 w14"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny Llama + tokenizer folder, its MCL adapters (K=3) and hypothesis 1 exported as a PEFT adapter."""
    root = tmp_path_factory.mktemp("generate")
    torch.manual_seed(0)
    base = build_model("llama")
    base.save_pretrained(root / "base")
    word_tokenizer().save_pretrained(root / "base")
    mcl = get_mcl_model(base, MCLConfig(num_hypotheses=3, r=4, alpha=8, target_modules=["q_proj", "v_proj"]))
    randomize_adapters(mcl, std=0.5)
    mcl.save_pretrained(root / "mcl")
    mcl.export_hypothesis(1, root / "peft")
    with open(root / "prompts.jsonl", "w") as f:
        for i, prompt in enumerate(PROMPTS):
            f.write(json.dumps({"id": f"p{i}", "prompt": prompt}) + "\n")
    return root


def read(path) -> list[dict]:
    return [json.loads(line) for line in open(path)]


def test_mcl_adapters_give_one_candidate_per_hypothesis(saved, capsys):
    out = saved / "mcl_preds.jsonl"
    CLI(generate, args=["--model", str(saved / "base"), "--adapters", str(saved / "mcl"), "--input",
                        str(saved / "prompts.jsonl"), "--out", str(out), "--strategy", "beam", "--num_beams", "2",
                        "--max_new_tokens", "5", "--repetition_penalty", "1.1", "--batch_size", "2"],
        as_positional=False)
    printed = capsys.readouterr()
    assert str(out) in printed.out
    assert "generate: 100%" in printed.err and "3/3" in printed.err  # the progress bar, on stderr
    records = read(out)
    assert [r["id"] for r in records] == ["p0", "p1", "p2"]
    assert all(r["hypotheses"] == [0, 1, 2] and len(r["candidates"]) == len(r["log_probs"]) == 3 for r in records)

    mcl = load_mcl_model(AutoModelForCausalLM.from_pretrained(saved / "base"), saved / "mcl")
    outs = generate_hypotheses(mcl, word_tokenizer(), PROMPTS, strategy="beam", num_beams=2, max_new_tokens=5,
                               repetition_penalty=1.1)
    assert [r["candidates"] for r in records] == [[c.text for c in row] for row in outs]
    logged = [value for r in records for value in r["log_probs"]]
    assert logged == pytest.approx([c.log_prob for row in outs for c in row], abs=1e-4)


def test_diverse_mcl_decoding_from_the_command_line(saved):
    """--strategy diverse_beam with MCL adapters is diverse MCL decoding (--num_beams per hypothesis)."""
    out = saved / "dbs_preds.jsonl"
    generate(model=str(saved / "base"), adapters=str(saved / "mcl"), input=str(saved / "prompts.jsonl"),
             out=str(out), strategy="diverse_beam", budget=6, diversity_penalty=1.0, max_new_tokens=5)
    mcl = load_mcl_model(AutoModelForCausalLM.from_pretrained(saved / "base"), saved / "mcl")
    outs = generate_hypotheses(mcl, word_tokenizer(), PROMPTS, strategy="diverse_beam", num_beams=2,
                               diversity_penalty=1.0, max_new_tokens=5)
    records = read(out)
    assert all(r["hypotheses"] == [0, 1, 2] for r in records)
    assert [r["candidates"] for r in records] == [[c.text for c in row] for row in outs]


def test_peft_adapter_is_a_single_model_baseline(saved):
    """A PEFT adapter decodes as the hypothesis it was exported from (its best beam, token for token), not as the
    base model; sampling gives num_sequences seeded candidates."""
    beams = saved / "peft_beams.jsonl"
    generate(model=str(saved / "base"), adapters=str(saved / "peft"), input=str(saved / "prompts.jsonl"),
             out=str(beams), strategy="beam", num_beams=2, num_sequences=2, max_new_tokens=5)
    best = [r["candidates"][0] for r in read(beams)]
    mcl = load_mcl_model(AutoModelForCausalLM.from_pretrained(saved / "base"), saved / "mcl")
    hypothesis = generate_hypotheses(mcl, word_tokenizer(), PROMPTS, strategy="beam", num_beams=2, hypotheses=[1],
                                     max_new_tokens=5)
    base = generate_hypotheses(AutoModelForCausalLM.from_pretrained(saved / "base"), word_tokenizer(), PROMPTS,
                               strategy="beam", num_beams=2, num_sequences=2, max_new_tokens=5)
    assert best == [row[0].text for row in hypothesis]
    assert best != [row[0].text for row in base]

    out = saved / "peft_preds.jsonl"
    generate(model=str(saved / "base"), adapters=str(saved / "peft"), input=str(saved / "prompts.jsonl"),
             out=str(out), strategy="sample", num_sequences=4, max_new_tokens=5, top_k=10)
    records = read(out)
    assert all(len(r["candidates"]) == 4 and "hypotheses" not in r for r in records)
    again = saved / "peft_preds_again.jsonl"
    generate(model=str(saved / "base"), adapters=str(saved / "peft"), input=str(saved / "prompts.jsonl"),
             out=str(again), strategy="sample", num_sequences=4, max_new_tokens=5, top_k=10)
    assert read(again) == records  # seeded


def test_bad_files_are_clear_errors(saved, tmp_path):
    with pytest.raises(FileNotFoundError, match="neither MCL adapters"):
        generate(model=str(saved / "base"), adapters=str(tmp_path), input=str(saved / "prompts.jsonl"),
                 out=str(tmp_path / "x.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1, "text": "w5"}\n')
    with pytest.raises(ValueError, match='must be an object with "prompt"'):
        generate(model=str(saved / "base"), input=str(bad), out=str(tmp_path / "x.jsonl"))
    bad.write_text('{"prompt": ["w5"]}\n')
    with pytest.raises(ValueError, match='"prompt" must be a text or a list of'):
        generate(model=str(saved / "base"), input=str(bad), out=str(tmp_path / "x.jsonl"))


def test_adapters_on_a_base_with_other_weights_are_warned_by_each_command(saved, tmp_path, capsys):
    """`loramcl generate` and `loramcl nll` load adapters through load_mcl_model: silent on the base they were saved
    on, one warning line naming the mismatch on a base of the same class and shapes with other weights, an error
    with --strict true."""
    import warnings

    from loramcl.cli import main

    torch.manual_seed(1)
    build_model("llama").save_pretrained(tmp_path / "other")
    word_tokenizer().save_pretrained(tmp_path / "other")
    references = tmp_path / "refs.jsonl"
    references.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p, "references": ["w20 w21"]}) + "\n"
                                  for i, p in enumerate(PROMPTS)))
    commands = {"generate": ["--input", str(saved / "prompts.jsonl"), "--max_new_tokens", "2", "--progress", "false"],
                "nll": ["--input", str(references)]}
    for command, options in commands.items():
        for base in (saved / "base", tmp_path / "other"):
            with warnings.catch_warnings():
                warnings.simplefilter("always")  # not once per line of code: each command loads on its own
                main([command, "--model", str(base), "--adapters", str(saved / "mcl"), *options,
                      "--out", str(tmp_path / f"{command}.jsonl")])
            warned = [line for line in capsys.readouterr().err.splitlines() if ": warning: " in line]
            if base == saved / "base":
                assert warned == [], warned
            else:
                assert len(warned) == 1 and warned[0].startswith(f"loramcl {command}: warning: the adapters in "), \
                    warned
                assert "were trained on other base weights" in warned[0] and "every output of this pairing is " \
                    "wrong" in warned[0]
        with pytest.raises(SystemExit) as stopped:  # --strict true: an error before anything is decoded or scored
            main([command, "--model", str(tmp_path / "other"), "--adapters", str(saved / "mcl"), *options,
                  "--out", str(tmp_path / f"strict_{command}.jsonl"), "--strict", "true"])
        error = capsys.readouterr().err.strip().splitlines()[-1]
        assert stopped.value.code == 1 and error.startswith(f"loramcl {command}: error: the adapters in "), error
        assert not (tmp_path / f"strict_{command}.jsonl").exists()


def spelling_tokenizer():
    """A word-level tokenizer of the tiny models' vocabulary whose words are spellings of two answers: even ids
    "deposit" (deposit, Deposit, dEposit, ...: other cases of its letters), odd ids "depositing"; so two different
    beams of one token are often one answer, and any 4 candidates hold a repeat (3 texts at most with "")."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    def spelling(word: str, n: int) -> str:  # the n-th case pattern of ``word``
        return "".join(c.upper() if n >> i & 1 else c for i, c in enumerate(word))

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2} | {spelling("deposit" if i % 2 == 0 else "depositing", i // 2): i
                                                 for i in range(3, 97)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="</s>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def test_dedupe_keeps_each_answer_once_and_fills_from_the_spare_beams(saved, tmp_path, capsys):
    from loramcl.metrics.short_answers import normalise_answer

    model = tmp_path / "spellings"
    AutoModelForCausalLM.from_pretrained(saved / "base").save_pretrained(model)
    spelling_tokenizer().save_pretrained(model)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["deposit", "Deposit depositing", "x"]))
    options = dict(model=str(model), input=str(prompts), strategy="beam", max_new_tokens=1, num_sequences=4)
    plain = read(generate(out=str(tmp_path / "plain.jsonl"), num_beams=4, **options))
    assert all(len({normalise_answer(c) for c in r["candidates"]}) < 4 for r in plain)  # one word twice, or more
    every = read(generate(out=str(tmp_path / "every.jsonl"), num_beams=8, **{**options, "num_sequences": 8}))
    capsys.readouterr()
    deduped = read(generate(out=str(tmp_path / "deduped.jsonl"), num_beams=8, dedupe=True, **options))
    for all_beams, row in zip(every, deduped, strict=True):
        seen, expected = set(), []
        for text, log_prob in zip(all_beams["candidates"], all_beams["log_probs"], strict=True):
            if normalise_answer(text) not in seen:
                seen.add(normalise_answer(text))
                expected.append((text, log_prob))
        assert list(zip(row["candidates"], row["log_probs"], strict=True)) == expected[:4]  # first of each, in order
        assert "hypotheses" not in row
    fewer = sum(len(r["candidates"]) < 4 for r in deduped)
    assert f"--dedupe: {fewer} of 3 prompts have fewer than 4 distinct candidates" in capsys.readouterr().out


def test_a_single_model_names_no_hypothesis_k1_included(saved, tmp_path):
    """The decoding guide: hypothesis None for a single model; an MCL model with K = 1 (LoRA-MLE) is one."""
    base = AutoModelForCausalLM.from_pretrained(saved / "base")
    mle = get_mcl_model(base, MCLConfig(num_hypotheses=1, r=4, alpha=8, target_modules=["q_proj", "v_proj"]))
    mle.save_pretrained(tmp_path / "mle")
    beams = read(generate(model=str(saved / "base"), adapters=str(tmp_path / "mle"), input=str(saved / "prompts.jsonl"),
                          out=str(tmp_path / "mle.jsonl"), strategy="beam", num_beams=3, num_sequences=3,
                          max_new_tokens=3))
    greedy = read(generate(model=str(saved / "base"), adapters=str(tmp_path / "mle"), input=str(saved / "prompts.jsonl"),
                           out=str(tmp_path / "greedy.jsonl"), max_new_tokens=3))
    assert all("hypotheses" not in r for r in beams + greedy)
    assert len(beams[0]["candidates"]) == 3 and len(greedy[0]["candidates"]) == 1


def test_compile_decodes_the_same_candidates_on_a_static_cache(saved, monkeypatch):
    """--compile true: the steps compiled (aot_eager here: the same graphs without inductor's C++ build), the same
    candidates and log-probabilities as eager decoding."""
    from loramcl.decoding import compiled

    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    records = {}
    for flag in ("false", "true"):
        out = saved / f"compile_{flag}.jsonl"
        CLI(generate, args=["--model", str(saved / "base"), "--adapters", str(saved / "mcl"), "--input",
                            str(saved / "prompts.jsonl"), "--out", str(out), "--max_new_tokens", "4", "--compile",
                            flag], as_positional=False)
        records[flag] = read(out)
    compiled_frames = torch._dynamo.utils.counters["frames"]["ok"]
    torch._dynamo.reset()
    assert compiled_frames > 0
    assert [r["candidates"] for r in records["true"]] == [r["candidates"] for r in records["false"]]
    assert [v for r in records["true"] for v in r["log_probs"]] == pytest.approx(
        [v for r in records["false"] for v in r["log_probs"]], abs=1e-5)
