"""`loramcl translation`: the paper-scale recipe files load and build a model; the CPU recipe end to end on the real
SmolLM2-135M and the machine's gettext catalogs (`--quick`), then again to check that finished stages are reused."""

import json
import math

import pytest
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from loramcl.data.gettext_pairs import normalise
from loramcl.mcl.config import MCLConfig
from loramcl.recipes.files import recipe_folder, run_arguments, run_names
from loramcl.recipes.runner import COMMON, EXPERIMENT
from loramcl.recipes.stages import Stages
from loramcl.recipes.translation.reproduce import Experiment, Translation, translation
from loramcl.training.config import DataConfig, TrainConfig


def test_paper_scale_recipe_files_load_and_build_a_model(tmp_path):
    from loramcl import get_mcl_model

    folder = recipe_folder(None, "translation/alma", [EXPERIMENT, COMMON])
    experiment = Experiment.read(folder / EXPERIMENT)
    assert (experiment.candidates, experiment.budgets, experiment.decoding["diversity_penalty"]) == (3, [3, 6, 9], 0.8)
    runs = run_names(folder, reserved=(EXPERIMENT, COMMON))
    assert runs == ["mcl", "mle-r16", "mle-r48"]
    values = {run: run_arguments(folder, run, tmp_path, common=COMMON) for run in runs}
    for run in runs:
        header = (folder / f"{run}.yaml").read_text()
        assert header.startswith("# ") and "Launch" in header
        training, data = TrainConfig(**values[run]["training"]), DataConfig(**values[run]["data"])
        assert (training.learning_rate, training.weight_decay, training.scheduler) == (2e-5, 0.01, "inverse_sqrt")
        assert data.max_length == 512 and values[run]["dtype"] == "bfloat16"
    assert "accelerate launch --num_processes 8" in (folder / COMMON).read_text()
    mcl = MCLConfig.from_dict(values["mcl"]["mcl"])
    assert (mcl.num_hypotheses, mcl.r, mcl.alpha, mcl.loss, mcl.epsilon) == (3, 16, 32, "relaxed", 0.05)
    # a tiny Llama (ALMA-7B's architecture) wide enough for rank 48: the adapters land on every down_proj, and
    # LoRA-MLE r=48 has the trainable count of the three r=16 hypotheses
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    counts = {}
    for run in runs:
        model = get_mcl_model(LlamaForCausalLM(config), MCLConfig.from_dict(values[run]["mcl"]))
        assert [name.rsplit(".", 1)[-1] for name in model.layer_names] == ["down_proj"] * 2
        counts[run] = model.parameter_counts()[0]
    assert counts["mcl"] == counts["mle-r48"] == 3 * counts["mle-r16"] == 3 * 16 * (48 + 64) * 2
    task = Translation(folder, experiment, Stages(tmp_path / "out"), False, None, "cpu")
    names = [s.name for s in task.systems(values, experiment.budgets)]
    assert names == ["mle-r16-beam-b3", "mle-r16-diversebeam-b3", "mle-r16-beam-b6", "mle-r16-diversebeam-b6",
                     "mle-r16-beam-b9", "mle-r16-diversebeam-b9", "mle-r48-beam-b3", "mle-r48-diversebeam-b3",
                     "mle-r48-beam-b6", "mle-r48-diversebeam-b6", "mle-r48-beam-b9", "mle-r48-diversebeam-b9",
                     "mcl-beam-b3", "mcl-greedy-b3", "mcl-beam-b6", "mcl-beam-b9"]


def test_experiment_settings_are_checked(tmp_path):
    with pytest.raises(ValueError, match="every budget must be a multiple of candidates = 3"):
        Experiment(budgets=[3, 4])
    with pytest.raises(ValueError, match="data: files needs files:"):
        Experiment(data="files")
    (tmp_path / EXPERIMENT).write_text("candidate: 3\n")
    with pytest.raises(ValueError, match=r"unknown settings \['candidate'\]"):
        Experiment.read(tmp_path / EXPERIMENT)


@pytest.fixture(scope="module")
def quick(tmp_path_factory, smollm2_folder):
    out = tmp_path_factory.mktemp("translation")
    (out / "SmolLM2-135M-Instruct").symlink_to(smollm2_folder)  # converted once per test session
    return out, translation(out=str(out), quick=True, threads=1)


def test_quick_recipe_writes_every_output(quick):
    out, report = quick
    assert set(report["systems"]) == {"mle-r8-beam-b3", "mle-r8-diversebeam-b3", "mle-r24-beam-b3",
                                      "mle-r24-diversebeam-b3", "mcl-k3-beam-b3", "mcl-k3-greedy-b3",
                                      "mcl-k3-diversebeam-b3"}
    for name, result in report["systems"].items():
        metrics = result["metrics"]
        for metric in ("loo_bleu", "pairwise_bleu", "sacrebleu", "chrf", "oracle_nll"):
            assert math.isfinite(metrics[metric]), (name, metric)
        assert 1 <= metrics["refs_covered"] <= 3 and 1 <= metrics["distinct"] <= 3
        assert len(result["profile"]["words"]) == 3 and sum(result["best_candidate"]) == pytest.approx(1)
    table = report["nll_table"]
    assert list(table) == ["mle-r8", "mcl-k3", "mle-r24"] and [table[r]["K"] for r in table] == [1, 3, 1]
    assert table["mcl-k3"]["trainable_parameters"] == table["mle-r24"]["trainable_parameters"]
    assert table["mcl-k3"]["oracle_nll"] <= min(table["mcl-k3"]["hypothesis_nll"])
    for figure in ("tradeoff.png", "training.png"):
        assert (out / "figures" / figure).stat().st_size > 1000
    markdown = (out / "report.md").read_text()
    assert "paper Fig. 4" in markdown and "paper Table 1" in markdown
    test = [json.loads(line) for line in (out / "data" / "test.jsonl").read_text().splitlines()]
    train = [json.loads(line) for line in (out / "data" / "train.jsonl").read_text().splitlines()]
    assert all(len(item["references"]) >= 2 for item in test)
    assert all(t == " " + r for item in test for t, r in zip(item["targets"], item["references"], strict=True))
    assert not {normalise(r["source"]) for r in train} & {normalise(i["source"]) for i in test}
    assert train[0]["prompt"].startswith("Translate this from English to German:\nEnglish: ")


def test_a_second_run_reuses_the_finished_stages(quick):
    out, first = quick
    again = translation(out=str(out), quick=True, threads=1)
    assert set(again["timing_s"]) == {"convert model", "report", "runs"}  # nothing retrained or decoded
    assert again["systems"]["mcl-k3-greedy-b3"]["metrics"] == first["systems"]["mcl-k3-greedy-b3"]["metrics"]


def test_a_stop_after_data_writes_the_data_only(tmp_path, smollm2_folder):
    (tmp_path / "SmolLM2-135M-Instruct").symlink_to(smollm2_folder)
    assert translation(out=str(tmp_path), quick=True, stop_after="data") == {"data": str(tmp_path / "data")}
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == [
        "prepare.json", "stats.json", "test.jsonl", "train.jsonl", "validation.jsonl"]


@pytest.mark.parametrize("chat_template", [False, True])
def test_prepare_data_from_the_official_files(tmp_path, smollm2_folder, chat_template):
    from test_translation_data import EXTRA_REFS

    from loramcl.data.prompts import encode_pairs, prompt_text
    from loramcl.recipes.translation.reproduce import prepare_data

    train = tmp_path / "train.de-en.json"
    train.write_text("\n".join(json.dumps({"translation": {"de": de, "en": en}}) for en, de in [
        ("Open the file", "Datei öffnen"), ("Good night", "Gute Nacht")]) + "\n", encoding="utf-8")
    refs = tmp_path / "wmt14-en-de.extra_refs"
    refs.write_text(EXTRA_REFS, encoding="utf-8")
    experiment = Experiment(data="files", files={"train_file": str(train), "test_file": str(refs)})
    stats = prepare_data(tmp_path / "data", experiment, str(smollm2_folder), chat_template, quick=False)
    assert stats["examples"] == {"train": 2, "test": 2} and stats["test_references"] == {"2": 1, "3": 1}
    rows = [json.loads(line) for line in (tmp_path / "data" / "train.jsonl").read_text().splitlines()]
    test = [json.loads(line) for line in (tmp_path / "data" / "test.jsonl").read_text().splitlines()]
    assert rows[0]["prompt"] == "Translate this from English to German:\nEnglish: Open the file\nGerman:"
    assert test[1]["references"] == ["Es regnet .", "Es gießt ."]
    assert not (tmp_path / "data" / "validation.jsonl").exists()
    # what `loramcl train` builds from these files is the tokenization of the text the model reads
    tokenizer = AutoTokenizer.from_pretrained(smollm2_folder)
    encoded = encode_pairs(tokenizer, [rows[0]["prompt"]], [rows[0]["target"]], chat_template)[0]
    text = prompt_text(tokenizer, rows[0]["prompt"], chat_template) + ("" if chat_template else " ") + "Datei öffnen"
    expected = tokenizer(text, add_special_tokens=not chat_template)["input_ids"] + [tokenizer.eos_token_id]
    assert encoded["input_ids"] == expected
    n_target = len(expected) - sum(1 for label in encoded["labels"] if label == -100)
    assert tokenizer.decode(expected[-n_target:-1]).strip() == "Datei öffnen"  # labels: the target and the end
    assert rows[0]["target"] == ("Datei öffnen" if chat_template else " Datei öffnen")
