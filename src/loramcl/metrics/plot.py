"""Quality-diversity plot in the style of the paper's Fig. 3: one marker per system / decoding, x = diversity,
y = quality, the better corner marked."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from loramcl.metrics.io import read_report
from loramcl.metrics.suite import METRICS

MARKERS = "osD^vP*Xph<>"


def _axis_label(metric: str) -> str:
    if metric not in METRICS:
        return metric
    return f"{metric} ({'higher' if METRICS[metric].higher_is_better else 'lower'} is better)"


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
    point is annotated with its label (e.g. its budget), and the legend lists methods and decodings once each.
    """
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
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.8), dpi=150)
    if methods is None:
        method_of, colour_of = {n: i for i, n in enumerate(names)}, {n: i for i, n in enumerate(names)}
        method_keys, colour_keys = names, names
    else:
        method_of = {m: i for i, m in enumerate(dict.fromkeys(methods))}
        colour_of = {d: i for i, d in enumerate(dict.fromkeys(decodings))}
        method_keys, colour_keys = list(methods), list(decodings)
    for name, report, method, decoding in zip(names, reports, method_keys, colour_keys, strict=True):
        point = (report["metrics"][x], report["metrics"][y])
        ax.scatter(*point, s=90, marker=MARKERS[method_of[method] % len(MARKERS)],
                   color=plt.cm.tab10(colour_of[decoding] % 10), edgecolor="black", linewidth=0.6,
                   label=name if methods is None else None, zorder=3)
        ax.annotate(name, point, textcoords="offset points", xytext=(6, 5), fontsize=8)
    if methods is not None:  # one legend entry per method (marker) and per decoding (colour)
        for method, i in method_of.items():
            ax.scatter([], [], marker=MARKERS[i % len(MARKERS)], color="white", edgecolor="black", label=method)
        for decoding, i in colour_of.items():
            ax.scatter([], [], marker="s", color=plt.cm.tab10(i % 10), label=decoding)
    ax.set_xlabel(_axis_label(x))
    ax.set_ylabel(_axis_label(y))
    ax.grid(True, alpha=0.3, zorder=0)
    x_better_high = METRICS[x].higher_is_better if x in METRICS else True
    y_better_high = METRICS[y].higher_is_better if y in METRICS else True
    corner = f"{'top' if y_better_high else 'bottom'}-{'right' if x_better_high else 'left'}"
    ax.set_title(title or f"Quality vs diversity (better: {corner})", fontsize=10)
    ax.annotate(
        "better", xy=(0.97 if x_better_high else 0.03, 0.97 if y_better_high else 0.03), xycoords="axes fraction",
        xytext=(0.80 if x_better_high else 0.20, 0.80 if y_better_high else 0.20), textcoords="axes fraction",
        ha="center", va="center", fontsize=8, color="gray", arrowprops={"arrowstyle": "->", "color": "gray"},
    )
    ax.margins(0.15)
    ax.legend(fontsize=7, loc="best", framealpha=0.8)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out


def tradeoff_plot_from_files(paths: Sequence[str | Path], **kwargs) -> Path:
    return tradeoff_plot([read_report(p) for p in paths], **kwargs)
