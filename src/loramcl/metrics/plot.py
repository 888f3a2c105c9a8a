"""Quality-diversity plot in the style of the paper's Fig. 3-4: one marker per system / decoding, x = diversity,
y = quality.

Made to be read without the table: the axes carry the metrics' names and the direction that is better, every point
has its label where the label covers no other label and no marker (``place_labels``), and points at the same place
are drawn inside each other and named together.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from loramcl.metrics.io import read_report
from loramcl.metrics.suite import METRICS

MARKERS = "osD^vP*Xph<>"
MARKER_SIZE = 90  # points² (matplotlib's scatter size)
FONT_SIZE = 8
GAP = 2.0  # points between a marker and its label, and around every label
RINGS = 7  # distances tried around a point; past the first, a thin line joins the label to its point
RING_STEP = 7.0  # points
# Unit offsets around a point, in the order they are tried: right, above, below, left, then the corners.
DIRECTIONS = ((1, 0), (0, 1), (0, -1), (-1, 0), (1, 1), (1, -1), (-1, 1), (-1, -1))


def axis_label(metric: str) -> str:
    """The metric's name and its better direction, e.g. "Pairwise-BLEU (lower = more diverse) ←"; the key itself
    for a metric the suite does not know. The arrow points to the better end: on the y axis the label is turned a
    quarter turn, so its → points up."""
    if metric not in METRICS:
        return metric
    info = METRICS[metric]
    better = "more diverse" if info.diversity else "better"
    return f"{info.name} ({'higher' if info.higher_is_better else 'lower'} = {better}) " + \
        ("→" if info.higher_is_better else "←")


def tradeoff_plot(
    reports: Sequence[dict],
    x: str = "mbleu4",
    y: str = "spider",
    out: str | Path = "tradeoff.png",
    labels: Sequence[str] | None = None,
    title: str | None = None,
    methods: Sequence[str] | None = None,
    decodings: Sequence[str] | None = None,
) -> Path:
    """Scatter of `y` (quality) against `x` (diversity), one labelled marker per report; returns the PNG path.

    With ``methods`` and ``decodings`` (one name per report, as the paper's Fig. 3-4 legends), the marker shows the
    method (e.g. LoRA-MCL, LoRA-MLE r=16), the colour the decoding (beam search, diverse beam search, ...), each
    point is annotated with its label (e.g. its budget), and the legend, beside the axes, lists methods and
    decodings once each.
    """
    figure = draw_tradeoff(reports, x, y, labels, title, methods, decodings)
    import matplotlib.pyplot as plt

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out)
    plt.close(figure)
    return out


def draw_tradeoff(reports: Sequence[dict], x: str, y: str, labels: Sequence[str] | None = None,
                  title: str | None = None, methods: Sequence[str] | None = None,
                  decodings: Sequence[str] | None = None):
    """The matplotlib Figure of ``tradeoff_plot``, laid out and labelled (what is drawn is what is saved)."""
    for what, names in (("labels", labels), ("methods", methods), ("decodings", decodings)):
        if names is not None and len(names) != len(reports):
            raise ValueError(f"{len(names)} {what} for {len(reports)} runs: give one per run")
    if (methods is None) != (decodings is None):
        raise ValueError("give both methods and decodings (marker per method, colour per decoding), or neither")
    names = list(labels) if labels is not None else [r.get("name", f"run {i}") for i, r in enumerate(reports)]
    for name, report in zip(names, reports, strict=True):
        missing = [m for m in (x, y) if m not in report["metrics"]]
        if missing:
            raise ValueError(
                f"run {name!r} has no {missing} (it has {sorted(report['metrics'])}): evaluate it with these metrics, "
                "or pick others with --x / --y"
            )
        bad = [f"{m} = {report['metrics'][m]}" for m in (x, y) if not np.isfinite(report["metrics"][m])]
        if bad:
            raise ValueError(f"run {name!r} has {', '.join(bad)}: no point to draw; look at its evaluation report")
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    points = np.array([(r["metrics"][x], r["metrics"][y]) for r in reports], dtype=float)  # [N, 2]
    if methods is None:  # each run its own marker and colour; the labels name them
        method_keys, colour_keys = names, names
    else:
        method_keys, colour_keys = list(methods), list(decodings)
    method_of = {m: i for i, m in enumerate(dict.fromkeys(method_keys))}
    colour_of = {d: i for i, d in enumerate(dict.fromkeys(colour_keys))}

    figure, ax = plt.subplots(figsize=(6.4 if methods is None else 8.8, 4.8), dpi=150)
    # Limits, texts and legend first: the layout must be final before points are compared and labels placed in
    # display space.
    ax.set_xlim(*_limits(points[:, 0]))
    ax.set_ylim(*_limits(points[:, 1]))
    ax.set_xlabel(axis_label(x))
    ax.set_ylabel(axis_label(y))
    ax.grid(True, alpha=0.3, zorder=0)
    x_better_high = METRICS[x].higher_is_better if x in METRICS else True
    y_better_high = METRICS[y].higher_is_better if y in METRICS else True
    corner = f"{'top' if y_better_high else 'bottom'}-{'right' if x_better_high else 'left'}"
    ax.set_title(title or f"Quality vs diversity (better: {corner})", fontsize=10)
    if methods is not None:  # one legend entry per method (marker) and per decoding (colour)
        for method, i in method_of.items():
            ax.scatter([], [], marker=MARKERS[i % len(MARKERS)], color="white", edgecolor="black", label=method)
        for decoding, i in colour_of.items():
            ax.scatter([], [], marker="s", color=plt.cm.tab10(i % 10), label=decoding)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, framealpha=0.8)
    figure.tight_layout()

    pixels = ax.transData.transform(points)  # [N, 2]
    marker_px = np.sqrt(MARKER_SIZE) * figure.dpi / 72
    groups = coinciding(pixels, marker_px / 2)
    anchors, texts = [], []
    for group in groups:
        # a group's markers inside each other, the first the largest: every colour and shape shows
        sizes = np.linspace(2.0, 0.6, len(group)) * MARKER_SIZE if len(group) > 1 else [MARKER_SIZE]
        for i, size in zip(group, sizes, strict=True):
            ax.scatter(*points[i], s=size, marker=MARKERS[method_of[method_keys[i]] % len(MARKERS)],
                       color=plt.cm.tab10(colour_of[colour_keys[i]] % 10), edgecolor="black", linewidth=0.6,
                       zorder=3)
        anchors.append(points[group[0]])
        texts.append(group_label(group, names, points, methods, decodings))
    place_labels(ax, np.array(anchors), texts)
    return figure


def _limits(values: np.ndarray) -> tuple[float, float]:
    low, high = float(values.min()), float(values.max())
    pad = 0.12 * (high - low) if high > low else max(abs(low) * 0.1, 1.0)
    return low - pad, high + pad


def coinciding(pixels: np.ndarray, distance: float) -> list[list[int]]:
    """Groups of points closer than ``distance`` pixels to another of the group (their markers would hide each
    other), each in input order; groups ordered by their first point."""
    group_of = list(range(len(pixels)))

    def root(i: int) -> int:
        while group_of[i] != i:
            i = group_of[i]
        return i

    for i in range(len(pixels)):
        for j in range(i):
            if np.hypot(*(pixels[i] - pixels[j])) < distance:
                group_of[max(root(i), root(j))] = min(root(i), root(j))
    groups: dict[int, list[int]] = {}
    for i in range(len(pixels)):
        groups.setdefault(root(i), []).append(i)
    return list(groups.values())


def group_label(group: list[int], names: list[str], points: np.ndarray, methods, decodings) -> str:
    """A point's label; for points at the same place, all of them: "B=2: sampling top_p=0.95" and "= sampling
    typical_p=0.95" on the next line ("≈" when the values differ a little), naming what tells them apart."""
    if len(group) == 1:
        return names[group[0]]
    same = "=" if all((points[i] == points[group[0]]).all() for i in group) else "≈"
    parts = [[] for _ in group]
    for what in (decodings, methods):
        if what is not None and len({what[i] for i in group}) > 1:
            for part, i in zip(parts, group, strict=True):
                part.append(what[i])
    if len({names[i] for i in group}) == 1:
        if not any(parts):
            return f"{names[group[0]]} ×{len(group)}"
        return f"{names[group[0]]}: " + f"\n{same} ".join(", ".join(part) for part in parts)
    return f"\n{same} ".join(" ".join([names[i], *part]) for i, part in zip(group, parts, strict=True))


def marker_boxes(ax) -> list[tuple[float, float, float, float]]:
    """The box (x0, y0, x1, y1, pixels) of every marker drawn on ``ax`` by ``scatter``: the marker's path scaled
    to its size, its edge included, around its position (matplotlib gives no window extent for these)."""
    scale = ax.figure.dpi / 72  # pixels per point
    boxes = []
    for collection in ax.collections:
        offsets = collection.get_offsets()
        if not len(offsets):  # a legend's stand-in
            continue
        shape = collection.get_paths()[0].get_extents()  # the marker's path, unit size
        edge = collection.get_linewidths()[0] / 2
        for (x, y), size in zip(ax.transData.transform(offsets), np.broadcast_to(collection.get_sizes(),
                                                                                len(offsets)), strict=True):
            side = np.sqrt(size)
            boxes.append(((x + (shape.x0 * side - edge) * scale), (y + (shape.y0 * side - edge) * scale),
                          (x + (shape.x1 * side + edge) * scale), (y + (shape.y1 * side + edge) * scale)))
    return boxes


def place_labels(ax, anchors: np.ndarray, texts: list[str]) -> list:
    """Annotate each anchor (data coordinates) with its text where the text's box, measured by the renderer,
    overlaps no marker (``marker_boxes``), no label placed before it and nothing outside the axes.

    Deterministic: positions are tried in a fixed order (right, above, below, left, the corners; then the same
    further away, with a thin line to the point that crosses no other marker or label), points with the most
    neighbours first. Where no position is free the one overlapping least is taken.
    """
    figure = ax.figure
    renderer = figure.canvas.get_renderer()
    scale = figure.dpi / 72  # pixels per point
    pixels = ax.transData.transform(anchors)  # [G, 2]
    markers = marker_boxes(ax)
    frame = ax.get_window_extent(renderer)
    inside = (frame.x0 + GAP * scale, frame.y0 + GAP * scale, frame.x1 - GAP * scale, frame.y1 - GAP * scale)
    crowding = [int((np.hypot(*(pixels - p).T) < 60 * scale).sum()) for p in pixels]
    placed: list[tuple] = []
    annotations = [None] * len(anchors)
    for g in sorted(range(len(anchors)), key=lambda g: (-crowding[g], g)):
        own = [b for b in markers if b[0] <= pixels[g][0] <= b[2] and b[1] <= pixels[g][1] <= b[3]]
        others = [b for b in markers if b not in own]
        reach = max(max(pixels[g][0] - b[0], b[2] - pixels[g][0], pixels[g][1] - b[1], b[3] - pixels[g][1])
                    for b in own) / scale  # points from the point to its markers' edge
        probe = ax.text(0, 0, texts[g], fontsize=FONT_SIZE)
        size = probe.get_window_extent(renderer)
        width, height = size.width, size.height
        probe.remove()
        best = None
        for ring in range(RINGS):
            distance = reach + GAP + ring * RING_STEP  # points from the point to the text's nearest edge
            for dx, dy in DIRECTIONS:
                left = pixels[g][0] + dx * distance * scale - (width if dx < 0 else width / 2 if dx == 0 else 0)
                bottom = pixels[g][1] + dy * distance * scale - (height if dy < 0 else height / 2 if dy == 0 else 0)
                box = (left, bottom, left + width, bottom + height)
                cost = _outside(box, inside) + sum(_overlap(_grown(box, GAP * scale), b) for b in markers + placed)
                if ring:
                    cost += sum(_crosses(pixels[g], box, b) for b in others + placed)
                if best is None or cost < best[0]:
                    best = (cost, box, (dx, dy), distance, ring)
                if cost == 0:
                    break
            if best[0] == 0:
                break
        _, box, (dx, dy), distance, ring = best
        placed.append(box)
        annotations[g] = ax.annotate(
            texts[g], anchors[g], xytext=(dx * distance, dy * distance), textcoords="offset points",
            ha={1: "left", 0: "center", -1: "right"}[dx], va={1: "bottom", 0: "center", -1: "top"}[dy],
            fontsize=FONT_SIZE, multialignment="left", zorder=4,
            arrowprops={"arrowstyle": "-", "color": "gray", "lw": 0.6, "shrinkA": 0, "shrinkB": reach}
            if ring else None)
    return annotations


def _grown(box, by: float):
    return (box[0] - by, box[1] - by, box[2] + by, box[3] + by)


def _overlap(a, b) -> float:
    """Area shared by two boxes (x0, y0, x1, y1)."""
    return max(0.0, min(a[2], b[2]) - max(a[0], b[0])) * max(0.0, min(a[3], b[3]) - max(a[1], b[1]))


def _outside(box, frame) -> float:
    """Area of ``box`` outside ``frame``."""
    return (box[2] - box[0]) * (box[3] - box[1]) - _overlap(box, frame)


def _crosses(point, label, box) -> float:
    """1 when the segment from ``point`` to the centre of ``label`` passes through ``box`` (Liang-Barsky clipping:
    the segment's parameter interval inside each slab of the box must meet)."""
    end = np.array([(label[0] + label[2]) / 2, (label[1] + label[3]) / 2])
    start, step = np.asarray(point, dtype=float), end - np.asarray(point, dtype=float)
    low, high = 0.0, 1.0
    for axis in (0, 1):
        lo, hi = box[axis], box[axis + 2]
        if step[axis] == 0:
            if not lo <= start[axis] <= hi:
                return 0.0
            continue
        a, b = (lo - start[axis]) / step[axis], (hi - start[axis]) / step[axis]
        low, high = max(low, min(a, b)), min(high, max(a, b))
    return float(low <= high)


def tradeoff_plot_from_files(paths: Sequence[str | Path], **kwargs) -> Path:
    return tradeoff_plot([read_report(p) for p in paths], **kwargs)
