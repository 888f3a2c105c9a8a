"""Decoding: K candidates per input from an MCL model, and the single-model baselines, with one API.

    from loramcl.decoding import generate_hypotheses, equal_budget
    outs = generate_hypotheses(model, tokenizer, ["a prompt", ...], strategy="beam", num_beams=2,
                               max_new_tokens=64, repetition_penalty=1.1)
    outs[i][k].text, outs[i][k].log_prob   # candidate k of input i

- ``strategies``: ``generate_hypotheses`` (all K hypotheses of an ``MCLModel`` in one batched ``generate``, or a
  single model's beam search / diverse beam search / sampling / test-time augmentation): its checks and inputs.
- ``candidates``: each strategy's ``generate`` call and its output as ``Candidate``s (text, token ids, log-prob).
- ``options``: ``Decoding``, the options of a decoding (strategy, beams, candidates, logits settings).
- ``budget``: ``equal_budget``, beam sizes at an equal forward budget (paper §4.1).
- ``diverse_beam``: diverse (group) beam search, gone from transformers' core since 4.57.
- ``augment``: SpecAugment time/frequency masking of audio features, for test-time augmentation.
- ``predictions``: a predictions file from a prompts file (``generate``, `loramcl generate`), one line of it.

The names load on first use, so that ``loramcl --help`` does not import torch.
"""

from loramcl.utils.lazy import lazy_exports

_EXPORTS = {
    "generate_hypotheses": "loramcl.decoding.strategies", "equal_budget": "loramcl.decoding.budget",
    "EqualBudget": "loramcl.decoding.budget", "Candidate": "loramcl.decoding.candidates",
    "tokenize_prompts": "loramcl.decoding.strategies", "Decoding": "loramcl.decoding.options",
    "generate_diverse_beam": "loramcl.decoding.diverse_beam",
    "spec_augment": "loramcl.decoding.augment",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
