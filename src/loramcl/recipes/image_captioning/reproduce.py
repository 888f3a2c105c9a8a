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
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from loramcl.recipes.command import task_command
from loramcl.recipes.experiment import Experiment as RecipeExperiment
from loramcl.recipes.grid import System
from loramcl.recipes.steps import ProcessorTask
from loramcl.utils.files import write_json
from loramcl.utils.validate import require, require_int

DEFAULT_RECIPES = "image_captioning/tiny"
TINY_MODEL_FOLDER, SYNTHETIC_FOLDER = "tiny-llava-next", "synthetic-textcaps"
# Images per split of the generated set (five captions each; the test split has none, as TextCaps').
SYNTHETIC_IMAGES = {"train": 24, "val": 6, "test": 3}
# Quick: the same pipeline on a few images and one training step, at the smallest budget (numbers meaningless).
QUICK_DATA = {"train": 8, "test": 3}
QUICK_TRAIN = {"steps": 1, "batch_size": 2, "logging_steps": 1, "warmup_steps": 0, "save_every": 0, "eval_every": 0}
QUICK_DECODING = {"max_new_tokens": 5, "batch_size": 3}


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
    write_json(out / "stats.json", stats)
    return stats


def read_images(path: Path) -> list:
    """The CaptionImage list of a data/*.jsonl file."""
    from loramcl.recipes.image_captioning.textcaps import CaptionImage
    from loramcl.utils.files import read_jsonl

    return [CaptionImage(str(r["id"]), Path(r["image"]), list(r["references"]))
            for r in read_jsonl(path, "references").values()]


class ImageCaptioning(ProcessorTask):
    """Image captioning on TextCaps (paper §4.3, Table 3): train, decode at equal budget, score and report.

    Trains the runs of a recipe folder (LoRA-MLE, LoRA-MCL K = 3, LoRA-MoE), decodes K captions per image at equal
    forward budgets (MCL: beam B/K per hypothesis; single models: beam B and diverse beam search), scores them
    (`loramcl evaluate --metrics captioning`), plots quality against diversity, and reports.

    Writes to `out`: data/, one folder per run (adapters, logs), predictions/, figures/, report.json and report.md.
    Finished stages are reused when their settings are unchanged; an interrupted training resumes.
    """

    quick_settings = {"training": QUICK_TRAIN}
    quick_decoding = QUICK_DECODING
    experiment_type = Experiment
    default_recipes = DEFAULT_RECIPES
    options = {
        "recipes": "recipe folder with experiment.yaml, common.yaml and one file per run, or a packaged recipe's name "
                   "(default: tiny, a tiny random LLaVA-NeXT on generated images, on the CPU in seconds; textcaps and "
                   "textcaps-bilingual are the paper's scale; `loramcl recipes` lists them).",
        "quick": "a few images, one training step per run, the smallest budget: checks the whole pipeline (numbers "
                 "meaningless).",
        "stop_after": '"data" or "train": stop after that stage (e.g. train under `accelerate launch` on several GPUs, '
                      "then run this command again to decode and report)."}

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
                systems.append(replace(system, name=name, options={"diversity_penalty": penalty}))  # best kept
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

    def example_settings(self, values: dict) -> dict:
        experiment = self.experiment
        return {"data": {"per_image": experiment.per_image, "instruction": experiment.instruction,
                         "max_caption_tokens": experiment.max_caption_tokens}}

    def training_sets(self, values: dict, training, processor) -> tuple:
        from loramcl.recipes.image_captioning.prompts import CaptionEncoder
        from loramcl.recipes.image_captioning.textcaps import CaptionTrainingSet

        experiment = self.experiment
        encoder = CaptionEncoder(processor, experiment.instruction, experiment.max_caption_tokens)
        return CaptionTrainingSet(read_images(self.data / "train.jsonl"), experiment.per_image, training.seed,
                                  encoder), None

    def collate(self):
        from loramcl.recipes.image_captioning.prompts import collate_captions

        return collate_captions

    def test_inputs(self) -> dict:
        return {image.image_id: image for image in read_images(self.test)}

    def inputs(self, processor, batch: list, strength) -> tuple:
        from loramcl.recipes.image_captioning.prompts import decoding_batch

        return decoding_batch(processor, batch, self.experiment.instruction), None

    def decoding_settings(self) -> dict:
        return {"instruction": self.experiment.instruction}

    def report(self, systems: list[System], runs: list[str]) -> dict:
        from loramcl.recipes.image_captioning.report import build_report

        return build_report(self.root, self.experiment, systems, runs)


image_captioning = task_command(ImageCaptioning, "image_captioning")


__all__ = ["Experiment", "ImageCaptioning", "image_captioning", "prepare_data"]
