"""Does hypothesis k write in its own region of sentence-embedding space? (paper App. H.5)

`embed` maps candidates to unit sentence embeddings; `hypothesis_probe` trains a linear SVM to tell which hypothesis
wrote a candidate, on items it never saw (accuracy well above chance = the hypotheses specialise); `pca_plot` draws
the candidates in the plane of their first two principal components, coloured by hypothesis or by e.g. language.

Embeddings of an experiment are laid out [N items, K candidates, d], candidate k coming from hypothesis k (for a
beam-search baseline: the beam rank).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np


def embed(texts: Sequence[str], model: str | None = None, batch_size: int = 64) -> np.ndarray:
    """Sentence embeddings [N, d] float32, each row L2-normalised (cosine = dot product).

    `model`: a local sentence-transformers folder; default the packaged all-MiniLM-L6-v2 (d = 384). The encoder is
    loaded once per folder and process. Flatten [N][K] candidates before calling and reshape to [N, K, d] after.
    """
    texts = list(texts)
    if not texts:
        raise ValueError("no text to embed: give at least one string")
    if not all(isinstance(t, str) for t in texts):
        raise ValueError("texts must be strings (flatten N lists of K candidates into one list of N*K strings)")
    from loramcl.metrics.quality import load_sentence_encoder  # the cached loader of the sBERT metric

    vectors = load_sentence_encoder(str(model) if model is not None else None).encode(
        texts, batch_size=batch_size, convert_to_numpy=True, normalize_embeddings=True, show_progress_bar=False)
    return np.asarray(vectors, dtype=np.float32)


def _check_embeddings(embeddings: np.ndarray, mask: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    embeddings = np.asarray(embeddings, dtype=float)
    if embeddings.ndim != 3:
        raise ValueError(f"embeddings must be [items, candidates, dim], got shape {embeddings.shape}: reshape the "
                         "N*K rows of embed(...) with .reshape(N, K, -1)")
    if mask is None:
        mask = np.ones(embeddings.shape[:2], dtype=bool)
    mask = np.asarray(mask)
    if mask.shape != embeddings.shape[:2]:
        raise ValueError(f"mask has shape {mask.shape}, embeddings {embeddings.shape}: give one bool per candidate "
                         f"[{embeddings.shape[0]}, {embeddings.shape[1]}]")
    if not np.isfinite(embeddings[mask.astype(bool)]).all():
        raise ValueError("embeddings contain NaN or inf: mask those candidates out or recompute them")
    return embeddings, mask.astype(bool)


def item_split(num_items: int, test_size: float = 0.3, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Split item indices 0..num_items-1 into (train_items, test_items), sorted, disjoint, test ~ test_size of them
    (at least 1 item on each side). All candidates of an item go to the side of their item."""
    if num_items < 2:
        raise ValueError(f"{num_items} items cannot be split into train and test: give at least 2 items")
    if not 0 < test_size < 1:
        raise ValueError(f"test_size must be a fraction in (0, 1), got {test_size}")
    num_test = min(max(int(round(test_size * num_items)), 1), num_items - 1)
    order = np.random.default_rng(seed).permutation(num_items)
    return np.sort(order[num_test:]), np.sort(order[:num_test])


def hypothesis_probe(
    embeddings: np.ndarray,
    mask: np.ndarray | None = None,
    test_size: float = 0.3,
    seed: int = 0,
    C: float = 1.0,
) -> dict[str, object]:
    """How well a linear SVM tells which hypothesis wrote a candidate from its embedding.

    `embeddings` [N, K, d]: the label of [i, k] is k. `mask` [N, K] bool (optional): False drops that candidate
    (e.g. empty outputs). The items are split (`item_split`, test_size of them to test), all K candidates of an item
    on the same side, so the probe is scored on items it never saw and cannot win by recognising an item's content.
    Classifier: features standardised on the training rows, then sklearn `LinearSVC` (one-vs-rest, squared hinge,
    `C`); standardising puts every embedding dimension on the same scale, which the SVM's single margin needs, and
    makes the solver converge fast.

    Returns accuracy (test), train_accuracy, chance (the larger of 1/K and the most frequent label's share of the
    test rows), num_train, num_test (candidates), num_hypotheses (K).
    """
    embeddings, mask = _check_embeddings(embeddings, mask)
    num_items, num_hypotheses, dim = embeddings.shape
    if num_hypotheses < 2:
        raise ValueError(f"K = {num_hypotheses} hypothesis: the probe needs K >= 2 candidates per item")
    train_items, test_items = item_split(num_items, test_size, seed)
    labels = np.broadcast_to(np.arange(num_hypotheses), (num_items, num_hypotheses))

    def rows(items: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        keep = mask[items]
        return embeddings[items][keep], labels[items][keep]

    x_train, y_train = rows(train_items)
    x_test, y_test = rows(test_items)
    if len(np.unique(y_train)) < 2:
        raise ValueError(f"the training items hold candidates of {len(np.unique(y_train))} hypothesis after masking: "
                         "give more items or mask fewer candidates")
    if len(y_test) == 0:
        raise ValueError("no test candidate left after masking: give more items, a larger test_size or a lighter mask")
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler
    from sklearn.svm import LinearSVC

    probe = make_pipeline(StandardScaler(), LinearSVC(C=C, max_iter=20000, random_state=seed))
    probe.fit(x_train, y_train)
    majority = np.bincount(y_test, minlength=num_hypotheses).max() / len(y_test)
    return {
        "accuracy": float((probe.predict(x_test) == y_test).mean()),
        "train_accuracy": float((probe.predict(x_train) == y_train).mean()),
        "chance": float(max(1 / num_hypotheses, majority)),
        "num_train": int(len(y_train)),
        "num_test": int(len(y_test)),
        "num_hypotheses": num_hypotheses,
    }


def pca_plot(
    embeddings: np.ndarray,
    out: str | Path,
    title: str = "",
    colours_by: np.ndarray | None = None,
    label_names: Sequence[str] | None = None,
    mask: np.ndarray | None = None,
) -> dict[str, object]:
    """Scatter of all candidates of `embeddings` [N, K, d] on their first two principal components; writes a PNG.

    Colour: the hypothesis k by default (`label_names`, K of them, name the hypotheses; default h0..h{K-1}), or the
    value in `colours_by` [N, K] (e.g. the `predictions` of `language_shares`); then `label_names`, if given, lists
    the values in legend order, which keeps colours the same across plots. `mask` [N, K] bool drops candidates.
    Returns path (the PNG) and explained_variance [pc1, pc2] (fractions of the total variance).
    """
    embeddings, mask = _check_embeddings(embeddings, mask)
    num_items, num_hypotheses, dim = embeddings.shape
    if colours_by is None:
        names = list(label_names) if label_names is not None else [f"h{k}" for k in range(num_hypotheses)]
        if len(names) != num_hypotheses:
            raise ValueError(f"{len(names)} label_names for K = {num_hypotheses} hypotheses: give one name each")
        groups = np.broadcast_to(np.arange(num_hypotheses), (num_items, num_hypotheses))[mask]
    else:
        values = np.asarray(colours_by, dtype=object)
        if values.shape != (num_items, num_hypotheses):
            raise ValueError(f"colours_by has shape {values.shape}: give one value per candidate "
                             f"[{num_items}, {num_hypotheses}]")
        values = np.array([str(v) for v in values[mask]], dtype=object)
        names = [str(n) for n in label_names] if label_names is not None else sorted(set(values))
        unknown = sorted(set(values) - set(names))
        if unknown:
            raise ValueError(f"colours_by has values {unknown} missing from label_names {names}: add them")
        index = {name: j for j, name in enumerate(names)}
        groups = np.array([index[v] for v in values], dtype=int)
    points = embeddings[mask]
    if len(points) < 2 or dim < 2:
        raise ValueError(f"PCA to 2 components needs at least 2 candidates of dimension >= 2, got {points.shape}")
    from sklearn.decomposition import PCA

    pca = PCA(n_components=2, svd_solver="full")
    plane = pca.fit_transform(points)
    explained = [float(v) for v in pca.explained_variance_ratio_]

    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 4), dpi=120)
    for j, name in enumerate(names):
        chosen = groups == j
        if chosen.any():
            ax.scatter(plane[chosen, 0], plane[chosen, 1], s=10, alpha=0.6, color=plt.cm.tab10(j % 10),
                       label=f"{name} ({int(chosen.sum())})", linewidth=0)
    ax.set_xlabel(f"PC1 ({100 * explained[0]:.1f}% of variance)")
    ax.set_ylabel(f"PC2 ({100 * explained[1]:.1f}% of variance)")
    if title:
        ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="best", framealpha=0.8, markerscale=1.5)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return {"path": str(out), "explained_variance": explained}
