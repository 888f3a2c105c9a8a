"""`loramcl audio-captioning`: audio captioning with Qwen2-Audio (paper §4.2, App. H.1), data -> train -> decode ->
evaluate -> report, every stage reused when its outputs exist with the same settings.

A recipe folder holds `experiment.yaml` (the data, the prompt, the K candidates, the forward budgets, the decodings
of the single models), `common.yaml` (the model and the training settings every run shares) and one file per
training run (its `out` and its `mcl:` or `moe:` block). Three ship inside the package (`loramcl recipes`):

- audio_captioning/tiny (the default): a tiny random Qwen2-Audio on a generated set in the Clotho layout, on the
  CPU: the whole pipeline in seconds (its numbers mean nothing);
- audio_captioning/clotho and audio_captioning/audiocaps (`--recipes clotho`): the paper's scale (Qwen2-Audio-7B-
  Instruct, App. H.1 hyper-parameters, every trained system of Fig. 3); their common.yaml says how to launch the
  training on one or several GPUs.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from loramcl.data.audio_captions import CAPTIONS_PER_CLIP, LAYOUTS, MISSING_AUDIO, SPLITS, csv_path
from loramcl.recipes.audio_captioning.prompts import DEFAULT_INSTRUCTION
from loramcl.recipes.command import task_command
from loramcl.recipes.experiment import Experiment as RecipeExperiment
from loramcl.recipes.grid import System, check_sampling, check_tta
from loramcl.recipes.steps import ProcessorTask
from loramcl.recipes.stages import data_stats
from loramcl.utils.files import write_json
from loramcl.utils.validate import require, require_int, require_real

DEFAULT_RECIPES = "audio_captioning/tiny"
TINY_MODEL_FOLDER = "tiny-qwen2-audio"
ROLES = ("train", "validation", "test")
# Quick: the same pipeline on a few clips and one or two steps, at the smallest budget (numbers meaningless).
QUICK_CLIPS = {"train": 4, "validation": 2, "test": 3}
QUICK_TRAIN = {"steps": 2, "batch_size": 2, "eval_every": 0, "logging_steps": 1, "warmup_steps": 0, "save_every": 0}
QUICK_DECODING = {"max_new_tokens": 4, "batch_size": 3}
# No METEOR or sBERT (fewer tools started), no Div-n (undefined when every candidate has one word or none).
QUICK_METRICS = "bleu4,cider_d,mbleu4"
# Words of the synthetic captions (and of the tiny model's vocabulary).
PITCHES = {"low": 220.0, "middle": 440.0, "high": 880.0}
SYNTHETIC_PHRASES = ("a {p} tone is playing", "a steady {p} beep sounds", "someone plays a {p} note",
                     "a {p} hum fills the room", "a {p} pitched whistle")
SYNTHETIC_CLIPS = {"development": 24, "validation": 6, "evaluation": 9}
SYNTHETIC_WORDS = sorted({w for phrase in SYNTHETIC_PHRASES for p in PITCHES for w in phrase.format(p=p).split()})


@dataclass(frozen=True, kw_only=True)
class Experiment(RecipeExperiment):
    """experiment.yaml: what `loramcl audio-captioning` does with the runs of a recipe folder. Paths in it (`out`,
    `root`) are relative to that file, as those of the run files (`model` in common.yaml) are to theirs."""

    PATHS = ("out", "root")
    out: str = "runs/audio-captioning"

    layout: str = "clotho"
    """The official distribution read: 'clotho' (Clotho v2) or 'audiocaps' (loramcl.data.audio_captions)."""

    root: str | None = None
    """The folder holding the distribution's CSV files and audio folders (None: synthetic must be true)."""

    synthetic: bool = False
    """Write a small generated set (tones of three pitches, five captions each) in the Clotho layout under
    <out>/synthetic-clotho and read it as the official one: the CPU demonstration."""

    splits: dict = field(default_factory=dict)
    """{train, validation, test}: split names (default Clotho: development, validation, evaluation; AudioCaps:
    train, val, test)."""

    missing_audio: str = "error"
    """A clip without its audio file: 'error', or 'skip' (counted in data/stats.json)."""

    max_seconds: float | None = 30.0
    """Audio cropped to its first seconds (the paper: 30 for Clotho, 10 for AudioCaps)."""

    captions_per_clip: str = "one"
    """Training: 'one' caption drawn per clip per epoch (the paper's), or 'all' (one example per (clip, caption))."""

    chat_template: bool = False
    """The processor's chat template around the audio and instruction; false: the paper's raw prompt."""

    instruction: str = DEFAULT_INSTRUCTION

    packaged_model: str | None = None
    """'tiny-random': build a tiny random Qwen2-Audio into <out>/tiny-qwen2-audio and train on it (the CPU
    demonstration); None: the runs' `model` is a local folder (Qwen2-Audio-7B-Instruct)."""

    epochs: float | None = None
    """Training length in epochs: each run's steps = ceil(epochs x train examples / (batch_size x processes)) and
    its warm-up = warmup_ratio x steps; None: the run files' steps and warmup_steps."""

    processes: int = 1
    """Training processes (GPUs) the runs are launched on, for the steps from epochs."""

    warmup_ratio: float = 0.0

    candidates: int = 5
    """K candidates per clip for every system (the paper: 5)."""

    budgets: list[int] = field(default_factory=lambda: [5, 10])
    """Forward budgets B: MLE beam B and diverse beam (K groups), MCL beam B/K per hypothesis,
    test-time augmentation beam B/K per augmented input; sampling at B = K only."""

    diversity_penalties: list[float] = field(default_factory=lambda: [0.8, 1.0])
    """λ of diverse beam search, one system per value."""

    sampling: list[dict] = field(default_factory=lambda: [{"top_k": 50}, {"top_p": 0.95}, {"typical_p": 0.95}])
    """Sampling systems of the single models (at B = K), one per entry of generate_hypotheses arguments."""

    tta: list[list[float]] = field(default_factory=lambda: [[0.2, 0.3], [0.4, 0.6], [0.6, 0.9]])
    """Test-time augmentation strengths φ = (time, frequency): SpecAugment masks up to that fraction of the frames
    and of the mel channels (one mask of each), once per candidate (paper App. H, Table 7)."""

    metrics: str = "captioning"
    """`loramcl evaluate` metrics (preset 'captioning': BLEU, METEOR, ROUGE-L, CIDEr-D, SPICE/SPIDEr when the SPICE
    jars are there, sBERT, Div-n, mBLEU-4)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.layout in LAYOUTS, f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        require(self.synthetic or isinstance(self.root, str) and bool(self.root),
               "root must name the folder of the official distribution (or set synthetic: true)")
        require(not self.synthetic or self.layout == "clotho", "synthetic data is written in the Clotho layout")
        unknown = set(self.splits) - set(ROLES)
        require(not unknown, f"splits: unknown roles {sorted(unknown)}; roles are {ROLES}")
        for split in self.splits.values():
            require(split in SPLITS[self.layout], f"splits: {split!r} is no {self.layout} split {SPLITS[self.layout]}")
        require(self.missing_audio in MISSING_AUDIO, f"missing_audio must be one of {MISSING_AUDIO}")
        if self.max_seconds is not None:
            require_real("max_seconds", self.max_seconds, low=0.0, low_open=True)
        require(self.captions_per_clip in CAPTIONS_PER_CLIP, f"captions_per_clip must be one of {CAPTIONS_PER_CLIP}")
        require(isinstance(self.chat_template, bool), "chat_template must be true or false")
        require(self.packaged_model in (None, "tiny-random"), "packaged_model must be tiny-random or null")
        if self.epochs is not None:
            require_real("epochs", self.epochs, low=0.0, low_open=True)
        require_int("processes", self.processes)
        require_real("warmup_ratio", self.warmup_ratio, low=0.0, high=1.0, high_open=True)
        for penalty in self.diversity_penalties:
            require_real("diversity_penalties", penalty, low=0.0)
        check_sampling(self.sampling)
        check_tta(self.tta)

    def split(self, role: str) -> str:
        defaults = dict(zip(ROLES, SPLITS[self.layout], strict=True))
        return self.splits.get(role, defaults[role])


# ---- data ----------------------------------------------------------------------------------------------------


def write_synthetic_clotho(folder: Path, clips: dict[str, int], seed: int = 0) -> Path:
    """A generated set in the exact Clotho v2 layout: ``clotho_captions_<split>.csv`` (file_name, caption_1..5)
    beside ``<split>/`` of 44.1 kHz 16-bit WAV files, each a tone of one of three pitches (0.3-1.2 s, some noise)
    with five captions naming its pitch in five phrasings."""
    import csv

    import numpy as np
    from scipy.io import wavfile

    rng = np.random.default_rng(seed)
    names = list(PITCHES)
    for split, count in clips.items():
        (folder / split).mkdir(parents=True, exist_ok=True)
        with (folder / f"clotho_captions_{split}.csv").open("w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f)
            writer.writerow(["file_name", *(f"caption_{i}" for i in range(1, 6))])
            for n in range(count):
                pitch = names[n % len(names)]
                rate, seconds = 44_100, float(rng.uniform(0.3, 1.2))
                t = np.arange(int(rate * seconds)) / rate
                wave = 0.4 * np.sin(2 * np.pi * PITCHES[pitch] * t) + 0.05 * rng.standard_normal(t.size)
                name = f"{split}_{n:03d}.wav"
                wavfile.write(folder / split / name, rate, (wave * 32767).astype(np.int16))
                writer.writerow([name, *(phrase.format(p=pitch) for phrase in SYNTHETIC_PHRASES)])
    return folder


def prepare_data(out: Path, experiment: Experiment, root: Path, quick: bool) -> dict:
    """Read the three splits and write data/{train,validation,test}.jsonl: {"id", "audio", "references"} per clip
    (every file's header read: an unreadable file fails here), and data/stats.json (clips, captions, skipped clips,
    hours of audio)."""
    from loramcl.data.audio_captions import audio_info, read_split

    out.mkdir(parents=True, exist_ok=True)
    stats: dict = {"layout": experiment.layout, "root": str(root), "splits": {}}
    for role in ROLES:
        split = experiment.split(role)
        clips, skipped = read_split(experiment.layout, root, split, experiment.missing_audio)
        if quick:
            clips = clips[:QUICK_CLIPS[role]]
        seconds = 0.0
        with (out / f"{role}.jsonl").open("w", encoding="utf-8") as f:
            for clip in clips:
                rate, frames = audio_info(clip.audio)
                seconds += frames / rate
                f.write(json.dumps({"id": clip.id, "audio": clip.audio, "references": list(clip.captions)},
                                   ensure_ascii=False) + "\n")
        stats["splits"][role] = {"split": split, "clips": len(clips), "captions": sum(len(c.captions) for c in clips),
                                 "skipped": len(skipped), "hours": round(seconds / 3600, 3)}
    write_json(out / "stats.json", stats)
    return stats


def read_manifest(path: Path) -> list:
    from loramcl.data.audio_captions import AudioClip

    with path.open(encoding="utf-8") as f:
        return [AudioClip(r["id"], r["audio"], tuple(r["references"]), f"{path}:{n}")
                for n, r in enumerate(map(json.loads, f), start=1)]


# ---- training ------------------------------------------------------------------------------------------------


def training_config(values: dict, experiment: Experiment, train_examples: int, quick: bool = False):
    """The run's TrainConfig, its steps and warm-up from experiment.epochs when given (not in a quick run)."""
    from loramcl.training.config import TrainConfig
    from loramcl.utils.run_record import RunFile

    settings = dict(RunFile.of(values).training)
    if experiment.epochs is not None and not quick:
        batch = settings.get("batch_size", TrainConfig.batch_size) * experiment.processes
        steps = max(1, math.ceil(experiment.epochs * train_examples / batch))
        settings |= {"steps": steps, "warmup_steps": round(experiment.warmup_ratio * steps)}
    return TrainConfig(**settings)


# ---- the command ---------------------------------------------------------------------------------------------


class AudioCaptioning(ProcessorTask):
    """Audio captioning with Qwen2-Audio (paper §4.2, Fig. 3): LoRA-MCL against LoRA-MLE and LoRA-MoE at equal budget.

    Trains every run of the recipe folder, decodes K captions per clip at equal forward budgets (MCL beam B/K per
    hypothesis; MLE and MoE beam, diverse beam, SpecAugment test-time augmentation; sampling), scores them
    (`loramcl evaluate`: oracle SPIDEr / CIDEr-D / METEOR / sBERT, mBLEU-4, Div-n) and plots quality against
    diversity.

    Writes to `out`: data/, one folder per run (adapters, logs), predictions/, eval/, figures/, report.json and
    report.md. Finished stages are reused when their settings are unchanged; an interrupted training resumes.
    """

    experiment_type = Experiment
    default_recipes = DEFAULT_RECIPES
    quick_settings = {"training": QUICK_TRAIN}
    quick_decoding = QUICK_DECODING
    options = {
        "recipes": "recipe folder with experiment.yaml, common.yaml and one file per run, or a packaged recipe's name "
                   "(default: tiny; clotho and audiocaps are the paper's scale; `loramcl recipes` lists them).",
        "quick": "a few clips, two training steps per run, the smallest budget: checks the whole pipeline (numbers "
                 "meaningless).",
        "stop_after": '"data" or "train": stop after that stage (e.g. to train each run with `accelerate launch`, see '
                      "the paper-scale common.yaml, then run this command again to decode and report).",
        "runs": "train only these runs (with stop_after train; e.g. one run per `accelerate launch`)."}

    def build_model(self) -> str | None:
        return self.tiny_model(TINY_MODEL_FOLDER, "tiny_qwen2_audio", SYNTHETIC_WORDS)

    def check(self, model: str, values: dict[str, dict]) -> None:
        from loramcl.utils.inputs import check_model_folder

        check_model_folder(model)  # before hours of data preparation

    def prepare_data(self, model: str, values: dict[str, dict]) -> None:
        from loramcl.utils.files import sha256

        experiment = self.experiment
        root = Path(experiment.root) if experiment.root else self.root / "synthetic-clotho"
        if experiment.synthetic:
            self.stages.run("write synthetic data", root / "written.json", {"clips": SYNTHETIC_CLIPS},
                            write_synthetic_clotho, root, SYNTHETIC_CLIPS)
        csvs = {role: csv_path(experiment.layout, root, experiment.split(role)) for role in ROLES}
        settings = {"layout": experiment.layout, "root": str(root), "splits": {r: experiment.split(r) for r in ROLES},
                    "missing_audio": experiment.missing_audio, "quick": self.quick,
                    "csv_sha256": {role: sha256(path) for role, path in csvs.items() if path.is_file()}}
        self.stages.run("prepare data", self.data / "prepare.json", settings, prepare_data, self.data, experiment,
                        root, self.quick)

    def training_config(self, values: dict):
        stats = data_stats(self.data)
        examples = stats["splits"]["train"]["clips" if self.experiment.captions_per_clip == "one" else "captions"]
        return training_config(values, self.experiment, examples, self.quick)

    def example_settings(self, values: dict) -> dict:
        experiment = self.experiment
        return {"eval_examples": values.get("eval_examples", 64), "captions": {
            "captions_per_clip": experiment.captions_per_clip, "max_seconds": experiment.max_seconds,
            "chat_template": experiment.chat_template, "instruction": experiment.instruction}}

    def encoder(self, processor):
        from loramcl.recipes.audio_captioning.prompts import CaptionEncoder

        return CaptionEncoder(processor, self.experiment.chat_template, self.experiment.instruction)

    def audio(self, clip):
        from loramcl.data.audio_captions import load_audio

        return load_audio(clip.audio, max_seconds=self.experiment.max_seconds)

    def training_sets(self, values: dict, training, processor) -> tuple:
        from loramcl.data.audio_captions import CaptionExamples

        encoder = self.encoder(processor)

        def encode(clip, caption: str) -> dict:
            return encoder.encode(self.audio(clip), caption)

        train_set = CaptionExamples(read_manifest(self.data / "train.jsonl"), encode,
                                    self.experiment.captions_per_clip, seed=training.seed)
        validation = read_manifest(self.data / "validation.jsonl")[:values.get("eval_examples", 64)]
        return train_set, CaptionExamples(validation, encode, "all") if validation else None

    def collate(self):
        from loramcl.recipes.audio_captioning.prompts import collate_audio

        return collate_audio

    def test_inputs(self) -> dict:
        return {clip.id: clip for clip in read_manifest(self.test)}

    def inputs(self, processor, batch: list, strength) -> tuple:
        from loramcl.decoding.augment import tta_augment

        return (self.encoder(processor).generation_batch([self.audio(clip) for clip in batch]),
                tta_augment(*strength) if strength else None)

    def scored_runs(self, runs: list[str], systems: list[System]) -> list[str]:
        return list(dict.fromkeys(system.entry for system in systems))  # '<run>@best': its best adapters

    def reference_examples(self, processor):
        """The reference captions of each test clip, tokenized as in training: the mean NLL per caption token (end
        token included)."""
        encoder = self.encoder(processor)
        for clip in read_manifest(self.test):
            waveform = self.audio(clip)
            yield clip.id, [encoder.encode(waveform, caption) for caption in clip.captions]

    def evaluate(self, systems: list[System]) -> None:
        from loramcl.metrics.evaluate import evaluate
        from loramcl.training.runs import file_stamp

        metrics = QUICK_METRICS if self.quick else self.experiment.metrics
        for system in systems:
            predictions, nll = self.stages.predictions(system.name), self.root / "nll" / f"{system.entry}.jsonl"
            self.stages.run(f"evaluate {system.name}", self.root / "eval" / f"{system.name}.settings.json",
                            {"predictions": file_stamp(predictions), "nll": file_stamp(nll), "metrics": metrics},
                            evaluate, predictions=str(predictions), references=str(self.test), metrics=metrics,
                            out=str(self.root / "eval"), name=system.name, nll=str(nll))

    def report(self, systems: list[System], runs: list[str]) -> dict:
        from loramcl.recipes.audio_captioning.report import build_report

        return build_report(self.root, self.experiment, systems, runs)


audio_captioning = task_command(AudioCaptioning, "audio_captioning")


__all__ = ["AudioCaptioning", "Experiment", "audio_captioning", "prepare_data", "write_synthetic_clotho"]
