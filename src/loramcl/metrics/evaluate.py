"""`loramcl evaluate` and `loramcl plot-tradeoff`: each function's signature and docstring are its CLI (jsonargparse).

Heavy libraries (pycocoevalcap, sentence-transformers, matplotlib) load inside the functions, so `loramcl --help`
stays fast.
"""

from __future__ import annotations

import glob
import json
import sys
from pathlib import Path

from loramcl.utils.inputs import LocalPath, check_output


def _split(value: list[str] | str | None) -> list[str]:
    if value is None:
        return []
    return [v.strip() for v in (value.split(",") if isinstance(value, str) else value) if v.strip()]


def evaluate(
    predictions: LocalPath,
    references: LocalPath,
    metrics: list[str] | str = "captioning",
    out: LocalPath = "eval",
    name: str | None = None,
    exclude: list[str] | str | None = None,
    group_key: str | None = None,
    winner_metric: str | None = None,
    nll: LocalPath | None = None,
    spice_dir: LocalPath | None = None,
    sbert_model: LocalPath | None = None,
    bleu_tokenize: str = "13a",
    tokenize: bool = True,
    dedupe: bool = False,
) -> dict[str, str]:
    """Score K candidates per item on quality (oracle) and diversity; write a JSON, a markdown table, per-item scores.

    Args:
        predictions: JSONL, one line per item: {"id": ..., "candidates": [K strings]} (candidate k = hypothesis k),
            as `loramcl generate` writes it.
        references: JSONL, one line per item: {"id": ..., "references": [R_i strings] or one string}, e.g. the
            test file given to `loramcl generate` and `loramcl nll`; R_i may differ between items. The ids must
            match; "id" is optional in every file: a line without one is numbered by its position (0, 1, ...), as
            `generate` and `nll` number it. A training file of several answers per prompt is read as it is: its
            "completion" list (texts, or assistant messages' contents) when it has no "references".
        metrics: presets ("captioning", "translation", "short_answers") and/or metric names, comma-separated (e.g.
            "bleu4,div2", "exact_match,chrf,distinct"). Every oracle (best of K) metric is reported with its mean
            over the K candidates beside it.
            A preset's metric whose tool is missing (SPICE and SPIDEr without the SPICE jars) is reported as not
            computed, with the reason; a metric named here whose tool is missing is an error.
        out: output folder.
        name: run name, used for the file names and plot labels (default: the predictions file's stem).
        exclude: metrics to leave out, comma-separated (e.g. "spice,spider" without the SPICE jars).
        group_key: a field of the references (or predictions) lines, e.g. "lang": win rates per group.
        winner_metric: candidate-level metric deciding which hypothesis wins an item (default cider_d if computed).
        nll: optional JSONL {"id": ..., "nll": [[K floats] per reference]} -> oracle NLL and perplexity (+ the
            mixture NLL when its lines have "mixture_nll", as `loramcl nll` writes for adapters with hypothesis
            scores). Predictions with "scores" (p(k|c), from such adapters) also get score_top1 and score_ece.
        spice_dir: folder with the Stanford CoreNLP 3.6.0 jars for SPICE (default: $LORAMCL_SPICE_DIR).
        sbert_model: local sentence-transformers folder (default: the packaged all-MiniLM-L6-v2).
        bleu_tokenize: sacrebleu tokenizer for Loo-BLEU and Pairwise-BLEU (the paper: 13a).
        tokenize: PTB-tokenize before the COCO and diversity metrics (the paper's protocol).
        dedupe: count each candidate text once per item (case, punctuation, articles and white space aside): the
            oracle, the mean over the candidates and the winners read the first of equal candidates only; reads the
            lines of `loramcl generate --dedupe` (fewer candidates where fewer distinct ones were found). The set
            metrics (div, mbleu, pairwise_bleu, loo_bleu, refs_covered) need the candidates as decoded.
    """
    from loramcl.metrics.io import (
        candidate_positions,
        load_mixture_nll,
        load_nll,
        load_run,
        load_scores,
        to_jsonable,
    )
    from loramcl.metrics.oracle import winners
    from loramcl.metrics.suite import METRICS, evaluate_candidates, markdown_report, unavailable_groups
    from loramcl.utils.files import shown_ids, write_json

    check_output(out, folder=True)
    ids, candidates, refs, groups = load_run(predictions, references, group_key)
    report = evaluate_candidates(
        candidates, refs, metrics=_split(metrics), exclude=_split(exclude), groups=groups,
        winner_metric=winner_metric, nll=load_nll(nll, ids, refs, candidates) if nll else None, spice_dir=spice_dir,
        sbert_model=sbert_model, bleu_tokenize=bleu_tokenize, tokenize=tokenize,
        mixture_nll=load_mixture_nll(nll, ids, refs) if nll else None,
        scores=None if dedupe else load_scores(predictions, ids, candidates), dedupe=dedupe,
        positions=candidate_positions(predictions),
    )
    name = name or Path(predictions).name.removesuffix(".jsonl").removesuffix(".json")
    report = {"name": name, "predictions": str(predictions), "references": str(references), **report}
    scores = report.pop("candidate_scores")
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = write_json(out_dir / f"{name}.json", to_jsonable(report), indent=2)
    markdown = markdown_report(report)
    md_path = out_dir / f"{name}.md"
    md_path.write_text(markdown, encoding="utf-8")

    # Per item, every candidate's score: to look at winners and failures item by item.
    winner_metric = report["specialisation"]["metric"]
    higher = METRICS[winner_metric].higher_is_better if winner_metric in METRICS else True
    counted = report.pop("candidates_counted")
    best = winners(scores[winner_metric], higher, counted)
    items_path = out_dir / f"{name}.items.jsonl"
    with items_path.open("w", encoding="utf-8") as f:
        for i, item_id in enumerate(ids):
            row = {"id": item_id, "winner": int(best[i]), "scores": {m: s[i] for m, s in scores.items()}}
            if counted is not None:
                row["counted"] = counted[i]
            f.write(json.dumps(to_jsonable(row)) + "\n")

    print(markdown)
    if "loo_bleu" in report["notes"]:
        single = [i for i, r in zip(ids, refs, strict=True) if len(r) < 2]
        print(f"loramcl evaluate: note: loo_bleu is {report['notes']['loo_bleu']}; their ids: {shown_ids(single)}",
              file=sys.stderr)
    for reason, names in unavailable_groups(report["unavailable"]).items():
        print(f"loramcl evaluate: not computed: {', '.join(names)}: {reason.split('. ')[0]} (the report says how to "
              f"set it up; --exclude {','.join(names)} leaves them out)", file=sys.stderr)
    print(f"metrics (JSON):  {json_path}\ntable (markdown): {md_path}\nper-item scores: {items_path}")
    return {"json": str(json_path), "markdown": str(md_path), "items": str(items_path)}


def plot_tradeoff(
    runs: list[str] | str,
    x: str = "mbleu4",
    y: str = "spider",
    out: LocalPath = "tradeoff.png",
    labels: list[str] | str | None = None,
    title: str | None = None,
    methods: list[str] | str | None = None,
    decodings: list[str] | str | None = None,
) -> str:
    """Quality-diversity plot (paper Fig. 3-4 style): one labelled marker per run, x = diversity, y = quality.

    The axes carry the metrics' names and better directions; labels cover no label and no marker; points at the
    same place are drawn inside each other and named together.

    Args:
        runs: JSON reports written by `loramcl evaluate`: comma-separated and/or glob patterns
            ("eval/a.json,eval/b.json", "eval/*.json") or a list ("[eval/a.json, eval/b.json]").
        x: metric on the x axis (diversity, e.g. mbleu4, div2, pairwise_bleu).
        y: metric on the y axis (quality, e.g. spider, cider_d, bleu4, loo_bleu).
        out: PNG file to write.
        labels: one label per run, comma-separated (default: each run's name).
        title: plot title (default: says which corner is better).
        methods: one method per run (e.g. "LoRA-MCL K=3", "LoRA-MLE r=24"), comma-separated or a list: the
            marker; give decodings too.
        decodings: one decoding per run (e.g. "beam search"), comma-separated or a list (for names with commas):
            the colour.
    """
    from loramcl.metrics.plot import tradeoff_plot_from_files

    check_output(out, folder=False, example="tradeoff.png")
    paths: list[str] = []
    for pattern in _split(runs):
        if glob.has_magic(pattern):
            matched = sorted(glob.glob(pattern))
            if not matched:
                raise FileNotFoundError(f"no file matches {pattern!r}")
            paths += matched
        else:
            paths.append(pattern)
    if not paths:
        raise ValueError("no run given: --runs eval/a.json,eval/b.json (or a glob such as 'eval/*.json')")
    path = tradeoff_plot_from_files(paths, x=x, y=y, out=out, labels=_split(labels) or None, title=title,
                                    methods=_split(methods) or None, decodings=_split(decodings) or None)
    print(f"plot ({len(paths)} runs, x={x}, y={y}): {path}")
    return str(path)
