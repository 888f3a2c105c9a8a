"""`loramcl train` / `loramcl nll` on prompt -> target JSONL: the tokenization generation will see, labels only on
the target, adapters and logs written, the K = 1 PEFT export, and reference NLLs equal to a direct computation."""

import contextlib
import io
import json
import re

import pytest
import torch
from tiny_models import CASES, build_model, save_tiny_run_inputs, word_tokenizer
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

from loramcl import DataConfig, MCLConfig, TrainConfig, load_mcl_model
from loramcl.cli import main
from loramcl.data.prompts import collate, encode_pairs, prompt_text
from loramcl.decoding import tokenize_prompts
from loramcl.training.fit import train
from loramcl.training.reference_nll import nll

TARGETS = ["q_proj", "v_proj"]


def test_pairs_keep_the_generation_prompt_and_label_only_the_target_and_its_end():
    tok = word_tokenizer()
    model = build_model("llama")
    rows = encode_pairs(tok, ["w5 w6", "w7"], ["w8 w9 w10", "w11"])
    for row, prompt in zip(rows, ["w5 w6", "w7"], strict=True):
        prompt_ids = tokenize_prompts(model, tok, [prompt])["input_ids"][0].tolist()  # what generate is given
        n = len(prompt_ids)
        assert row["input_ids"][:n] == prompt_ids and row["labels"][:n] == [-100] * n
        assert row["labels"][n:] == row["input_ids"][n:] and row["input_ids"][-1] == tok.eos_token_id
    assert rows[0]["input_ids"][-4:] == [8, 9, 10, tok.eos_token_id]
    cut = encode_pairs(tok, ["w5 w6"], ["w8 w9 w10"], max_length=4)[0]
    assert cut["input_ids"] == [5, 6, 8, 9] and cut["labels"] == [-100, -100, 8, 9]
    with pytest.raises(ValueError, match="the prompt alone has 2 tokens"):
        encode_pairs(tok, ["w5 w6"], ["w8"], max_length=2)
    batch = collate(rows, pad_token_id=0)
    assert batch["input_ids"].shape == (2, 6) and batch["attention_mask"][1].tolist() == [1, 1, 1, 0, 0, 0]
    assert batch["labels"][1].tolist() == [-100, 11, tok.eos_token_id, -100, -100, -100]


def test_chat_template_prompts_are_wrapped_once_without_extra_special_tokens():
    tok = word_tokenizer()
    tok.chat_template = ("{% for m in messages %}<s> {{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %} w4{% endif %}")
    assert prompt_text(tok, "w5", chat_template=True) == "<s> w5 w4"
    row = encode_pairs(tok, ["w5"], ["w8"], chat_template=True)[0]
    assert row["input_ids"] == [1, 5, 4, 8, tok.eos_token_id] and row["labels"][:3] == [-100] * 3


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("finetune")
    save_tiny_run_inputs(root, 24)
    test = [{"id": "a", "prompt": "w5 w20", "references": ["w40 w60", "w41"]}, {"id": "b", "prompt": "w6",
                                                                                 "references": "w42 w61 w62"}]
    (root / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in test))
    return root


@pytest.fixture(scope="module")
def trained(folders):
    """The MCL run (K = 2) the tests below read, trained once per module (or per worker of `pytest -n`), and the
    lines its training printed."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        train(model=str(folders / "base"), out=str(folders / "mcl"),
              mcl=MCLConfig(num_hypotheses=2, r=4, alpha=8, target_modules=TARGETS, loss="relaxed", epsilon=0.1),
              data=DataConfig(train_file=str(folders / "train.jsonl"), validation_file=str(folders / "train.jsonl")),
              training=TrainConfig(steps=12, batch_size=8, learning_rate=1e-2, eval_every=6, logging_steps=3),
              threads=1)
    return folders / "mcl", printed.getvalue()


@pytest.fixture(scope="module")
def exported(folders):
    """A K = 1 run, which `loramcl train` also exports as a PEFT adapter (OUT/peft)."""
    out = folders / "mle"
    train(model=str(folders / "base"), out=str(out), mcl=MCLConfig(num_hypotheses=1, r=8, alpha=16,
                                                                  target_modules=TARGETS),
          data=DataConfig(train_file=str(folders / "train.jsonl")),
          training=TrainConfig(steps=3, batch_size=8, learning_rate=1e-2), threads=1)
    return out


def test_train_writes_adapters_logs_and_learns(folders, trained):
    out, printed = trained
    assert re.search(r"^step 3: loss \d\.\d+, grad_norm [\d.e-]+, learning_rate [\d.e-]+, win_rate_h0 [\d.]+, "
                     r"win_rate_h1 [\d.]+, nll_h0 [\d.]+, nll_h1 [\d.]+, split_gap [\d.e-]+, initial_nll [\d.]+, "
                     r"tokens_per_second [\d.e+]+, labelled_tokens_per_second [\d.e+]+, step_time [\d.e-]+, "
                     r"epoch [\d.]+$", printed, re.M)  # numbers, not quoted strings
    assert "step 6: eval_loss " in printed and "'" not in printed
    log = json.loads((out / "train_log.json").read_text())
    evals = [e["eval_loss"] for e in log if "eval_loss" in e]
    assert len(evals) == 2 and evals[-1] < log[0]["loss"]  # it learned something on its own training data
    assert {"win_rate_h0", "win_rate_h1"} <= set(next(e for e in log if "loss" in e))
    run = json.loads((out / "run.json").read_text())
    assert run["settings"]["mcl"]["loss"] == "relaxed" and run["settings"]["training"]["steps"] == 12
    assert run["train_examples"] == 24 and run["trainable_parameters"] > 0
    assert not (out / "peft").exists()  # K > 1: the MCL folder is the checkpoint
    load_mcl_model(AutoModelForCausalLM.from_pretrained(folders / "base"), out)


def test_k1_run_exports_a_peft_adapter_equal_to_it(folders, exported):
    from peft import PeftModel

    out = exported
    mcl = load_mcl_model(AutoModelForCausalLM.from_pretrained(folders / "base"), out).eval()
    # B starts at 0: trained, it must not be, or the adapter would be the base model on both sides
    assert all(layer.lora_B.abs().max() > 1e-3 for _, layer in mcl.mcl_layers())
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folders / "base"), out / "peft").eval()
    ids = torch.tensor([[5, 20, 40, 60]])
    with torch.no_grad():
        logits = mcl(input_ids=ids).logits[:, 0]  # [1, T, V]
        torch.testing.assert_close(logits, peft(input_ids=ids).logits)
        base = AutoModelForCausalLM.from_pretrained(folders / "base").eval()(input_ids=ids).logits
    assert (logits - base).abs().max() > 1e-3  # the adapter changes the outputs: the comparison above has a subject


def test_nll_scores_every_reference_under_every_hypothesis(folders, trained, capsys):
    out = folders / "nll.jsonl"
    nll(model=str(folders / "base"), adapters=str(folders / "mcl"), input=str(folders / "test.jsonl"), out=str(out),
        batch_size=2, threads=1)
    assert "nll: 100%" in capsys.readouterr().err  # a progress bar (references scored), on stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in records] == ["a", "b"] and [len(r["nll"]) for r in records] == [2, 1]
    model = load_mcl_model(AutoModelForCausalLM.from_pretrained(folders / "base"), folders / "mcl").eval()
    tok = word_tokenizer()
    for k in range(2):  # direct: mean NLL of the target tokens + end of sequence under hypothesis k
        ids = torch.tensor([[5, 20, 41, tok.eos_token_id]])
        with torch.no_grad():
            log_probs = model(input_ids=ids).logits[0, k].log_softmax(-1)  # [T, V]
        expected = -(log_probs[1, 41] + log_probs[2, tok.eos_token_id]) / 2
        assert records[0]["nll"][1][k] == pytest.approx(expected.item(), abs=1e-5)


def test_bad_inputs_say_what_to_change(folders, exported, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "w5", "target": []}) + "\n")  # a list of references, but empty
    with pytest.raises(ValueError, match='bad.jsonl:1: "target" must be a non-empty list of references'):
        train(model=str(folders / "base"), out=str(tmp_path / "o"), mcl=MCLConfig(r=2),
              data=DataConfig(train_file=str(bad)))
    bad.write_text(json.dumps({"prompt": "w5"}) + "\n")
    with pytest.raises(ValueError, match='bad.jsonl:1 has "prompt" but no completion'):
        train(model=str(folders / "base"), out=str(tmp_path / "o"), mcl=MCLConfig(r=2),
              data=DataConfig(train_file=str(bad)))
    with pytest.raises(ValueError, match="not an MCL adapters folder"):
        nll(model=str(folders / "base"), adapters=str(folders / "mle" / "peft"), input=str(folders / "test.jsonl"))


def _adapters(folder):
    from safetensors.torch import load_file

    return load_file(folder / "mcl_adapters.safetensors")


def test_train_checkpoints_and_resumes_an_interrupted_run_exactly(folders, tmp_path):
    import shutil

    def run(out, resume=False, steps=8, learning_rate=1e-2):
        return train(model=str(folders / "base"), out=str(out), resume=resume,
                     mcl=MCLConfig(num_hypotheses=2, r=4, alpha=8, dropout=0.1, target_modules=TARGETS,
                                   loss="relaxed", epsilon=0.1),
                     data=DataConfig(train_file=str(folders / "train.jsonl")),
                     training=TrainConfig(steps=steps, batch_size=4, learning_rate=learning_rate, save_every=3,
                                          keep_checkpoints=2, logging_steps=2), threads=1)

    whole = tmp_path / "whole"
    run(whole)
    assert sorted(p.name for p in (whole / "checkpoints").glob("checkpoint-*")) == ["checkpoint-6", "checkpoint-8"]
    with pytest.raises(ValueError, match="already holds checkpoints.*--resume true"):
        run(whole)  # never overwritten by mistake
    with pytest.raises(ValueError, match=r"other settings \(training differ\)"):
        run(whole, resume=True, learning_rate=2e-2)

    interrupted = tmp_path / "interrupted"  # as if killed while writing checkpoint 8 (a half-written folder)
    shutil.copytree(whole / "checkpoints", interrupted / "checkpoints")
    (interrupted / "checkpoints" / "checkpoint-8" / "trainer_state.json").unlink()
    with pytest.warns(UserWarning, match="skipping the incomplete checkpoint .*checkpoint-8"):
        run(interrupted, resume=True)
    record = json.loads((interrupted / "run.json").read_text())
    assert record["resumed_from"] == "checkpoint-6"
    state = json.loads((whole / "checkpoints" / "checkpoint-6" / "trainer_state.json").read_text())
    before = state["stateful_callbacks"]["TrainingClock"]["attributes"]["earlier"]  # the first 6 steps' seconds
    assert record["seconds_before_resume"] == round(before, 1) and record["seconds"] > before  # the run's, all of it
    assert "seconds_before_resume" not in json.loads((whole / "run.json").read_text())  # not resumed
    resumed, expected = _adapters(interrupted), _adapters(whole)
    assert all(torch.equal(resumed[name], expected[name]) for name in expected)  # bit-identical, dropout included


@pytest.mark.parametrize("name", ["t5", "bart"])
def test_encoder_decoders_read_the_source_alone_and_learn_the_target(name, tmp_path, monkeypatch):
    """`loramcl train` on an encoder-decoder: the encoder sees the prompt as `loramcl generate` tokenizes it, never
    the target; the decoder is teacher-forced on the target (labels = target + end, decoder inputs derived by the
    model); `loramcl nll` gives each hypothesis's mean NLL of the reference, as the merged model's own loss."""
    import loramcl.models.load as loading

    torch.manual_seed(0)
    build_model(name).save_pretrained(tmp_path / "base")
    tok = word_tokenizer()
    tok.save_pretrained(tmp_path / "base")
    pairs = [(f"w{5 + i} w{20 + i % 3}", f"w{40 + i % 2} w{60 + i}") for i in range(6)]  # no token in both
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"prompt": p, "target": t}) + "\n" for p, t in pairs))
    seen = {"encoder": []}
    load_model = loading.load_model

    def load_and_watch(*args, **kwargs):
        model = load_model(*args, **kwargs)

        def watch(part):
            def hook(module, args, kwargs):
                ids, mask = kwargs["input_ids"], kwargs["attention_mask"]
                seen[part] += [row[m.bool()].tolist() for row, m in zip(ids, mask, strict=True)]
            return hook

        if hasattr(model, "get_encoder"):  # the base model train() wraps (nll loads adapters: not watched)
            model.get_encoder().register_forward_pre_hook(watch("encoder"), with_kwargs=True)
        return model

    monkeypatch.setattr(loading, "load_model", load_and_watch)
    train(model=str(tmp_path / "base"), out=str(tmp_path / "run"),
          mcl=MCLConfig(num_hypotheses=2, r=4, alpha=8, target_modules=CASES[name].targets),
          data=DataConfig(train_file=str(tmp_path / "train.jsonl")),
          training=TrainConfig(steps=2, batch_size=6, learning_rate=1e-2, save_every=0), threads=1)
    sources = {tuple(tok(p)["input_ids"]) for p, _ in pairs}  # what generate feeds the encoder
    assert seen["encoder"] and {tuple(row) for row in seen["encoder"]} == sources
    target_tokens = {i for _, t in pairs for i in tok(t, add_special_tokens=False)["input_ids"]}
    assert not target_tokens & {i for row in seen["encoder"] for i in row}  # the answer never leaks in

    rows = encode_pairs(tok, [p for p, _ in pairs], [t for _, t in pairs], encoder_decoder=True)
    assert [r["labels"] for r in rows] == [tok(t)["input_ids"] + [tok.eos_token_id] for _, t in pairs]
    base = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "base")
    batch = collate(rows[:2], pad_token_id=tok.pad_token_id)
    assert batch["labels"].shape == (2, 3) and batch["input_ids"].shape == (2, 2)
    decoder_inputs = base.prepare_decoder_input_ids_from_labels(labels=batch["labels"])
    assert decoder_inputs[:, 1:].tolist() == batch["labels"][:, :-1].tolist()  # teacher forcing on the target

    test = tmp_path / "test.jsonl"
    test.write_text(json.dumps({"id": "a", "prompt": pairs[0][0], "references": [pairs[0][1], "w41"]}) + "\n")
    nll(model=str(tmp_path / "base"), adapters=str(tmp_path / "run"), input=str(test), out=str(tmp_path / "n.jsonl"))
    scores = json.loads((tmp_path / "n.jsonl").read_text())["nll"]  # [2 references][K]
    mcl = load_mcl_model(AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "base"), tmp_path / "run").eval()
    for k in range(2):
        merged = mcl.merge_hypothesis(k).eval()
        for r, reference in enumerate([pairs[0][1], "w41"]):
            labels = torch.tensor([tok(reference)["input_ids"] + [tok.eos_token_id]])
            with torch.no_grad():
                expected = merged(input_ids=torch.tensor([tok(pairs[0][0])["input_ids"]]), labels=labels).loss
            assert scores[r][k] == pytest.approx(expected.item(), abs=1e-5)


def test_decoding_takes_the_prompt_format_of_the_training_run(folders, trained, tmp_path, capsys):
    """generate and nll format prompts as the run that trained the adapters did (its run.json), unless told
    otherwise, which contradicting the record is a warning; the PEFT export of a K = 1 run reads OUT/run.json."""
    import shutil

    from loramcl.decoding.predictions import generate
    from loramcl.utils.inputs import PromptFormatWarning, prompt_format

    base = tmp_path / "base"
    shutil.copytree(folders / "base", base)
    tok = word_tokenizer()
    tok.chat_template = ("{% for m in messages %}{{ '<s> w4 ' if m['role'] == 'user' else ' w3 ' }}{{ m['content'] }}"
                         "{% endfor %}{% if add_generation_prompt %} w3 {% endif %}")  # w3 opens an answer
    tok.save_pretrained(base)
    run = tmp_path / "run"
    shutil.copytree(folders / "mcl", run)
    (run / "run.json").write_text(json.dumps({"settings": {"data": {"chat_template": True}}}))
    test = str(folders / "test.jsonl")

    def scored(out, **kwargs):
        nll(model=str(base), adapters=str(run), input=test, out=str(tmp_path / out), **kwargs)
        return (tmp_path / out).read_text()

    recorded = scored("a.jsonl")
    assert recorded == scored("b.jsonl", chat_template=True)
    with pytest.warns(PromptFormatWarning, match=r"trained with chat_template true \(.*run.json\)"):
        assert scored("c.jsonl", chat_template=False) != recorded
    capsys.readouterr()
    main(["nll", "--model", str(base), "--adapters", str(run), "--input", test, "--out", str(tmp_path / "d.jsonl"),
          "--chat_template", "false"])  # the command line: one warning line
    assert [line for line in capsys.readouterr().err.splitlines() if "warning" in line] == [
        f"loramcl nll: warning: chat_template is false but the adapters were trained with chat_template true "
        f"({run / 'run.json'}): the prompts will not look like the training prompts (leave --chat_template out to "
        "use the training run's format)"]

    def decoded(out, **kwargs):
        generate(model=str(base), adapters=str(run), input=test, out=str(tmp_path / out), max_new_tokens=3,
                 progress=False, **kwargs)
        return (tmp_path / out).read_text()

    assert decoded("e.jsonl") == decoded("f.jsonl", chat_template=True)
    (run / "peft").mkdir()
    assert prompt_format(str(run / "peft"), None) is True and prompt_format(str(folders / "mcl"), None) is False
    assert prompt_format(None, None) is False


def test_train_says_whether_the_hypotheses_split_and_logs_its_speed(folders, capsys):
    """The verdict in the console, train_log.json and run.json; tokens per second and step time at every logging step
    of a CPU run (no GPU: no memory fields)."""
    out = folders / "verdict"
    main(["train", "--model", str(folders / "base"), "--out", str(out), "--data.train_file",
          str(folders / "train.jsonl"), "--mcl.num_hypotheses", "2", "--mcl.r", "4", "--mcl.target_modules",
          "[q_proj, v_proj]", "--training.steps", "6", "--training.batch_size", "8", "--training.logging_steps", "2",
          "--training.learning_rate", "1e-2", "--threads", "1"])
    printed = capsys.readouterr()
    run = json.loads((out / "run.json").read_text())
    judged = run["specialisation"]
    assert judged["kind"] in ("split", "not split", "partly collapsed") and judged["steps"][1] == 6
    assert judged["line"].startswith("specialisation: ") and judged["line"] in " ".join((printed.out + printed.err)
                                                                                          .split())
    log = json.loads((out / "train_log.json").read_text())
    assert log[-1] == {"step": 6, "specialisation": judged}
    training = [entry for entry in log if "loss" in entry]
    assert [entry["step"] for entry in training] == [2, 4, 6]
    for entry in training:
        assert entry["tokens_per_second"] > entry["labelled_tokens_per_second"] > 0 and entry["step_time"] > 0
        assert "peak_allocated_gb" not in entry and "mfu" not in entry
    assert "initial_nll" in training[0] and {"nll_h0", "nll_h1", "split_gap"} <= set(training[-1])


@pytest.mark.parametrize("case", ["two steps", "logging past the steps", "K = 1"])
def test_a_run_without_a_verdict_says_why(folders, case, capsys):
    """Issue 61: runs of 1-2 steps, or logging_steps past the steps, ended with no verdict and run.json's
    `specialisation: null`, and K = 1 with none at all: each now says why, in the console and run.json (train_log.json
    stays Trainer's log, closed by its train loss)."""
    out = folders / f"no-verdict-{case.replace(' ', '-')}"
    options = {"two steps": ["--training.steps", "2", "--training.logging_steps", "1"],
               "logging past the steps": ["--training.steps", "3"],  # logging_steps: 10
               "K = 1": ["--training.steps", "4", "--training.logging_steps", "1", "--mcl.num_hypotheses", "1",
                         "--mcl.epsilon", "0"]}[case]
    reason = {"two steps": "the run took 2 optimizer steps, and a verdict needs at least 4 (it compares the hypotheses "
                           "over the run's second half with its first step)",
              "logging past the steps": "no training step was logged, and the verdict reads the training logs: "
                                        "logging_steps 10 is more than the run's 3 steps, set "
                                        "--training.logging_steps 3 or less for one",
              "K = 1": "one hypothesis (K = 1), nothing to split"}[case]
    main(["train", "--model", str(folders / "base"), "--out", str(out), "--data.train_file",
          str(folders / "train.jsonl"), "--mcl.r", "4", "--mcl.target_modules", "[q_proj, v_proj]",
          "--training.batch_size", "8", "--training.warmup_steps", "0", "--threads", "1", *options])
    printed = capsys.readouterr()
    judged = json.loads((out / "run.json").read_text())["specialisation"]
    line = f"specialisation: no verdict: {reason}."
    assert judged == {"kind": "no verdict", "reason": reason, "line": line}
    assert line in printed.out.splitlines() and "specialisation" not in printed.err
    assert "train_loss" in json.loads((out / "train_log.json").read_text())[-1]


def test_a_warm_up_longer_than_the_run_is_said_and_the_verdict_does_not_advise_annealing(folders, capsys):
    """Issue 61: `--training.warmup_steps 100` on a short run trained far below its learning rate without a word,
    and the verdict then advised annealing and more steps: a warning now gives the rate reached, and the verdict
    names the rate instead of changes of method."""
    out = folders / "long-warm-up"
    main(["train", "--model", str(folders / "base"), "--out", str(out), "--data.train_file",
          str(folders / "train.jsonl"), "--mcl.r", "4", "--mcl.target_modules", "[q_proj, v_proj]",
          "--training.steps", "6", "--training.batch_size", "8", "--training.logging_steps", "2",
          "--training.learning_rate", "1e-2", "--training.warmup_steps", "100", "--threads", "1"])
    err = capsys.readouterr().err
    assert ("loramcl train: warning: the learning rate never reaches the 0.01 set: warmup_steps 100 outlasts the "
            "run's 6 steps, whose last trains at 0.0005 (5% of it); set --training.warmup_steps below "
            "--training.steps (e.g. 0) for the run to train at its learning rate") in err.splitlines()
    judged = json.loads((out / "run.json").read_text())["specialisation"]
    assert judged["kind"] == "not split" and judged["line"] in " ".join(err.split())  # nothing learned at 5%
    assert judged["line"].endswith("But the learning rate never reaches the 0.01 set: warmup_steps 100 outlasts the "
                                   "run's 6 steps, whose last trains at 0.0005 (5% of it): train at the rate set "
                                   "(--training.warmup_steps below --training.steps) before changing the method.")
    assert "annealed" not in judged["line"] and "more steps" not in judged["line"]
