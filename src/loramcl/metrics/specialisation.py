"""Which hypothesis wins each item, overall and per group (e.g. the caption's language; paper §5 and App. H).

Candidate k of an item is taken to come from hypothesis k (LoRA-MCL's layout). For a single model the position is
the candidate's place in its output (beam search: the beam's rank, best first), and the table says so.

An item is *won* by a candidate that scores better than every other; where two or more share the best score it is a
*tie*, and where no candidate scores above 0 (a metric whose floor is 0, e.g. exact match or BLEU) *no candidate
scored*: neither says anything about specialisation, so the table shows them apart from the wins.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from loramcl.metrics.oracle import winners


def win_rates(
    scores: np.ndarray, groups: Sequence[str] | None = None, higher_is_better: bool = True,
    kept: np.ndarray | None = None,
) -> dict[str, object]:
    """Win rate of each hypothesis from a per-candidate score matrix [N, K].

    The winner of an item is its best candidate (ties -> lowest k). Returns win_rate [K] (fractions summing to 1,
    ties to the lowest k, as the training loss counts them), tie_rate (share of items where 2+ hypotheses share the
    best score), and apart from each other: won [K] (share of items whose best candidate is hypothesis k alone and
    scored), tied (2+ share a best score that is above 0) and none_scored (higher-is-better metrics: no candidate
    above 0), summing to 1; num_items, and by_group {label: {win_rate, won, tied, none_scored, num_items}} when
    `groups` (one label per item) is given. ``kept`` ([N, K] bool): the candidates that compete (duplicates out).
    """
    scores = np.asarray(scores, dtype=float)
    if scores.ndim != 2:
        raise ValueError(f"scores must be [items, candidates], got shape {scores.shape}")
    num_items, num_hypotheses = scores.shape
    best = winners(scores, higher_is_better, kept)  # [N]
    best_value = scores[np.arange(num_items), best]
    competing = np.ones_like(scores, dtype=bool) if kept is None else np.asarray(kept, dtype=bool)
    sharing = (np.isclose(scores, best_value[:, None], rtol=0, atol=1e-12) & competing).sum(axis=1)  # [N]
    none_scored = (best_value <= 0) if higher_is_better else np.zeros(num_items, bool)  # [N]
    tied = (sharing > 1) & ~none_scored
    won = ~tied & ~none_scored

    def rates(mask: np.ndarray) -> dict[str, object]:
        count = max(int(mask.sum()), 1)
        return {"win_rate": (np.bincount(best[mask], minlength=num_hypotheses) / count).tolist(),
                "won": (np.bincount(best[mask & won], minlength=num_hypotheses) / count).tolist(),
                "tied": float((mask & tied).sum() / count), "none_scored": float((mask & none_scored).sum() / count),
                "num_items": int(mask.sum())}

    result = {**rates(np.ones(num_items, bool)), "tie_rate": float((sharing > 1).mean())}
    if groups is not None:
        if len(groups) != num_items:
            raise ValueError(f"{len(groups)} group labels for {num_items} items: give one label per item")
        labels = np.asarray([str(g) for g in groups])
        result["by_group"] = {g: rates(labels == g) for g in sorted(set(labels))}
    return result


def likelihood_wins(nll: Sequence[np.ndarray], groups: Sequence[Sequence[str]] | None = None) -> dict[str, object]:
    """Win rate of each hypothesis as the paper defines the winner (Table 7): each test reference is won by the
    hypothesis under which it is most likely (lowest NLL). ``nll``: per item, [R_i, K] NLL of its references (as
    ``metrics.io.load_nll`` reads them); ``groups``: per item, one label per reference (e.g. its language). Every
    reference counts once: ``win_rates`` over the references."""
    labels = None if groups is None else [label for item in groups for label in item]
    return win_rates(np.concatenate([np.asarray(n, dtype=float) for n in nll]), labels, higher_is_better=False)


def win_rate_table(result: dict, metric: str = "", positions: str = "hypothesis") -> str:
    """Markdown table: one row per group (and 'all'), one column per hypothesis with the share of items it won
    outright (%), then the tied items and those where no candidate scored. ``positions``: "hypothesis" (h0, h1, ...:
    an MCL model's candidates) or "beam position" (#0, #1, ...: a single model's candidates in its output order)."""
    num_hypotheses = len(result["win_rate"])
    names = [f"h{k}" if positions == "hypothesis" else f"#{k}" for k in range(num_hypotheses)]
    header = "| group | items | " + " | ".join(names) + " | tied | no candidate scored |"
    rule = "|---|---:|" + "---:|" * (num_hypotheses + 2)
    rows = [("all", result)] + list(result.get("by_group", {}).items())
    body = ["| " + f"{g} | {r['num_items']} | " + " | ".join(f"{100 * w:.1f}" for w in r["won"])
            + f" | {100 * r['tied']:.1f} | {100 * r['none_scored']:.1f} |" for g, r in rows]
    what = "hypothesis" if positions == "hypothesis" else "beam position (a single model's candidates, best first)"
    title = (f"Winning {what} per item (best {metric}; % of items won by one candidate alone, tied between 2+, or "
             "with no candidate above 0)")
    return "\n".join([title, "", header, rule, *body])
