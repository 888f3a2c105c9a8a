"""The image-captioning report (paper Table 3, Fig. 3): the trained runs, quality and diversity of every system at
equal forward budget, the quality-diversity plot, examples, and the training curves."""

from __future__ import annotations

from pathlib import Path

from loramcl.recipes.report import Column, inline, metrics_table, runs_table, training_curves
from loramcl.recipes.stages import data_stats

EXAMPLES_SHOWN = 3
# Table 3's columns first, then the rest of the captioning preset, in this order when computed.
COLUMNS = (Column("cider_d", "CIDEr-D"), Column("spice", "SPICE"), Column("spider", "SPIDEr"),
           Column("mbleu4", "mBLEU-4 ↓"), Column("bleu4", "BLEU-4"), Column("meteor", "METEOR"),
           Column("rouge_l", "ROUGE-L"), Column("sbert_sim", "sBERT"), Column("div2", "Div-2"))


def build_report(root: Path, experiment, systems, runs: list[str]) -> dict:
    from loramcl.metrics import evaluate_candidates
    from loramcl.metrics.io import load_run, to_jsonable
    from loramcl.metrics.plot import tradeoff_plot
    from loramcl.training.runs import run_record

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
    stats = data_stats(root / "data")

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
    specialisation = None
    if experiment.bilingual is not None:
        candidates = {name: load_run(root / "predictions" / f"{name}.jsonl", root / "data" / "test.jsonl")[1]
                      for name in results}
        mcl_systems = [s.name for s in systems if s.strategy in ("greedy", "beam") and s.options == {}
                       and records[s.run].settings.values.get("mcl", {}).get("num_hypotheses", 1) > 1]
        specialisation, more = bilingual_analysis(root, experiment.bilingual_settings().language, candidates,
                                                  mcl_systems)
        lines += more
    (root / "report.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return to_jsonable({"data": stats, "systems": {name: {k: v for k, v in r.items() if k != "examples"}
                                                   for name, r in results.items()},
                        "specialisation": specialisation,
                        "figures": {"quality_diversity": str(plot) if plot else None, "training": curves}})


def bilingual_analysis(root: Path, language: str, candidates: dict[str, list[list[str]]], probed: list[str]
                       ) -> tuple[dict, list[str]]:
    """The bilingual variant's App. H.5 analysis, through `loramcl.analysis`: per system, which hypothesis's candidate
    is closest (sentence chrF) to each reference language's references (paper Table 2's win rates), the language
    of each hypothesis's outputs (a character n-gram identifier fit on the training captions of both languages), and
    for the MCL systems a linear SVM probe and PCA plots of the candidates' sentence embeddings."""
    import numpy as np

    from loramcl.analysis import LanguageIdentifier, embed, hypothesis_probe, language_shares, pca_plot
    from loramcl.metrics import candidate_scores, chrf_sentence, win_rates
    from loramcl.recipes.report import percent
    from loramcl.utils.files import read_jsonl

    languages = ["en", language]
    test = list(read_jsonl(root / "data" / "test.jsonl", "references").values())
    train = list(read_jsonl(root / "data" / "train.jsonl", "references").values())
    texts = [t for r in train for t in r["references"]]
    labels = [lang for r in train for lang in r["languages"]]
    identifier = LanguageIdentifier().fit(texts, labels) if len(set(labels)) == 2 else None
    analysis: dict = {"systems": {}, "probes": {}}
    lines = ["", f"## Bilingual variant: English and {language} captions (paper Table 2, App. H.5)", "",
             "Win rates: for each test image and each reference language, the candidate closest to that language's "
             "references (sentence chrF) wins (ties go to the lowest k).", "",
             "| system | reference | " + " | ".join(f"h{k}" for k in range(len(next(iter(candidates.values()))[0])))
             + " |", "|---|---|" + "---:|" * len(next(iter(candidates.values()))[0])]
    for name, cands in candidates.items():
        scores = [candidate_scores(chrf_sentence, cands, [[ref for ref, lang in zip(
            r["references"], r["reference_languages"], strict=True) if lang == wanted] for r in test])["chrf"]
            for wanted in languages]
        wins = win_rates(np.concatenate(scores), [lang for lang in languages for _ in test])
        entry = {"language_wins": wins}
        for lang in languages:
            lines.append(f"| {name} | {lang} | " + " | ".join(percent(x) for x in wins["by_group"][lang]["win_rate"])
                         + " |")
        if identifier is not None:
            shares = language_shares(cands, identifier, languages=languages)
            entry["languages"] = {k: v for k, v in shares.items() if k != "predictions"}
            entry["predicted"] = shares["predictions"]
        analysis["systems"][name] = entry
    if identifier is None:
        lines += ["", "The training captions hold one language only: no language identifier, no language shares."]
    else:
        lines += ["", "Language of each hypothesis's outputs (identifier fit on the training captions):", "",
                  "| system | hypothesis | " + " | ".join(languages) + " | majority |",
                  "|---|---|" + "---:|" * len(languages) + "---|"]
        for name, entry in analysis["systems"].items():
            shares = entry["languages"]
            for k, share in enumerate(shares["per_hypothesis"]):
                lines.append(f"| {name} | h{k} | " + " | ".join(percent(share.get(lang, 0.0)) for lang in languages)
                             + f" | {shares['majority'][k]} |")
    for name in probed:
        cands = candidates[name]
        vectors = embed([c for row in cands for c in row]).reshape(len(cands), len(cands[0]), -1)  # [N, K, d]
        mask = np.array([[bool(c.strip()) for c in row] for row in cands])
        probe = hypothesis_probe(vectors, mask=mask)
        by_hypothesis = pca_plot(vectors, root / "figures" / f"pca-{name}.png", mask=mask,
                                 title=f"{name}: candidates by hypothesis")
        probe["figures"] = [str(by_hypothesis["path"])]
        if identifier is not None:
            predicted = np.array(analysis["systems"][name]["predicted"])
            probe["figures"].append(str(pca_plot(vectors, root / "figures" / f"pca-{name}-language.png", mask=mask,
                                                 colours_by=predicted, label_names=sorted(set(predicted.ravel())),
                                                 title=f"{name}: candidates by identified language")["path"]))
        analysis["probes"][name] = probe
    if probed:
        lines += ["", "Linear SVM predicting the hypothesis from a candidate's sentence embedding (split by image):",
                  "", "| system | SVM test accuracy | chance |", "|---|---:|---:|"]
        lines += [f"| {name} | {percent(p['accuracy'])}% | {percent(p['chance'])}% |"
                  for name, p in analysis["probes"].items()]
    return analysis, lines
