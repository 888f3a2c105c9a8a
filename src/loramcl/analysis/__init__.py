"""Do the K hypotheses specialise? Offline language identification and embedding probes (paper App. H.5).

    language   LanguageIdentifier (character n-gram tf-idf + logistic regression; fit / predict / labels),
               evaluate_identifier (its accuracy and confusion on labelled text),
               language_shares (share of each language per hypothesis, from N items x K candidates),
               language_table (that as markdown),
               language_wins (per reference language, which hypothesis comes closest: paper Table 7)
    embedding  embed (unit sentence embeddings, default the packaged all-MiniLM-L6-v2),
               hypothesis_probe (linear SVM predicting the hypothesis from the embedding, split by item),
               item_split (that split), pca_plot (2-D PCA scatter coloured by hypothesis or label)
    outputs    output_verdict (do the hypotheses' answers differ, and does each own a mode: issue 64), OutputVerdict

Candidate k of an item comes from hypothesis k; for a beam-search baseline, k is the beam rank. The modules import
sklearn, sentence-transformers and matplotlib inside their functions.
"""

from loramcl.analysis.embedding import embed, hypothesis_probe, item_split, pca_plot
from loramcl.analysis.language import (
    EMPTY,
    LanguageIdentifier,
    evaluate_identifier,
    language_shares,
    language_table,
    language_wins,
)
from loramcl.analysis.outputs import OutputVerdict, output_verdict

__all__ = [
    "LanguageIdentifier", "evaluate_identifier", "language_shares", "language_table", "language_wins", "EMPTY",
    "embed", "hypothesis_probe", "item_split", "pca_plot", "OutputVerdict", "output_verdict",
]
