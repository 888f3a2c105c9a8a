"""TextCaps (Sidorov et al. 2020), the image-captioning task of paper §4.3 and App. H.2, read from its official files.

``TextCaps_0.1_{train,val,test}.json`` hold ``{"data": [item, ...]}``. A train/val item is one caption of one image:
``image_id``, ``image_path`` (e.g. ``train/011e7e629fb9ae7b.jpg``), ``caption_str`` and ``reference_strs`` (all the
image's captions, the same list on each of its items); the test split has one item per image and no captions. The
images are TextVQA's, under the folder the user gives: ``<images>/<image_path>``, or ``<images>/<file name>`` for the
flat ``train_images/`` folder TextVQA ships.

Training reads one example per (image, reference caption), or one caption drawn per image and per epoch
(``CaptionTrainingSet(per_image="one")``); evaluation reads each image once with all its references.

Nothing here imports torch: a command checks its files before loading it.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from loramcl.utils.files import write_json

SPLIT_FILES = {"train": "TextCaps_0.1_train.json", "val": "TextCaps_0.1_val.json", "test": "TextCaps_0.1_test.json"}
PER_IMAGE = ("all", "one")


@dataclass(frozen=True)
class CaptionImage:
    """One image of a split: its id, its file, and its reference captions (empty in the test split)."""

    image_id: str
    image_path: Path
    references: list[str] = field(default_factory=list)


def image_file(images: str | Path, image_path: str) -> Path | None:
    """Where an item's image is: ``images/image_path``, else ``images/<its file name>`` (TextVQA's flat folders)."""
    folder = Path(images)
    for candidate in (folder / image_path, folder / Path(image_path).name):
        if candidate.is_file():
            return candidate
    return None


def read_textcaps(path: str | Path, images: str | Path, captions: bool | None = None,
                  check_images: bool = True) -> list[CaptionImage]:
    """The images of a TextCaps split file, in the order of their first item, each with all its references.

    captions: whether the items must carry captions (None: as the file does; the test split has none).
    check_images: every image file must exist and open as an image (PIL reads its header only).
    Errors name the file and the item: malformed JSON, a missing field, a caption that is not a non-empty string,
    an image missing or unreadable.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist (TextCaps split file, e.g. {SPLIT_FILES['train']})")
    try:
        content = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON (line {error.lineno}, column {error.colno}: {error.msg})") from None
    except UnicodeDecodeError as error:
        raise ValueError(f"{path} is not UTF-8 text ({error.reason} at byte {error.start})") from None
    if not isinstance(content, dict) or not isinstance(content.get("data"), list):
        raise ValueError(f'{path} must hold a JSON object with a "data" list of items, as TextCaps_0.1_*.json do')
    items = content["data"]
    if not items:
        raise ValueError(f'{path}: "data" is empty')
    if captions is None:
        captions = any(isinstance(item, dict) and "caption_str" in item for item in items)
    by_image: dict[str, CaptionImage] = {}
    for number, item in enumerate(items):
        where = f'{path}: item {number} of "data"'
        if not isinstance(item, dict):
            raise ValueError(f"{where} must be an object, got {type(item).__name__}")
        for key in ("image_id", "image_path"):
            if not isinstance(item.get(key), str) or not item[key]:
                raise ValueError(f'{where} needs "{key}" (a non-empty string), got {item.get(key)!r}')
        where = f"{where} (image_id {item['image_id']!r})"
        references = []
        if captions:
            caption, references = item.get("caption_str"), item.get("reference_strs")
            if not isinstance(caption, str) or not caption.strip():
                raise ValueError(f'{where}: "caption_str" must be a non-empty string, got {caption!r}')
            if references is None:
                references = [caption]
            if (not isinstance(references, list) or not references
                    or not all(isinstance(r, str) and r.strip() for r in references)):
                raise ValueError(f'{where}: "reference_strs" must be a non-empty list of non-empty strings')
            if caption not in references:
                references = [*references, caption]
        seen = by_image.get(item["image_id"])
        if seen is not None:
            if captions and item["caption_str"] not in seen.references:  # items of one image share reference_strs
                seen.references.append(item["caption_str"])
            continue
        found = image_file(images, item["image_path"])
        if check_images:
            if found is None:
                raise FileNotFoundError(f"{where}: image {item['image_path']!r} not found under {images} (tried "
                                        f"{Path(images) / item['image_path']} and "
                                        f"{Path(images) / Path(item['image_path']).name})")
            check_image(found, where)
        by_image[item["image_id"]] = CaptionImage(item["image_id"], found or Path(images) / item["image_path"],
                                                  list(references))
    return list(by_image.values())


def check_image(path: Path, where: str = "") -> None:
    """Raise a ValueError naming ``where`` and the file if PIL cannot identify it as an image."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            image.verify()
    except (UnidentifiedImageError, OSError, SyntaxError) as error:
        raise ValueError(f"{where}: {path} is not a readable image ({error})") from None


def load_image(path: Path, where: str = ""):
    """The image as RGB (PIL), or a ValueError naming ``where`` and the file."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError, SyntaxError) as error:
        raise ValueError(f"{where}: {path} is not a readable image ({error})") from None


class CaptionTrainingSet:
    """The (image, caption) training examples of a split, map-style (what Trainer indexes).

    per_image 'all': one example per (image, reference caption), in reading order.
    per_image 'one': one example per image and epoch, its caption drawn among the image's references by a
        generator seeded with (seed, epoch, image): reproducible, and another draw each epoch (``set_epoch``;
        ``training.fit.fit`` calls it at every epoch's start).
    ``encode(image, caption)`` turns an example into model inputs when indexed (None: the pair itself).
    """

    def __init__(self, images: list[CaptionImage], per_image: str = "all", seed: int = 0, encode=None) -> None:
        if per_image not in PER_IMAGE:
            raise ValueError(f"per_image must be one of {PER_IMAGE}, got {per_image!r}")
        missing = [image.image_id for image in images if not image.references]
        if missing:
            raise ValueError(f"training needs captions: image {missing[0]!r} has none (the test split has none)")
        self.images, self.per_image, self.seed, self.encode = images, per_image, seed, encode
        self.epoch = 0
        self.pairs = [(i, j) for i, image in enumerate(images) for j in range(len(image.references))]

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return len(self.pairs) if self.per_image == "all" else len(self.images)

    def example(self, index: int) -> tuple[CaptionImage, str]:
        """(image, caption) of example ``index`` in the current epoch."""
        if self.per_image == "all":
            i, j = self.pairs[index]
        else:
            i = index
            j = random.Random(f"{self.seed}/{self.epoch}/{i}").randrange(len(self.images[i].references))
        return self.images[i], self.images[i].references[j]

    def __getitem__(self, index: int):
        image, caption = self.example(index)
        return (image, caption) if self.encode is None else self.encode(image, caption)


# The generated set (`write_synthetic_textcaps`): a shape of one colour per image, five captions naming both.
SYNTHETIC_COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 220), "yellow": (230, 200, 30)}
SYNTHETIC_SHAPES = ("square", "circle", "triangle")
SYNTHETIC_PHRASES = ("a {colour} {shape}", "a {colour} {shape} on a white background",
                     "a picture of a {colour} {shape}", "a small {colour} {shape} in the middle",
                     "the {shape} is {colour}")
SYNTHETIC_WORDS = sorted({word for phrase in SYNTHETIC_PHRASES for colour in SYNTHETIC_COLOURS
                          for shape in SYNTHETIC_SHAPES for word in phrase.format(colour=colour, shape=shape).split()})
# Image sizes (height, width), in turn: square and wide ones, so that anyres gives images different token counts.
SYNTHETIC_SIZES = ((16, 16), (16, 32), (24, 24), (20, 36))


def write_synthetic_textcaps(folder: str | Path, images: dict[str, int], seed: int = 0) -> Path:
    """A generated set in the exact TextCaps 0.1 layout: ``TextCaps_0.1_<split>.json`` for ``images``' splits (train,
    val, test: {"dataset_type", "dataset_name", "dataset_version", "data"}; a train/val item per caption carrying the
    image's ``reference_strs``, a test item per image without captions) beside ``images/train/`` (train and val
    images, as TextVQA's) and ``images/test/``: small JPEG images of a coloured square, circle or triangle on white,
    each described by five captions naming its colour and shape. Image ids are 16 hex digits, as TextCaps'."""
    import numpy as np
    from PIL import Image, ImageDraw

    folder = Path(folder)
    rng = np.random.default_rng(seed)
    kinds = [(colour, shape) for shape in SYNTHETIC_SHAPES for colour in SYNTHETIC_COLOURS]
    for split, count in images.items():
        data = []
        for n in range(count):
            colour, shape = kinds[n % len(kinds)]
            height, width = SYNTHETIC_SIZES[n % len(SYNTHETIC_SIZES)]
            image_id = rng.bytes(8).hex()
            image_path = f"{'test' if split == 'test' else 'train'}/{image_id}.jpg"
            picture = Image.new("RGB", (width, height), "white")
            side = int(min(height, width) * rng.uniform(0.5, 0.8))
            left, top = int(rng.integers(0, width - side + 1)), int(rng.integers(0, height - side + 1))
            box = (left, top, left + side - 1, top + side - 1)
            draw = ImageDraw.Draw(picture)
            fill = SYNTHETIC_COLOURS[colour]
            if shape == "square":
                draw.rectangle(box, fill=fill)
            elif shape == "circle":
                draw.ellipse(box, fill=fill)
            else:
                draw.polygon([(left + side // 2, top), (box[2], box[3]), (left, box[3])], fill=fill)
            (folder / "images" / image_path).parent.mkdir(parents=True, exist_ok=True)
            picture.save(folder / "images" / image_path, quality=95)
            item = {"image_id": image_id, "image_classes": ["Shape"], "flickr_original_url": "",
                    "flickr_300k_url": "", "image_width": width, "image_height": height, "set_name": split,
                    "image_name": image_id, "image_path": image_path}
            if split == "test":  # TextCaps' test split: one item per image, no captions
                data.append(item)
                continue
            references = [phrase.format(colour=colour, shape=shape) for phrase in SYNTHETIC_PHRASES]
            data += [item | {"caption_id": len(data) + k, "caption_str": caption, "caption_tokens": caption.split(),
                             "reference_strs": references, "reference_tokens": [r.split() for r in references]}
                     for k, caption in enumerate(references)]
        content = {"dataset_type": split, "dataset_name": "textcaps", "dataset_version": "0.1", "data": data}
        write_json(folder / SPLIT_FILES[split], content, indent=None)
    return folder


__all__ = ["SPLIT_FILES", "CaptionImage", "CaptionTrainingSet", "read_textcaps", "load_image", "image_file",
           "write_synthetic_textcaps"]
