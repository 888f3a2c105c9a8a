"""The bilingual captioning variant (paper §4.3, Table 2, App. H.5): half of the training captions replaced by their
French translation, so that p(caption | image) has two modes the instruction does not tell apart.

The translations come from a sequence-to-sequence model the user gives as a local folder (the paper: T5-small with
the prefix 'translate English to French: '), decoded greedily, and are cached in a JSONL file keyed by the English
text, so each caption is translated once across runs and interruptions. Which captions are translated is drawn per
caption (seeded by the seed, the image and the caption's position); the test set keeps every English reference and
its translation, each tagged with its language.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from loramcl.utils.validate import require, require_int, require_real


@dataclass(frozen=True)
class BilingualSettings:
    """experiment.yaml `bilingual:`: how the French half of the captions is made."""

    translator: str
    """Local folder of a sequence-to-sequence translation model and its tokenizer (e.g. T5-small)."""

    prefix: str = "translate English to French: "
    """Text put before each English caption (T5's task prefix)."""

    language: str = "fr"
    """Language tag of the translations ('en' tags the original captions)."""

    fraction: float = 0.5
    """Share of the training captions replaced by their translation (each caption drawn independently)."""

    seed: int = 0
    batch_size: int = 32
    max_new_tokens: int = 64

    def __post_init__(self) -> None:
        require(isinstance(self.translator, str) and self.translator, "bilingual.translator must be a model folder")
        require(isinstance(self.prefix, str), f"bilingual.prefix must be a string, got {self.prefix!r}")
        require(isinstance(self.language, str) and self.language and self.language != "en",
               f"bilingual.language must be a tag other than 'en', got {self.language!r}")
        require_real("bilingual.fraction", self.fraction, low=0.0, high=1.0)
        require_int("bilingual.seed", self.seed, minimum=0)
        require_int("bilingual.batch_size", self.batch_size)
        require_int("bilingual.max_new_tokens", self.max_new_tokens)

    def translated(self, image_id: str, position: int) -> bool:
        """Whether training caption ``position`` of image ``image_id`` is replaced by its translation."""
        return random.Random(f"{self.seed}/{image_id}/{position}").random() < self.fraction

    def cache_name(self) -> str:
        """The cache file of these translator settings (another model or prefix: another cache)."""
        key = json.dumps({"translator": str(Path(self.translator).resolve()), "prefix": self.prefix,
                          "max_new_tokens": self.max_new_tokens}, sort_keys=True)
        return f"translations-{hashlib.sha256(key.encode()).hexdigest()[:12]}.jsonl"


def translate(texts: Sequence[str], settings: BilingualSettings, cache: Path, device: str = "cpu") -> dict[str, str]:
    """{English text: translation} for ``texts``, reading ``cache`` first and appending what it lacked (one line
    {"text", "translation"} per text, written batch by batch: an interrupted run keeps what it translated)."""
    known: dict[str, str] = {}
    if cache.is_file():
        for number, line in enumerate(cache.read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                known[record["text"]] = record["translation"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"{cache}:{number} is not a translation record; delete the file to translate "
                                 "again") from None
    missing = [t for t in dict.fromkeys(texts) if t not in known]
    if not missing:
        return {t: known[t] for t in texts}
    folder = Path(settings.translator)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"bilingual.translator {folder} is not a model folder (no config.json)")
    import torch
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSeq2SeqLM.from_pretrained(folder).to(device).eval()
    cache.parent.mkdir(parents=True, exist_ok=True)
    with cache.open("a", encoding="utf-8") as f, torch.no_grad():
        for start in range(0, len(missing), settings.batch_size):
            chunk = missing[start:start + settings.batch_size]
            batch = tokenizer([settings.prefix + t for t in chunk], return_tensors="pt", padding=True).to(device)
            output = model.generate(**batch, max_new_tokens=settings.max_new_tokens, num_beams=1, do_sample=False)
            for text, translation in zip(chunk, tokenizer.batch_decode(output, skip_special_tokens=True), strict=True):
                if not translation.strip():
                    raise ValueError(f"the translator {folder} gave an empty translation of caption {text!r}: check "
                                     f"the model and bilingual.prefix ({settings.prefix!r})")
                known[text] = translation.strip()
                f.write(json.dumps({"text": text, "translation": known[text]}, ensure_ascii=False) + "\n")
    return {t: known[t] for t in texts}


def bilingual_splits(train: list, test: list, settings: BilingualSettings, cache: Path, device: str = "cpu"
                     ) -> tuple[list[dict], list[dict]]:
    """The training images with their captions, a drawn ``fraction`` of them translated ({"id", "image",
    "references", "languages"}), and the test images with every English reference then its translation, tagged
    ({"id", "image", "references", "reference_languages"})."""
    chosen = [(image, j) for image in train for j in range(len(image.references))
              if settings.translated(image.image_id, j)]
    texts = [image.references[j] for image, j in chosen] + [r for image in test for r in image.references]
    translations = translate(texts, settings, cache, device)
    lang = settings.language
    train_rows = []
    for image in train:
        flags = [settings.translated(image.image_id, j) for j in range(len(image.references))]
        train_rows.append({"id": image.image_id, "image": str(image.image_path),
                           "references": [translations[r] if f else r for r, f in zip(image.references, flags,
                                                                                         strict=True)],
                           "languages": [lang if f else "en" for f in flags]})
    test_rows = [{"id": image.image_id, "image": str(image.image_path),
                  "references": [*image.references, *(translations[r] for r in image.references)],
                  "reference_languages": ["en"] * len(image.references) + [lang] * len(image.references)}
                 for image in test]
    return train_rows, test_rows


__all__ = ["BilingualSettings", "bilingual_splits", "translate"]

