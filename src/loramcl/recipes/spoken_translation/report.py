"""The spoken translation report: the data, the runs, every system's oracle quality and diversity at its forward
budget, which mode each hypothesis's outputs are in (by an offline language identifier, and by the language token
the model chose), which hypothesis wins each mode, examples, and the training curves."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

from loramcl.recipes.report import (
    inline,
    nll_section,
    percent,
    runs_nll,
    runs_table,
    tradeoff_figure,
    wins_table,
    written_report,
)
from loramcl.recipes.spoken_translation.messages import MODES, read_rows

IDENTIFIER_EXAMPLES = 2000  # per language, from the training split
EXAMPLES_SHOWN = 8


def train_identifier(train: list[dict], test: list[dict], seed: int = 0):
    """Character n-gram identifier of en / fr fit on the training messages (their English source and their French
    translation, whatever the example's mode); its accuracy on the test references (never seen: the split is by
    message)."""
    from loramcl.analysis import LanguageIdentifier, evaluate_identifier

    rng = random.Random(seed)
    rows = rng.sample(train, min(IDENTIFIER_EXAMPLES, len(train)))
    texts = [r["source"] for r in rows] + [r["fr"][0] for r in rows]
    identifier = LanguageIdentifier().fit(texts, ["en"] * len(rows) + ["fr"] * len(rows))
    check = [(text, mode) for r in test for text, mode in zip(r["references"], r["reference_modes"], strict=True)]
    return identifier, evaluate_identifier(identifier, [t for t, _ in check], [m for _, m in check])


def build_report(root: Path, experiment, systems, runs, scored: list[str], stats: dict, metrics: str) -> dict:
    """report.md and figures/ from the predictions of ``systems`` (each evaluated with ``metrics``), the trained
    ``runs`` and the NLL of the ``scored`` runs; returns the report's data."""
    from loramcl.analysis import language_shares, language_wins
    from loramcl.metrics import evaluate_candidates
    from loramcl.recipes.report import training_curves
    from loramcl.training.runs import run_record
    from loramcl.utils.files import read_jsonl

    test = read_rows(root / "data" / "test.jsonl")
    references = [r["references"] for r in test]
    train = read_rows(root / "data" / "train.jsonl")
    identifier, identifier_accuracy = train_identifier(train, test)
    by_mode = [{"en": [r["source"]], "fr": r["fr"]} for r in test]
    records = {run: run_record(root / run) for run in runs}
    results, outputs = {}, {}
    for system in systems:
        predictions = read_jsonl(root / "predictions" / f"{system.name}.jsonl", "candidates")
        candidates = [predictions[r["id"]]["candidates"] for r in test]
        outputs[system.name] = candidates
        evaluation = evaluate_candidates(candidates, references, metrics=metrics,
                                         winner_metric="chrf")
        shares = language_shares(candidates, identifier, languages=list(MODES))
        shares.pop("predictions")
        tokens = [predictions[r["id"]]["modes"] for r in test]
        declared = [dict(Counter(row[k] for row in tokens)) for k in range(len(tokens[0]))]
        results[system.name] = {"system": system.to_dict(), "metrics": evaluation["metrics"],
                                "mode_wins": language_wins(candidates, by_mode, MODES), "languages": shares,
                                "language_tokens": [{t: n / len(test) for t, n in d.items()} for d in declared]}
    likelihood = runs_nll(root, scored, [r["id"] for r in test], references, [r["reference_modes"] for r in test])
    curves = training_curves({run: root / run for run in runs}, root / "figures" / "training.png")
    figures, examples = {"training": curves}, []
    if systems:  # none when experiment.yaml decodes no run (`decoded: []`): the likelihood table only
        figures["tradeoff"] = str(tradeoff_figure(
            results, systems, records, "mbleu4", "chrf", root / "figures" / "tradeoff.png",
            title=f"Oracle chrF against mBLEU-4 (lower: more diverse), K = {experiment.candidates}"))
        shown = [s.name for s in systems if s.budget == min(x.budget for x in systems)]
        examples = [{"source": r["source"], "fr": r["fr"][0], **{name: outputs[name][i] for name in shown}}
                    for i, r in enumerate(test[:EXAMPLES_SHOWN])]
    return written_report(root, {"data": stats, "identifier": identifier_accuracy,
                                 "runs": {run: r.values for run, r in records.items()}, "systems": results,
                                 "likelihood": likelihood, "examples": examples, "figures": figures,
                                 "num_test_items": len(test), "context_seconds": experiment.context_seconds}, markdown)


def markdown(report: dict) -> str:
    systems, data = report["systems"], report["data"]["splits"]
    lines = ["# Whisper-base on spoken English messages: transcript or French translation", "",
             f"{report['num_test_items']} test messages spoken by espeak-ng, each with its English transcript and its "
             "French translation(s) as references. K = 2 candidates per message for every system. Encoder context: "
             f"{report['context_seconds']} s.", "", "## Data", "",
             "| split | messages | left out (longer than the context) | minutes of speech | modes (en / fr) |",
             "|---|---:|---:|---:|---|"]
    for name, split in data.items():
        modes = split.get("modes")
        shown = f"{modes['en']} / {modes['fr']}" if modes else "–"
        lines.append(f"| {name} | {split['messages']} | {split['too_long']} | {split['minutes']} | {shown} |")
    lines += ["", "## Runs", "", *runs_table(report["runs"]), ""]
    if not systems:
        return "\n".join([*lines, "No run is decoded (experiment.yaml: `decoded: []`).", "",
                          *nll_section(report["likelihood"], MODES, "mode"), "",
                          f"![training curves](figures/{Path(report['figures']['training']).name})", ""])
    lines += ["## Quality and diversity at equal forward budget", "",
              "Oracle = best of the K candidates per message against every reference of both modes (vs EN / vs FR: "
              "against one mode's references only, sentence chrF). mBLEU-4: lower is more diverse.", "",
              "| system | budget | oracle BLEU | oracle chrF | oracle chrF vs EN / vs FR | mBLEU-4 | both modes |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for name, result in systems.items():
        m, per_mode = result["metrics"], result["mode_wins"]["oracle_chrf"]
        lines.append(f"| {name} | {result['system']['budget']} | {m['sacrebleu']:.2f} | {m['chrf']:.2f} | "
                     f"{per_mode['en']:.2f} / {per_mode['fr']:.2f} | {m['mbleu4']:.3f} | "
                     f"{percent(result['languages']['both_languages'])}% |")
    lines += ["", "## Which candidate wins each mode", "",
              "For each test message and each mode, the candidate closest (sentence chrF) to that mode's references "
              "wins; ties go to candidate 0 (for an MCL run candidate k is hypothesis k; for MLE, beam or group rank).",
              "", *wins_table(systems, "mode_wins", MODES, "| system | mode | k=0 | k=1 | ties |")]
    lines += ["", *nll_section(report["likelihood"], MODES, "mode")]
    identified = report["identifier"]["per_language"]
    accuracy = ", ".join(f"{lang}: {percent(v['accuracy'])}%" for lang, v in identified.items())
    lines += ["", "## Mode of each candidate", "",
              "Language identified by a character n-gram classifier trained on the training messages (right "
              f"{percent(report['identifier']['accuracy'])}% of the time on the test references: {accuracy}); "
              "token: the language token the model wrote first.", "",
              "| system | candidate | en | fr | other/empty | token <\\|en\\|> | token <\\|fr\\|> |",
              "|---|---|---:|---:|---:|---:|---:|"]
    for name, result in systems.items():
        for k, share in enumerate(result["languages"]["per_hypothesis"]):
            tokens = result["language_tokens"][k]
            rest = max(0.0, 1 - share.get("en", 0.0) - share.get("fr", 0.0))  # not -0.0 from rounding
            lines.append(f"| {name} | {k} | {percent(share.get('en', 0))} | {percent(share.get('fr', 0))} | "
                         f"{percent(rest)} | {percent(tokens.get('<|en|>', 0))} | {percent(tokens.get('<|fr|>', 0))} |")
    lines += ["", "## Examples", ""]
    for example in report["examples"]:
        lines.append(f"- **{inline(example['source'])}** (fr: {inline(example['fr'])})")
        for name, candidates in example.items():
            if name not in ("source", "fr"):
                lines.append(f"  - {name}: " + " · ".join(f"{k}: {inline(c)}" for k, c in enumerate(candidates)))
    lines += ["", f"![training curves](figures/{Path(report['figures']['training']).name})",
              f"![quality against diversity](figures/{Path(report['figures']['tradeoff']).name})", ""]
    return "\n".join(lines)
