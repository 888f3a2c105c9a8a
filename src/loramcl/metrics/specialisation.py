"""Which hypothesis wins each item, overall and per group (e.g. the caption's language; paper §5 and App. H).

Candidate k of an item is taken to come from hypothesis k (LoRA-MCL's layout). For a beam-search baseline the
position is the beam rank, and the table reads as a win rate per rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from loramcl.metrics.oracle import winners


def win_rates(
    scores: np.ndarray, groups: Sequence[str] | None = None, higher_is_better: bool = True
) -> dict[str, object]:
    """Win rate of each hypothesis from a per-candidate score matrix [N, K].

    The winner of an item is its best candidate (ties -> lowest k). Returns win_rate [K] (fractions summing to 1),
    tie_rate (share of items where 2+ hypotheses share the best score: their wins go to the lowest k), num_items,
    and by_group {label: {win_rate, num_items}} when `groups` (one label per item) is given.
    """
    scores = np.asarray(scores, dtype=float)
    if scores.ndim != 2:
        raise ValueError(f"scores must be [items, candidates], got shape {scores.shape}")
    num_items, num_hypotheses = scores.shape
    best = winners(scores, higher_is_better)  # [N]
    best_value = scores[np.arange(num_items), best]
    ties = (np.isclose(scores, best_value[:, None], rtol=0, atol=1e-12).sum(axis=1) > 1).mean()

    def rates(mask: np.ndarray) -> list[float]:
        return (np.bincount(best[mask], minlength=num_hypotheses) / max(int(mask.sum()), 1)).tolist()

    result = {"win_rate": rates(np.ones(num_items, bool)), "tie_rate": float(ties), "num_items": num_items}
    if groups is not None:
        if len(groups) != num_items:
            raise ValueError(f"{len(groups)} group labels for {num_items} items: give one label per item")
        labels = np.asarray([str(g) for g in groups])
        result["by_group"] = {
            g: {"win_rate": rates(labels == g), "num_items": int((labels == g).sum())} for g in sorted(set(labels))
        }
    return result


def likelihood_wins(nll: Sequence[np.ndarray], groups: Sequence[Sequence[str]] | None = None) -> dict[str, object]:
    """Win rate of each hypothesis as the paper defines the winner (Table 7): each test reference is won by the
    hypothesis under which it is most likely (lowest NLL). ``nll``: per item, [R_i, K] NLL of its references (as
    ``metrics.io.load_nll`` reads them); ``groups``: per item, one label per reference (e.g. its language). Every
    reference counts once: ``win_rates`` over the references."""
    labels = None if groups is None else [label for item in groups for label in item]
    return win_rates(np.concatenate([np.asarray(n, dtype=float) for n in nll]), labels, higher_is_better=False)


def win_rate_table(result: dict, metric: str = "") -> str:
    """Markdown table: one row per group (and 'all'), one column per hypothesis, winning share in %."""
    num_hypotheses = len(result["win_rate"])
    header = "| group | items | " + " | ".join(f"h{k}" for k in range(num_hypotheses)) + " |"
    rule = "|---|---:|" + "---:|" * num_hypotheses
    rows = [("all", result["num_items"], result["win_rate"])]
    rows += [(g, r["num_items"], r["win_rate"]) for g, r in result.get("by_group", {}).items()]
    body = ["| " + f"{g} | {n} | " + " | ".join(f"{100 * w:.1f}" for w in rate) + " |" for g, n, rate in rows]
    ties = f"ties: {100 * result['tie_rate']:.1f}% of items, to the lowest k"
    title = f"Winning hypothesis per item (best {metric}; {ties})"
    return "\n".join([title, "", header, rule, *body])
