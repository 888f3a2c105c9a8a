"""Nothing silent (issue 36, 35.5): every bad value is refused before the work starts, in one line that names the
option as typed and its bound. The commands' usual mistakes are rows of docs/guide/cli.md (tests/test_cli.py runs them,
most before torch loads); here, the checks behind them: Decoding's bounds and its checks against the adapters, the
configurations' values that would train nothing, the model's positions, the output paths, the devices, the threads,
the rank against each layer and K (E, the copies of a module) against the memory."""

import json
import os
import re

import pytest
import torch
from tiny_models import build_model, word_tokenizer

from loramcl import MCLConfig, get_mcl_model
from loramcl.cli import main
from loramcl.decoding.options import DecodedModel, Decoding, plan
from loramcl.decoding.predictions import check_generated_positions, decoded_model_of
from loramcl.mcl.adapter_size import check_adapter_size, hypothesis_bytes
from loramcl.mcl.build import target_layer_names
from loramcl.mcl.layers import MCLLoraLinear
from loramcl.training.config import TrainConfig
from loramcl.training.fit import check_max_length
from loramcl.utils.inputs import PositionLimits, check_device, check_output, model_positions
from loramcl.utils.threads import check_threads, usable_cores, use_threads
from loramcl.utils.validate import OptionError


def run_main(argv, capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    return stopped.value.code, capsys.readouterr().err.strip().splitlines()[-1]


# ---- the decoding options: each with its bound ----------------------------------------------------------------

@pytest.mark.parametrize("field,value,bound", [
    ("top_p", 1.5, "in (0, 1]"), ("top_p", 0.0, "in (0, 1]"), ("typical_p", 2.0, "in (0, 1]"),
    ("temperature", 0.0, "in (0, inf)"), ("temperature", float("nan"), "in (0, inf)"), ("top_k", -1, ">= 0"),
    ("repetition_penalty", -1.0, "in (0, inf)"), ("max_new_tokens", 0, ">= 1"), ("num_beams", 0, ">= 1"),
    ("budget", -2, ">= 1"), ("num_sequences", 0, ">= 1"), ("num_beam_groups", 0, ">= 1"),
    ("seed", -1, "in [0, 2**32 - 1]"), ("seed", 2**32, "in [0, 2**32 - 1]"),
    ("diversity_penalty", -0.5, "in [0, inf)"), ("hypotheses", [0, -1], "integers >= 0"),
    ("hypotheses", [], "is empty: leave it out"),
    ("max_new_tokens", True, ">= 1"),  # a bool is not a number of tokens
    *[(name, 10**18, "must be at most 4096 (beams or candidates per input") for name in
      ("num_beams", "budget", "num_sequences", "num_beam_groups")],  # torch's sizes would overflow
])
def test_each_decoding_option_is_refused_out_of_its_bounds(field, value, bound):
    with pytest.raises(OptionError, match=f"^{field} .*{re.escape(bound)}") as error:
        Decoding(**{field: value})
    assert (error.value.option, error.value.owner) == (field, Decoding)


def test_the_decoding_bounds_keep_their_edges():
    Decoding(strategy="sample", top_p=1.0, typical_p=1.0, top_k=0, temperature=1e-3, seed=2**32 - 1, hypotheses=[0, 2])
    Decoding(strategy="diverse_beam", num_beams=4096, num_beam_groups=4096, diversity_penalty=0.0)


@pytest.mark.parametrize("options,option,message", [
    (dict(num_beams=3), "num_beams", "num_beams 3: strategy 'greedy' decodes one beam; use strategy 'beam'"),
    (dict(strategy="sample", budget=4), "budget", "budget 4: a forward budget sets beam sizes, and strategy 'sample' "
                                                  "has none"),
    (dict(strategy="beam", num_beams=2, budget=4), "num_beams", "num_beams 2 and budget 4: give one of them, not both"),
    (dict(strategy="beam"), "strategy", "strategy 'beam' needs num_beams (or a forward budget"),
    (dict(diversity_penalty=0.0), "diversity_penalty",
     "diversity_penalty 0.0 belongs to strategy 'diverse_beam' (strategy is 'greedy')"),
    (dict(strategy="beam", num_beams=2, num_beam_groups=2), "num_beam_groups", "num_beam_groups 2 belongs to"),
    (dict(strategy="diverse_beam", num_beams=2), "strategy", "strategy 'diverse_beam' needs diversity_penalty >= 0"),
    (dict(top_p=0.9), "top_p", "top_p 0.9 acts on strategy 'sample' only (strategy is 'greedy', which would ignore"),
    (dict(strategy="beam", num_beams=2, temperature=0.7), "temperature", "temperature 0.7 acts on strategy 'sample'"),
    (dict(strategy="diverse_beam", num_beams=2, diversity_penalty=1.0, top_k=50), "top_k", "top_k 50 acts on"),
])
def test_an_option_of_another_strategy_is_refused_whatever_the_model(options, option, message):
    """Checked by Decoding itself, so that `loramcl generate` refuses it before the model loads."""
    with pytest.raises(OptionError, match="^" + re.escape(message)) as error:
        Decoding(**options)
    assert error.value.option == option


@pytest.mark.parametrize("options,model,option,message", [
    (dict(hypotheses=[1, 2]), DecodedModel(2), "hypotheses", r"hypotheses \[2\] do not exist: this model has K=2"),
    (dict(hypotheses=[0]), DecodedModel(None, name="the base model"), "hypotheses",
     "hypotheses [0] selects adapter sets of an MCLModel; the base model has none"),
    (dict(num_sequences=3), DecodedModel(2), "num_sequences", "num_sequences=3 does not match the 2 hypotheses"),
    (dict(strategy="tta", num_sequences=2, hypotheses=[0]), DecodedModel(2), "strategy", "strategy 'tta' needs "
                                                                                          "augment"),
    (dict(strategy="stochastic_router", num_sequences=2), DecodedModel(2), "strategy",
     "strategy 'stochastic_router' samples the experts of a LoRA-MoE model"),
    (dict(strategy="diverse_beam", num_beams=1, diversity_penalty=1.0, num_beam_groups=3), DecodedModel(2),
     "num_beam_groups", "num_beam_groups 3: in diverse MCL decoding the groups are the 2 hypotheses"),
    (dict(strategy="beam", num_beams=2, num_sequences=3), DecodedModel(None), "num_sequences",
     "num_sequences 3 is more than the beams"),
    (dict(strategy="diverse_beam", num_beams=5, num_sequences=2, diversity_penalty=1.0), DecodedModel(None),
     "num_beam_groups", "num_beam_groups 2: diverse beam search splits num_beams=5"),
    (dict(strategy="beam", budget=3), DecodedModel(2), "budget", "budget 3 cannot be split among K=2"),
])
def test_a_decoding_is_checked_against_the_models_kind_and_k(options, model, option, message):
    with pytest.raises(OptionError, match="^" + (message if "\\" in message else re.escape(message))) as error:
        plan(Decoding(**options), model)
    assert error.value.option == option
    decoded = plan(Decoding(strategy="beam", budget=4), DecodedModel(2))
    assert (decoded.selected, decoded.mcl, decoded.num_beams) == ([0, 1], True, 2)
    decoded = plan(Decoding(strategy="beam", budget=4, num_sequences=2), DecodedModel(None))
    assert (decoded.selected, decoded.mcl, decoded.num_beams) == (None, False, 4)


def test_the_learning_rate_past_any_recipe_is_refused():
    """AdamW's step is about the learning rate for every weight: past 1 training diverges (issue 36: 1e30 trained and
    wrote adapters at 1e29). The packaged recipes use at most 1e-3, the Markov scores head 1e-2."""
    TrainConfig(learning_rate=1.0)
    for name in ("learning_rate", "scoring_learning_rate"):
        with pytest.raises(OptionError, match=rf"^{name} must be a finite number in \(0, 1\] \(AdamW"):
            TrainConfig(**{name: 1e30})


def test_the_command_line_names_the_option_as_typed(capsys):
    """The error's field is named as the user typed it: the configuration's group (`--moe.r`, not `r`; a baseline's
    configuration checks its fields through an MCLConfig), a command's own argument (`--batch_size`)."""
    train = ["train", "--model", "m", "--out", "o", "--data.train_file", "t.jsonl"]
    assert run_main([*train, "--method", "moe", "--moe.r", "0"], capsys) == (
        1, "loramcl train: error: --moe.r (LoRA rank) must be an integer >= 1, got 0")
    assert run_main([*train, "--method", "multihead", "--multihead.loss", "relaxed", "--multihead.epsilon", "0.7"],
                    capsys)[1].startswith("loramcl train: error: --multihead.epsilon must be in [0, (K-1)/K]")
    assert run_main([*train, "--training.scoring_learning_rate", "3"], capsys)[1].startswith(
        "loramcl train: error: --training.scoring_learning_rate must be a finite number in (0, 1]")
    assert run_main(["generate", "--model", "m", "--input", "i", "--batch_size", "0"], capsys) == (
        1, "loramcl generate: error: --batch_size must be an integer >= 1, got 0")


@pytest.mark.parametrize("options,message", [
    # the adapters' scaling (recipes: alpha/r from 1 to 4; at 1e30 every gradient norm is infinite)
    (["--mcl.alpha", "1e30"], "--mcl.alpha 1e+30 scales the adapter output by alpha/r = 1.25e+29, more than 100: set "
                              "alpha at most 800"),
    (["--mcl.r", "4", "--mcl.use_rslora", "true", "--mcl.alpha", "201"], "--mcl.alpha 201 scales the adapter output "
                                                                         "by alpha/sqrt(r) = 100.5"),
    (["--method", "moe", "--moe.alpha", "1e30"], "--moe.alpha 1e+30 scales the adapter output by alpha/r"),
    # a value that would be ignored
    (["--mcl.loss", "wta", "--mcl.epsilon", "0.1"], "--mcl.epsilon 0.1 is relaxed WTA's weight, and loss is 'wta': "
                                                    "set loss relaxed, or leave epsilon out"),
    (["--method", "multihead", "--multihead.loss", "annealed", "--multihead.epsilon", "0.1"],
     "--multihead.epsilon 0.1 is relaxed WTA's weight, and loss is 'annealed'"),
    (["--mcl.scoring_weight", "2"], "--mcl.scoring_weight 2.0 weighs the hypothesis scores' loss, and scoring is off"),
    (["--method", "moe", "--moe.router_std", "0.1"], "--moe.router_std 0.1 draws the router's initial weights when "
                                                     "router_init is 'normal', and router_init is 'zeros'"),
    # a value that trains nothing, or wrecks every step
    (["--mcl.loss", "annealed", "--mcl.temperature_min", "1"], "--mcl.temperature_min 1.0 is not below temperature0 "
                                                               "1.0: annealing would be vanilla WTA from the first"),
    (["--mcl.scoring", "true", "--mcl.scoring_weight", "0"], "--mcl.scoring_weight must be a finite number in (0, 100]"
                                                             " (beta, the scoring loss' weight: 0 would leave"),
    (["--mcl.scoring", "true", "--mcl.scoring_weight", "1e30"], "--mcl.scoring_weight must be a finite number in (0, "
                                                                "100]"),
    (["--method", "moe", "--moe.router_init", "normal", "--moe.router_std", "1e30"],
     "--moe.router_std must be a finite number in (0, 10]"),
    (["--training.weight_decay", "1e30"], "--training.weight_decay must be a finite number in [0, 1] (AdamW multiplies "
                                          "every adapter weight by 1 - learning_rate x weight_decay"),
    (["--training.seed", str(10**18)], "--training.seed must be an integer in [0, 2**32 - 1]"),
    # named with their block
    (["--method", "moe", "--moe.num_experts", "0"], "--moe.num_experts (E) must be an integer >= 1, got 0"),
    (["--method", "moe", "--moe.router_init", "normal", "--moe.router_std", "-1"], "--moe.router_std must be a finite "
                                                                                   "number in (0, 10]"),
    (["--mcl.layers_to_transform", "-1"], "--mcl.layers_to_transform must be None, a block index >= 0"),
])
def test_a_value_that_would_train_nothing_or_be_ignored_is_refused_by_its_option(options, message, capsys):
    """Each refused before the model loads (the model folder does not exist), named as typed."""
    code, line = run_main(["train", "--model", "m", "--out", "o", "--data.train_file", "t.jsonl", *options], capsys)
    assert code in (1, 2) and line.startswith("loramcl train: error: " + message), line


def test_a_saved_configuration_reads_what_its_settings_ignore_as_the_default():
    """Adapters saved before those values were refused (or whose loss was edited to continue training) still load:
    epsilon without the relaxed loss, scoring_weight without scores and router_std with a zero router act on
    nothing; given for training, they are refused."""
    from loramcl.mcl.config import saved_values

    saved = {"loss": "wta", "epsilon": 0.1, "scoring_weight": 2.0, "r": 4}
    assert saved_values(saved) == {"loss": "wta", "r": 4}
    assert saved_values({"loss": "relaxed", "epsilon": 0.1}) == {"loss": "relaxed", "epsilon": 0.1}
    assert MCLConfig.from_dict(saved_values(saved)) == MCLConfig(r=4)
    with pytest.raises(OptionError, match="^epsilon 0.1 is relaxed WTA's weight"):
        MCLConfig.from_dict({"loss": "wta", "epsilon": 0.1})  # a recipe's block is read so


def test_the_recipes_keep_clear_of_the_new_bounds():
    """Every packaged recipe's method block and training block is accepted as it is (the bounds are past them)."""
    import yaml

    from loramcl.baselines import MoEConfig, MultiHeadConfig
    from loramcl.recipes.files import packaged_recipes

    blocks = {"mcl": MCLConfig, "moe": MoEConfig, "multihead": MultiHeadConfig, "training": TrainConfig}
    checked = 0
    for path in packaged_recipes().rglob("*.yaml"):
        values = yaml.safe_load(path.read_text()) or {}
        for name, config in blocks.items():
            if isinstance(values.get(name), dict):
                config(**{k: v for k, v in values[name].items() if k != "target_modules"})
                checked += 1
    assert checked > 20


# ---- the model's positions ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name,limits", [
    ("llama", (128, 128, True, "max_position_embeddings")),  # rotary: the length it was trained to
    ("gpt2", (128, 128, True, "n_positions")),
    ("bart", (128, 128, False, "max_position_embeddings")),  # encoder and decoder
    ("whisper", (None, 64, False, "max_target_positions")),  # its encoder reads audio frames, not prompt tokens
    ("t5", (None, None, False, "")),  # relative positions: no limit
    ("qwen2_audio", (128, 128, True, "max_position_embeddings")),  # the language model's (text_config)
])
def test_the_positions_of_a_model_are_read_from_its_config_file(tmp_path, name, limits):
    build_model(name).config.save_pretrained(tmp_path)
    found = model_positions(str(tmp_path))
    assert (found.prompt, found.target, found.shared) == limits[:3]
    assert found.source == (f"{limits[3]} in {tmp_path / 'config.json'}" if limits[3] else "")


def test_what_does_not_fit_the_positions_is_said_with_the_numbers():
    causal = PositionLimits(128, 128, True, "max_position_embeddings in m/config.json")
    assert causal.excess(100, 28) is None
    assert causal.excess(100, 29) == "129 positions, more than the 128 the model reads (max_position_embeddings in " \
                                     "m/config.json)"
    seq2seq = PositionLimits(64, 32, False, "max_position_embeddings")
    assert seq2seq.excess(64, 32) is None
    assert seq2seq.excess(65, 1) == "65 prompt tokens, more than the 64 its encoder reads (max_position_embeddings)"
    assert seq2seq.excess(3, 33) == "33 target positions, more than the 32 its decoder reads (max_position_embeddings)"
    assert PositionLimits(None, None, True, "").excess(10**9, 10**9) is None


def test_generation_past_the_positions_is_refused_before_decoding(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a"}\n\n{"prompt": "b"}\n{"prompt": "c"}\n')
    causal = PositionLimits(16, 16, True, "n_positions")
    check_generated_positions(causal, 8, str(prompts), [3, 8, 1])
    with pytest.raises(OptionError, match=r"^max_new_tokens 9 does not fit: .*p.jsonl:3: the prompt \(8 tokens\) and 9 "
                                          r"new tokens need 17 positions, .*: set --max_new_tokens 8 or less, or "):
        check_generated_positions(causal, 9, str(prompts), [3, 8, 1])
    with pytest.raises(ValueError, match=r"p.jsonl:4: the prompt \(16 tokens\) is too long: with one new token it "
                                         "needs 17 positions"):
        check_generated_positions(causal, 1, str(prompts), [3, 8, 16])
    with pytest.raises(ValueError, match=r"p.jsonl:3: the prompt has no token once tokenized"):
        check_generated_positions(causal, 1, str(prompts), [3, 0, 1])
    seq2seq = PositionLimits(16, 4, False, "max_position_embeddings")
    check_generated_positions(seq2seq, 4, str(prompts), [16, 1, 1])  # the encoder reads 16, the decoder writes 4
    with pytest.raises(OptionError, match=r"^max_new_tokens 5 does not fit: a one-token prompt and 5 new tokens need "
                                          r"5 target positions.*: set --max_new_tokens 4 or less$"):
        check_generated_positions(seq2seq, 5)


def test_the_library_refuses_decoding_past_the_positions():
    """generate_hypotheses (what the recipes decode images and audio with) checks the padded prompts and the new
    tokens against the model's configuration before it decodes."""
    from loramcl.decoding import generate_hypotheses

    mcl = get_mcl_model(build_model("llama"), MCLConfig(num_hypotheses=2, r=2, target_modules=["q_proj"]))
    batch = {"input_ids": torch.full((2, 120), 5), "attention_mask": torch.ones(2, 120, dtype=torch.long)}
    with pytest.raises(OptionError, match=r"^max_new_tokens 9 does not fit: prompts of 120 tokens and 9 new tokens "
                                          r"need 129 positions, more than the 128 the model reads "
                                          r"\(max_position_embeddings in the LlamaConfig\)"):
        generate_hypotheses(mcl, None, batch, max_new_tokens=9, pad_token_id=0)
    outs = generate_hypotheses(mcl, None, batch, max_new_tokens=8, min_new_tokens=8, pad_token_id=0)
    assert [len(c.token_ids) for c in outs[0]] == [8, 8]


def test_a_training_length_past_the_positions_is_refused():
    check_max_length(128, PositionLimits(128, 128, True, "n_positions"))
    check_max_length(10**6, PositionLimits(None, None, False, ""))
    with pytest.raises(OptionError, match=r"^max_length 100 is more than the 64 positions the model reads \(x\): "
                                          r"set --data.max_length 64 or less") as error:
        check_max_length(100, PositionLimits(None, 64, False, "x"))  # an encoder-decoder: each side
    assert error.value.option == "max_length"


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    """A folder holding `tiny/` (a tiny Llama of 128 positions), `run/` (its MCL adapters) and `refs.jsonl`."""
    root = tmp_path_factory.mktemp("bad")
    build_model("llama").save_pretrained(root / "tiny")
    word_tokenizer().save_pretrained(root / "tiny")
    get_mcl_model(build_model("llama"), MCLConfig(num_hypotheses=2, r=2, target_modules=["q_proj"])).save_pretrained(
        root / "run")
    return root


def nll_error(folder, lines: list[dict], capsys, *options: str) -> tuple[int, str]:
    (folder / "refs.jsonl").write_text("".join(json.dumps(line) + "\n" if line else "\n" for line in lines))
    return run_main(["nll", "--model", str(folder / "tiny"), "--adapters", str(folder / "run"), "--input",
                     str(folder / "refs.jsonl"), "--out", str(folder / "nll.jsonl"), *options], capsys)


def test_nll_refuses_empty_and_too_long_references_by_their_line(scored, capsys):
    good = {"prompt": "w5", "references": ["w6"]}
    code, line = nll_error(scored, [good, None, {"prompt": "w5", "references": ["w6", " "]}], capsys)
    assert (code, line) == (1, f'loramcl nll: error: {scored}/refs.jsonl:3: "references" must be a non-empty text or '
                               "list of non-empty texts")
    code, line = nll_error(scored, [good, {"prompt": "w5 " * 100, "references": "w7 " * 30}], capsys)
    assert (code, line) == (1, f"loramcl nll: error: {scored}/refs.jsonl:2: the prompt and reference need 131 "
                               f"positions, more than the 128 the model reads (max_position_embeddings in {scored}/"
                               "tiny/config.json): shorten them (a reference is scored whole)")
    code, line = nll_error(scored, [{"prompt": "", "references": "w7"}], capsys)
    assert (code, line) == (1, f'loramcl nll: error: {scored}/refs.jsonl:1: "prompt" is empty: give it some text (or '
                               "remove the row)")
    code, line = nll_error(scored, [good], capsys, "--out", str(scored))
    assert code == 1 and line.startswith(f"loramcl nll: error: --out {scored} is a folder, and a file is written")
    code, line = nll_error(scored, [good], capsys, "--device", "cuda:x")
    assert (code, line) == (1, "loramcl nll: error: --device 'cuda:x' is not a device torch knows: give cpu, cuda, "
                               "cuda:N (GPU N) or mps")
    assert not (scored / "nll.jsonl").exists()
    main(["nll", "--model", str(scored / "tiny"), "--adapters", str(scored / "run"), "--input",
          str(scored / "refs.jsonl"), "--out", str(scored / "nll.jsonl"), "--device", "cpu"])  # a good file is scored
    assert len(json.loads((scored / "nll.jsonl").read_text())["nll"][0]) == 2


def test_generate_refuses_new_tokens_past_an_encoder_decoders_decoder_before_torch(tmp_path, capsys):
    build_model("bart").config.save_pretrained(tmp_path / "bart")
    (tmp_path / "p.jsonl").write_text('{"prompt": "w5"}\n')
    code, line = run_main(["generate", "--model", str(tmp_path / "bart"), "--input", str(tmp_path / "p.jsonl"),
                           "--max_new_tokens", "129"], capsys)
    assert (code, line) == (1, "loramcl generate: error: --max_new_tokens 129 does not fit: a one-token prompt and "
                               "129 new tokens need 129 target positions, more than the 128 its decoder reads "
                               f"(max_position_embeddings in {tmp_path}/bart/config.json): set --max_new_tokens 128 or "
                               "less")


@pytest.mark.parametrize("options,message", [
    (["--hypotheses", "[2]"], "--hypotheses [2] do not exist: this model has K=2 (0..1)"),
    (["--strategy", "beam", "--budget", "3"], "--budget 3 cannot be split among K=2 hypotheses"),
    (["--num_sequences", "3"], "--num_sequences=3 does not match the 2 hypotheses to decode"),
    (["--strategy", "stochastic_router", "--num_sequences", "2"], "--strategy 'stochastic_router' samples the experts "
                                                                  "of a LoRA-MoE model"),
    (["--sort_by_score", "true"], "--sort_by_score needs an MCL model with hypothesis scores"),
    (["--num_beams", "3"], "--num_beams 3: strategy 'greedy' decodes one beam"),
    (["--strategy", "beam", "--num_beams", str(10**18)], "--num_beams must be at most 4096"),
    (["--diversity_penalty", "1"], "--diversity_penalty 1.0 belongs to strategy 'diverse_beam'"),
    (["--top_p", "0.9"], "--top_p 0.9 acts on strategy 'sample' only (strategy is 'greedy', which would ignore it)"),
])
def test_generate_checks_the_decoding_against_the_adapters_before_the_model_loads(scored, options, message, capsys,
                                                                                 monkeypatch):
    """The adapters' kind and K are read from their mcl_config.json: a decoding that cannot run on them is refused
    naming its option, before the model loads, and an earlier predictions file is left as it was."""
    monkeypatch.setattr("loramcl.models.load.load_model", lambda *args, **kwargs: pytest.fail("the model loaded"))
    (scored / "gen-prompts.jsonl").write_text('{"prompt": "w5"}\n')
    (scored / "gen-preds.jsonl").write_text("earlier\n")
    code, line = run_main(["generate", "--model", str(scored / "tiny"), "--adapters", str(scored / "run"), "--input",
                           str(scored / "gen-prompts.jsonl"), "--out", str(scored / "gen-preds.jsonl"), *options],
                          capsys)
    assert code in (1, 2) and line.startswith("loramcl generate: error: " + message), line
    assert (scored / "gen-preds.jsonl").read_text() == "earlier\n"


def test_a_generation_that_fails_leaves_the_earlier_predictions_file_whole(scored, capsys, monkeypatch):
    """The predictions are written under a temporary name beside --out and renamed once every prompt is decoded: a
    failure midway (here the second batch) leaves the earlier file as it was, and no temporary file."""
    import loramcl.decoding.strategies as decoding

    decode, calls = decoding.generate_hypotheses, []

    def fails_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("CUDA out of memory (injected)")
        return decode(*args, **kwargs)

    (scored / "gen-prompts.jsonl").write_text('{"prompt": "w5"}\n{"prompt": "w6 w7"}\n')
    preds = scored / "gen-preds.jsonl"
    preds.write_text("earlier\n")
    command = ["generate", "--model", str(scored / "tiny"), "--adapters", str(scored / "run"), "--input",
               str(scored / "gen-prompts.jsonl"), "--out", str(preds), "--batch_size", "1", "--max_new_tokens", "2",
               "--progress", "false"]
    monkeypatch.setattr(decoding, "generate_hypotheses", fails_second)
    assert run_main(command, capsys) == (1, "loramcl generate: error: CUDA out of memory (injected)")
    assert preds.read_text() == "earlier\n" and [p.name for p in scored.glob("gen-preds*")] == ["gen-preds.jsonl"]
    monkeypatch.setattr(decoding, "generate_hypotheses", decode)
    main(command)
    assert [len(json.loads(line)["candidates"]) for line in preds.read_text().splitlines()] == [2, 2]


def test_what_generate_decodes_is_read_from_the_adapters_files(scored, tmp_path):
    from loramcl.baselines import MoEConfig, MultiHeadConfig, get_moe_model, get_multihead_model

    get_moe_model(build_model("llama"), MoEConfig(num_experts=3, r=2, target_modules=["q_proj"])).save_pretrained(
        tmp_path / "moe")
    get_multihead_model(build_model("llama"), MultiHeadConfig(num_hypotheses=3)).save_pretrained(tmp_path / "heads")
    (tmp_path / "peft").mkdir()
    (tmp_path / "peft" / "adapter_config.json").write_text("{}")
    found = {name: decoded_model_of(path) for name, path in (
        ("mcl", str(scored / "run")), ("moe", str(tmp_path / "moe")), ("heads", str(tmp_path / "heads")),
        ("peft", str(tmp_path / "peft")), ("none", None))}
    assert {name: (m.num_hypotheses, m.router, m.scoring) for name, m in found.items()} == {
        "mcl": (2, False, False), "moe": (1, True, False), "heads": (3, False, False), "peft": (None, False, False),
        "none": (None, False, False)}
    (tmp_path / "moe" / "mcl_config.json").write_text("{not json")
    assert decoded_model_of(str(tmp_path / "moe")) is None  # loading the adapters says what is wrong


# ---- output paths, devices, threads -------------------------------------------------------------------------------

def test_output_paths_are_checked_before_any_work(tmp_path, monkeypatch):
    (tmp_path / "file.jsonl").write_text("")
    check_output(str(tmp_path / "new" / "deeper" / "out.jsonl"), folder=False)  # folders are made
    check_output(str(tmp_path / "file.jsonl"), folder=False)  # a file is replaced
    check_output(str(tmp_path), folder=True)
    cases = [(tmp_path, False, f"out {tmp_path} is a folder, and a file is written there: give a file path, e.g. "
                               f"{tmp_path}/out.jsonl"),
             (tmp_path / "file.jsonl", True, "is a file, and a folder is written there: give a folder"),
             (tmp_path / "file.jsonl" / "run", True, f"cannot be made: {tmp_path}/file.jsonl is a file, not a folder"),
             (tmp_path / "file.jsonl" / "a" / "p.jsonl", False, "file.jsonl is a file, not a folder")]
    for path, folder, message in cases:
        with pytest.raises(OptionError, match=message.replace(".", r"\.")) as error:
            check_output(str(path), folder)
        assert error.value.option == "out"
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # a read-only place (root writes anywhere)
    with pytest.raises(OptionError, match=f"out {tmp_path}/new/p.jsonl: {tmp_path} is not writable"):
        check_output(str(tmp_path / "new" / "p.jsonl"), folder=False)


def test_a_device_torch_cannot_use_is_named_with_the_fix(monkeypatch):
    check_device("cpu")
    for device in ("cdua", "cuda:x", "CPU"):
        with pytest.raises(OptionError, match=f"^device '{device}' is not a device torch knows: give cpu, cuda"):
            check_device(device)
    with pytest.raises(OptionError, match="^device meta holds no weights"):
        check_device("meta")
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(OptionError, match=r"^device mps: Apple's Metal \(MPS\) is not available here.*--device cpu$"):
        check_device("mps")
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None)
    with pytest.raises(OptionError, match=r"^device cuda: this torch \(.*\) is built without CUDA: install a CUDA "
                                          "build of torch"):
        check_device("cuda")
    monkeypatch.setattr(torch.version, "cuda", "12.8")  # a CUDA build that sees no GPU, then one GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(OptionError, match=r"^device cuda: torch sees no GPU \(CUDA_VISIBLE_DEVICES=''\): check"):
        check_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    check_device("cuda:0")
    with pytest.raises(OptionError, match=r"^device cuda:1: torch sees 1 GPU \(cuda:0 to cuda:0\)"):
        check_device("cuda:1")


def test_threads_are_a_positive_number_below_any_machines_cores_and_more_than_ours_is_said_once(monkeypatch):
    """check_threads only checks (a command calls it up to three times); use_threads warns, once per process."""
    import warnings

    for threads in (None, 1, 4096):
        check_threads(threads)
    for threads, bound in ((0, "an integer >= 1"), (-1, "an integer >= 1"), (True, "an integer >= 1"),
                           (10**18, "at most 4096 (no machine")):
        with pytest.raises(OptionError, match=r"^threads must be " + re.escape(bound)):
            check_threads(threads)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    more = len(usable_cores()) + 1
    try:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("default")  # Python's own: a warning once per place and message
            check_threads(more)
            for _ in range(3):
                use_threads(more)
        assert [str(w.message).split(":")[0] for w in said] == [
            f"threads {more} is more than the {more - 1} CPU cores this process may use"]
    finally:
        torch.set_num_threads(before)


# ---- the adapters: rank against each layer, K against the memory ----------------------------------------------

def test_a_rank_past_a_target_layers_width_is_refused_naming_the_narrowest_layer():
    """v_proj of the tiny Llama maps 32 features to 16 (2 key-value heads of 8): a rank above 16 adds weights and no
    rank. The model is left as it was."""
    model = build_model("llama")
    get_mcl_model(build_model("llama"), MCLConfig(r=16, target_modules=["q_proj", "v_proj"]))
    with pytest.raises(OptionError, match=r"^r 17 is more than the rank of an adapter on model.layers.0.self_attn."
                                          r"v_proj \(32 -> 16 features, rank at most 16\): set --mcl.r 16 or less"):
        get_mcl_model(model, MCLConfig(r=17, target_modules=["q_proj", "v_proj"]))
    assert not any(isinstance(module, MCLLoraLinear) for module in model.modules())
    assert all(parameter.requires_grad for parameter in model.parameters())


def test_the_adapter_bytes_are_those_the_hypotheses_take():
    """The estimate is exact: one hypothesis' bytes per device are those of A and B once made (float32 adapters on a
    bfloat16 base, as by default)."""
    config = MCLConfig(num_hypotheses=3, r=4, target_modules=["q_proj", "v_proj", "down_proj"])
    base = build_model("llama").to(torch.bfloat16)
    estimate = hypothesis_bytes(base, target_layer_names(base, config), config)
    mcl = get_mcl_model(base, config)
    made = sum(p.numel() * p.element_size() for name, p in mcl.named_parameters() if "lora_" in name)
    assert estimate == {torch.device("cpu"): made // 3}


def test_more_hypotheses_than_the_memory_holds_are_refused_with_the_estimate(monkeypatch):
    config = MCLConfig(num_hypotheses=11, r=4, target_modules=["q_proj"])
    model = build_model("llama")
    names = target_layer_names(model, config)
    one = hypothesis_bytes(model, names, config)[torch.device("cpu")]  # 2 layers x (32 + 32) x 4 x 4 bytes
    monkeypatch.setattr("loramcl.mcl.adapter_size.available_memory", lambda device: 10 * one)
    check_adapter_size(model, names, MCLConfig(num_hypotheses=10, r=4, target_modules=["q_proj"]))
    with pytest.raises(OptionError, match=r"^num_hypotheses 11: K hypotheses of rank 4 on 2 layers need 22.5 kB of "
                                          r"adapter weights, more than the 20.5 kB available on cpu: set "
                                          r"--mcl.num_hypotheses 10 or less, or a lower --mcl.r$"):
        check_adapter_size(model, names, config)
    with pytest.raises(OptionError, match=r"with their gradients and AdamW state, .* --mcl.num_hypotheses 2 or less"):
        check_adapter_size(model, names, MCLConfig(num_hypotheses=3, r=4, target_modules=["q_proj"]), training=True)
    monkeypatch.setattr("loramcl.mcl.adapter_size.available_memory", lambda device: one - 1)
    with pytest.raises(OptionError, match="not one hypothesis fits: lower --mcl.r, or adapt fewer layers"):
        get_mcl_model(model, MCLConfig(num_hypotheses=1, r=4, target_modules=["q_proj"]))


def test_lora_moe_and_multi_head_copies_are_sized_before_they_are_made(monkeypatch):
    """E experts (their A, B and router column) and K copies of a module: checked against the memory as K hypotheses
    are, named as typed; 10^18 of them is refused with the numbers, not torch's overflow or a MemoryError."""
    from loramcl.baselines import MoEConfig, MultiHeadConfig, get_moe_model, get_multihead_model
    from loramcl.baselines.moe import MoELoraLinear

    config = MoEConfig(num_experts=3, r=4, target_modules=["q_proj"])
    model = build_model("llama")
    one = hypothesis_bytes(model, target_layer_names(model, config.mle_config()), config)[torch.device("cpu")]
    assert one == 2 * ((32 + 32) * 4 + 32) * 4  # 2 layers, A [32, 4], B [4, 32], router column [32], float32
    monkeypatch.setattr("loramcl.mcl.adapter_size.available_memory", lambda device: 3 * one)
    moe = get_moe_model(build_model("llama"), config)
    made = sum(p.numel() * p.element_size() for _, layer in moe.mcl_layers() for p in layer.parameters()
               if p.requires_grad)
    assert made == 3 * one
    with pytest.raises(OptionError, match=r"^num_experts 4: E experts of rank 4 on 2 layers need 9.2 kB of adapter "
                                          r"weights, more than the 6.9 kB available on cpu: set --moe.num_experts 3 or "
                                          r"less, or a lower --moe.r$") as error:
        get_moe_model(model, MoEConfig(num_experts=4, r=4, target_modules=["q_proj"]))
    assert error.value.owner is MoEConfig and not any(isinstance(m, MoELoraLinear) for m in model.modules())
    monkeypatch.undo()
    with pytest.raises(OptionError, match=r"^num_experts 1000000000000000000: E experts .* more than the .* available"):
        get_moe_model(build_model("llama"), MoEConfig(num_experts=10**18, r=4, target_modules=["q_proj"]))
    with pytest.raises(OptionError, match=r"^r 1000000000000000000 is more than the rank of an adapter on "
                                          r".*: set --moe.r 32 or less"):
        get_moe_model(build_model("llama"), MoEConfig(r=10**18, target_modules=["q_proj"]))
    with pytest.raises(OptionError, match=r"^num_hypotheses 1000000000000000000: K copies of lm_head need .* more than "
                                          r"the .* available on cpu: set --multihead.num_hypotheses \d+ or less$"):
        get_multihead_model(build_model("llama"), MultiHeadConfig(num_hypotheses=10**18))


def test_blocks_that_hold_no_target_layer_are_named_by_layers_to_transform():
    """The tiny Llama has blocks 0 and 1: block 5 holds no q_proj, which the message says of layers_to_transform (the
    command line: --mcl.layers_to_transform), not of target_modules."""
    get_mcl_model(build_model("llama"), MCLConfig(target_modules=["q_proj"], layers_to_transform=[1]))
    with pytest.raises(OptionError, match=r"^layers_to_transform \[5, 10\] names no block of LlamaForCausalLM holding "
                                          r"a layer of target_modules=\['q_proj'\]: its blocks are numbered 0 to 1$") \
            as error:
        get_mcl_model(build_model("llama"), MCLConfig(target_modules=["q_proj"], layers_to_transform=[5, 10]))
    assert error.value.owner is MCLConfig
    with pytest.raises(ValueError, match="matched no layer"):  # no such layer at all: target_modules is at fault
        get_mcl_model(build_model("llama"), MCLConfig(target_modules=["qq_proj"], layers_to_transform=[0]))


def test_a_gradient_norm_that_is_not_finite_stops_training(tmp_path):
    """Clipping by an infinite norm scales every gradient to 0: the adapters would stay as initialised for the whole
    run (--mcl.alpha 1e30 did that, exit 0). Gradients of 1e30 per entry (finite, their norm is not) stop it."""
    from tiny_models import token_rows
    from transformers import TrainingArguments

    from loramcl import MCLTrainer

    mcl = get_mcl_model(build_model("llama"), MCLConfig(r=2, target_modules=["q_proj"]))
    for _, layer in mcl.mcl_layers():
        layer.lora_B.register_hook(lambda gradient: torch.full_like(gradient, 1e30))
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=3, report_to=[],
                             use_cpu=True, logging_steps=10, save_strategy="steps", save_steps=1, disable_tqdm=True)
    with pytest.raises(FloatingPointError, match=r"^the gradient norm became infinite or NaN before step 1: "
                                                 r"clipping by it zeroes the update"):
        MCLTrainer(mcl, args=args, train_dataset=token_rows(8, 8, 0, prompt=2)).train()
    assert not any(tmp_path.glob("checkpoint-*"))


def test_a_prompt_past_max_length_is_named_by_its_file_and_line(scored, capsys):
    (scored / "long.jsonl").write_text('{"prompt": "w5", "target": "w6"}\n\n{"prompt": "' + "w5 " * 20 +
                                       '", "target": "w6"}\n')
    code, line = run_main(["train", "--model", str(scored / "tiny"), "--out", str(scored / "long-run"),
                           "--data.train_file", str(scored / "long.jsonl"), "--data.max_length", "16"], capsys)
    assert (code, line) == (1, f"loramcl train: error: {scored}/long.jsonl:3: the prompt alone has 20 tokens, "
                               "max_length is 16 (and the target needs one more): shorten it, or raise max_length")


def test_nll_columns_that_differ_between_items_are_named_by_file_and_id(tmp_path):
    from loramcl.metrics.io import load_nll

    path = tmp_path / "nll.jsonl"
    path.write_text('{"id": "a", "nll": [[1.0, 2.0]]}\n{"id": "b", "nll": [[1.0]]}\n')
    with pytest.raises(ValueError, match=f"^{path}: id 'b': NLL under 1 hypotheses, and id 'a' under 2: every item's"):
        load_nll(path, ["a", "b"], candidates=[["x", "y"], ["x", "y"]])
