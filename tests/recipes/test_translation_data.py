"""Translation data (paper §4.4, App. H.6): readers of ALMA's JSON, parallel text, fairseq's extra_refs and JSONL
multi-reference files (fixtures in each layout), ALMA's prompt, the prompt/target separator read through the
tokenizer, and the multi-reference set built from gettext catalogs."""

import json

import pytest
from catalogs import locale

from loramcl.data.gettext_references import MultiReferenceSettings, multi_reference_splits
from loramcl.recipes.translation.readers import (
    read_alma_json,
    read_fairseq_refs,
    read_multi_reference_jsonl,
    read_parallel_text,
    read_test_set,
    read_training_pairs,
    target_separator,
    translation_prompt,
)

# fairseq's extra_refs layout (wmt14-en-de.extra_refs): S, T, then the additional references R0..R<m>, per sentence;
# sentence 1 has two references, sentence 0 three (and its R lines out of order).
EXTRA_REFS = ("S-0\tThe cat sleeps .\nT-0\tDie Katze schläft .\nR1-0\tDie Katze pennt .\nR0-0\tDie Katze schläft .\n"
              "R2-0\tEine Katze schläft .\nS-1\tIt rains .\nT-1\tEs regnet .\nR0-1\tEs regnet .\n"
              "R1-1\tEs gießt .\n")


def test_alma_json_lines_and_list_any_pair(tmp_path):
    lines = tmp_path / "train.de-en.json"
    lines.write_text(json.dumps({"translation": {"de": "Hallo Welt", "en": "Hello world"}}) + "\n\n"
                     + json.dumps({"translation": {"en": "Good night", "de": "Gute Nacht", "fr": "Bonne nuit"}})
                     + "\n", encoding="utf-8")
    assert read_alma_json(lines, "en", "de") == [{"source": "Hello world", "target": "Hallo Welt"},
                                                 {"source": "Good night", "target": "Gute Nacht"}]
    as_list = tmp_path / "pairs.json"
    as_list.write_text(json.dumps([{"translation": {"de": "Hallo", "en": "Hello"}}]), encoding="utf-8")
    assert read_alma_json(as_list, "de", "en") == [{"source": "Hallo", "target": "Hello"}]  # any direction
    assert read_training_pairs(as_list, "en", "de") == [{"source": "Hello", "target": "Hallo"}]


@pytest.mark.parametrize("content, message", [
    ('{"translation": {"en": "Hi", "de": "Hallo"}}\n{"translation": {"en": "Bye", "fr": "Salut"}}\n',
     r"pairs.json:2 has no \['de'\] text \(its languages are \['en', 'fr'\]\)"),
    ('{"translation": {"en": "Hi", "de": "Hallo"}}\n{"en": "Hi"\n', r"pairs.json:2 is not valid JSON"),
    ('{"en": "Hi", "de": "Hallo"}\n', r'pairs.json:1 must be an object \{"translation"'),
    ('{"translation": {"en": "", "de": "Hallo"}}\n', r"pairs.json:1: en must be a non-empty string"),
    ('[{"translation": {"en": "Hi", "de": "Hallo"}}, {"translation": {"en": "Hi"}}]',
     r"pairs.json: element 1 has no \['de'\] text"),
])
def test_alma_json_errors_name_file_and_line(tmp_path, content, message):
    path = tmp_path / "pairs.json"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ValueError, match=message):
        read_alma_json(path, "en", "de")


def test_parallel_text_files(tmp_path):
    source, target = tmp_path / "train.en", tmp_path / "train.de"
    source.write_text("Hello world\nGood night\n\n", encoding="utf-8")  # a trailing blank line is no sentence
    target.write_text("Hallo Welt\nGute Nacht\n", encoding="utf-8")
    assert read_training_pairs(source, "en", "de", target) == [{"source": "Hello world", "target": "Hallo Welt"},
                                                               {"source": "Good night", "target": "Gute Nacht"}]
    target.write_text("Hallo Welt\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"train.en has 2 lines but .*train.de has 1"):
        read_parallel_text(source, target)
    target.write_text("Hallo Welt\n \nMehr\n", encoding="utf-8")
    source.write_text("Hello world\nGood night\nMore\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"train.de:2 is empty"):
        read_parallel_text(source, target)
    with pytest.raises(ValueError, match=r"a .json/.jsonl file of ALMA pairs, or plain text with .* --target_file"):
        read_training_pairs(source, "en", "de")


def test_fairseq_extra_refs_reference_set_is_the_r_lines(tmp_path):
    path = tmp_path / "wmt14-en-de.extra_refs"
    path.write_text(EXTRA_REFS, encoding="utf-8")
    items = read_fairseq_refs(path)
    assert items == [
        {"id": 0, "source": "The cat sleeps .", "target": "Die Katze schläft .",
         "references": ["Die Katze schläft .", "Die Katze pennt .", "Eine Katze schläft ."]},  # R0, R1, R2
        {"id": 1, "source": "It rains .", "target": "Es regnet .", "references": ["Es regnet .", "Es gießt ."]}]
    with_target = read_fairseq_refs(path, include_target=True)
    assert with_target[1]["references"] == ["Es regnet .", "Es regnet .", "Es gießt ."]  # T first
    assert read_test_set(path) == items  # recognised by its first line


@pytest.mark.parametrize("content, message", [
    (EXTRA_REFS + "H-1\t-0.5\tEs regnet .\n", r"refs:10 is not a fairseq reference line .*'H-1"),
    (EXTRA_REFS + "R1-1\tEs schüttet .\n", r"refs:10: sentence 1 has a second R1 line"),
    (EXTRA_REFS + "S-0\tAgain .\n", r"refs:10: sentence 0 has a second S line"),
    (EXTRA_REFS + "R0-2\tNur eine Referenz .\n", r"sentence 2 \(line 10\) has no S-2 line"),
    (EXTRA_REFS + "S-2\tNo reference .\n", r"sentence 2 \(line 10\) has no R<j>-2 reference line"),
    ("S-0\tSource .\nR0-0\t  \n", r"refs:2: reference R0 must be a non-empty string"),
])
def test_fairseq_extra_refs_errors_name_file_and_line(tmp_path, content, message):
    path = tmp_path / "refs"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ValueError, match=message):
        read_fairseq_refs(path)


def test_multi_reference_jsonl_with_differing_reference_counts(tmp_path):
    path = tmp_path / "test.jsonl"
    path.write_text('{"id": "a", "source": "Open file", "references": ["Datei öffnen", "Öffne Datei", "Öffnen"]}\n'
                    '{"source": "Close", "references": ["Schließen"]}\n', encoding="utf-8")
    assert read_test_set(path) == [
        {"id": "a", "source": "Open file", "references": ["Datei öffnen", "Öffne Datei", "Öffnen"]},
        {"id": 1, "source": "Close", "references": ["Schließen"]}]
    path.write_text('{"id": "a", "source": "Open file", "references": []}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"test.jsonl: item 1 \(id 'a'\) needs \"references\", a non-empty list"):
        read_multi_reference_jsonl(path)
    path.write_text('{"id": "a", "references": ["x"]}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r'test.jsonl:1 must be an object with "source"'):
        read_test_set(path)
    with pytest.raises(ValueError, match="include_target applies to fairseq extra_refs files only"):
        read_test_set(path, include_target=True)


def test_alma_prompt():
    assert translation_prompt("Hello", "en", "de") == "Translate this from English to German:\nEnglish: Hello\nGerman:"
    assert translation_prompt("Hallo", "de", "cs") == "Translate this from German to Czech:\nGerman: Hallo\nCzech:"
    with pytest.raises(ValueError, match=r"unknown language code 'xx': known codes are \["):
        translation_prompt("Hello", "en", "xx")


def _tokenizer(normalizer=None, pre_tokenizer=None, words=()):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1, **{w: i + 2 for i, w in enumerate(words)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.normalizer, backend.pre_tokenizer = normalizer, pre_tokenizer
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>")


def test_the_separator_reproduces_the_joined_texts_tokens():
    from tokenizers import normalizers, pre_tokenizers

    prompts, targets = ["English: Hi\nGerman:"], ["Hallo Welt"]
    # byte-level BPE (GPT-2, SmolLM2): a word start carries its space, ' Hallo' is the token after ':'
    bpe = _tokenizer(pre_tokenizer=pre_tokenizers.ByteLevel(add_prefix_space=False),
                     words=["English", ":", "ĠHi", "Ċ", "German", "ĠHallo", "ĠWelt", "Hallo"])
    assert target_separator(bpe, prompts, targets) == " "
    # SentencePiece as Llama-2 (a '▁' prepended to every text, spaces made '▁'): the target alone starts a word
    spm = _tokenizer(normalizer=normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]),
                     pre_tokenizer=pre_tokenizers.Split("▁", behavior="merged_with_next"),
                     words=["▁English:", "▁Hi\nGerman:", "▁Hallo", "▁Welt", "▁"])
    assert target_separator(spm, prompts, targets) == ""
    assert target_separator(bpe, prompts, targets, chat_template=True) == ""  # the assistant turn starts the target
    glued = _tokenizer(pre_tokenizer=pre_tokenizers.Split("|", behavior="isolated"))  # never splits on spaces
    with pytest.raises(ValueError, match="reads prompt \\+ ' ' \\+ target differently"):
        target_separator(glued, prompts, targets)


def test_gettext_multi_reference_set_keeps_test_messages_out_of_training(tmp_path):
    de = {"Open the file": "Datei öffnen", "Open the file.": "Datei öffnen.", "Save the file": "Datei speichern",
          "Close the window": "Fenster schließen", "Print the page": "Seite drucken", "Quit the program": "Beenden",
          "Copy the text": "Text kopieren"}
    root = locale(tmp_path, {"de": {
        "a": de, "b": {"Open the file": "Öffne die Datei", "Save the file": "Datei speichern.",
                       "Print the page": "Drucke die Seite"},
        "c": {"Open the file": "Datei öffnen", "Print the page": "Seite ausdrucken"}}})
    splits = multi_reference_splits(MultiReferenceSettings(locale_dir=str(root), validation=1, min_chars=8))
    test = {item["source"]: item["references"] for item in splits["test"]}
    # most used translation first; 'Datei speichern.' differs from 'Datei speichern' by punctuation only
    assert test == {"Open the file": ["Datei öffnen", "Öffne die Datei"],
                    "Print the page": ["Drucke die Seite", "Seite ausdrucken", "Seite drucken"]}
    trained = [r["source"] for r in splits["train"] + splits["validation"]]
    assert sorted(trained) == ["Close the window", "Copy the text", "Quit the program", "Save the file"]
    assert "Open the file." not in trained  # a variant of a test message is not trained on either
    assert len(splits["validation"]) == 1 and all(isinstance(r["target"], str) for r in splits["train"])
    with pytest.raises(ValueError, match="min_references must be >= 2"):
        MultiReferenceSettings(min_references=1)
