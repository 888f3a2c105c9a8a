"""The formats end to end through the commands: a file of 3 references per prompt trains K = 3 with `loramcl train`,
`loramcl generate` decodes its prompts and `loramcl evaluate` / `loramcl nll` score the candidates against every
reference of each prompt; a file of conversations trains and is decoded from the same template."""

from __future__ import annotations

import json

import pytest
from tiny_models import build_model, word_tokenizer

from loramcl.cli import main
from loramcl.data.prompts import prompt_text

TEMPLATE = ("{% for m in messages %}{{ 'w5 ' if m['role'] == 'user' else 'w6 ' }}{{ m['content'] }} </s> "
            "{% endfor %}{% if add_generation_prompt %}w6 {% endif %}")
TRAIN = ["--training.steps", "4", "--training.batch_size", "6", "--training.learning_rate", "1e-2",
         "--training.save_every", "0", "--training.eval_every", "0", "--mcl.r", "2", "--threads", "1"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data_commands") / "base"
    build_model("llama").save_pretrained(folder)
    tokenizer = word_tokenizer()
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


def write(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_three_references_per_prompt_train_three_hypotheses_and_are_all_scored(base, tmp_path, capsys):
    rows = [{"id": f"p{i}", "prompt": f"w{10 + i} w{20 + i}", "references": [f"w{40 + i}", f"w{50 + i}", f"w{60 + i}"]}
            for i in range(4)]
    data = write(tmp_path / "refs.jsonl", rows)
    run = tmp_path / "run"
    main(["train", "--model", str(base), "--out", str(run), "--data.train_file", data, "--mcl.num_hypotheses", "3",
          *TRAIN])
    record = json.loads((run / "run.json").read_text())
    assert record["train_examples"] == 12  # one example per reference
    preds = tmp_path / "preds.jsonl"
    main(["generate", "--model", str(base), "--adapters", str(run), "--input", data, "--out", str(preds),
          "--max_new_tokens", "2", "--threads", "1", "--progress", "false"])
    candidates = [json.loads(line)["candidates"] for line in preds.read_text().splitlines()]
    assert len(candidates) == 4 and all(len(c) == 3 for c in candidates)
    main(["evaluate", "--predictions", str(preds), "--references", data, "--metrics", "bleu1", "--tokenize", "false",
          "--out", str(tmp_path / "eval")])
    report = json.loads((tmp_path / "eval" / "preds.json").read_text())
    from loramcl.metrics.suite import evaluate_candidates

    every = evaluate_candidates(candidates, [r["references"] for r in rows], metrics=["bleu1"], tokenize=False)
    assert report["metrics"]["bleu1"] == pytest.approx(every["metrics"]["bleu1"])
    main(["nll", "--model", str(base), "--adapters", str(run), "--input", data, "--out", str(tmp_path / "nll.jsonl"),
          "--threads", "1", "--progress", "false"])
    nll = [json.loads(line)["nll"] for line in (tmp_path / "nll.jsonl").read_text().splitlines()]
    assert [len(item) for item in nll] == [3] * 4 and all(len(row) == 3 for item in nll for row in item)
    third = write(tmp_path / "third.jsonl", [{"id": r["id"], "candidates": [r["references"][2]] * 3} for r in rows])
    main(["evaluate", "--predictions", third, "--references", data, "--metrics", "bleu1", "--tokenize", "false",
          "--out", str(tmp_path / "eval")])  # each candidate is the third reference: all are read, or it is not 1
    assert json.loads((tmp_path / "eval" / "third.json").read_text())["metrics"]["bleu1"] == pytest.approx(1.0)
    capsys.readouterr()


def test_conversations_train_and_generate_decodes_from_the_same_template(base, tmp_path, capsys):
    rows = [{"messages": [{"role": "user", "content": f"w{10 + i}"}, {"role": "assistant", "content": f"w{40 + i}"},
                          {"role": "user", "content": f"w{20 + i}"}, {"role": "assistant", "content": f"w{50 + i}"}]}
            for i in range(6)]
    data = write(tmp_path / "chat.jsonl", rows)
    main(["train", "--model", str(base), "--out", str(tmp_path / "run"), "--data.train_file", data,
          "--mcl.num_hypotheses", "2", *TRAIN])
    preds = tmp_path / "preds.jsonl"
    main(["generate", "--model", str(base), "--adapters", str(tmp_path / "run"), "--input", data, "--out", str(preds),
          "--max_new_tokens", "1", "--threads", "1", "--progress", "false"])
    assert len(preds.read_text().splitlines()) == 6
    from loramcl.decoding.predictions import read_prompts

    _, prompts = read_prompts(data, "prompt")  # each conversation up to its last user turn, rendered to answer it
    tokenizer = word_tokenizer()
    tokenizer.chat_template = TEMPLATE
    assert prompt_text(tokenizer, prompts[0], False) == "w5 w10 </s> w6 w40 </s> w5 w20 </s> w6 "
    capsys.readouterr()


def test_conversational_rows_of_several_answers_are_trained_decoded_and_scored_from_one_file(base, tmp_path, capsys):
    """A training file of conversational prompts and lists of answers (assistant messages) is the test set too:
    `generate` renders its prompts, `nll` scores every answer as `train` tokenized it, `evaluate` reads the answers'
    texts as the references."""
    rows = [{"id": i, "prompt": [{"role": "user", "content": f"w{10 + i}"}],
             "completion": [{"role": "assistant", "content": f"w{40 + i}"}, {"role": "assistant", "content": "w7"}]}
            for i in range(4)]
    data = write(tmp_path / "answers.jsonl", rows)
    run = tmp_path / "run"
    main(["train", "--model", str(base), "--out", str(run), "--data.train_file", data, "--mcl.num_hypotheses", "2",
          *TRAIN])
    assert json.loads((run / "run.json").read_text())["train_examples"] == 8
    main(["generate", "--model", str(base), "--adapters", str(run), "--input", data, "--out",
          str(tmp_path / "preds.jsonl"), "--max_new_tokens", "1", "--threads", "1", "--progress", "false"])
    main(["nll", "--model", str(base), "--adapters", str(run), "--input", data, "--out", str(tmp_path / "nll.jsonl"),
          "--threads", "1", "--progress", "false"])
    assert [len(json.loads(line)["nll"]) for line in (tmp_path / "nll.jsonl").read_text().splitlines()] == [2] * 4
    third = write(tmp_path / "second.jsonl", [{"id": i, "candidates": ["w7", "w7"]} for i in range(4)])
    main(["evaluate", "--predictions", third, "--references", data, "--metrics", "bleu1", "--tokenize", "false",
          "--nll", str(tmp_path / "nll.jsonl"), "--out", str(tmp_path / "eval")])
    assert json.loads((tmp_path / "eval" / "second.json").read_text())["metrics"]["bleu1"] == pytest.approx(1.0)
    capsys.readouterr()


def test_nll_names_the_completion_field_it_reads_and_one_hypothesis_in_the_singular(base, tmp_path, capsys):
    rows = [{"prompt": f"w{10 + i}", "completion": [f"w{40 + i}", "w7"]} for i in range(4)]
    data = write(tmp_path / "answers.jsonl", rows)
    run = tmp_path / "mle"
    main(["train", "--model", str(base), "--out", str(run), "--data.train_file", data, "--mcl.num_hypotheses", "1",
          *TRAIN])
    capsys.readouterr()
    main(["nll", "--model", str(base), "--adapters", str(run), "--input", data, "--out", str(tmp_path / "nll.jsonl"),
          "--threads", "1", "--progress", "false"])
    out = capsys.readouterr().out
    assert '("prompt" + "completion"; the loss on "completion"' in out and '"references"' not in out, out
    assert "NLL of 8 references under 1 hypothesis:" in out
