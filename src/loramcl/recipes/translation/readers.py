"""Machine translation data for the diverse-translation recipe (paper §4.4, App. H.6): readers for the files the
field distributes, ALMA's prompt, and the separator that makes prompt + target read as one text.

Training pairs:
    ALMA / Hugging Face JSON    {"translation": {"en": "...", "de": "..."}} per line, or a JSON list of such objects
                                (ALMA's human_written_data/<xx>en/train.<xx>-en.json); any language pair
    plain parallel text         two files, one sentence per line, line i of one translating line i of the other

Multi-reference test sets:
    fairseq extra_refs          the form of Ott et al. 2018's newstest2014 set (wmt14-en-de.extra_refs), read by
                                fairseq's examples/translation_moe/score.py: per sentence i, a line `S-i<TAB>source`,
                                optionally `T-i<TAB>target` (the original newstest reference), and the additional
                                references `R<j>-i<TAB>reference`. **The reference set is the R lines, in the order of
                                j**, as score.py reads it; the T line is kept as "target" and is not a reference
                                unless include_target=True (then it comes first).
    JSONL                       {"id": ..., "source": "...", "references": ["...", ...]} per line

Every reader returns plain dicts and raises ValueError naming the file and the line of a malformed record.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

from loramcl.utils.files import decode_line, read_utf8

# English names of language codes, as ALMA's prompt writes them (the ALMA paper's languages and a few more).
LANGUAGE_NAMES = {
    "en": "English", "de": "German", "fr": "French", "cs": "Czech", "is": "Icelandic", "zh": "Chinese",
    "ja": "Japanese", "ru": "Russian", "uk": "Ukrainian", "ha": "Hausa", "ro": "Romanian", "gu": "Gujarati",
    "es": "Spanish", "it": "Italian", "nl": "Dutch", "pt": "Portuguese", "pl": "Polish", "fi": "Finnish",
    "sv": "Swedish", "da": "Danish", "tr": "Turkish", "ko": "Korean", "ar": "Arabic", "hi": "Hindi",
}
PROMPT = "Translate this from {source_name} to {target_name}:\n{source_name}: {source}\n{target_name}:"
_FAIRSEQ_LINE = re.compile(r"(S|T|R\d*)-(\d+)\t(.*)")


def language_name(code: str) -> str:
    """English name of a language code ('de' -> 'German'); a clear error for an unknown code."""
    if code not in LANGUAGE_NAMES:
        raise ValueError(f"unknown language code {code!r}: known codes are {sorted(LANGUAGE_NAMES)}")
    return LANGUAGE_NAMES[code]


def translation_prompt(source: str, source_lang: str = "en", target_lang: str = "de") -> str:
    """ALMA's prompt: 'Translate this from English to German:\\nEnglish: {source}\\nGerman:' (the target follows)."""
    source_name, target_name = language_name(source_lang), language_name(target_lang)
    return PROMPT.format(source_name=source_name, target_name=target_name, source=source)


def _text(value, where: str, what: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{where}: {what} must be a non-empty string, got {value!r}")
    return value.strip()


def read_alma_json(path: str | Path, source_lang: str, target_lang: str) -> list[dict]:
    """Pairs [{"source", "target"}] from ALMA's JSON: one {"translation": {lang: text, ...}} object per line, or a
    JSON list of them. Objects may hold more languages than the two asked for."""
    path = Path(path)
    language_name(source_lang), language_name(target_lang)
    text = read_utf8(path)
    if text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{error.lineno} is not valid JSON ({error.msg})") from None
        records = [(f"{path}: element {i}", item) for i, item in enumerate(items)]
    else:
        records = []
        for number, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                try:
                    records.append((f"{path}:{number}", json.loads(line)))
                except json.JSONDecodeError as error:
                    raise ValueError(f"{path}:{number} is not valid JSON ({error.msg})") from None
    if not records:
        raise ValueError(f"{path} holds no translation pair")
    pairs = []
    for where, record in records:
        pair = record.get("translation") if isinstance(record, dict) else None
        if not isinstance(pair, dict):
            raise ValueError(f'{where} must be an object {{"translation": {{"{source_lang}": ..., "{target_lang}": '
                             f"...}}}}, got {str(record)[:120]}")
        missing = [lang for lang in (source_lang, target_lang) if lang not in pair]
        if missing:
            raise ValueError(f"{where} has no {missing} text (its languages are {sorted(pair)}): choose the pair "
                             "with --source_lang / --target_lang")
        pairs.append({"source": _text(pair[source_lang], where, source_lang),
                      "target": _text(pair[target_lang], where, target_lang)})
    return pairs


def read_parallel_text(source_path: str | Path, target_path: str | Path) -> list[dict]:
    """Pairs [{"source", "target"}] from two plain text files, line i of one translating line i of the other."""
    sides = []
    for path in (Path(source_path), Path(target_path)):
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist")
        lines = read_utf8(path).splitlines()
        while lines and not lines[-1].strip():  # a trailing blank line is no sentence
            lines.pop()
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                raise ValueError(f"{path}:{number} is empty: every line must hold a sentence (its translation is on "
                                 "the same line of the other file)")
        sides.append(lines)
    if len(sides[0]) != len(sides[1]):
        raise ValueError(f"{source_path} has {len(sides[0])} lines but {target_path} has {len(sides[1])}: parallel "
                         "files need one line per sentence, in the same order")
    if not sides[0]:
        raise ValueError(f"{source_path} holds no sentence")
    return [{"source": s.strip(), "target": t.strip()} for s, t in zip(*sides, strict=True)]


def read_fairseq_refs(path: str | Path, include_target: bool = False) -> list[dict]:
    """Items [{"id", "source", "references", "target"}] of a fairseq extra_refs file (see the module docstring),
    in the order of their S lines. references: the R lines by j (T first when include_target); target: the T line
    or None."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    items: dict[int, dict] = {}
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            line = decode_line(raw, path, number).rstrip("\r\n")
            if not line.strip():
                continue
            match = _FAIRSEQ_LINE.fullmatch(line)
            if match is None:
                raise ValueError(f"{path}:{number} is not a fairseq reference line (S-<i>, T-<i> or R<j>-<i>, a "
                                 f"tab, then the text): {line[:80]!r}")
            kind, index, text = match.group(1), int(match.group(2)), match.group(3)
            where = f"{path}:{number}"
            item = items.setdefault(index, {"id": index, "source": None, "target": None, "refs": {}, "line": number})
            if kind == "S" or kind == "T":
                field = "source" if kind == "S" else "target"
                if item[field] is not None:
                    raise ValueError(f"{where}: sentence {index} has a second {kind} line")
                item[field] = _text(text, where, f"the {kind} text")
            else:
                j = int(kind[1:]) if len(kind) > 1 else len(item["refs"])
                if j in item["refs"]:
                    raise ValueError(f"{where}: sentence {index} has a second R{j} line")
                item["refs"][j] = _text(text, where, f"reference R{j}")
    if not items:
        raise ValueError(f"{path} holds no sentence")
    result = []
    for index, item in items.items():
        if item["source"] is None:
            raise ValueError(f"{path}: sentence {index} (line {item['line']}) has no S-{index} line (its source)")
        references = [item["refs"][j] for j in sorted(item["refs"])]
        if include_target and item["target"] is not None:
            references.insert(0, item["target"])
        if not references:
            raise ValueError(f"{path}: sentence {index} (line {item['line']}) has no R<j>-{index} reference line")
        result.append({"id": index, "source": item["source"], "references": references, "target": item["target"]})
    return result


def read_multi_reference_jsonl(path: str | Path) -> list[dict]:
    """Items [{"id", "source", "references"}] of a JSONL file (missing ids: the line's position among the items)."""
    from loramcl.utils.files import read_jsonl

    items = []
    for number, (item_id, record) in enumerate(read_jsonl(path, "source", number_missing_ids=True).items(), start=1):
        where = f"{path}: item {number} (id {item_id!r})"
        references = record.get("references")
        if not isinstance(references, list) or not references:
            raise ValueError(f'{where} needs "references", a non-empty list of strings, got {str(references)[:80]}')
        items.append({"id": item_id, "source": _text(record["source"], where, '"source"'),
                      "references": [_text(r, where, "every reference") for r in references]})
    return items


def read_test_set(path: str | Path, include_target: bool = False) -> list[dict]:
    """A multi-reference test set in either form: fairseq extra_refs when the first non-empty line starts with
    S-, T- or R, else JSONL."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    with path.open("rb") as f:
        first = next((decode_line(raw, path, n) for n, raw in enumerate(f, start=1) if raw.strip()), "")
    if _FAIRSEQ_LINE.match(first.rstrip("\r\n")):
        return read_fairseq_refs(path, include_target)
    if include_target:
        raise ValueError(f"{path} is JSONL: include_target applies to fairseq extra_refs files only")
    return read_multi_reference_jsonl(path)


def read_training_pairs(path: str | Path, source_lang: str, target_lang: str,
                        target_path: str | Path | None = None) -> list[dict]:
    """Training pairs from ALMA's JSON (``path`` ending in .json or .jsonl) or from plain parallel text (``path``
    the source side, ``target_path`` the target side)."""
    if target_path is not None:
        return read_parallel_text(path, target_path)
    if Path(path).suffix not in (".json", ".jsonl"):
        raise ValueError(f"{path}: a .json/.jsonl file of ALMA pairs, or plain text with its translation in "
                         "--target_file")
    return read_alma_json(path, source_lang, target_lang)


def target_separator(tokenizer, prompts: Sequence[str], targets: Sequence[str], chat_template: bool = False) -> str:
    """What goes between the prompt and its target so that `loramcl train` (which tokenizes them apart and joins the
    token lists, ``data.prompts.encode_pairs``) gives the tokens the tokenizer reads in the joined text.

    After ALMA's 'German:' the target follows a space. A byte-level BPE (GPT-2, SmolLM2, Qwen2) needs the space at the
    start of the target (' Haus' is one token, 'Haus' after ':' would be another word start); a SentencePiece
    tokenizer that marks every word start itself needs none. With the chat template the target starts the
    assistant's turn: no separator. Returns ' ' or ''; raises if neither reproduces the joined text's tokens.
    """
    from loramcl.data.prompts import prompt_text

    if chat_template:
        return ""
    texts = [prompt_text(tokenizer, p, chat_template) for p in prompts]
    joined = tokenizer([f"{text} {target}" for text, target in zip(texts, targets, strict=True)])["input_ids"]
    prompt_ids = tokenizer(texts)["input_ids"]
    for separator in (" ", ""):
        target_ids = tokenizer([separator + t for t in targets], add_special_tokens=False)["input_ids"]
        mismatch = next((i for i, (whole, p, t) in enumerate(zip(joined, prompt_ids, target_ids, strict=True))
                         if whole != p + t), None)
        if mismatch is None:
            return separator
    raise ValueError(f"the tokenizer reads prompt + ' ' + target differently from the prompt's and the target's own "
                     f"tokens (e.g. {prompts[mismatch]!r} + {targets[mismatch]!r}): end the prompt where the tokenizer "
                     "starts a new token")
