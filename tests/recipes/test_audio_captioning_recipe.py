"""`loramcl audio-captioning`: the CPU pipeline end to end (--quick) and the paper-scale recipe files."""

import json
from pathlib import Path

import pytest
import torch

from loramcl.recipes.audio_captioning.reproduce import Experiment, audio_captioning, training_config
from loramcl.recipes.files import method_of, packaged_recipes, run_names, run_values
from loramcl.recipes.grid import systems_of
from loramcl.recipes.runner import COMMON, EXPERIMENT

RECIPES = packaged_recipes() / "audio_captioning"


def test_quick_end_to_end_then_every_stage_reused(tmp_path):
    """Data (a generated set in the Clotho layout, read by the official reader) -> a tiny random Qwen2-Audio ->
    train MCL (relaxed, annealed), MLE and MoE -> decode with every strategy -> evaluate -> report; run again, every
    stage is reused."""
    out = tmp_path / "ac"
    report = audio_captioning(out=str(out), quick=True)
    assert (out / "synthetic-clotho" / "clotho_captions_development.csv").is_file()
    test_ids = [json.loads(line)["id"] for line in (out / "data" / "test.jsonl").read_text().splitlines()]
    assert test_ids == ["evaluation_000.wav", "evaluation_001.wav", "evaluation_002.wav"]
    strategies = {s["system"]["strategy"] for s in report["systems"].values()}
    assert strategies == {"greedy", "beam", "diverse_beam", "tta", "sample"}
    assert set(report["runs"]) == {"mcl-relaxed", "mcl-annealed", "mle", "moe"}
    assert {"mcl-relaxed-greedy-b2", "mcl-relaxed-diversebeam-b2", "mle-dbs0.8-b2", "moe-tta1-b2"} <= set(
        report["systems"])
    for name, result in report["systems"].items():
        lines = [json.loads(line) for line in (out / "predictions" / f"{name}.jsonl").read_text().splitlines()]
        assert [line["id"] for line in lines] == test_ids and all(len(line["candidates"]) == 2 for line in lines)
        if name.startswith("mcl-"):
            assert all(line["hypotheses"] == [0, 1] for line in lines)
        assert {"cider_d", "bleu4", "mbleu4", "oracle_nll"} <= set(result["metrics"])
    nll = [json.loads(line)["nll"] for line in (out / "nll" / "mcl-relaxed.jsonl").read_text().splitlines()]
    assert [len(rows) for rows in nll] == [5, 5, 5] and all(len(row) == 2 for rows in nll for row in rows)
    oracle = sum(min(row) for rows in nll for row in rows) / 15  # App. E.1: mean over references of min over k
    assert abs(report["systems"]["mcl-relaxed-greedy-b2"]["metrics"]["oracle_nll"] - oracle) < 1e-9
    text = (out / "report.md").read_text()
    assert "| mcl-relaxed | 2 | 4 | relaxed ε=0.05 |" in text and "| moe | 1 | 4 | MoE NLL, 2 experts |" in text
    assert (out / "figures" / "tradeoff.png").is_file() and (out / "figures" / "training.png").is_file()

    again = audio_captioning(out=str(out), quick=True)
    assert set(again["timing_s"]) == {"report", "runs"}  # nothing trained, decoded or evaluated again


@pytest.mark.parametrize("folder", ["clotho", "audiocaps"])
def test_paper_scale_recipes_load_and_build_the_model(folder, tmp_path, monkeypatch):
    """Every run file of the paper-scale recipes parses into its method's configuration and a TrainConfig, and wraps
    Qwen2-Audio-7B built from its config on the meta device (no weights): LoRA-MCL K = 5 x r = 8 trains exactly
    LoRA-MLE r = 40's parameters."""
    from transformers import Qwen2AudioConfig, Qwen2AudioForConditionalGeneration

    from loramcl.training.fit import method_model

    recipes = RECIPES / folder
    monkeypatch.chdir(tmp_path)  # a packaged recipe's ./models and ./data are the current folder's
    experiment = Experiment.read(recipes / EXPERIMENT)
    runs = run_names(recipes, reserved=(EXPERIMENT, COMMON))
    assert runs == ["mcl-annealed", "mcl-relaxed-e0.0005", "mcl-relaxed-e0.05", "mle-r40", "mle-r8", "moe"]
    clips = {"clotho": 3839, "audiocaps": 49_838}[folder]  # official training clips
    config = Qwen2AudioConfig(text_config=dict(model_type="qwen2", vocab_size=156_032, intermediate_size=11_008))
    with torch.device("meta"):
        base = Qwen2AudioForConditionalGeneration(config)
    trainable, hypotheses = {}, {}
    for run in runs:
        values = run_values(recipes, run, Path("/tmp/out"), None, None)
        assert values["model"] == str(tmp_path / "models" / "Qwen2-Audio-7B-Instruct")
        assert values["dtype"] == "bfloat16" and experiment.root == str(tmp_path / "data" / folder)
        training = training_config(values, experiment, clips)
        assert training.steps == -(-experiment.epochs * clips // 2) and training.warmup_steps == round(
            0.1 * training.steps)
        assert (training.learning_rate, training.min_learning_rate, training.adam_beta2) == (1e-5, 1e-6, 0.98)
        method, method_config = method_of(values)
        model = method_model(base, method, method_config)
        trainable[run] = model.parameter_counts()[0]
        hypotheses[run] = method_config.to_dict().get("num_hypotheses", 1)
        base = model.unload()
    assert trainable["mcl-annealed"] == trainable["mle-r40"] == 5 * trainable["mle-r8"]
    assert trainable["moe"] > trainable["mle-r40"]  # + the routers
    names = {s.name for s in systems_of(experiment, hypotheses, experiment.budgets)}
    assert {"mcl-annealed-beam-b5", "mcl-annealed-greedy-b5", "mcl-annealed-beam-b10", "mle-r8-beam-b10",
            "mle-r8-dbs1-b5", "mle-r8-tta3-b10", "moe-dbs0.8-b10", "mle-r8-topk50-b5",
            "mcl-annealed-typical0.95-b5"} <= names


def test_experiment_errors_say_what_to_change(tmp_path):
    with pytest.raises(ValueError, match="root must name the folder"):
        Experiment(layout="clotho")
    with pytest.raises(ValueError, match="'train' is no clotho split"):
        Experiment(root="x", splits={"train": "train"})
    with pytest.raises(ValueError, match="every budget must be a multiple of candidates = 5"):
        Experiment(root="x", budgets=[5, 7])
    (tmp_path / EXPERIMENT).write_text("root: x\nepoch: 3\n")
    with pytest.raises(ValueError, match=r"unknown settings \['epoch'\]"):
        Experiment.read(tmp_path / EXPERIMENT)


def test_tta_masks_at_most_its_strength_inside_the_audio():
    from loramcl.decoding.augment import tta_augment

    features = torch.randn(2, 20, 100) + 5.0  # [B, n_mels, frames]
    mask = torch.zeros(2, 100, dtype=torch.long)
    mask[0, :100], mask[1, :40] = 1, 1  # the second clip: 40 frames of audio, then padding
    inputs = {"input_features": features, "feature_attention_mask": mask}
    masked_frames, masked_channels = [], []
    for k in range(30):
        changed = tta_augment(0.4, 0.6)(inputs, k)["input_features"] != features  # [B, n_mels, frames]
        frames, channels = changed.all(dim=1), changed.all(dim=2)  # [B, frames] / [B, n_mels] fully masked
        assert not frames[1, 40:].any()  # time masks fall on audio, never on padding
        masked_frames.append(frames.sum(-1))
        masked_channels.append(channels.sum(-1))
    frames, channels = torch.stack(masked_frames), torch.stack(masked_channels)  # [30, B]
    assert (frames[:, 0] <= 40).all() and (frames[:, 1] <= 16).all() and (channels <= 12).all()
    assert frames[:, 0].max() > 20 and channels.max() > 6  # the widths reach toward the strength
    assert inputs["input_features"] is features and torch.equal(features, inputs["input_features"])


def test_quick_on_the_audiocaps_layout(tmp_path):
    """The same pipeline on a fixture in the AudioCaps layout (one caption per training clip, five per test clip,
    32 kHz WAV named by YouTube id, a missing clip skipped), with an MCL and an MLE run."""
    import csv
    import shutil

    import numpy as np
    from scipy.io import wavfile

    root = tmp_path / "audiocaps"
    rng = np.random.default_rng(0)
    for split, clips, captions in [("train", 5, 1), ("val", 2, 5), ("test", 3, 5)]:
        (root / split).mkdir(parents=True)
        with (root / f"{split}.csv").open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["audiocap_id", "youtube_id", "start_time", "caption"])
            for c in range(clips + 1):  # the last clip of each split has no audio file
                writer.writerows([[100 * c + n, f"{split}-yt{c}", 30, f"a high tone {n}"] for n in range(captions)])
                if c < clips:
                    t = np.arange(16_000) / 32_000
                    wave = 0.3 * np.sin(2 * np.pi * 440 * t) + 0.01 * rng.standard_normal(t.size)
                    wavfile.write(root / split / f"{split}-yt{c}.wav", 32_000, wave.astype(np.float32))
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    shutil.copy(RECIPES / "tiny" / COMMON, recipes / COMMON)
    for run in ("mcl-relaxed", "mle"):
        shutil.copy(RECIPES / "tiny" / f"{run}.yaml", recipes / f"{run}.yaml")
    (recipes / EXPERIMENT).write_text(
        f"layout: audiocaps\nroot: {root}\nmissing_audio: skip\nmax_seconds: 10.0\npackaged_model: tiny-random\n"
        "candidates: 2\nbudgets: [2]\ndiversity_penalties: [1.0]\nsampling: [{top_p: 0.95}]\ntta: [[0.2, 0.3]]\n")
    out = tmp_path / "out"
    report = audio_captioning(out=str(out), recipes=str(recipes), quick=True)
    assert report["data"]["splits"]["test"] | {"hours": None} == {"split": "test", "clips": 3, "captions": 15,
                                                                   "skipped": 1, "hours": None}
    assert report["data"]["splits"]["train"]["captions"] == 4  # quick: the first 4 clips, one caption each
    assert {s["system"]["strategy"] for s in report["systems"].values()} == {"greedy", "beam", "diverse_beam", "tta",
                                                                             "sample"}
    references = [json.loads(line)["references"] for line in (out / "data" / "test.jsonl").read_text().splitlines()]
    assert references == [[f"a high tone {n}" for n in range(5)]] * 3
