"""`loramcl image-captioning`: image description with reading comprehension (paper §4.3, App. H.2-H.4), data ->
train -> decode -> evaluate -> report, every stage reused when its outputs exist with the same settings.

A recipe folder holds `experiment.yaml` (what this command does: the TextCaps files and images, the K candidates, the
forward budgets, which runs are decoded), `common.yaml` and one file per training run (the model, `mcl:` or `method:
moe` with `moe:`, `training:`, `dtype:`); the runs train on the LLaVA-NeXT conversation of
`loramcl.recipes.image_captioning.prompts`.
Adding a run (another K, a baseline) is adding a file. Three ship inside the package (`loramcl recipes`):

- image_captioning/tiny (the default): a tiny random LLaVA-NeXT on a generated set in the TextCaps layout, on the
  CPU: the whole pipeline in seconds (its numbers mean nothing);
- image_captioning/textcaps and textcaps-bilingual (`--recipes textcaps`): the paper's scale (LLaVA-1.6-Vicuna-7B on
  TextCaps); their files say how to launch the training on several GPUs.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path

from loramcl.recipes import runner
from loramcl.recipes.experiment import Experiment as RecipeExperiment
from loramcl.recipes.grid import DecodeConfig, System
from loramcl.utils.validate import require, require_int

DEFAULT_RECIPES = "image_captioning/tiny"
TINY_MODEL_FOLDER, SYNTHETIC_FOLDER = "tiny-llava-next", "synthetic-textcaps"
# Images per split of the generated set (five captions each; the test split has none, as TextCaps').
SYNTHETIC_IMAGES = {"train": 24, "val": 6, "test": 3}
# Quick: the same pipeline on a few images and one training step, at the smallest budget (numbers meaningless).
QUICK_DATA = {"train": 8, "test": 3}
QUICK_TRAIN = {"steps": 1, "batch_size": 2, "logging_steps": 1, "warmup_steps": 0, "save_every": 0, "eval_every": 0}
QUICK_DECODING = {"max_new_tokens": 5, "batch_size": 3}
logger = logging.getLogger(__name__)  # a stage's progress, which the command shows (docs/cli.md)


@dataclass(frozen=True, kw_only=True)
class Experiment(RecipeExperiment):
    """experiment.yaml: what `loramcl image-captioning` does with the runs of a recipe folder."""

    PATHS = ("out", "textcaps", "images")

    textcaps: str | None = None
    """Folder holding TextCaps_0.1_{train,val,test}.json (relative paths: to this file's folder; None: synthetic
    must be true)."""

    images: str | None = None
    """Folder of the images: <images>/<image_path> or <images>/<file name> (TextVQA's train_images/); relative
    paths: to this file's folder (None with synthetic: <textcaps>/images)."""

    synthetic: bool = False
    """Write a small generated set (coloured shapes, five captions each naming colour and shape) in the TextCaps 0.1
    layout into `textcaps` (default <out>/synthetic-textcaps) and read it as the official one: the CPU
    demonstration."""

    packaged_model: str | None = None
    """'tiny-random': build a tiny random LLaVA-NeXT into <out>/tiny-llava-next and train on it (the CPU
    demonstration); None: the runs' `model` is a local folder (LLaVA-1.6-Vicuna-7B)."""

    out: str = "runs/image-captioning"
    """Output folder (relative paths: to this file's folder, as every path of a recipe file)."""

    train_split: str = "train"
    test_split: str = "val"
    """Split scored (TextCaps' test captions are not public: the paper reports on val)."""

    per_image: str = "all"
    """Training examples: 'all' (one per image and reference caption) or 'one' (one caption drawn per image and
    epoch)."""

    instruction: str = "Please carefully observe the image and come up with a caption for the image."
    """The user's instruction after the image (the paper's reference code, a Vicuna-v1 conversation)."""

    max_caption_tokens: int = 64
    """Training captions longer than this (end-of-sequence included) lose their end."""

    test_images: int | None = None
    """Score the first N images of the test split only (None: all)."""

    candidates: int = 3
    """K candidates per image for every system (the paper: 3)."""

    budgets: list[int] = field(default_factory=lambda: [3, 6])
    """Forward budgets B (the paper: 3 and 6): single models decode with beam B and diverse beam search (K groups),
    runs with K hypotheses with beam B/K each."""

    diversity_penalties: list[float] = field(default_factory=lambda: [0.8, 1.0])
    """λ of diverse beam search: one system per value (the paper: 0.8 and 1.0)."""

    metrics: str = "captioning"
    """`loramcl evaluate --metrics` presets or names (the 'captioning' preset: BLEU, METEOR, ROUGE-L, CIDEr-D, SPICE
    and SPIDEr where the SPICE jars are installed, sBERT, Div-n, mBLEU-4)."""

    bilingual: dict | None = None
    """The bilingual variant (§4.3, App. H.5): `data.caption_translation.BilingualSettings` (translator: a local
    seq2seq model folder, relative to this file; prefix, language, fraction, seed). Half the training captions become
    French, the test set keeps the English references and their translations; the report adds which hypothesis wins
    each reference language, the language of each hypothesis's outputs, and the embedding probes."""

    def __post_init__(self) -> None:
        from loramcl.recipes.image_captioning.textcaps import PER_IMAGE, SPLIT_FILES

        super().__post_init__()
        for name in ("textcaps", "images"):
            value = getattr(self, name)
            require((self.synthetic and value is None) or (isinstance(value, str) and bool(value)),
                    f"{name} must be a folder path (or set synthetic: true)")
        require(isinstance(self.synthetic, bool), "synthetic must be true or false")
        require(self.packaged_model in (None, "tiny-random"), "packaged_model must be tiny-random or null")
        for name in ("train_split", "test_split"):
            require(getattr(self, name) in SPLIT_FILES, f"{name} must be one of {sorted(SPLIT_FILES)}, got "
                   f"{getattr(self, name)!r}")
        require(self.test_split != "test", "test_split: TextCaps' test split has no captions to score against; use val")
        require(self.per_image in PER_IMAGE, f"per_image must be one of {PER_IMAGE}, got {self.per_image!r}")
        require(isinstance(self.instruction, str) and self.instruction.strip(), "instruction must be a non-empty text")
        require_int("max_caption_tokens", self.max_caption_tokens, minimum=2)
        if self.test_images is not None:
            require_int("test_images", self.test_images)
        require(isinstance(self.diversity_penalties, list) and all(
            isinstance(x, int | float) and not isinstance(x, bool) and x >= 0 for x in self.diversity_penalties),
            f"diversity_penalties must be a list of numbers >= 0, got {self.diversity_penalties!r}")
        if self.bilingual is not None:
            self.bilingual_settings()

    def bilingual_settings(self):
        """The typed `bilingual:` settings, or None."""
        from loramcl.recipes.image_captioning.caption_translation import BilingualSettings

        if self.bilingual is None:
            return None
        require(isinstance(self.bilingual, dict), f"bilingual must be a mapping of settings, got {self.bilingual!r}")
        return BilingualSettings(**self.bilingual)

    @classmethod
    def read(cls, path: Path) -> Experiment:
        """experiment.yaml, the translator of `bilingual:` relative to it too."""
        import dataclasses

        from loramcl.recipes.files import path_base

        experiment = super().read(path)
        bilingual = experiment.bilingual
        if isinstance(bilingual, dict) and isinstance(bilingual.get("translator"), str):
            translator = (path_base(path) / Path(bilingual["translator"]).expanduser()).resolve()
            experiment = dataclasses.replace(experiment, bilingual={**bilingual, "translator": str(translator)})
        return experiment


def prepare_data(out: Path, experiment: Experiment, quick: bool, device: str = "cpu") -> dict:
    """Read and check the TextCaps splits (every image opened), and write data/{train,test}.jsonl: {"id", "image",
    "references"} per image. The bilingual variant translates its share of the training captions and every test
    reference (cached in <out>/../translations/), and tags them: "languages" (train), "reference_languages" (test)."""
    from loramcl.recipes.image_captioning.caption_translation import bilingual_splits
    from loramcl.recipes.image_captioning.textcaps import SPLIT_FILES, read_textcaps

    splits = {}
    for name, split in (("train", experiment.train_split), ("test", experiment.test_split)):
        images = read_textcaps(Path(experiment.textcaps) / SPLIT_FILES[split], experiment.images, captions=True)
        limit = QUICK_DATA[name] if quick else (experiment.test_images if name == "test" else None)
        splits[name] = images[:limit]
    rows = {name: [{"id": i.image_id, "image": str(i.image_path), "references": i.references} for i in images]
            for name, images in splits.items()}
    bilingual = experiment.bilingual_settings()
    if bilingual is not None:
        rows["train"], rows["test"] = bilingual_splits(splits["train"], splits["test"], bilingual,
                                                       out.parent / "translations" / bilingual.cache_name(), device)
    out.mkdir(parents=True, exist_ok=True)
    for name, lines in rows.items():
        with (out / f"{name}.jsonl").open("w", encoding="utf-8") as f:
            for line in lines:
                f.write(json.dumps(line, ensure_ascii=False) + "\n")
    stats = {"images": {name: len(images) for name, images in rows.items()},
             "captions": {name: sum(len(r["references"]) for r in images) for name, images in rows.items()}}
    if bilingual is not None:
        stats["translated_training_captions"] = sum(lang != "en" for r in rows["train"] for lang in r["languages"])
    (out / "stats.json").write_text(json.dumps(stats, indent=1) + "\n", encoding="utf-8")
    return stats


def read_images(path: Path) -> list:
    """The CaptionImage list of a data/*.jsonl file."""
    from loramcl.recipes.image_captioning.textcaps import CaptionImage
    from loramcl.utils.files import read_jsonl

    return [CaptionImage(str(r["id"]), Path(r["image"]), list(r["references"]))
            for r in read_jsonl(path, "references").values()]


def load_vlm(model: str, dtype: str = "float32", device: str = "cpu", adapters: str | None = None):
    """A local image-text-to-text model (LLaVA-NeXT) in eval mode, with the adapters of a run folder if given."""
    from loramcl.models import load_model

    return load_model(model, adapters, dtype, device)


def train_run(values: dict, data: Path, experiment: Experiment, settings: dict, threads: int | None) -> dict:
    """Train one run on the training images (``training.fit.fit``: the same files and record as `loramcl train`)."""
    from transformers import AutoProcessor

    from loramcl.recipes.files import method_of
    from loramcl.recipes.image_captioning.prompts import CaptionEncoder, collate_captions
    from loramcl.recipes.image_captioning.textcaps import CaptionTrainingSet
    from loramcl.training.config import TrainConfig
    from loramcl.training.fit import fit, resumable_checkpoint
    from loramcl.utils.threads import use_threads

    use_threads(threads)
    processor = AutoProcessor.from_pretrained(values["model"])
    training = TrainConfig(**values.get("training", {}))
    encoder = CaptionEncoder(processor, experiment.instruction, experiment.max_caption_tokens)
    train_set = CaptionTrainingSet(read_images(data / "train.jsonl"), experiment.per_image, training.seed, encoder)
    pad = processor.tokenizer.pad_token_id
    pad = processor.tokenizer.eos_token_id if pad is None else pad
    method, config = method_of(values)
    last = resumable_checkpoint(values["out"], settings, resume=True)
    return fit(lambda: load_vlm(values["model"], values.get("dtype", "float32")), values["out"], config, training,
               settings, train_set, None, collator=lambda rows: collate_captions(rows, pad), processor=processor,
               last_checkpoint=last, method=method)


def caption(model: str, adapters: str, test: Path, out: Path, arguments: dict, batch_size: int, instruction: str,
            dtype: str = "float32", device: str = "cpu") -> str:
    """K candidates per test image with ``generate_hypotheses``; written as `loramcl evaluate` reads predictions:
    {"id", "candidates", "log_probs"(, "hypotheses")} per line. Batch b decodes with seed + b."""
    from transformers import AutoProcessor

    from loramcl.decoding.predictions import prediction_record
    from loramcl.decoding.strategies import generate_hypotheses
    from loramcl.recipes.image_captioning.prompts import decoding_batch

    processor = AutoProcessor.from_pretrained(model)
    decoder = load_vlm(model, dtype, device, adapters)
    images = read_images(test)
    out.parent.mkdir(parents=True, exist_ok=True)
    seed = arguments.pop("seed", 0)
    with out.open("w", encoding="utf-8") as f:
        for b, start in enumerate(range(0, len(images), batch_size)):
            chunk = images[start:start + batch_size]
            outs = generate_hypotheses(decoder, processor, decoding_batch(processor, chunk, instruction),
                                       seed=seed + b, **arguments)
            for image, candidates in zip(chunk, outs, strict=True):
                f.write(json.dumps(prediction_record(image.image_id, candidates), ensure_ascii=False) + "\n")
    logger.info(f"{len(images)} images x {len(outs[0])} candidates ({arguments['strategy']}): {out}")
    return str(out)


class ImageCaptioning(runner.Task):
    """LLaVA-NeXT captions on TextCaps: one run per run file, the test images' every reference caption scored."""

    quick_settings = {"training": QUICK_TRAIN}
    quick_decoding = QUICK_DECODING
    experiment_type = Experiment
    default_recipes = DEFAULT_RECIPES

    def build_model(self) -> str | None:
        from loramcl.recipes.image_captioning.textcaps import SYNTHETIC_WORDS

        return self.tiny_model(TINY_MODEL_FOLDER, "tiny_llava_next", SYNTHETIC_WORDS)

    def systems(self, values: dict[str, dict], budgets: list[int]) -> list[System]:
        """Each decoded run x each decoding x each budget, at equal forward budget; one diverse beam search system
        per λ."""
        from loramcl.recipes.grid import equal_budget_systems

        decoded = self.experiment.decoded_runs(list(values))
        systems = []
        for system in equal_budget_systems({run: self.hypotheses(values[run]) for run in decoded},
                                           self.experiment.candidates, budgets,
                                           mcl_strategies=self.experiment.mcl_decodings):
            if system.strategy != "diverse_beam":
                systems.append(system)
                continue
            for penalty in self.experiment.diversity_penalties:
                name = system.name.replace("-diversebeam-", f"-diversebeam{penalty:g}-")
                systems.append(System(name, system.run, system.strategy, system.budget,
                                      {"diversity_penalty": penalty}))
        return systems

    def split_files(self) -> dict[str, Path]:
        from loramcl.recipes.image_captioning.textcaps import SPLIT_FILES

        experiment = self.experiment
        return {split: Path(experiment.textcaps) / SPLIT_FILES[split]
                for split in dict.fromkeys((experiment.train_split, experiment.test_split))}

    def prepare_data(self, model: str, values: dict[str, dict]) -> None:
        import dataclasses

        from loramcl.recipes.image_captioning.textcaps import write_synthetic_textcaps
        from loramcl.utils.files import sha256

        experiment = self.experiment
        if experiment.synthetic:  # then read as the official files are
            textcaps = Path(experiment.textcaps or self.root / SYNTHETIC_FOLDER)
            self.stages.run("write synthetic data", textcaps / "written.json", {"images": SYNTHETIC_IMAGES},
                            write_synthetic_textcaps, textcaps, SYNTHETIC_IMAGES)
            self.experiment = dataclasses.replace(experiment, textcaps=str(textcaps),
                                                  images=experiment.images or str(textcaps / "images"))
        for path in self.split_files().values():  # the first thing a user of a paper-scale recipe meets
            if not path.is_file():
                raise FileNotFoundError(f"{path} does not exist: the recipe {self.folder} reads TextCaps 0.1 and the "
                                        "TextVQA images where its experiment.yaml says: download them there, or point "
                                        "a copy at them (loramcl recipes copy image_captioning/textcaps DIR); the CPU "
                                        "recipe is the default: loramcl image-captioning without --recipes")
        settings = asdict(self.experiment) | {"quick": self.quick, "files_sha256": {
            split: sha256(path) for split, path in self.split_files().items()}}
        for name in ("out", "decoded", "decoding", "budgets", "candidates", "diversity_penalties", "metrics",
                     "mcl_decodings", "packaged_model"):
            settings.pop(name)  # decoding settings: not the data's
        self.stages.run("prepare data", self.data / "prepare.json", settings, prepare_data, self.data,
                        self.experiment, self.quick, self.device)

    def train(self, run: str, values: dict) -> None:
        from loramcl.recipes.files import method_of
        from loramcl.training.config import TrainConfig
        from loramcl.utils.files import sha256

        experiment = self.experiment
        method, config = method_of(values)
        settings = json.loads(json.dumps({
            "model": values["model"], **({"mcl": config.to_dict()} if method == "mcl" else {
                "method": method, method: config.to_dict()}),
            "data": {"per_image": experiment.per_image, "instruction": experiment.instruction,
                     "max_caption_tokens": experiment.max_caption_tokens},
            "training": asdict(TrainConfig(**values.get("training", {}))), "dtype": values.get("dtype", "float32"),
            "data_sha256": {"train": sha256(self.data / "train.jsonl")}}))
        self.stages.train(f"train {run}", Path(values["out"]), settings, train_run, values, self.data, experiment,
                          settings, self.threads)

    def decode(self, system: System, values: dict, arguments: dict, decode: DecodeConfig) -> None:
        caption(values["model"], str(self.root / system.run), self.test, self.stages.predictions(system.name),
                arguments, decode.batch_size, self.experiment.instruction, values.get("dtype", "float32"),
                self.device)

    def decoding_settings(self) -> dict:
        return {"instruction": self.experiment.instruction}

    def report(self, systems: list[System], runs: list[str]) -> dict:
        from loramcl.recipes.image_captioning.report import build_report

        return build_report(self.root, self.experiment, systems, runs)


def image_captioning(out: str | None = None, recipes: str | None = None, quick: bool = False,
                     budgets: list[int] | None = None, stop_after: str | None = None, runs: list[str] | None = None,
                     threads: int | None = None, device: str = "cpu") -> dict:
    """Image captioning on TextCaps (paper §4.3, Table 3): train, decode at equal budget, score and report.

    Trains the runs of a recipe folder (LoRA-MLE, LoRA-MCL K = 3, LoRA-MoE), decodes K captions per image at equal
    forward budgets (MCL: beam B/K per hypothesis; single models: beam B and diverse beam search), scores them
    (`loramcl evaluate --metrics captioning`), plots quality against diversity, and reports.

    Writes to `out`: data/, one folder per run (adapters, logs), predictions/, figures/, report.json and report.md.
    Finished stages are reused when their settings are unchanged; an interrupted training resumes.

    Args:
        out: output folder (default: experiment.yaml's `out`).
        recipes: recipe folder with experiment.yaml, common.yaml and one file per run, or a packaged recipe's name
            (default: tiny, a tiny random LLaVA-NeXT on generated images, on the CPU in seconds; textcaps and
            textcaps-bilingual are the paper's scale; `loramcl recipes` lists them).
        quick: a few images, one training step per run, the smallest budget: checks the whole pipeline (numbers
            meaningless).
        budgets: forward budgets to decode at (default: experiment.yaml's).
        stop_after: "data" or "train": stop after that stage (e.g. train under `accelerate launch` on several GPUs,
            then run this command again to decode and report).
        runs: train only these runs (with stop_after train).
        threads: torch CPU threads (default: the cores that are free when the command starts).
        device: e.g. cpu or cuda.
    """
    return runner.run_recipe(ImageCaptioning, out, recipes, quick, budgets, stop_after, runs, threads, device)


__all__ = ["Experiment", "ImageCaptioning", "image_captioning", "prepare_data", "caption"]
