"""The audio captioning report: the data, the trained runs, every system's quality and diversity at its forward
budget (the paper's Fig. 3 and Tables 5-9 columns), which candidate position wins, training curves, and the
quality-diversity plot."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from loramcl.recipe.grid import System
from loramcl.recipe.report import Column, loss_name, metrics_table, percent, runs_table, training_curves

COLUMNS = (Column("spider", "SPIDEr"), Column("cider_d", "CIDEr-D"), Column("meteor", "METEOR"),
           Column("sbert_sim", "sBERT"), Column("bleu4", "BLEU-4"), Column("rouge_l", "ROUGE-L"),
           Column("mbleu4", "mBLEU-4 (lower: more diverse)"), Column("div2", "Div-2"),
           Column("oracle_nll", "oracle test NLL (of the run)"))


def build_report(root: Path, experiment, systems: Sequence[System], runs: Sequence[str]) -> dict:
    """report.md and figures/ from the evaluations in eval/ and the runs' records; returns the report's data."""
    from loramcl.metrics.io import read_report
    from loramcl.metrics.plot import tradeoff_plot
    from loramcl.runs import run_record

    evaluations = {s.name: read_report(root / "eval" / f"{s.name}.json") for s in systems}
    results = {s.name: {"system": s.to_dict(), "metrics": evaluations[s.name]["metrics"],
                        "win_rate": evaluations[s.name]["specialisation"].get("win_rate"),
                        "winner_metric": evaluations[s.name]["specialisation"].get("metric")} for s in systems}
    trained = [run for run in runs if (root / run / "run.json").is_file()]
    records = {run: run_record(root / run) for run in trained}
    stats = json.loads((root / "data" / "stats.json").read_text())
    columns = [c for c in COLUMNS if any(c.key in r["metrics"] for r in results.values())]
    unavailable = sorted({f"{name}: {reason.split('. ')[0]}" for e in evaluations.values()
                          for name, reason in e.get("unavailable", {}).items()})

    figures = root / "figures"
    curves = training_curves({run: root / run for run in trained}, figures / "training.png")
    quality = "spider" if all("spider" in r["metrics"] for r in results.values()) else "cider_d"
    tradeoff = tradeoff_plot(list(evaluations.values()), x="mbleu4", y=quality, out=figures / "tradeoff.png",
                             labels=[f"B={s.budget}" for s in systems],
                             methods=[method_label(records[s.run]) for s in systems],
                             decodings=[decoding_label(s) for s in systems])

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
    return {"data": stats, "runs": records, "systems": results, "figures": {"training": str(curves),
                                                                              "tradeoff": str(tradeoff)}}


def method_label(record: dict) -> str:
    """The paper's name of a trained run (Fig. 3 legend), from its run.json."""
    settings = record["settings"]
    method = settings.get("method", "mcl")
    if method == "moe":
        return "LoRA-MoE"
    mcl = settings["mcl"]
    return f"LoRA-MLE r={mcl['r']}" if mcl["num_hypotheses"] == 1 else f"LoRA-MCL ({loss_name(mcl)})"


def decoding_label(system: System) -> str:
    """The decoding of a system (Fig. 3 colours): an MCL run's beam and greedy decoding are beam search with one beam
    per hypothesis at B = K (greedy: with the repetition penalty on the logits)."""
    options = system.options
    if system.strategy == "diverse_beam":  # an MCL run's: diverse MCL decoding at the recipe's λ
        return f"diverse beam λ={options['diversity_penalty']:g}" if "diversity_penalty" in options else \
            "diverse MCL decoding"
    if system.strategy == "tta":
        return "TTA φ=({:g}, {:g})".format(*options["tta_strength"])
    if system.strategy == "sample":
        return "sampling " + ", ".join(f"{key}={value:g}" for key, value in options.items())
    return "greedy (penalty on logits)" if system.strategy == "greedy" else "beam search"
