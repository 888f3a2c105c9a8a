"""The translation recipe's report: Loo-BLEU against Pairwise-BLEU per system (paper Fig. 4), #references covered,
oracle sentence BLEU / chrF, the oracle test NLL per run (paper Table 1), what tells the K candidates apart, and
examples."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from loramcl.recipes.report import Column, inline, metrics_table, percent, runs_table, written_report
from loramcl.utils.run_record import RunRecord

EXAMPLES_SHOWN = 8
COLUMNS = (Column("loo_bleu", "Loo-BLEU ↑", ".2f"), Column("pairwise_bleu", "Pairwise-BLEU ↓", ".2f"),
           Column("refs_covered", "#refs covered ↑", ".2f"), Column("sacrebleu", "oracle BLEU ↑", ".2f"),
           Column("chrf", "oracle chrF ↑", ".2f"), Column("distinct", "K distinct ↑", ".2f"),
           Column("oracle_nll", "oracle NLL ↓", ".3f"))
DECODING_NAMES = {"greedy": "greedy (penalty on logits)", "beam": "beam search", "diverse_beam": "diverse beam search"}
# Features that could tell German candidates apart (formal address, hyphenated compounds, sentence punctuation).
FEATURES = {
    "formal 'Sie'": re.compile(r"\b(Sie|Ihnen|Ihre[nmrs]?)\b"),
    "informal 'du'": re.compile(r"\b([Dd]u|[Dd]ich|[Dd]ir|[Dd]ein\w*)\b"),
    "hyphen": re.compile(r"\w-\w"),
    "final period": re.compile(r"\.$"),
}


def clean(text: str) -> str:
    """A decoded candidate as a translation: its first non-empty line, stripped (the model may go on after the
    end of its translation, as ALMA's evaluation also cuts it)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0] if lines else ""


def method_name(record: RunRecord) -> str:
    mcl = record.settings.values["mcl"]
    k, r = mcl["num_hypotheses"], mcl["r"]
    return f"LoRA-MLE r={r}" if k == 1 else f"LoRA-MCL K={k} r={r}"


def hypothesis_profile(candidates: list[list[str]], sources: list[str], references: list[list[str]],
                       tokenize: str = "13a") -> dict:
    """Per candidate position k (hypothesis k for MCL, beam rank for a single model): mean length in words, the
    share of untranslated candidates (the English copied), the share whose closest reference (score.py's sentence
    BLEU+1, as #refs covered) is the item's most used translation (reference 0), and the share showing each of
    FEATURES."""
    from loramcl.metrics import bleu_plus_one

    num_candidates = len(candidates[0])
    profile: dict = {"words": [], "untranslated": [], "closest_is_first": [], **{name: [] for name in FEATURES}}
    for k in range(num_candidates):
        column = [cands[k] for cands in candidates]
        profile["words"].append(float(np.mean([len(c.split()) for c in column])))
        profile["closest_is_first"].append(float(np.mean([
            np.argmax([bleu_plus_one(c, r, tokenize) for r in refs]) == 0
            for c, refs in zip(column, references, strict=True)])))
        profile["untranslated"].append(float(np.mean([c.casefold() == s.casefold() for c, s in
                                                      zip(column, sources, strict=True)])))
        for name, pattern in FEATURES.items():
            profile[name].append(float(np.mean([bool(pattern.search(c)) for c in column])))
    return profile


def build_report(root: Path, experiment, systems, nll_table: list[str], runs: list[str]) -> dict:
    from loramcl.metrics import evaluate_candidates, loo_bleu, oracle_nll
    from loramcl.metrics.io import load_nll
    from loramcl.metrics.plot import tradeoff_plot
    from loramcl.recipes.report import training_curves
    from loramcl.training.runs import run_record
    from loramcl.utils.files import read_jsonl

    test = list(read_jsonl(root / "data" / "test.jsonl", "references").values())
    ids, sources = [r["id"] for r in test], [r["source"] for r in test]
    references = [r["references"] for r in test]
    # Loo-BLEU holds out one reference stream at a time: the first R_min references of every item, as fairseq's
    # score.py (which transposes the reference lists, keeping the shortest one's length).
    r_min = min(len(r) for r in references)
    loo_references = [r[:r_min] for r in references]
    records = {run: run_record(root / run) for run in runs}
    nll = {run: load_nll(root / "nll" / f"{run}.jsonl", ids, references) for run in nll_table}

    results, outputs = {}, {}
    for system in systems:
        predictions = read_jsonl(root / "predictions" / f"{system.name}.jsonl", "candidates")
        candidates = [[clean(c) for c in predictions[i]["candidates"]] for i in ids]
        outputs[system.name] = candidates
        evaluated = evaluate_candidates(candidates, references, metrics="sacrebleu,chrf,pairwise_bleu,refs_covered",
                                        winner_metric="sacrebleu", bleu_tokenize=experiment.bleu_tokenize,
                                        nll=nll.get(system.entry))  # the NLL of the adapters it decodes
        metrics = evaluated["metrics"] | loo_bleu(candidates, loo_references, tokenize=experiment.bleu_tokenize)
        metrics["distinct"] = float(np.mean([len(set(c)) for c in candidates]))
        results[system.name] = {"system": system.to_dict(), "method": method_name(records[system.run]),
                                "decoding": DECODING_NAMES[system.strategy], "metrics": metrics,
                                "best_candidate": evaluated["specialisation"]["win_rate"],
                                "profile": hypothesis_profile(candidates, sources, references,
                                                              experiment.bleu_tokenize)}

    nll_rows = {}
    for run in nll_table:
        mcl = records[run].settings.values["mcl"]
        summary = oracle_nll(nll[run])
        nll_rows[run] = {"K": mcl["num_hypotheses"], "r": mcl["r"],
                         "trainable_parameters": records[run].trainable_parameters, **summary}

    figures = {"curves": training_curves({run: root / run for run in runs}, root / "figures" / "training.png")}
    if results:
        names = list(results)
        figures["tradeoff"] = str(tradeoff_plot(
            [results[n] for n in names], x="pairwise_bleu", y="loo_bleu", out=root / "figures" / "tradeoff.png",
            labels=[f"B={results[n]['system']['budget']}" for n in names],
            methods=[results[n]["method"] for n in names], decodings=[results[n]["decoding"] for n in names],
            title=f"Quality vs diversity, K = {experiment.candidates} candidates (paper Fig. 4)"))
    examples = [{"source": sources[i], "references": references[i],
                 **{name: outputs[name][i] for name in outputs}} for i in range(min(EXAMPLES_SHOWN, len(test)))]
    report = {"systems": results, "nll_table": nll_rows, "runs": {run: r.values for run, r in records.items()},
              "figures": figures, "examples": examples,
              "num_test_items": len(test), "loo_references": r_min,
              "references_per_item": float(np.mean([len(r) for r in references])),
              "candidates": experiment.candidates, "bleu_tokenize": experiment.bleu_tokenize}
    return written_report(root, report, markdown)


def markdown(report: dict) -> str:
    k = report["candidates"]
    lines = ["# Diverse machine translation (paper §4.4, App. H.6)", "",
             f"{report['num_test_items']} test sources with {report['references_per_item']:.2f} references on "
             f"average; K = {k} candidates per source for every system; BLEU with sacrebleu's "
             f"`{report['bleu_tokenize']}` tokenizer.", "", "## Runs", "", *runs_table(report["runs"]), "",
             "## Quality and diversity at equal forward budget (paper Fig. 4)", "",
             f"Loo-BLEU: corpus BLEU of all candidates against the references but one, averaged over the held-out "
             f"reference (the first {report['loo_references']} references of each source). Pairwise-BLEU: the "
             "candidates against each other (lower = more diverse). #refs covered: distinct references that are "
             "the closest one to some candidate. Oracle BLEU / chrF: the best candidate's sentence score. K distinct: "
             "distinct candidates per source. Oracle NLL: of the references, under the run's best hypothesis.", "",
             *metrics_table(report["systems"], COLUMNS)]
    if report["nll_table"]:
        lines += ["", "## Oracle test NLL as a function of K (paper Table 1)", "",
                  "NLL of every reference (nats per target token) under the hypothesis that explains it best; "
                  "'best single' is the best hypothesis's own mean; 'won by' the share of references each hypothesis "
                  "explains best.", "",
                  "| run | K | rank per hypothesis | trainable | oracle NLL | oracle PPL | best single | won by |",
                  "|---|---:|---:|---:|---:|---:|---:|---|"]
        for run, row in report["nll_table"].items():
            won = " / ".join(percent(w) for w in row["win_rate"])
            lines.append(f"| {run} | {row['K']} | {row['r']} | {row['trainable_parameters']:,} | "
                         f"{row['oracle_nll']:.3f} | {row['oracle_ppl']:.2f} | {min(row['hypothesis_nll']):.3f} | "
                         f"{won} |")
    lines += ["", "## What tells the K candidates apart", "",
              "Per candidate position (hypothesis k for LoRA-MCL, beam or group rank for LoRA-MLE): mean words, "
              "untranslated share, how often its closest reference is the most used translation (reference 0), "
              "features of German style, and how often that candidate is the best of the K (sentence BLEU; ties to "
              "the lowest k). Shares in %.", "",
              "| system | k | words | untranslated | closest is ref 0 | " + " | ".join(FEATURES) + " | best of K |",
              "|---|---:|---:|---:|---:|" + "---:|" * len(FEATURES) + "---:|"]
    for name, result in report["systems"].items():
        profile = result["profile"]
        for position in range(len(profile["words"])):
            cells = " | ".join(percent(profile[f][position]) for f in FEATURES)
            lines.append(f"| {name} | {position} | {profile['words'][position]:.2f} | "
                         f"{percent(profile['untranslated'][position])} | "
                         f"{percent(profile['closest_is_first'][position])} | {cells} | "
                         f"{percent(result['best_candidate'][position])} |")
    lines += ["", "Figures: " + ", ".join(f"`{Path(p).name}`" for p in report["figures"].values()), "",
              "## Examples (the first test sources)", ""]
    for example in report["examples"]:
        lines.append(f"- **{inline(example['source'])}** (references: "
                     + " · ".join(inline(r) for r in example["references"]) + ")")
        for name, candidates in example.items():
            if name not in ("source", "references"):
                lines.append(f"  - {name}: " + " · ".join(inline(c) for c in candidates))
    return "\n".join(lines) + "\n"
