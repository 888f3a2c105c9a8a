"""All metrics of a K-candidate system in one call: `evaluate_candidates` (the Python side of `loramcl evaluate`)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from loramcl.metrics import diversity, quality, short_answers, translation
from loramcl.metrics.nll import check_nll_columns, oracle_nll
from loramcl.metrics.oracle import candidate_scores, mean_over_candidates, oracle, winners
from loramcl.metrics.ranking import ranking_quality
from loramcl.metrics.specialisation import win_rates
from loramcl.metrics.text import check_candidate_sets, check_pairs, ptb_tokenize, require_java


@dataclass(frozen=True)
class Metric:
    kind: str  # "oracle" (best of K vs references), "diversity" (among the K), "translation", "likelihood"
    higher_is_better: bool
    what: str  # one line for the report
    name: str  # as a reader knows it (axis labels)
    diversity: bool = False  # measures how different the K candidates are (its better direction: more diverse)


METRICS: dict[str, Metric] = {
    **{f"bleu{n}": Metric("oracle", True, f"oracle BLEU-{n} (pycocoevalcap, PTB tokens)", f"oracle BLEU-{n}")
       for n in range(1, 5)},
    "meteor": Metric("oracle", True, "oracle METEOR 1.5 (pycocoevalcap jar)", "oracle METEOR"),
    "rouge_l": Metric("oracle", True, "oracle ROUGE-L (pycocoevalcap)", "oracle ROUGE-L"),
    "cider_d": Metric("oracle", True, "oracle CIDEr-D (pycocoevalcap; idf over all references)", "oracle CIDEr-D"),
    "spice": Metric("oracle", True, "oracle SPICE (SPICE 1.0 jar)", "oracle SPICE"),
    "spider": Metric("oracle", True, "oracle SPIDEr = (CIDEr-D + SPICE) / 2 per candidate", "oracle SPIDEr"),
    "sbert_sim": Metric("oracle", True, "oracle sBERT similarity (mean cosine to the references)",
                        "oracle sBERT similarity"),
    "sacrebleu": Metric("oracle", True, "oracle sentence BLEU (sacrebleu, raw text, 0-100)", "oracle sentence BLEU"),
    "chrf": Metric("oracle", True, "oracle sentence chrF (sacrebleu, raw text, 0-100)", "oracle chrF"),
    "exact_match": Metric("oracle", True, "oracle exact match: a candidate equal to a reference after SQuAD's "
                          "normalisation (case, punctuation, articles, white space)", "oracle exact match"),
    "distinct": Metric("diversity", True, "distinct candidates per item after the same normalisation",
                       "distinct candidates", True),
    **{f"div{n}": Metric("diversity", True, f"Div-{n}: distinct / total {n}-grams among the K", f"Div-{n}", True)
       for n in range(1, 5)},
    **{f"mbleu{n}": Metric("diversity", False, f"mBLEU-{n}: BLEU-{n} of each candidate vs the K-1 others",
                           f"mBLEU-{n}", True) for n in range(1, 5)},
    "loo_bleu": Metric("translation", True, "Leave-One-Out BLEU (sacrebleu, 0-100)", "Loo-BLEU"),
    "pairwise_bleu": Metric("translation", False, "Pairwise-BLEU among the K (sacrebleu, 0-100)", "Pairwise-BLEU",
                            True),
    "refs_covered": Metric("translation", True, "#references covered: distinct references closest to a candidate, "
                           "per item (score.py's sentence BLEU+1)", "#references covered"),
    "oracle_nll": Metric("likelihood", False, "oracle NLL of the references (nats/token)", "oracle NLL"),
    "oracle_ppl": Metric("likelihood", False, "oracle perplexity = exp(oracle NLL)", "oracle perplexity"),
    "mixture_nll": Metric("likelihood", False, "mixture NLL -log sum_k p(k|c) p_k(x|c) of the references (nats/token)",
                          "mixture NLL"),
    "score_top1": Metric("ranking", True, "share of items whose most probable candidate (p(k|c)) is the winner",
                         "top-1 accuracy of p(k|c)"),
    "score_ece": Metric("ranking", False, "calibration error of p(k|c) against winning (10 bins)",
                        "calibration error of p(k|c)"),
}
FROM_FILES = ("oracle_nll", "oracle_ppl", "mixture_nll", "score_top1", "score_ece")  # not requested by name

PRESETS: dict[str, tuple[str, ...]] = {
    # paper App. E tables: Div-2, mBLEU-4, BLEU-1/4, METEOR, ROUGE-L, sBERT, CIDEr-D, SPICE, SPIDEr
    "captioning": ("bleu1", "bleu2", "bleu3", "bleu4", "meteor", "rouge_l", "cider_d", "spice", "spider",
                   "sbert_sim", "div1", "div2", "mbleu4"),
    "translation": ("loo_bleu", "pairwise_bleu", "refs_covered"),  # paper App. H.6, Shen et al. 2019
    "short_answers": ("exact_match", "chrf", "distinct"),  # one word or a few: docs/guide/metrics.md
}

# Metrics that need a tool some machines lack: the SPICE jars (not installable offline), the sentence encoder
# package. Reached through a preset they are left out with the reason when the tool is missing; asked for by name,
# the missing tool is an error.
OPTIONAL_TOOLS: dict[str, tuple[str, ...]] = {"spice": ("spice", "spider"), "sentence encoder": ("sbert_sim",)}

RAW_TEXT = {"sacrebleu", "chrf", "exact_match", "distinct"}  # sacrebleu tokenizes (or not) on its own; the short
# answers' normalisation is their own
NEEDS_PTB = {name for name, m in METRICS.items() if m.kind in ("oracle", "diversity")} - RAW_TEXT
# Metrics of the K candidates as a set: they compare the candidates with each other (or hold references out), so they
# read the candidates as decoded, duplicates included; with dedupe (a varying number per item) they are left out.
SET_METRICS = {name for name, m in METRICS.items() if m.kind in ("diversity", "translation")} - {"distinct"}


def _split(value: str | Sequence[str]) -> list[str]:
    return [v.strip() for v in (value.split(",") if isinstance(value, str) else value) if v.strip()]


def resolve_metrics(metrics: str | Sequence[str], exclude: str | Sequence[str] = ()) -> list[str]:
    """Preset and metric names (a list or a comma-separated string) -> the ordered list of metric names."""
    names: list[str] = []
    for name in _split(metrics):
        names += PRESETS.get(name, (name,))
    excluded = _split(exclude)
    known = set(METRICS) - set(FROM_FILES)
    unknown = [n for n in [*names, *excluded] if n not in known]
    if unknown:
        raise ValueError(
            f"unknown metric(s) {unknown}; presets: {sorted(PRESETS)}; metrics: {sorted(known)} "
            "(the NLL metrics come from an NLL file and the ranking metrics from the candidates' scores, not from "
            "this list)"
        )
    names = [n for n in dict.fromkeys(names) if n not in excluded]
    if not names:
        raise ValueError("no metric left to compute")
    return names


def evaluate_candidates(
    candidates: Sequence[Sequence[str]],
    references: Sequence[Sequence[str]],
    metrics: str | Sequence[str] = "captioning",
    exclude: str | Sequence[str] = (),
    groups: Sequence[str] | None = None,
    winner_metric: str | None = None,
    nll=None,
    mixture_nll=None,
    scores=None,
    spice_dir: str | None = None,
    sbert_model: str | None = None,
    sbert_batch_size: int = 64,
    bleu_tokenize: str = "13a",
    tokenize: bool = True,
    dedupe: bool = False,
    positions: str = "hypothesis",
) -> dict:
    """Every requested metric for N items x K candidates with R_i references each.

    Args:
        candidates: N lists of K raw candidate strings (candidate k = hypothesis k).
        references: N lists of R_i raw reference strings.
        metrics: metric or preset names ("captioning", "translation"), list or comma-separated.
        exclude: names to leave out. A metric a preset brings whose tool is missing (SPICE and SPIDEr without the
            SPICE jars, sbert_sim without a sentence encoder) is left out and listed in "unavailable" with the
            reason; one asked for by name is an error.
        groups: one label per item (e.g. its language) for the per-group win-rate table.
        winner_metric: the candidate-level metric that decides which hypothesis wins an item; default cider_d if
            computed, else the first oracle metric, else sacrebleu sentence BLEU.
        nll: optional per-reference NLL [num_refs, K] or per-item [R_i, K] arrays -> oracle_nll / oracle_ppl.
        mixture_nll: optional per-reference mixture NLL of a model with hypothesis scores ([num_refs], or per-item
            [R_i] arrays) -> mixture_nll (its mean over the references).
        scores: optional [N, K] p(k | c) of the candidates (a model with hypothesis scores) -> score_top1 and
            score_ece, against the winners of ``winner_metric``.
        spice_dir: folder with the Stanford CoreNLP 3.6.0 jars for SPICE (default $LORAMCL_SPICE_DIR).
        sbert_model: local sentence-transformers folder (default: the packaged all-MiniLM-L6-v2).
        sbert_batch_size: encoder batch size.
        bleu_tokenize: sacrebleu tokenizer of the translation metrics (the paper: 13a).
        tokenize: PTB-tokenize the text for the COCO metrics and diversity (the paper's protocol). False when the
            text is tokenized already.
        dedupe: count each candidate text once per item (after ``short_answers.normalise_answer``): the oracle, the
            mean over the candidates and the winners read the first of equal candidates only. Items may then have
            fewer candidates than others (as `loramcl generate --dedupe` writes them). The set metrics (Div-n,
            mBLEU, Pairwise-BLEU, Loo-BLEU, #refs covered) compare K candidates as decoded: refused by name, left
            out of a preset (said in "unavailable").
        positions: what candidate k is, for the win-rate table: "hypothesis" (an MCL model) or "beam position" (a
            single model's candidates in its output order).

    Returns:
        {"metrics": {name: value}, "mean_over_candidates": {oracle metric: mean over items of the mean over its
        candidates}, "unavailable": {name: reason}, "notes": {name: how it was computed, where it
        differs from the definition's usual case}, "candidate_scores": {name: array [N, K]},
        "specialisation": {...}, "num_items", "num_candidates", "references_per_item", "timing_s": {step: seconds},
        "settings": {...}}.
    """
    start = time.perf_counter()
    names = resolve_metrics(metrics, exclude)
    if positions not in ("hypothesis", "beam position"):
        raise ValueError(f"positions must be 'hypothesis' or 'beam position', got {positions!r}")
    if dedupe:  # items of fewer candidates filled with repeats of their first, which the mask leaves out
        width = max((len(c) for c in candidates), default=0)
        candidates = [list(c) + [c[0]] * (width - len(c)) if c else c for c in candidates]
    num_candidates = check_candidate_sets(candidates)
    kept = short_answers.first_occurrences(candidates) if dedupe else None  # [N, K] or None
    check_pairs([c[0] for c in candidates], references)
    if nll is not None:
        check_nll_columns(np.shape(nll[0])[-1] if len(nll) else 0, num_candidates, "nll")
    # Fail before the long computations if a tool is missing (or leave out what a preset brought).
    named = set(_split(metrics))
    unavailable: dict[str, str] = {}

    def check_tool(tool: str, check) -> None:
        wanted = [n for n in OPTIONAL_TOOLS[tool] if n in names]
        if not wanted:
            return
        try:
            check()
        except RuntimeError as error:
            if named & set(wanted):
                raise
            unavailable.update(dict.fromkeys(wanted, " ".join(str(error).split())))

    check_tool("spice", lambda: quality.spice_command(spice_dir))
    if sbert_model is None:
        def find_encoder():
            nonlocal sbert_model
            sbert_model = quality.default_sentence_encoder()

        check_tool("sentence encoder", find_encoder)
    if dedupe:
        refused = [n for n in names if n in SET_METRICS]
        if named & set(refused):
            raise ValueError(f"{', '.join(sorted(named & set(refused)))} compare the K candidates as decoded: "
                             "evaluate them without --dedupe (exact_match, distinct and every oracle metric take it)")
        unavailable.update(dict.fromkeys(refused, "a set metric: it compares the K candidates as decoded, so it is "
                                                   "left out with --dedupe (evaluate without it for this one)"))
    if unavailable:
        names = [n for n in names if n not in unavailable]
        if not names:
            raise ValueError(f"no metric left to compute: {unavailable}")
    if "meteor" in names or (tokenize and NEEDS_PTB & set(names)):
        require_java("METEOR" if "meteor" in names else "The PTB tokenizer")
    for name in names:
        if METRICS[name].kind == "diversity" and name.startswith("mbleu") and num_candidates < 2:
            raise ValueError(f"{name} needs K >= 2 candidates per item")
    if ("cider_d" in names or "spider" in names) and len(candidates) < 2:
        raise ValueError("CIDEr-D (and SPIDEr) need at least 2 items (idf over the reference corpus)")
    notes: dict[str, str] = {}
    if "loo_bleu" in names:
        single = len(candidates) - len(translation.loo_items(references))
        if single:
            notes["loo_bleu"] = (f"over the {len(candidates) - single} of {len(candidates)} items with >= 2 "
                                 f"references; the {single} with one reference are left out (holding out their "
                                 "only reference leaves nothing to score against)")
    if groups is not None and len(groups) != len(candidates):
        raise ValueError(f"{len(groups)} group labels for {len(candidates)} items: give one label per item")
    scored = [n for n in names if METRICS[n].kind == "oracle"]  # the candidate-level metrics
    scored += [n for n in ("cider_d", "spice") if "spider" in names and n not in scored]
    if winner_metric is None:
        winner_metric = "cider_d" if "cider_d" in scored else (scored[0] if scored else "sacrebleu")
    if winner_metric not in [*scored, "sacrebleu"]:
        raise ValueError(f"winner_metric {winner_metric!r} is not a candidate-level metric of this run: "
                         f"choose one of {[*scored, 'sacrebleu']}")
    likelihood = oracle_nll(nll) if nll is not None else None

    timing: dict[str, float] = {}

    def timed(step, fn, *args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        timing[step] = round(time.perf_counter() - t0, 3)
        return out

    cands_tok, refs_tok = candidates, references
    if tokenize and NEEDS_PTB & set(names):
        flat = [c for cands in candidates for c in cands] + [r for refs in references for r in refs]
        tokenized = iter(timed("ptb_tokenize", ptb_tokenize, flat))
        cands_tok = [[next(tokenized) for _ in cands] for cands in candidates]
        refs_tok = [[next(tokenized) for _ in refs] for refs in references]

    matrices: dict[str, np.ndarray] = {}
    meteor_job = executor = None
    if "meteor" in names:
        # METEOR's JVM (a second core) works while we compute the rest; `meteor` streams its pipe, so the thread
        # needs the GIL rarely and is not stalled by our pure-Python metrics.
        executor = ThreadPoolExecutor(1)
        meteor_job = (time.perf_counter(), executor.submit(candidate_scores, quality.meteor, cands_tok, refs_tok))
    try:
        bleu_orders = [int(n[4:]) for n in names if n.startswith("bleu")]
        if bleu_orders:
            bleu = timed("bleu", candidate_scores, quality.bleu, cands_tok, refs_tok, n=max(bleu_orders))
            matrices |= {f"bleu{n}": bleu[f"bleu{n}"] for n in bleu_orders}
        if "rouge_l" in names:
            matrices |= timed("rouge_l", candidate_scores, quality.rouge_l, cands_tok, refs_tok)
        if "cider_d" in names or "spider" in names:
            matrices |= timed("cider_d", candidate_scores, quality.cider_d, cands_tok, refs_tok)
        if "spice" in names or "spider" in names:
            matrices |= timed("spice", candidate_scores, quality.spice, cands_tok, refs_tok, spice_dir=spice_dir)
        if "spider" in names:
            matrices["spider"] = (matrices["cider_d"] + matrices["spice"]) / 2
        if "sacrebleu" in names:
            matrices |= timed("sacrebleu", candidate_scores, translation.sacrebleu_sentence, candidates, references,
                              tokenize=bleu_tokenize)
        if "chrf" in names:
            matrices |= timed("chrf", candidate_scores, translation.chrf_sentence, candidates, references)
        if "exact_match" in names:
            matrices |= timed("exact_match", candidate_scores, short_answers.exact_match, candidates, references)
        if "sbert_sim" in names:
            matrices |= timed("sbert_sim", candidate_scores, quality.sbert_sim, cands_tok, refs_tok,
                              model=sbert_model, batch_size=sbert_batch_size)
        if meteor_job is not None:
            matrices |= meteor_job[1].result()
            timing["meteor (overlapped)"] = round(time.perf_counter() - meteor_job[0], 3)
    finally:
        if executor is not None:
            executor.shutdown(cancel_futures=True)

    oracle_names = [n for n in names if METRICS[n].kind == "oracle"]
    values: dict[str, float] = {n: oracle(matrices[n], kept=kept) for n in oracle_names}
    mean_values = {n: mean_over_candidates(matrices[n], kept) for n in oracle_names}
    if "distinct" in names:
        values["distinct"] = short_answers.distinct_candidates(candidates)
    div_orders = [int(n[3:]) for n in names if n.startswith("div")]
    if div_orders:
        values |= timed("div", diversity.div_n, cands_tok, div_orders)
    mbleu_orders = [int(n[5:]) for n in names if n.startswith("mbleu")]
    if mbleu_orders:
        mbleu = timed("mbleu", diversity.mbleu, cands_tok, max(mbleu_orders))
        values |= {f"mbleu{n}": mbleu[f"mbleu{n}"] for n in mbleu_orders}
    if "loo_bleu" in names:
        values |= timed("loo_bleu", translation.loo_bleu, candidates, references, tokenize=bleu_tokenize)
    if "pairwise_bleu" in names:
        values |= timed("pairwise_bleu", translation.pairwise_bleu, candidates, tokenize=bleu_tokenize)
    if "refs_covered" in names:
        covered = timed("refs_covered", translation.references_covered, candidates, references, tokenize=bleu_tokenize)
        values["refs_covered"] = covered["refs_covered"]
    values = {n: values[n] for n in names}  # the requested order

    if likelihood is not None:
        values |= {"oracle_nll": likelihood["oracle_nll"], "oracle_ppl": likelihood["oracle_ppl"]}

    # Specialisation: which hypothesis wins each item under one candidate-level metric.
    if winner_metric == "sacrebleu" and "sacrebleu" not in matrices:
        matrices |= timed("sacrebleu", candidate_scores, translation.sacrebleu_sentence, candidates, references,
                          tokenize=bleu_tokenize)
    higher_is_better = METRICS[winner_metric].higher_is_better if winner_metric in METRICS else True
    specialisation = {"metric": winner_metric, "positions": positions,
                      **win_rates(matrices[winner_metric], groups, higher_is_better, kept)}
    if likelihood is not None:
        specialisation["nll_win_rate"] = likelihood["win_rate"]
    if mixture_nll is not None:
        flat = np.concatenate([np.atleast_1d(np.asarray(m, dtype=float)) for m in mixture_nll])
        if not np.isfinite(flat).all() or (flat < 0).any():
            raise ValueError("mixture_nll must be finite and >= 0 (nats per token)")
        values["mixture_nll"] = float(flat.mean())
    if scores is not None:
        if np.shape(scores) != (len(candidates), num_candidates):
            raise ValueError(f"scores must give p(k | c) for each of the {num_candidates} candidates of the "
                             f"{len(candidates)} items, got shape {np.shape(scores)}")
        values |= ranking_quality(scores, winners(matrices[winner_metric], higher_is_better, kept))
        values.pop("score_chance")
        specialisation["score_chance"] = 1.0 / num_candidates

    timing["total"] = round(time.perf_counter() - start, 3)
    ref_counts = [len(r) for r in references]
    return {
        "metrics": values,
        "mean_over_candidates": mean_values,
        "unavailable": unavailable,
        "notes": notes,
        "likelihood": likelihood,
        "specialisation": specialisation,
        "candidate_scores": matrices,
        "num_items": len(candidates),
        "num_candidates": num_candidates,
        "references_per_item": {"min": min(ref_counts), "max": max(ref_counts), "mean": float(np.mean(ref_counts))},
        "timing_s": timing,
        "settings": {"metrics": names, "tokenize": "ptb" if tokenize else "none", "bleu_tokenize": bleu_tokenize,
                     "sbert_model": sbert_model if "sbert_sim" in names else None, "dedupe": dedupe},
        "candidates_counted": None if kept is None else kept.tolist(),
    }


def unavailable_groups(unavailable: dict[str, str]) -> dict[str, list[str]]:
    """{reason: [metric names]} of the metrics left out for a missing tool."""
    groups: dict[str, list[str]] = {}
    for name, reason in unavailable.items():
        groups.setdefault(reason, []).append(name)
    return groups


def markdown_report(report: dict) -> str:
    """The metrics of one `evaluate_candidates` report as a markdown table (+ the win-rate table)."""
    from loramcl.metrics.specialisation import win_rate_table

    lines = [f"# {report.get('name', 'evaluation')}", "",
             f"{report['num_items']} items x {report['num_candidates']} candidates, "
             f"{report['references_per_item']['min']}-{report['references_per_item']['max']} references per item.", "",
             *_dedupe_line(report),
             "| metric | value | mean over the candidates | better | what |", "|---|---:|---:|:---:|---|"]
    means = report.get("mean_over_candidates") or {}
    for name, value in report["metrics"].items():
        metric = METRICS[name]
        mean = f"{means[name]:.4g}" if name in means else ""
        lines.append(f"| {name} | {value:.4g} | {mean} | {'↑' if metric.higher_is_better else '↓'} | {metric.what} |")
    for reason, names in unavailable_groups(report.get("unavailable") or {}).items():
        lines.append(f"| {', '.join(names)} | not computed | | | {reason} |")
    lines += [f"\n{name}: {note}." for name, note in (report.get("notes") or {}).items()]
    wins = report["specialisation"]
    lines += ["", win_rate_table(wins, wins["metric"], wins.get("positions", "hypothesis"))]
    if report.get("likelihood"):
        lik = report["likelihood"]
        lines += ["", "| hypothesis | NLL | PPL | best for (% of references) |", "|---|---:|---:|---:|"]
        rows = zip(lik["hypothesis_nll"], lik["hypothesis_ppl"], lik["win_rate"], strict=True)
        lines += [f"| h{k} | {n:.4f} | {p:.3f} | {100 * w:.1f} |" for k, (n, p, w) in enumerate(rows)]
    return "\n".join(lines) + "\n"


def _dedupe_line(report: dict) -> list[str]:
    counted = report.get("candidates_counted")
    if counted is None:
        return []
    total = sum(len(row) for row in counted)
    return [f"--dedupe: each candidate text counted once per item ({sum(map(sum, counted))} of the {total} "
            "candidates); the oracle, the mean over the candidates and the winners read those.", ""]
