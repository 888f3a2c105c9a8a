"""The image-captioning report (paper Table 3, Fig. 3): the trained runs, quality and diversity of every system at
equal forward budget, the quality-diversity plot, examples, and the training curves."""

from __future__ import annotations

import json
from pathlib import Path

from loramcl.recipe.report import Column, inline, metrics_table, runs_table, training_curves

EXAMPLES_SHOWN = 3
# Table 3's columns first, then the rest of the captioning preset, in this order when computed.
COLUMNS = (Column("cider_d", "CIDEr-D"), Column("spice", "SPICE"), Column("spider", "SPIDEr"),
           Column("mbleu4", "mBLEU-4 ↓"), Column("bleu4", "BLEU-4"), Column("meteor", "METEOR"),
           Column("rouge_l", "ROUGE-L"), Column("sbert_sim", "sBERT"), Column("div2", "Div-2"))


def build_report(root: Path, experiment, systems, runs: list[str]) -> dict:
    from loramcl.metrics import evaluate_candidates
    from loramcl.metrics.io import load_run, to_jsonable
    from loramcl.metrics.plot import tradeoff_plot
    from loramcl.recipe.stages import run_record

    results = {}
    for system in systems:
        _, candidates, references, _ = load_run(root / "predictions" / f"{system.name}.jsonl",
                                             root / "data" / "test.jsonl")
        scores = evaluate_candidates(candidates, references, experiment.metrics)
        results[system.name] = {"system": system.to_dict(), "metrics": scores["metrics"],
                                "unavailable": scores["unavailable"], "examples": candidates[:EXAMPLES_SHOWN]}
    figures = root / "figures"
    computed = next(iter(results.values()))["metrics"] if results else {}
    quality = next((m for m in ("spider", "cider_d", "bleu4") if m in computed), None)
    plot = None
    if quality and "mbleu4" in computed:
        plot = tradeoff_plot([results[s.name] for s in systems], x="mbleu4", y=quality,
                             out=figures / "quality_diversity.png", labels=[s.name for s in systems],
                             title=f"{quality} against mBLEU-4 (K = {experiment.candidates})")
    curves = training_curves({run: root / run for run in runs}, figures / "training.png")
    records = {run: run_record(root / run) for run in runs}
    stats = json.loads((root / "data" / "stats.json").read_text())

    columns = [c for c in COLUMNS if c.key in computed] + [
        Column(key, key) for key in computed if key not in {c.key for c in COLUMNS}]
    unavailable = next(iter(results.values()))["unavailable"] if results else {}
    lines = ["# Image captioning with reading comprehension (TextCaps)", "",
             f"Data: {stats['images']['train']} training images ({stats['captions']['train']} captions), "
             f"{stats['images']['test']} test images ({stats['captions']['test']} references). K = "
             f"{experiment.candidates} candidates per image for every system; at forward budget B a single model "
             "decodes with beam B (and diverse beam search in K groups), an MCL model with beam B/K per hypothesis.",
             "", "## Runs", "", *runs_table(records), "", "## Quality and diversity at equal budget", "",
             *metrics_table(results, columns), ""]
    if unavailable:
        lines += ["Not computed: " + "; ".join(f"{name} ({reason})" for name, reason in unavailable.items()), ""]
    if plot:
        lines += [f"![quality against diversity]({Path(plot).relative_to(root)})", ""]
    lines += [f"![training]({Path(curves).relative_to(root)})", "", "## Examples", ""]
    for name, result in results.items():
        lines.append(f"- {name}: " + " | ".join(inline(c, 60) for c in result["examples"][0]))
    (root / "report.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return to_jsonable({"data": stats, "systems": {name: {k: v for k, v in r.items() if k != "examples"}
                                                   for name, r in results.items()},
                        "figures": {"quality_diversity": str(plot) if plot else None, "training": curves}})
