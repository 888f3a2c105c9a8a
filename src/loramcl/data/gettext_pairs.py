"""An ambiguous translation task from the gettext catalogs installed on the machine (paper §4.3, App. H.5).

Every English message with both a French and a German human translation becomes one example. Training and
validation examples keep ONE target, French or German with probability 1/2, and the prompt never says which:
the data has two modes, like the paper's half-French captions. Test examples keep every translation in both
languages as references.

Splits are by English message, after normalising case, whitespace and trailing punctuation, so a message and its
variant with a trailing colon or ellipsis never land in different splits.
"""

from __future__ import annotations

import gettext
import json
import random
import re
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

from loramcl.utils.files import write_json

LANGUAGES = ("fr", "de")
PROMPT = "Translate: {source}\n"  # the newline ends the prompt: the target follows it
# Debian packages that install French and German catalogs on a minimal image (checked with `dpkg -S`).
CATALOG_PACKAGES = "iso-codes, binutils-common, postgresql-client-15, wget, man-db, tar, sed, procps, xz-utils"

# printf and Python format codes, Qt/shell placeholders: a translation must keep them, not translate them.
_FORMAT_CODE = re.compile(r"%[-+ #0-9.*]*[a-zA-Z%]|%\(\w+\)|%\d|\{[^}]*\}|\$\{?\w")
# mnemonics (_File, &Open), markup, escapes, several lines: UI plumbing, not sentences.
_PLUMBING = re.compile(r"[_&<>\\\t\n\r|]")


@dataclass(frozen=True)
class CatalogSettings:
    """Which English messages of the machine's gettext catalogs a task keeps, and the seed of its split (the base of
    every gettext task's data settings)."""

    locale_dir: str = "/usr/share/locale"
    """The catalogs: <language>/LC_MESSAGES/*.mo."""
    min_chars: int = 15
    """English message length bounds (characters)."""
    max_chars: int = 70
    seed: int = 0
    """Seeds the split (and what else the task draws)."""

    def __post_init__(self) -> None:
        if not 0 < self.min_chars <= self.max_chars:
            raise ValueError(f"need 0 < min_chars <= max_chars, got {self.min_chars}, {self.max_chars}")


@dataclass(frozen=True)
class BuildSettings(CatalogSettings):
    max_target_chars: int = 140  # a translation longer than this is dropped
    validation: int = 300  # English messages per split
    test: int = 500


def read_catalogs(locale_dir: str | Path, language: str) -> dict[str, Counter]:
    """{English message: Counter of its translations over every catalog of the language} (plural forms skipped).

    Raises FileNotFoundError naming the Debian packages that provide catalogs when none is installed.
    """
    folder = Path(locale_dir) / language / "LC_MESSAGES"
    files = sorted(folder.glob("*.mo"))
    if not files:
        raise FileNotFoundError(
            f"no gettext catalog (*.mo) in {folder}: this task needs French and German catalogs. Install packages "
            f"that ship them, e.g. `apt-get install {CATALOG_PACKAGES.replace(',', '')}` (Debian/Ubuntu), or "
            "pass --locale_dir to a folder laid out as <language>/LC_MESSAGES/*.mo")
    translations: dict[str, Counter] = defaultdict(Counter)
    for path in files:
        try:
            with path.open("rb") as f:
                catalog = gettext.GNUTranslations(f)._catalog
        except (OSError, UnicodeDecodeError):  # a broken or non-UTF-8 catalog: skip it, the others are enough
            continue
        for key, text in catalog.items():
            if not isinstance(key, str) or not key or not text:
                continue  # the header (empty msgid) and plural forms ((msgid, n) keys)
            source = key.split("\x04", 1)[-1]  # drop a msgctxt
            translations[source][text] += 1
    return dict(translations)


def normalise(text: str) -> str:
    """Key of the leak-free split: lower case, single spaces, no trailing punctuation or ellipsis."""
    return re.sub(r"\s+", " ", text.lower()).strip().rstrip(".:!?…").strip()


def usable(text: str) -> bool:
    return bool(text.strip()) and not _FORMAT_CODE.search(text) and not _PLUMBING.search(text)


def build_pairs(settings: BuildSettings) -> list[dict]:
    """Every English message with a usable French and German translation: {source, fr: [...], de: [...]}.

    The translations of a language are ordered by how many catalogs use them (most common first, then
    alphabetically), so element 0 is the message's usual translation.
    """
    by_language = {lang: read_catalogs(settings.locale_dir, lang) for lang in LANGUAGES}
    pairs = []
    for source in sorted(set.intersection(*(set(c) for c in by_language.values()))):
        if not (settings.min_chars <= len(source) <= settings.max_chars) or not usable(source):
            continue
        item = {"source": source}
        for lang, catalog in by_language.items():
            kept = [t for t, _ in sorted(catalog[source].items(), key=lambda tc: (-tc[1], tc[0]))
                    if usable(t) and len(t) <= settings.max_target_chars and t.strip() != source.strip()]
            item[lang] = kept
        if all(item[lang] for lang in LANGUAGES):
            pairs.append(item)
    return pairs


def split_pairs(pairs: list[dict], settings: BuildSettings) -> dict[str, list[dict]]:
    """Seeded train / validation / test split by normalised English message; one target per train/val example."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for item in pairs:
        groups[normalise(item["source"])].append(item)
    keys = sorted(groups)
    rng = random.Random(settings.seed)
    rng.shuffle(keys)
    held_out = settings.validation + settings.test
    if len(keys) <= held_out:
        raise ValueError(f"only {len(keys)} distinct English messages for {settings.validation} validation and "
                         f"{settings.test} test messages: lower --validation/--test or widen the length bounds")
    parts = {"test": keys[:settings.test], "validation": keys[settings.test:held_out], "train": keys[held_out:]}
    splits: dict[str, list[dict]] = {}
    for name, part in parts.items():
        rows = []
        for key in part:
            for item in groups[key]:
                row = {"id": f"{name}-{len(rows)}", "prompt": PROMPT.format(source=item["source"]), **item}
                if name == "test":
                    row["references"] = item["fr"] + item["de"]
                    row["reference_languages"] = ["fr"] * len(item["fr"]) + ["de"] * len(item["de"])
                else:
                    row["lang"] = rng.choice(LANGUAGES)
                    row["target"] = item[row["lang"]][0]
                rows.append(row)
        splits[name] = rows
    return splits


def build_dataset(out: str | Path, settings: BuildSettings | None = None) -> dict:
    """Write train.jsonl, validation.jsonl, test.jsonl and stats.json to `out`; return the stats."""
    settings = settings or BuildSettings()
    splits = split_pairs(build_pairs(settings), settings)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in splits.items():
        with (out / f"{name}.jsonl").open("w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    stats = {
        "settings": asdict(settings),
        "examples": {name: len(rows) for name, rows in splits.items()},
        "target_languages": {name: dict(Counter(r["lang"] for r in rows))
                             for name, rows in splits.items() if name != "test"},
        "test_references_per_item": {lang: sum(len(r[lang]) for r in splits["test"]) / max(len(splits["test"]), 1)
                                     for lang in LANGUAGES},
    }
    write_json(out / "stats.json", stats, indent=2)
    return stats
