"""`loramcl export RUN --out DIR`: a finished run's hypotheses as PEFT folders with a model card; its refusals."""

import contextlib
import io
import json
import re
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from docs_blocks import extract_blocks, llama_cpp_recipe
from test_cli import run_main
from tiny_models import build_model, word_tokenizer
from transformers import AutoModelForCausalLM

from loramcl import MCLConfig, load_mcl_model
from loramcl.cli import main
from loramcl.training.config import DataConfig, TrainConfig
from loramcl.training.fit import train

# the assistant header of this chat template ends with w3, which no prompt or target holds; an assistant turn renders
# its own header, as real templates do, so a conversation's rendering extends its prompt's (loramcl.data.formats)
CHAT_TEMPLATE = ("{% for m in messages %}<s> {% if m['role'] == 'assistant' %}w3{% else %}w4{% endif %} "
                 "{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<s> w3{% endif %}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A tiny Llama and three finished runs of 4 steps: K = 3 (paper's method), K = 2 context-once with the chat
    template, K = 2 with the chat template."""
    root = tmp_path_factory.mktemp("export")
    torch.manual_seed(0)
    build_model("llama").save_pretrained(root / "base")
    tokenizer = word_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(root / "base")
    rows = [{"prompt": f"w{5 + i % 7} w{20 + i % 5}", "target": f"w{40 + i % 3} w{60 + i % 4}"} for i in range(16)]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = dict(train_file=str(root / "train.jsonl"))
    training = TrainConfig(steps=4, batch_size=8, learning_rate=5e-2, eval_every=4, logging_steps=2)
    with contextlib.redirect_stdout(io.StringIO()):
        train(model=str(root / "base"), out=str(root / "mcl"), threads=1, training=training,
              mcl=MCLConfig(num_hypotheses=3, r=8, alpha=16, target_modules=["q_proj", "v_proj"]),
              data=DataConfig(**data, validation_file=str(root / "train.jsonl")))
        train(model=str(root / "base"), out=str(root / "once"), threads=1, training=training,
              mcl=MCLConfig(num_hypotheses=2, r=8, alpha=16, target_modules=["q_proj", "v_proj"],
                            adapt_context=False), data=DataConfig(**data, chat_template=True))
        train(model=str(root / "base"), out=str(root / "chat"), threads=1, training=training,
              mcl=MCLConfig(num_hypotheses=2, r=8, alpha=16, target_modules=["q_proj", "v_proj"]),
              data=DataConfig(**data, chat_template=True))
    return root


def test_a_run_becomes_k_peft_folders_and_a_model_card(runs, tmp_path, capsys):
    out = tmp_path / "exported"
    main(["export", str(runs / "mcl"), "--out", str(out)])
    printed = capsys.readouterr()
    assert f"3 hypotheses as PEFT LoRA adapters (h0, h1, h2) and their model card: {out}" in printed.out
    assert "rank 8" not in printed.err  # a vLLM rank: no warning about it
    card = (out / "README.md").read_text()
    for fact in (str(runs / "base"), "3 of K = 3: h0, h1, h2", "| loss | wta |", "| rank | 8, alpha 16 |",
                 str(runs / "train.jsonl"), "validation oracle NLL", "h2: ", "training loss", "adapter_names=names",
                 "vllm serve", "--max-lora-rank 8", "convert_lora_to_gguf.py"):
        assert fact in card, fact
    base = AutoModelForCausalLM.from_pretrained(runs / "base")
    mcl = load_mcl_model(AutoModelForCausalLM.from_pretrained(runs / "base"), runs / "mcl").eval()
    peft = PeftModel.from_pretrained(base, out / "h0", adapter_name="h0").eval()
    for k in (1, 2):
        peft.load_adapter(out / f"h{k}", adapter_name=f"h{k}")
        config = json.loads((out / f"h{k}" / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == str(runs / "base") and config["r"] == 8
    inputs = {"input_ids": torch.tensor([[5, 20, 40, 60]])}
    with torch.no_grad():
        for k in range(3):
            peft.set_adapter(f"h{k}")
            torch.testing.assert_close(peft(**inputs).logits, mcl(**inputs, hypotheses=k).logits, atol=1e-5, rtol=0)

    main(["export", str(runs / "mcl"), "--out", str(tmp_path / "some"), "--hypotheses", "0,2", "--fold_scaling"])
    assert sorted(p.name for p in (tmp_path / "some").iterdir()) == ["README.md", "h0", "h2"]
    assert json.loads((tmp_path / "some" / "h2" / "adapter_config.json").read_text())["lora_alpha"] == 8
    assert "folded into lora_B" in (tmp_path / "some" / "README.md").read_text()


def test_context_once_run_with_the_chat_template_exports_as_activated_lora(runs, tmp_path, capsys):
    from loramcl.decoding import generate_hypotheses

    main(["export", str(runs / "once"), "--out", str(tmp_path)])
    config = json.loads((tmp_path / "h1" / "adapter_config.json").read_text())
    assert config["alora_invocation_tokens"] == [3]  # w3, the last token of the assistant header
    assert "activated LoRA" in (tmp_path / "README.md").read_text()
    mcl = load_mcl_model(AutoModelForCausalLM.from_pretrained(runs / "base"), runs / "once").eval()
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(runs / "base"), tmp_path / "h1").eval()
    prompt = {"input_ids": torch.tensor([[1, 4, 7, 22, 3]]), "attention_mask": torch.ones(1, 5, dtype=torch.long)}
    ours = generate_hypotheses(mcl, None, prompt, strategy="greedy", max_new_tokens=4, min_new_tokens=4)
    with torch.no_grad():
        theirs = peft.generate(**prompt, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert theirs[0, 5:].tolist() == ours[0][1].token_ids


def test_what_cannot_be_exported_is_refused_with_its_reason(runs, tmp_path, capsys):
    from loramcl.baselines import MoEConfig, get_moe_model

    moe = get_moe_model(AutoModelForCausalLM.from_pretrained(runs / "base"),
                        MoEConfig(num_experts=2, r=4, target_modules=["q_proj"]))
    moe.save_pretrained(tmp_path / "moe")
    main(["export", str(runs / "mcl"), "--out", str(tmp_path / "peft-source"), "--hypotheses", "1"])
    capsys.readouterr()
    no_chat = tmp_path / "once-plain"
    no_chat.mkdir()
    for name in ("mcl_config.json", "mcl_adapters.safetensors"):
        (no_chat / name).write_bytes((runs / "once" / name).read_bytes())
    for argv, message in [
        ([str(tmp_path / "moe"), "--out", str(tmp_path / "o1"), "--model", str(runs / "base")],
         "a LoRA-MoE model is not K LoRA adapters"),
        ([str(tmp_path / "peft-source" / "h1"), "--out", str(tmp_path / "o2")], "already holds one PEFT adapter"),
        ([str(runs / "mcl")], "missing --out DIR"),
        ([str(runs / "mcl"), "--out", str(tmp_path / "o3"), "--hypotheses", "0,x"],
         "--hypotheses must be comma-separated integers, e.g. 0,2; got '0,x'"),
        ([str(runs / "mcl"), "--out", str(tmp_path / "o4"), "--hypotheses", "3"],
         "hypotheses: 3 is no hypothesis of this model; it has 3, numbered 0 to 2"),
        ([str(no_chat), "--out", str(tmp_path / "o5"), "--model", str(runs / "base")],
         r"--mcl.adapt_context false.*--alora_invocation_tokens ID, ID the token every prompt of the run ends "
         "with"),  # the flag of the command, not the Python API's argument
        ([str(runs / "once"), "--out", str(tmp_path / "o6"), "--alora_invocation_tokens", "1,3"],
         "must be one token id"),
    ]:
        code, _, err = run_main(["export", *argv], capsys)
        line = err.strip().splitlines()[-1]  # after transformers' loading bar, where the model loaded
        assert code in (1, 2) and line.startswith("loramcl export: error: "), err
        assert re.search(message, line), line
    assert not any((tmp_path / f"o{i}").exists() for i in range(1, 7))


def _card_blocks(card) -> tuple[str, list]:
    """The model card's python block, and its bash commands as lists of words."""
    blocks = extract_blocks([str(card)])
    python = next(b.text for b in blocks if b.lang == "python")
    return python, [c.words for b in blocks if b.lang == "bash" for c in b.commands()]


@pytest.mark.parametrize("run", ["mcl", "chat"])
def test_the_model_card_runs_from_where_export_was_typed_with_the_prompt_as_trained(runs, tmp_path, monkeypatch,
                                                                                     capsys, run):
    """Issue 56 (and 52): the card's PEFT code, run from the folder `loramcl export` was typed in, decodes the
    placeholder prompt formatted as the run trained (chat template or not) into generate_hypotheses' candidates; its
    llama.cpp recipe converts the base and every exported hypothesis (with --base), serves them unapplied and sends
    one request per hypothesis naming every scale, the prompt as trained."""
    from loramcl.data.prompts import prompt_text
    from loramcl.decoding import generate_hypotheses

    monkeypatch.chdir(tmp_path)
    main(["export", str(runs / run), "--out", "exported"])
    python, commands = _card_blocks(tmp_path / "exported" / "README.md")
    namespace = {}
    exec(compile(python.replace("max_new_tokens=64", "max_new_tokens=6"), "README.md", "exec"), namespace)  # noqa: S102
    tokenizer, chat = namespace["tokenizer"], run == "chat"
    prompt = prompt_text(tokenizer, "your prompt", chat)
    assert ("apply_chat_template" in python) == chat
    mcl = load_mcl_model(AutoModelForCausalLM.from_pretrained(runs / "base"), runs / run).eval()
    ours = generate_hypotheses(mcl, None, dict(tokenizer([prompt], return_tensors="pt", add_special_tokens=not chat)),
                               strategy="greedy", max_new_tokens=6)
    assert namespace["candidates"] == [tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in ours[0]]

    folders = [f"exported/h{k}" for k in range(mcl.num_hypotheses)]
    llama_cpp_recipe(commands, folders, str(runs / "base"))
    requests = {(words[1], json.dumps(json.loads(words[words.index("-d") + 1]).get("prompt"))) for words in commands
                if words[0] == "curl" and "8080" in words[1]}
    if chat:
        assert requests == {("localhost:8080/v1/chat/completions", "null"),
                            ("localhost:8080/completion", json.dumps(prompt))}, requests
    else:
        assert requests == {("localhost:8080/completion", json.dumps("your prompt"))}, requests
    vllm = next(w for w in commands if w[0] == "vllm")
    assert list(vllm[vllm.index("--lora-modules") + 1:]) == [f"{Path(f).name}={f}" for f in folders]


def test_the_model_cards_llama_cpp_recipe_numbers_the_chosen_hypotheses_by_their_place(runs, tmp_path, monkeypatch,
                                                                                       capsys):
    monkeypatch.chdir(tmp_path)
    main(["export", str(runs / "mcl"), "--out", "some", "--hypotheses", "0,2"])
    _, commands = _card_blocks(tmp_path / "some" / "README.md")
    llama_cpp_recipe(commands, ["some/h0", "some/h2"], str(runs / "base"))
