"""Quality and diversity metrics for K candidates per input (paper App. E and H.6).

    quality        sentence metrics from pycocoevalcap / sentence-transformers: bleu, meteor, rouge_l, cider_d,
                   spice, spider, sbert_sim  (list[str] candidates, list[list[str]] references -> {name: [N]})
    oracle         candidate_scores (-> {name: [N, K]}) and oracle (best of K per item, mean over items)
    diversity      div_n, mbleu  (among the K candidates)
    translation    loo_bleu, pairwise_bleu, references_covered, bleu_plus_one (Shen et al. 2019, sacrebleu),
                   sacrebleu_sentence, chrf_sentence
    short_answers  exact_match (SQuAD's normalisation), distinct candidates, first_occurrences (--dedupe)
    nll            oracle_nll (references' NLL under K hypotheses)
    specialisation win_rates, win_rate_table
    suite          evaluate_candidates: all of them in one call (the Python side of `loramcl evaluate`)
    plot           tradeoff_plot (paper Fig. 3 style)
    evaluate       `loramcl evaluate` and `loramcl plot-tradeoff`: files in, a report or a figure out

The modules import their heavy libraries inside the functions.
"""

from loramcl.metrics.diversity import div_n, mbleu
from loramcl.metrics.nll import oracle_nll
from loramcl.metrics.oracle import candidate_scores, mean_over_candidates, oracle, uses_corpus_statistics, winners
from loramcl.metrics.short_answers import distinct_candidates, exact_match, normalise_answer
from loramcl.metrics.quality import bleu, cider_d, meteor, rouge_l, sbert_sim, spice, spider
from loramcl.metrics.specialisation import likelihood_wins, win_rate_table, win_rates
from loramcl.metrics.suite import METRICS, PRESETS, evaluate_candidates, markdown_report, resolve_metrics
from loramcl.metrics.text import ptb_tokenize
from loramcl.metrics.translation import (
    bleu_plus_one,
    chrf_sentence,
    loo_bleu,
    pairwise_bleu,
    references_covered,
    sacrebleu_sentence,
)

__all__ = [
    "bleu", "meteor", "rouge_l", "cider_d", "spice", "spider", "sbert_sim",
    "candidate_scores", "oracle", "mean_over_candidates", "winners", "uses_corpus_statistics",
    "exact_match", "distinct_candidates", "normalise_answer",
    "div_n", "mbleu", "loo_bleu", "pairwise_bleu", "references_covered", "bleu_plus_one", "sacrebleu_sentence",
    "chrf_sentence", "oracle_nll",
    "win_rates", "likelihood_wins", "win_rate_table", "evaluate_candidates", "markdown_report", "resolve_metrics",
    "METRICS", "PRESETS",
    "ptb_tokenize",
]
