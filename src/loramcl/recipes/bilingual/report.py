"""The bilingual experiment's report: quality and diversity per system, who wins each language, the language of each
hypothesis's outputs, embedding probes, and the training curves (paper Table 7, Fig. 4-5, App. H.5)."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np

from loramcl.data.gettext_pairs import LANGUAGES
from loramcl.recipes.report import inline, nll_section, percent, runs_nll, runs_table, wins_table, written_report
from loramcl.utils.validate import require

IDENTIFIER_EXAMPLES = 3000  # per language, from the training split
EXAMPLES_SHOWN = 6


def train_identifier(train: list[dict], test: list[dict], seed: int = 0):
    """Character n-gram identifier of fr / de / en, fit on training targets and English sources; its accuracy on
    the test references and sources (never seen in training: the split is by English message)."""
    from loramcl.analysis import LanguageIdentifier, evaluate_identifier

    rng = random.Random(seed)
    texts, labels = [], []
    for lang in LANGUAGES:
        rows = [r["target"] for r in train if r["lang"] == lang]
        chosen = rng.sample(rows, min(IDENTIFIER_EXAMPLES, len(rows)))
        texts += chosen
        labels += [lang] * len(chosen)
    sources = rng.sample([r["source"] for r in train], min(IDENTIFIER_EXAMPLES, len(train)))
    identifier = LanguageIdentifier().fit(texts + sources, labels + ["en"] * len(sources))
    check_texts = [t for r in test for lang in LANGUAGES for t in r[lang]] + [r["source"] for r in test]
    check_labels = [lang for r in test for lang in LANGUAGES for _ in r[lang]] + ["en"] * len(test)
    return identifier, evaluate_identifier(identifier, check_texts, check_labels)


def build_report(root: Path, systems, runs: list[str], scored: list[str], metrics: str,
                 probed: tuple[str, ...]) -> dict:
    """The report of the trained ``runs``, their decoded ``systems`` and the NLL of the test references under the
    ``scored`` runs; returns the report's data."""
    from loramcl.analysis import embed, hypothesis_probe, language_shares, language_wins, pca_plot
    from loramcl.metrics import evaluate_candidates
    from loramcl.metrics.io import load_mixture_nll, load_nll, load_scores
    from loramcl.recipes.report import training_curves
    from loramcl.training.runs import run_record
    from loramcl.utils.files import read_jsonl

    test = list(read_jsonl(root / "data" / "test.jsonl", "references").values())
    train = list(read_jsonl(root / "data" / "train.jsonl", "target").values())
    references = [r["references"] for r in test]
    identifier, identifier_accuracy = train_identifier(train, test)
    run_info = {run: run_record(root / run).values for run in runs}

    results: dict[str, dict] = {}
    outputs: dict[str, list[list[str]]] = {}
    languages: dict[str, np.ndarray] = {}
    for system in systems:
        path = root / "predictions" / f"{system.name}.jsonl"
        predictions = read_jsonl(path, "candidates")
        candidates = [predictions[r["id"]]["candidates"] for r in test]
        outputs[system.name] = candidates
        ids, nll_path = [r["id"] for r in test], root / "nll" / f"{system.entry}.jsonl"
        # p(k | c): runs trained with hypothesis scores (docs/guide/scores.md)
        scores = load_scores(path, ids, candidates)
        report = evaluate_candidates(candidates, references, metrics=metrics, nll=load_nll(nll_path, ids, references),
                                     winner_metric="chrf", mixture_nll=load_mixture_nll(nll_path, ids, references),
                                     scores=scores)
        report.pop("candidate_scores")
        shares = language_shares(candidates, identifier, languages=list(LANGUAGES))
        languages[system.name] = np.array(shares.pop("predictions"))  # [N, K] identified language per candidate
        results[system.name] = {"system": system.to_dict(), "metrics": report["metrics"],
                                "likelihood": report["likelihood"],
                                "language_wins": language_wins(candidates, test, LANGUAGES),
                                "languages": shares, "timing_s": report["timing_s"]}
        if scores is not None:
            results[system.name]["mean_scores"] = scores.mean(axis=0)

    groups = [[lang for lang in LANGUAGES for _ in r[lang]] for r in test]  # the language of each reference
    require(all(r["references"] == [t for lang in LANGUAGES for t in r[lang]] for r in test),
            f"{root / 'data' / 'test.jsonl'}: each item's references must be its {' then '.join(LANGUAGES)} ones")
    likelihood = runs_nll(root, scored, [r["id"] for r in test], references, groups)
    figures = {"curves": training_curves({run: root / run for run in runs}, root / "figures" / "training.png")}
    probes = {}
    for name in probed:
        candidates = outputs[name]
        flat = [c for cands in candidates for c in cands]
        vectors = embed(flat).reshape(len(candidates), len(candidates[0]), -1)
        mask = np.array([[bool(c.strip()) for c in cands] for cands in candidates])
        probes[name] = hypothesis_probe(vectors, mask=mask)
        predicted = languages[name]
        by_hypothesis = pca_plot(vectors, root / "figures" / f"pca-{name}.png", mask=mask,
                                 title=f"{name}: candidates by hypothesis")
        by_language = pca_plot(vectors, root / "figures" / f"pca-{name}-language.png", mask=mask,
                               colours_by=predicted, label_names=sorted(set(predicted.ravel())),
                               title=f"{name}: candidates by identified language")
        probes[name]["explained_variance"] = by_hypothesis["explained_variance"]
        figures[f"pca-{name}"] = by_hypothesis["path"]
        figures[f"pca-{name}-language"] = by_language["path"]

    examples = [{"source": r["source"], "fr": r["fr"][0], "de": r["de"][0],
                 **{name: outputs[name][i] for name in probed}} for i, r in enumerate(test[:EXAMPLES_SHOWN])]
    return written_report(root, {"identifier": identifier_accuracy, "systems": results, "likelihood": likelihood,
                                 "probes": probes, "runs": run_info, "figures": figures, "examples": examples,
                                 "num_test_items": len(test)}, markdown)


def markdown(report: dict) -> str:
    systems = report["systems"]
    lines = ["# SmolLM2-135M on an ambiguous translation task (English -> French or German)", "",
             f"{report['num_test_items']} test messages, each with its French and German human translations as "
             "references. K = 2 candidates per message for every system.", "",
             "## Runs", "", *runs_table(report["runs"])]

    lines += ["", "## Quality and diversity at equal forward budget", "",
              "Oracle = best of the K candidates per message, against all references of both languages (vs FR / vs "
              "DE: against one language's references only). "
              "mBLEU-4: lower is more diverse. Oracle NLL: references' NLL under the best hypothesis "
              "(nats per token; one number per trained run).", "",
              "| system | budget | oracle BLEU | oracle chrF | oracle chrF vs FR / vs DE | mBLEU-4 | Div-2 "
              "| oracle NLL | both FR and DE |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, result in systems.items():
        m, lik = result["metrics"], result["likelihood"]
        per_language = result["language_wins"]["oracle_chrf"]
        lines.append(f"| {name} | {result['system']['budget']} | {m['sacrebleu']:.2f} | {m['chrf']:.2f} | "
                     f"{per_language['fr']:.2f} / {per_language['de']:.2f} | "
                     f"{m['mbleu4']:.3f} | {m['div2']:.3f} | {lik['oracle_nll']:.3f} | "
                     f"{percent(result['languages']['both_languages'])}% |")

    scored = {name: result for name, result in systems.items() if "mean_scores" in result}
    if scored:
        lines += ["", "## Hypothesis scores p(k | c) (docs/guide/scores.md)", "",
                  "Top-1: how often the most probable candidate is the best one by sentence chrF (chance 1/K); ECE: "
                  "calibration of p(k | c) against those wins. Mixture NLL: -log sum_k p(k | c) p_k(x | c) of the "
                  "references (nats per token), a proper likelihood to compare with LoRA-MLE's NLL; oracle NLL: the "
                  "best hypothesis per reference.", "",
                  "| system | mean p(k \\| c) | top-1 (chance) | ECE | mixture NLL | oracle NLL |",
                  "|---|---|---:|---:|---:|---:|"]
        for name, result in scored.items():
            m, k = result["metrics"], len(result["mean_scores"])
            mean = " / ".join(f"{p:.2f}" for p in result["mean_scores"])
            mixture = f"{m['mixture_nll']:.3f}" if "mixture_nll" in m else "–"
            lines.append(f"| {name} | {mean} | {m['score_top1']:.3f} ({1 / k:.3f}) | {m['score_ece']:.3f} | "
                         f"{mixture} | {m['oracle_nll']:.3f} |")

    lines += ["", "## Which hypothesis wins each reference language (paper Table 7)", "",
              "For each test message and each language, the candidate closest to that language's reference "
              "(sentence chrF) wins; ties go to h0.", "",
              *wins_table(systems, "language_wins", LANGUAGES,
                          "| system | reference | h0 | h1 | ties (both languages) |")]
    lines += ["", *nll_section(report["likelihood"], LANGUAGES, "reference language")]

    identified = report["identifier"]["per_language"]
    per_language = ", ".join(f"{lang}: {percent(v['accuracy'])}%" for lang, v in identified.items())
    lines += ["", "## Language of each hypothesis's outputs", "",
              f"Identified by a character n-gram classifier trained on the training split; on the test references "
              f"and sources it is right {percent(report['identifier']['accuracy'])}% of the time ({per_language}).", "",
              "| system | hypothesis | fr | de | en | other/empty | majority |", "|---|---|---:|---:|---:|---:|---|"]
    for name, result in systems.items():
        shares = result["languages"]
        for k, share in enumerate(shares["per_hypothesis"]):
            rest = 1 - sum(share.get(lang, 0.0) for lang in ("fr", "de", "en"))
            lines.append(f"| {name} | h{k} | {percent(share.get('fr', 0))} | {percent(share.get('de', 0))} | "
                         f"{percent(share.get('en', 0))} | {percent(rest)} | {shares['majority'][k]} "
                         f"({percent(shares['majority_share'][k])}%) |")

    lines += ["", "## Embedding probes (App. H.5)", "",
              "A linear SVM predicts the hypothesis from the candidate's all-MiniLM-L6-v2 embedding (70/30 split by "
              "message); a PCA of the embeddings shows the same.", "",
              "| system | SVM test accuracy | chance | PC1, PC2 variance |", "|---|---:|---:|---|"]
    for name, probe in report["probes"].items():
        variance = ", ".join(f"{100 * v:.1f}%" for v in probe["explained_variance"])
        lines.append(f"| {name} | {percent(probe['accuracy'])}% | {percent(probe['chance'])}% | {variance} |")
    lines += ["", "Figures: " + ", ".join(f"`{Path(p).name}`" for p in report["figures"].values()), "",
              "## Examples", ""]
    for example in report["examples"]:
        lines.append(f"- **{inline(example['source'])}** (fr: {inline(example['fr'])} / de: "
                     f"{inline(example['de'])})")
        for name, candidates in example.items():
            if name not in ("source", "fr", "de"):
                lines.append(f"  - {name}: " + " · ".join(f"h{k}: {inline(c)}" for k, c in enumerate(candidates)))
    return "\n".join(lines) + "\n"
