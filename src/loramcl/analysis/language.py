"""Which language each candidate is in, and whether hypothesis k keeps to one language (paper App. H.5).

The identifier is a small character n-gram classifier trained on text whose language is known (e.g. the task's own
French and German references and English sources), so it runs offline and its accuracy can be measured on held-out
text (`evaluate_identifier`) before its verdicts are trusted.

Candidate k of an item is taken to come from hypothesis k (LoRA-MCL's layout); for a beam-search baseline the
position is the beam rank.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Protocol

EMPTY = "empty"  # the label of an empty or whitespace-only text: no language


class Identifier(Protocol):
    """What `language_shares` / `evaluate_identifier` need: `predict(texts) -> labels` and the known `labels`."""

    @property
    def labels(self) -> list[str]: ...

    def predict(self, texts: Sequence[str]) -> list[str]: ...


def _is_empty(text: str) -> bool:
    return not text.strip()


class LanguageIdentifier:
    """Character n-gram language identifier: tf-idf of 1- to 4-grams of characters inside word boundaries
    (lowercased, sublinear tf) followed by a multinomial logistic regression.

    Why this classifier: character n-grams carry the orthography that tells French from German from English even in
    a 3-word UI string (accents, umlauts, "ß", "sch", "tion", "qu'"), need no tokenizer, and are robust to unseen
    words. Logistic regression (lbfgs: no random state involved) is deterministic and discriminative: n-grams that
    all languages share get little weight instead of being counted as independent evidence as in naive Bayes. Check
    its accuracy on held-out text with `evaluate_identifier`: very short outputs (a few words) are the usual errors.
    """

    def __init__(self, C: float = 10.0, max_iter: int = 2000) -> None:
        self.C = C
        self.max_iter = max_iter
        self._pipeline = None
        self._labels: list[str] = []

    @property
    def labels(self) -> list[str]:
        """The sorted language labels seen in `fit` (empty before fitting)."""
        return list(self._labels)

    def fit(self, texts: Sequence[str], labels: Sequence[str]) -> LanguageIdentifier:
        """Train on `texts` [N] with their language `labels` [N] (e.g. "fr", "de", "en"); returns self.

        Needs at least 2 distinct labels, no empty text and no text labelled "empty" (that label is reserved for
        empty outputs at prediction time).
        """
        texts, labels = list(texts), [str(label) for label in labels]
        if len(texts) != len(labels):
            raise ValueError(f"{len(texts)} texts for {len(labels)} labels: give one language label per text")
        if not texts:
            raise ValueError("no training text: give at least one text for each of 2+ languages")
        empty = sum(_is_empty(t) for t in texts)
        if empty:
            raise ValueError(f"{empty} training texts are empty or whitespace-only: drop them (they have no language)")
        if EMPTY in labels:
            raise ValueError(f"the label {EMPTY!r} is reserved for empty outputs: rename that language")
        distinct = sorted(set(labels))
        if len(distinct) < 2:
            raise ValueError(f"only one language in the training labels ({distinct}): give texts of 2+ languages")
        from sklearn.feature_extraction.text import TfidfVectorizer
        from sklearn.linear_model import LogisticRegression
        from sklearn.pipeline import make_pipeline

        self._pipeline = make_pipeline(
            TfidfVectorizer(analyzer="char_wb", ngram_range=(1, 4), lowercase=True, sublinear_tf=True),
            LogisticRegression(C=self.C, max_iter=self.max_iter),
        )
        self._pipeline.fit(texts, labels)
        self._labels = distinct
        return self

    def predict(self, texts: Sequence[str]) -> list[str]:
        """One label per text [N]: a language from `labels`, or "empty" for an empty / whitespace-only text."""
        if self._pipeline is None:
            raise ValueError("this LanguageIdentifier is not trained: call fit(texts, labels) first")
        texts = list(texts)
        result = [EMPTY] * len(texts)
        rows = [i for i, t in enumerate(texts) if not _is_empty(t)]
        if rows:
            for i, label in zip(rows, self._pipeline.predict([texts[i] for i in rows]), strict=True):
                result[i] = str(label)
        return result


def evaluate_identifier(identifier: Identifier, texts: Sequence[str], labels: Sequence[str]) -> dict[str, object]:
    """Accuracy of `identifier` on `texts` [N] whose true languages are `labels` [N].

    Returns accuracy (over all N), per_language {true label: {accuracy, num}}, confusion {true: {predicted: count}}
    (predicted labels may include "empty"), num.
    """
    texts, labels = list(texts), [str(label) for label in labels]
    if len(texts) != len(labels):
        raise ValueError(f"{len(texts)} texts for {len(labels)} labels: give one true language per text")
    if not texts:
        raise ValueError("no text to evaluate on: give at least one (text, language) pair")
    predicted = list(identifier.predict(texts))
    if len(predicted) != len(texts):
        raise ValueError(f"the identifier returned {len(predicted)} labels for {len(texts)} texts")
    confusion: dict[str, dict[str, int]] = {}
    for true, pred in zip(labels, predicted, strict=True):
        row = confusion.setdefault(true, {})
        row[pred] = row.get(pred, 0) + 1
    confusion = {true: dict(sorted(row.items())) for true, row in sorted(confusion.items())}
    per_language = {
        true: {"accuracy": row.get(true, 0) / sum(row.values()), "num": sum(row.values())}
        for true, row in confusion.items()
    }
    correct = sum(true == pred for true, pred in zip(labels, predicted, strict=True))
    return {"accuracy": correct / len(texts), "per_language": per_language, "confusion": confusion,
            "num": len(texts)}


def language_shares(
    candidates: Sequence[Sequence[str]], identifier: Identifier, languages: Sequence[str] | None = None
) -> dict[str, object]:
    """Share of each language among the outputs of each hypothesis, from `candidates` [N items][K candidates].

    Returns
      labels          the columns: the identifier's labels, then any other predicted label, then "empty" if any
                      output is empty
      per_hypothesis  [K] {label: share of hypothesis k's N outputs}, over `labels` (zeros included), summing to 1
      majority        [K] the most frequent label of hypothesis k (ties: the first in `labels` order)
      majority_share  [K] its share
      both_languages  fraction of items whose K candidates contain every language of `languages`
      languages       those languages: by default all identifier labels except "en" (the source language)
      predictions     [N][K] the label of each candidate (e.g. for `pca_plot(colours_by=...)`)
      num_items       N
    """
    items = [list(item) for item in candidates]
    if not items:
        raise ValueError("no items: give candidates as N lists of K strings (candidate k from hypothesis k)")
    sizes = sorted({len(item) for item in items})
    if len(sizes) != 1:
        raise ValueError(f"items have different numbers of candidates ({sizes}): give every item the same K "
                         "(pad missing candidates with '', which counts as 'empty')")
    num_hypotheses = sizes[0]
    if num_hypotheses == 0:
        raise ValueError("items have no candidates: give K >= 1 candidates per item")
    if not all(isinstance(c, str) for item in items for c in item):
        raise ValueError("every candidate must be a string (give N lists of K strings, not token ids)")
    known = [str(label) for label in identifier.labels]
    if languages is None:
        languages = [label for label in known if label != "en"]
    languages = list(dict.fromkeys(str(label) for label in languages))
    if not languages:
        raise ValueError(f"no language to look for in both_languages (identifier labels: {known}): pass languages=")
    flat = list(identifier.predict([c for item in items for c in item]))
    if len(flat) != len(items) * num_hypotheses:
        raise ValueError(f"the identifier returned {len(flat)} labels for {len(items) * num_hypotheses} candidates")
    predictions = [[str(x) for x in flat[i * num_hypotheses:(i + 1) * num_hypotheses]] for i in range(len(items))]
    others = sorted({p for row in predictions for p in row} - set(known) - {EMPTY})
    columns = [*known, *others] + ([EMPTY] if any(EMPTY in row for row in predictions) else [])
    per_hypothesis, majority, majority_share = [], [], []
    for k in range(num_hypotheses):
        counts = Counter(row[k] for row in predictions)
        shares = {label: counts.get(label, 0) / len(items) for label in columns}
        top = max(columns, key=lambda label: shares[label])  # max keeps the first of equal shares
        per_hypothesis.append(shares)
        majority.append(top)
        majority_share.append(shares[top])
    covered = sum(set(languages) <= set(row) for row in predictions)
    return {
        "labels": columns, "per_hypothesis": per_hypothesis, "majority": majority, "majority_share": majority_share,
        "both_languages": covered / len(items), "languages": languages, "predictions": predictions,
        "num_items": len(items),
    }


def language_wins(candidates: list[list[str]], test: list[dict], languages: Sequence[str]) -> dict:
    """Per reference language, which hypothesis's candidate is closest (sentence chrF) to that language's
    references (``test[i][lang]``): the paper's Table 7 (which picks the winner with BLEU-4). Also the oracle chrF
    against each language's references alone: does the system offer a good French AND a good German translation?"""
    import numpy as np

    from loramcl.metrics import candidate_scores, chrf_sentence, oracle, win_rates

    scores, groups = [], []
    for lang in languages:
        scores.append(candidate_scores(chrf_sentence, candidates, [r[lang] for r in test])["chrf"])
        groups += [lang] * len(test)
    wins = win_rates(np.concatenate(scores), groups)
    wins["oracle_chrf"] = {lang: oracle(s) for lang, s in zip(languages, scores, strict=True)}
    return wins


def language_table(shares: dict, title: str = "") -> str:
    """Markdown table of a `language_shares` result: one row per hypothesis, one column per label (share in %),
    then the majority label; a last line gives the share of items covering all of `languages`."""
    per_hypothesis = shares["per_hypothesis"]
    columns = list(shares.get("labels") or dict.fromkeys(label for row in per_hypothesis for label in row))
    header = "| hypothesis | " + " | ".join(columns) + " | majority |"
    rule = "|---|" + "---:|" * len(columns) + "---|"
    body = [
        f"| h{k} | " + " | ".join(f"{100 * row.get(label, 0.0):.1f}" for label in columns)
        + f" | {shares['majority'][k]} ({100 * shares['majority_share'][k]:.1f}) |"
        for k, row in enumerate(per_hypothesis)
    ]
    languages = shares.get("languages", [])
    coverage = (f"Items whose candidates cover all of {', '.join(languages)}: "
                f"{100 * shares['both_languages']:.1f}% of {shares['num_items']}")
    lines = [title, ""] if title else []
    return "\n".join([*lines, header, rule, *body, "", coverage])
