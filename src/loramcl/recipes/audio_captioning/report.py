"""The audio captioning report: the data, the trained runs, every system's quality and diversity at its forward
budget (the paper's Fig. 3 and Tables 5-9 columns), which candidate position wins, training curves, and the
quality-diversity plot."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from loramcl.recipes.grid import System
from loramcl.recipes.report import Column, metrics_table, percent, runs_table, tradeoff_figure, training_curves
from loramcl.recipes.stages import data_stats

COLUMNS = (Column("spider", "SPIDEr"), Column("cider_d", "CIDEr-D"), Column("meteor", "METEOR"),
           Column("sbert_sim", "sBERT"), Column("bleu4", "BLEU-4"), Column("rouge_l", "ROUGE-L"),
           Column("mbleu4", "mBLEU-4 (lower: more diverse)"), Column("div2", "Div-2"),
           Column("oracle_nll", "oracle test NLL (of the run)"))


def build_report(root: Path, experiment, systems: Sequence[System], runs: Sequence[str]) -> dict:
    """report.md and figures/ from the evaluations in eval/ and the runs' records; returns the report's data."""
    from loramcl.metrics.io import read_report
    from loramcl.training.runs import run_record

    evaluations = {s.name: read_report(root / "eval" / f"{s.name}.json") for s in systems}
    results = {s.name: {"system": s.to_dict(), "metrics": evaluations[s.name]["metrics"],
                        "win_rate": evaluations[s.name]["specialisation"].get("win_rate"),
                        "winner_metric": evaluations[s.name]["specialisation"].get("metric")} for s in systems}
    trained = [run for run in runs if (root / run / "run.json").is_file()]
    records = {run: run_record(root / run) for run in trained}
    stats = data_stats(root / "data")
    columns = [c for c in COLUMNS if any(c.key in r["metrics"] for r in results.values())]
    unavailable = sorted({f"{name}: {reason.split('. ')[0]}" for e in evaluations.values()
                          for name, reason in e.get("unavailable", {}).items()})

    figures = root / "figures"
    curves = training_curves({run: root / run for run in trained}, figures / "training.png")
    quality = "spider" if all("spider" in r["metrics"] for r in results.values()) else "cider_d"
    tradeoff = tradeoff_figure(evaluations, systems, records, "mbleu4", quality, figures / "tradeoff.png")

    lines = [f"# Audio captioning: {experiment.layout}{' (synthetic)' if experiment.synthetic else ''}", "",
             f"K = {experiment.candidates} candidates per clip for every system; budget B = sequences advanced per "
             "decoding step and clip (MCL: beam B/K per hypothesis; MLE and MoE: beam B, diverse beam B in K "
             "groups, test-time augmentation beam B/K per augmented input; sampling at B = K).", "",
             "## Data", "", "| role | split | clips | captions | skipped | hours |", "|---|---|---:|---:|---:|---:|"]
    lines += [f"| {role} | {s['split']} | {s['clips']} | {s['captions']} | {s['skipped']} | {s['hours']} |"
              for role, s in stats["splits"].items()]
    lines += ["", "## Trained runs", "", *runs_table(records), "", "## Systems (oracle quality over the K "
              "candidates, diversity among them)", "", *metrics_table(results, columns), ""]
    if unavailable:
        lines += ["Not computed: " + "; ".join(unavailable), ""]
    winner_metric = results[systems[0].name]["winner_metric"]
    lines += ["## Which candidate wins", "", f"Share of clips whose best candidate ({winner_metric}) is candidate k "
              "(for an MCL run: hypothesis k).", "",
              "| system | " + " | ".join(f"k={k}" for k in range(experiment.candidates)) + " |",
              "|---|" + "---:|" * experiment.candidates]
    lines += [f"| {name} | " + " | ".join(percent(w) for w in r["win_rate"]) + " |" for name, r in results.items()
              if r["win_rate"]]
    lines += ["", f"![training curves]({Path(curves).relative_to(root)})",
              f"![quality vs diversity]({Path(tradeoff).relative_to(root)})", ""]
    (root / "report.md").write_text("\n".join(lines), encoding="utf-8")
    return {"data": stats, "runs": {run: r.values for run, r in records.items()}, "systems": results,
            "figures": {"training": str(curves), "tradeoff": str(tradeoff)}}

