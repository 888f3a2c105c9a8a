"""`loramcl plot-tradeoff` (metrics.plot): readable without the table. Metric names and better directions on the
axes; no label over another label or a marker, measured on the drawn figure; points at the same place named together.
"""

import json

import matplotlib
import numpy as np
import pytest

from loramcl.metrics.plot import MARKER_SIZE, draw_tradeoff, marker_boxes

matplotlib.use("Agg")

# The figures of docs/experiments/spoken_translation.md and docs/experiments/translation.md (their tables), where the
# labels used to collide:
# "B=2B=4" side by side, two "B=2" on each other, "B=3" over "B=6", top-p hidden under typical-p.
SPOKEN = [  # (mBLEU-4, oracle chrF, budget, method, decoding)
    (0.033, 61.60, 2, "MCL", "beam search"), (0.033, 61.51, 2, "MCL", "greedy"),
    (0.333, 67.86, 2, "MLE", "beam search"),
    (0.008, 64.83, 2, "MLE", "diverse beam"), (0.049, 52.28, 2, "MLE", "TTA"), (0.335, 65.58, 4, "MCL", "beam search"),
    (0.329, 69.32, 4, "MLE", "beam search"), (0.350, 67.86, 4, "MLE", "diverse beam"), (0.063, 54.21, 4, "MLE", "TTA"),
    (0.046, 46.45, 2, "MCL", "top_k=50"), (0.046, 43.22, 2, "MCL", "top_p=0.95"),
    (0.046, 43.22, 2, "MCL", "typical_p=0.95"), (0.058, 52.35, 2, "MLE", "top_k=50"),
    (0.050, 49.20, 2, "MLE", "top_p=0.95"), (0.050, 49.18, 2, "MLE", "typical_p=0.95"),
]
TRANSLATION = [  # (Pairwise-BLEU, Loo-BLEU, budget, method, decoding)
    (62.24, 17.03, 3, "MLE r=8", "beam"), (26.31, 15.25, 3, "MLE r=8", "DBS"), (62.78, 18.10, 6, "MLE r=8", "beam"),
    (42.34, 12.62, 6, "MLE r=8", "DBS"), (67.37, 16.77, 3, "MLE r=24", "beam"), (26.45, 13.38, 3, "MLE r=24", "DBS"),
    (61.87, 16.48, 6, "MLE r=24", "beam"), (40.93, 10.89, 6, "MLE r=24", "DBS"), (4.07, 4.15, 3, "MCL", "greedy"),
    (11.94, 10.62, 3, "MCL", "DBS"), (24.24, 14.36, 6, "MCL", "beam"), (15.34, 11.51, 6, "MCL", "DBS"),
]
# Several points at one x (a column of labels to fit), two of them identical, one far away.
COLUMN = [(0.5, y, 3, "MCL" if i % 2 else "MLE", "beam" if i < 4 else "DBS")
          for i, y in enumerate([0.30, 0.31, 0.32, 0.32, 0.33, 0.34, 0.35])] + [(0.9, 0.1, 3, "MLE", "beam")]


def figure_of(rows, x, y):
    reports = [{"metrics": {x: row[0], y: row[1]}} for row in rows]
    return draw_tradeoff(reports, x, y, labels=[f"B={row[2]}" for row in rows], methods=[row[3] for row in rows],
                         decodings=[row[4] for row in rows])


def drawn_boxes(figure):
    """(label boxes, marker boxes, axes box) of the drawn figure, in pixels."""
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    ax = figure.axes[0]
    labels = [tuple(text.get_window_extent(renderer).extents) for text in ax.texts]
    return labels, marker_boxes(ax), ax.get_window_extent(renderer).extents


def overlaps(a, b) -> bool:
    return min(a[2], b[2]) > max(a[0], b[0]) and min(a[3], b[3]) > max(a[1], b[1])


def test_axes_carry_the_metric_names_and_the_better_direction():
    import matplotlib.pyplot as plt

    figure = figure_of(TRANSLATION, "pairwise_bleu", "loo_bleu")
    ax = figure.axes[0]
    # the y label is turned a quarter turn: its → points up, to the better end
    assert ax.get_xlabel() == "Pairwise-BLEU (lower = more diverse) ←"
    assert ax.get_ylabel() == "Loo-BLEU (higher = better) →"
    plt.close(figure)
    figure = figure_of(SPOKEN, "mbleu4", "chrf")
    assert (figure.axes[0].get_xlabel(), figure.axes[0].get_ylabel()) == (
        "mBLEU-4 (lower = more diverse) ←", "oracle chrF (higher = better) →")
    plt.close(figure)
    figure = draw_tradeoff([{"metrics": {"div2": 0.5, "my_count": 2.9}}], "div2", "my_count")
    assert (figure.axes[0].get_xlabel(), figure.axes[0].get_ylabel()) == ("Div-2 (higher = more diverse) →",
                                                                          "my_count")  # unknown: the key
    plt.close(figure)


def test_the_marker_boxes_are_the_drawn_markers():
    import matplotlib.pyplot as plt

    figure = draw_tradeoff([{"metrics": {"mbleu4": 0.3, "chrf": 50.0}}], "mbleu4", "chrf")
    (box,) = marker_boxes(figure.axes[0])
    side = (np.sqrt(MARKER_SIZE) + 0.6) * figure.dpi / 72  # a circle's diameter and its edge, pixels
    centre = figure.axes[0].transData.transform((0.3, 50.0))
    assert box == pytest.approx((*(centre - side / 2), *(centre + side / 2)))
    plt.close(figure)


@pytest.mark.parametrize("rows, x, y, places", [
    (SPOKEN, "mbleu4", "chrf", 12),  # 15 points: 3 pairs at one place (equal, or 0.09 chrF apart)
    (TRANSLATION, "pairwise_bleu", "loo_bleu", 12),
    (COLUMN, "mbleu4", "loo_bleu", 7),  # one pair equal
], ids=["spoken", "translation", "column"])
def test_no_label_overlaps_another_label_a_marker_or_the_frame(rows, x, y, places):
    import matplotlib.pyplot as plt

    figure = figure_of(rows, x, y)
    labels, markers, frame = drawn_boxes(figure)
    assert len(labels) == places and len(markers) == len(rows)
    for i, label in enumerate(labels):
        assert not [j for j in range(i) if overlaps(label, labels[j])], (i, figure.axes[0].texts[i].get_text())
        assert not [m for m in markers if overlaps(label, m)], figure.axes[0].texts[i].get_text()
        assert frame[0] <= label[0] and label[2] <= frame[2] and frame[1] <= label[1] and label[3] <= frame[3]
    plt.close(figure)
    again = figure_of(rows, x, y)  # the placement is deterministic
    assert drawn_boxes(again)[0] == labels
    plt.close(again)


def test_points_at_the_same_place_are_drawn_inside_each_other_and_named_together():
    import matplotlib.pyplot as plt

    figure = figure_of(SPOKEN, "mbleu4", "chrf")
    texts = [text.get_text() for text in figure.axes[0].texts]
    assert "B=2: top_p=0.95\n= typical_p=0.95" in texts  # equal values
    assert "B=2: top_p=0.95\n≈ typical_p=0.95" in texts  # 49.20 and 49.18: one place in the figure
    assert "B=2: beam search\n≈ greedy" in texts
    # both markers drawn, the first one larger, at the same position
    at = [(c.get_offsets()[0].tolist(), float(c.get_sizes()[0])) for c in figure.axes[0].collections
          if len(c.get_offsets()) and tuple(c.get_offsets()[0]) == (0.046, 43.22)]
    assert len(at) == 2 and at[0][1] > MARKER_SIZE > at[1][1]
    plt.close(figure)
    # without methods and decodings: the runs' names
    same = [{"name": name, "metrics": {"mbleu4": 0.2, "chrf": 40.0}} for name in ("run_a", "run_b")]
    figure = draw_tradeoff([*same, {"name": "run_c", "metrics": {"mbleu4": 0.4, "chrf": 30.0}}], "mbleu4", "chrf")
    assert sorted(text.get_text() for text in figure.axes[0].texts) == ["run_a\n= run_b", "run_c"]
    plt.close(figure)


def test_plot_tradeoff_takes_methods_and_decodings(tmp_path, capsys):
    from loramcl.cli import main

    paths = []
    for i, row in enumerate(SPOKEN[:4]):
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(json.dumps({"name": f"s{i}", "metrics": {"mbleu4": row[0], "chrf": row[1]}}))
    out = tmp_path / "fig.png"
    main(["plot-tradeoff", "--runs", str(tmp_path / "*.json"), "--x", "mbleu4", "--y", "chrf", "--out", str(out),
          "--labels", "B=2,B=2,B=2,B=2", "--methods", "MCL,MCL,MLE,MLE",
          "--decodings", '["beam search", "greedy (penalty, on logits)", "beam search", "diverse beam"]'])
    assert out.read_bytes()[:4] == b"\x89PNG" and f"plot (4 runs, x=mbleu4, y=chrf): {out}" in capsys.readouterr().out
