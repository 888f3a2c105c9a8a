"""A multi-reference translation set from the gettext catalogs installed on the machine (the CPU stand-in for
Ott et al.'s newstest2014 set with ten references, paper §4.4).

An English UI message translated differently by different catalogs (glibc says 'Speicherzugriffsfehler', another
package 'Segmentierungsverletzung') has several human translations: those messages are the test set, each with its
distinct translations as references, most used first. Every other message gives one training pair (its most used
translation). Splits are by normalised English message (``gettext_pairs.normalise``), so no test message, nor a
variant of it with other case or trailing punctuation, is trained on.
"""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import dataclass

from loramcl.data.gettext_pairs import CatalogSettings, normalise, read_catalogs, usable


@dataclass(frozen=True)
class MultiReferenceSettings(CatalogSettings):
    min_chars: int = 8
    target_lang: str = "de"
    max_target_chars: int = 140  # a translation longer than this is dropped
    min_references: int = 2  # a test message needs this many distinct translations
    validation: int = 200  # single-reference messages held out for the validation loss
    max_test: int | None = None  # keep at most this many test messages (None: all)
    max_train: int | None = None  # keep at most this many training pairs (None: all)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.min_references < 2:
            raise ValueError(f"min_references must be >= 2 (a multi-reference set), got {self.min_references}")


def message_translations(settings: MultiReferenceSettings) -> dict[str, list[str]]:
    """{English message: its distinct usable translations, most used first}. Two translations that differ only in
    case, spacing or trailing punctuation count as one (its most used form is kept)."""
    catalog = read_catalogs(settings.locale_dir, settings.target_lang)
    messages = {}
    for source in sorted(catalog):
        if not (settings.min_chars <= len(source) <= settings.max_chars) or not usable(source):
            continue
        distinct: dict[str, str] = {}
        for text, _ in sorted(catalog[source].items(), key=lambda tc: (-tc[1], tc[0])):
            if usable(text) and len(text) <= settings.max_target_chars and text.strip() != source.strip():
                distinct.setdefault(normalise(text), text.strip())
        if distinct:
            messages[source] = list(distinct.values())
    return messages


def multi_reference_splits(settings: MultiReferenceSettings | None = None) -> dict[str, list[dict]]:
    """{"train": [...], "validation": [...], "test": [...]}: train and validation items {"id", "source",
    "target"} (one translation each), test items {"id", "source", "references"} (every distinct translation)."""
    settings = settings or MultiReferenceSettings()
    messages = message_translations(settings)
    groups: dict[str, list[str]] = defaultdict(list)
    for source in messages:
        groups[normalise(source)].append(source)
    # a test group: one of its messages has several distinct translations (its variants are not trained on either)
    test_keys = sorted(k for k, sources in groups.items()
                       if any(len(messages[s]) >= settings.min_references for s in sources))
    other_keys = sorted(set(groups) - set(test_keys))
    rng = random.Random(settings.seed)
    rng.shuffle(test_keys)
    rng.shuffle(other_keys)
    if len(other_keys) <= settings.validation:
        raise ValueError(f"only {len(other_keys)} single-reference messages for {settings.validation} validation "
                         "messages: lower validation or widen the length bounds")
    if not test_keys:
        raise ValueError(f"no English message has {settings.min_references} distinct {settings.target_lang} "
                         "translations in these catalogs: lower min_references or install more catalogs")
    splits: dict[str, list[dict]] = {"train": [], "validation": [], "test": []}
    for key in test_keys[:settings.max_test]:  # the test groups left out stay out of training too
        for source in groups[key]:
            if len(messages[source]) >= settings.min_references:
                splits["test"].append({"id": f"test-{len(splits['test'])}", "source": source,
                                       "references": messages[source]})
    held_out = other_keys[:settings.validation]
    trained = other_keys[settings.validation:]
    for name, keys in (("validation", held_out), ("train", trained[:settings.max_train])):
        for key in keys:
            for source in groups[key]:
                splits[name].append({"id": f"{name}-{len(splits[name])}", "source": source,
                                     "target": messages[source][0]})
    return splits
