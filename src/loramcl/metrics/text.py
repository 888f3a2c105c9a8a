"""Text handling shared by the metrics: input checks, the Java check and the PTB tokenizer (paper App. E.2)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence


def require_java(what: str) -> str:
    """Path of `java`, or a clear error: METEOR, SPICE and the PTB tokenizer are jars run by pycocoevalcap."""
    java = shutil.which("java")
    if java is None:
        raise RuntimeError(
            f"{what} runs a Java program (shipped with pycocoevalcap) but no `java` is on PATH. "
            "Install a Java runtime, e.g. `apt-get install openjdk-17-jre-headless`, or leave this metric out."
        )
    return java


def java_major_version(java: str) -> int:
    """17 for `openjdk version "17.0.15"`, 8 for `java version "1.8.0_392"`."""
    banner = subprocess.run([java, "-version"], capture_output=True, text=True, check=False).stderr
    quoted = banner.split('"')[1] if '"' in banner else ""
    parts = quoted.split(".")
    if not parts[0].isdigit():
        raise RuntimeError(f"could not read the Java version from `{java} -version`: {banner.strip()!r}")
    return int(parts[1]) if parts[0] == "1" and len(parts) > 1 else int(parts[0])


def one_line(text: str) -> str:
    """Collapse every kind of whitespace (\\r, \\u2028, tabs ...) to single spaces.

    The PTB tokenizer and the METEOR process read one sentence per line: a stray line break inside a
    caption would shift every later sentence by one line, silently.
    """
    return " ".join(text.split())


def ptb_tokenize(texts: Sequence[str]) -> list[str]:
    """PTB-tokenize sentences as the COCO caption protocol does: lower-cased, punctuation removed.

    One Java process for all texts (pycocoevalcap's `PTBTokenizer`); duplicates are tokenized once.
    Returns one tokenized string per input, in order (empty input -> empty string).
    """
    check_texts(texts, "texts")
    flat = [one_line(t) for t in texts]
    unique = [t for t in dict.fromkeys(flat) if t]
    table = {"": ""}
    if unique:
        require_java("The PTB tokenizer")
        from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

        with _stderr_kept_on_failure():  # the jar's "PTBTokenizer tokenized N tokens at ..." line, every call
            tokenized = PTBTokenizer().tokenize({i: [{"caption": t}] for i, t in enumerate(unique)})
        if len(tokenized) != len(unique):  # the tokenizer zips lines to ids: a lost line drops ids
            raise RuntimeError(f"the PTB tokenizer returned {len(tokenized)} lines for {len(unique)} sentences")
        table.update({t: tokenized[i][0] for i, t in enumerate(unique)})
    return [table[t] for t in flat]


@contextlib.contextmanager
def _stderr_kept_on_failure() -> Iterator[None]:
    """What a child process writes on our stderr (file descriptor 2, which it inherits) held back, and shown only if
    the block fails: the PTB tokenizer's jar reports its token count there on success."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        except BaseException:
            os.dup2(saved, 2)
            held.seek(0)
            sys.stderr.write(held.read().decode(errors="replace"))
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def check_texts(texts: Sequence[str], what: str) -> None:
    if isinstance(texts, str) or not isinstance(texts, Sequence):
        raise TypeError(f"{what} must be a list of strings, got {type(texts).__name__}")
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise TypeError(f"{what}[{i}] must be a string, got {type(t).__name__}: {t!r}")


def check_pairs(candidates: Sequence[str], references: Sequence[Sequence[str]]) -> None:
    """One candidate per item, a non-empty list of reference strings per item (the per-sentence metrics' input)."""
    check_texts(candidates, "candidates")
    if isinstance(references, str) or not isinstance(references, Sequence):
        raise TypeError(f"references must be a list of lists of strings, got {type(references).__name__}")
    if len(candidates) != len(references):
        raise ValueError(f"{len(candidates)} candidates but {len(references)} reference lists: give one list per item")
    if not candidates:
        raise ValueError("no items to score: candidates is empty")
    for i, refs in enumerate(references):
        check_texts(refs, f"references[{i}]")
        if len(refs) == 0:
            raise ValueError(f"item {i} has no reference: every item needs at least one")


def check_candidate_sets(candidates: Sequence[Sequence[str]], what: str = "candidates") -> int:
    """K candidates per item, the same K for every item; returns K."""
    if isinstance(candidates, str) or not isinstance(candidates, Sequence):
        raise TypeError(f"{what} must be a list (items) of lists (K candidates) of strings")
    if not candidates:
        raise ValueError(f"no items to score: {what} is empty")
    for i, cands in enumerate(candidates):
        check_texts(cands, f"{what}[{i}]")
    sizes = {len(c) for c in candidates}
    if 0 in sizes:
        empty = [i for i, c in enumerate(candidates) if not c][:5]
        raise ValueError(f"items {empty} have no candidate: every item needs its K candidates")
    if len(sizes) > 1:
        k = len(candidates[0])
        odd = [i for i, c in enumerate(candidates) if len(c) != k][:5]
        raise ValueError(
            f"every item needs the same number K of candidates (one per hypothesis); item 0 has {k}, "
            f"items {odd} have {[len(candidates[i]) for i in odd]} (a file of `loramcl generate --dedupe`, with "
            "fewer candidates where fewer distinct ones were found: evaluate it with --dedupe true)"
        )
    return sizes.pop()
