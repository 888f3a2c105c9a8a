"""Nothing silent (issue 36, 35.5): every bad value is refused before the work starts, in one line that names the
option as typed and its bound. The commands' usual mistakes are rows of docs/cli.md (tests/test_cli.py runs them,
most before torch loads); here, the checks behind them: Decoding's bounds, the model's positions, the output paths,
the devices, the threads, the rank against each layer and K against the memory."""

import json
import os
import re

import pytest
import torch
from tiny_models import build_model, word_tokenizer

from loramcl import MCLConfig, get_mcl_model
from loramcl.adapter_size import check_adapter_size, hypothesis_bytes
from loramcl.cli import main
from loramcl.config import TrainConfig
from loramcl.finetune import check_max_length
from loramcl.generation.options import Decoding
from loramcl.generation.predictions import check_generated_positions
from loramcl.inputs import PositionLimits, check_device, check_output, model_positions
from loramcl.threads import check_threads, usable_cores
from loramcl.layers import MCLLoraLinear
from loramcl.peft_interop import target_layer_names
from loramcl.validate import OptionError


def run_main(argv, capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    return stopped.value.code, capsys.readouterr().err.strip().splitlines()[-1]


# ---- the decoding options: each with its bound ----------------------------------------------------------------

@pytest.mark.parametrize("field,value,bound", [
    ("top_p", 1.5, "in (0, 1]"), ("top_p", 0.0, "in (0, 1]"), ("typical_p", 2.0, "in (0, 1]"),
    ("temperature", 0.0, "in (0, inf)"), ("temperature", float("nan"), "in (0, inf)"), ("top_k", -1, ">= 0"),
    ("repetition_penalty", -1.0, "in (0, inf)"), ("max_new_tokens", 0, ">= 1"), ("num_beams", 0, ">= 1"),
    ("budget", -2, ">= 1"), ("num_sequences", 0, ">= 1"), ("num_beam_groups", 0, ">= 1"), ("seed", -1, ">= 0"),
    ("diversity_penalty", -0.5, "in [0, inf)"), ("hypotheses", [0, -1], "integers >= 0"),
    ("max_new_tokens", True, ">= 1"),  # a bool is not a number of tokens
])
def test_each_decoding_option_is_refused_out_of_its_bounds(field, value, bound):
    with pytest.raises(OptionError, match=f"^{field} .*{re.escape(bound)}") as error:
        Decoding(**{field: value})
    assert (error.value.option, error.value.owner) == (field, Decoding)


def test_the_decoding_bounds_keep_their_edges():
    Decoding(top_p=1.0, typical_p=1.0, top_k=0, temperature=1e-3, seed=0, diversity_penalty=0.0, hypotheses=[0, 2])


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
    from loramcl.generation import generate_hypotheses

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
    assert (code, line) == (1, f'loramcl nll: error: {scored}/refs.jsonl:1: "prompt" is empty: a model continues a '
                               "prompt, give it some text (or remove the line)")
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


def test_threads_are_a_positive_number_and_more_than_the_cores_is_said():
    check_threads(None)
    check_threads(1)
    for threads in (0, -1, True):
        with pytest.raises(OptionError, match=r"^threads must be an integer >= 1"):
            check_threads(threads)
    with pytest.warns(UserWarning, match=r"^threads \d+ is more than the \d+ CPU cores"):
        check_threads(len(usable_cores()) + 1)


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
    monkeypatch.setattr("loramcl.adapter_size.available_memory", lambda device: 10 * one)
    check_adapter_size(model, names, MCLConfig(num_hypotheses=10, r=4, target_modules=["q_proj"]))
    with pytest.raises(OptionError, match=r"^num_hypotheses 11: K hypotheses of rank 4 on 2 layers need 22.5 kB of "
                                          r"adapter weights, more than the 20.5 kB available on cpu: set "
                                          r"--mcl.num_hypotheses 10 or less, or a lower --mcl.r$"):
        check_adapter_size(model, names, config)
    with pytest.raises(OptionError, match=r"with their gradients and AdamW state, .* --mcl.num_hypotheses 2 or less"):
        check_adapter_size(model, names, MCLConfig(num_hypotheses=3, r=4, target_modules=["q_proj"]), training=True)
    monkeypatch.setattr("loramcl.adapter_size.available_memory", lambda device: one - 1)
    with pytest.raises(OptionError, match="not one hypothesis fits: lower --mcl.r, or adapt fewer layers"):
        get_mcl_model(model, MCLConfig(num_hypotheses=1, r=4, target_modules=["q_proj"]))
