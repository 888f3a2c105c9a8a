"""The gettext translation dataset (paper §4.3 on human translations): reading .mo catalogs, filters, leak-free
seeded splits, one random target language per training example, clear errors."""

import json
from collections import Counter

import pytest
from catalogs import locale

from loramcl.data.gettext_pairs import BuildSettings, build_dataset, build_pairs, normalise, read_catalogs, split_pairs


def test_catalogs_are_read_with_contexts_stripped_plurals_skipped_and_translations_counted(tmp_path):
    root = locale(tmp_path, {"fr": {
        "a": {"Open the file": "Ouvrir le fichier", "menu\x04Close window": "Fermer la fenêtre",
              "one file\x00%d files": "un fichier\x00%d fichiers"},
        "b": {"Open the file": "Ouvre le fichier"},
        "c": {"Open the file": "Ouvrir le fichier"}}})
    catalog = read_catalogs(root, "fr")
    assert catalog["Open the file"] == Counter({"Ouvrir le fichier": 2, "Ouvre le fichier": 1})
    assert catalog["Close window"] == Counter({"Fermer la fenêtre": 1})
    assert set(catalog) == {"Open the file", "Close window"}  # no header, no plural entry


def test_pairs_need_both_languages_and_pass_the_filters(tmp_path):
    fr = {"Open the file now": "Ouvrir le fichier", "Cannot read %s here": "Impossible de lire %s",
          "_Save the document": "_Enregistrer", "Too short": "Trop court", "Only in French here": "Seulement",
          "Keep this message": "Garder ce message", "Untranslated message": "Untranslated message"}
    de = {k: f"Deutsch {i}" for i, k in enumerate(fr) if k != "Only in French here"}
    de["Untranslated message"] = "Nicht übersetzte Nachricht"
    root = locale(tmp_path, {"fr": {"a": fr, "b": {"Open the file now": "Ouvre le fichier", "Keep this message":
                                                   "Garder ce message"}}, "de": {"a": de}})
    pairs = {p["source"]: p for p in build_pairs(BuildSettings(locale_dir=str(root)))}
    # format codes, mnemonics, < 15 characters, one language only, and a French "translation" equal to the English
    assert set(pairs) == {"Open the file now", "Keep this message"}
    assert pairs["Open the file now"]["fr"] == ["Ouvre le fichier", "Ouvrir le fichier"]  # 1 catalog each: by name
    assert pairs["Keep this message"]["fr"] == ["Garder ce message"]  # the same text in two catalogs: once


def _many(n: int) -> dict[str, dict[str, dict[str, str]]]:
    sources = [f"Message number {i} of the catalog" for i in range(n)]
    sources += ["Message number 0 of the catalog.", "MESSAGE NUMBER 1 OF THE CATALOG..."]  # variants of 0 and 1
    return {"fr": {"a": {s: f"Message français {s[15:]}" for s in sources}},
            "de": {"a": {s: f"Deutsche Nachricht {s[15:]}" for s in sources}}}


def test_splits_are_seeded_leak_free_and_pick_one_target_language_at_random(tmp_path):
    root = locale(tmp_path, _many(400))
    settings = BuildSettings(locale_dir=str(root), validation=40, test=60, seed=3)
    splits = split_pairs(build_pairs(settings), settings)
    keys = {name: {normalise(r["source"]) for r in rows} for name, rows in splits.items()}
    assert not (keys["train"] & keys["test"]) and not (keys["train"] & keys["validation"])
    assert not (keys["validation"] & keys["test"])
    assert len(keys["test"]) == 60 and len(keys["validation"]) == 40 and len(keys["train"]) == 300
    assert sum(len(rows) for rows in splits.values()) == 402  # the two variants follow their message
    for row in splits["train"] + splits["validation"]:
        assert row["target"] == row[row["lang"]][0] and row["prompt"] == f"Translate: {row['source']}\n"
    share = Counter(r["lang"] for r in splits["train"])["fr"] / len(splits["train"])
    assert 0.4 < share < 0.6  # probability 1/2 each (300 draws: 3.5 standard deviations)
    for row in splits["test"]:
        assert row["references"] == row["fr"] + row["de"] and "target" not in row
        assert row["reference_languages"] == ["fr"] * len(row["fr"]) + ["de"] * len(row["de"])
    again = split_pairs(build_pairs(settings), settings)
    assert again == splits
    other = split_pairs(build_pairs(settings), BuildSettings(locale_dir=str(root), validation=40, test=60, seed=4))
    assert {r["source"] for r in other["test"]} != {r["source"] for r in splits["test"]}


def test_build_dataset_writes_the_splits_and_their_statistics(tmp_path):
    root = locale(tmp_path / "locale", _many(50))
    stats = build_dataset(tmp_path / "data", BuildSettings(locale_dir=str(root), validation=5, test=10))
    lines = {name: (tmp_path / "data" / f"{name}.jsonl").read_text().splitlines()
             for name in ("train", "validation", "test")}
    assert stats["examples"] == {name: len(rows) for name, rows in lines.items()}
    assert json.loads(lines["test"][0])["id"] == "test-0"
    assert json.loads((tmp_path / "data" / "stats.json").read_text())["settings"]["test"] == 10


def test_missing_catalogs_and_too_few_messages_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"apt-get install iso-codes .*--locale_dir"):
        build_pairs(BuildSettings(locale_dir=str(tmp_path)))
    root = locale(tmp_path, _many(20))
    with pytest.raises(ValueError, match="only 20 distinct English messages for 10 validation and 10 test"):
        build_dataset(tmp_path / "out", BuildSettings(locale_dir=str(root), validation=10, test=10))
