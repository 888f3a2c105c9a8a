"""Host synchronisations on the forward and decoding paths (issue 41, item 8): every read of a tensor's value on the
host (``.item()``, ``.tolist()``, ``.cpu()``, ``bool(tensor)``, ``nonzero``, ``torch.allclose`` ...) makes a GPU wait
for the host. They are counted by patching those methods; only the calls made from loramcl's own code count (those
of transformers are the same with or without loramcl). docs/benchmarks.md lists the numbers."""

import collections
import contextlib
import os
import sys
from pathlib import Path

import pytest
import torch
from conftest import wrapped_model

from loramcl.decoding import generate_hypotheses

SYNCING_METHODS = ("item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "__int__", "__float__", "__index__")
SYNCING_FUNCTIONS = ("allclose", "equal", "nonzero")
OURS = f"{os.sep}loramcl{os.sep}"


@contextlib.contextmanager
def host_syncs(monkeypatch):
    """Yields a Counter of the host reads made from loramcl's code, by 'name file:line'."""
    counts = collections.Counter()

    def counting(original, name):
        def read(*args, **kwargs):
            caller = sys._getframe(1)
            if OURS in caller.f_code.co_filename:
                counts[f"{name} {Path(caller.f_code.co_filename).name}:{caller.f_lineno}"] += 1
            return original(*args, **kwargs)
        return read

    with monkeypatch.context() as patch:
        for name in SYNCING_METHODS:
            patch.setattr(torch.Tensor, name, counting(getattr(torch.Tensor, name), name))
        for name in SYNCING_FUNCTIONS:
            patch.setattr(torch, name, counting(getattr(torch, name), name))
        yield counts


@pytest.mark.parametrize("chunk_size", [None, 4])
def test_the_mcl_forward_reads_the_host_once(monkeypatch, chunk_size):
    """The token-id check, the labels check and the number of label positions, read together (``checked_target_index``;
    given its result, none: tests/mcl/test_compile.py). With logits in chunks, whether the output layer alone
    reproduces the model's logits is checked at the first forward only."""
    mcl, _, inputs, labels = wrapped_model("llama", num_hypotheses=3, logits_chunk_size=chunk_size)
    with host_syncs(monkeypatch) as first:
        mcl(**inputs, labels=labels)
    with host_syncs(monkeypatch) as second:
        mcl(**inputs, labels=labels)
    checked = sum(key.startswith("allclose") for key in first)
    assert checked == (chunk_size is not None) and sum(first.values()) == 1 + checked, first
    assert sum(second.values()) == 1, second


@pytest.mark.parametrize("strategy,num_beams", [("greedy", 1), ("sample", 1), ("beam", 2)])
def test_decoding_steps_read_nothing_on_the_host(monkeypatch, strategy, num_beams):
    """A decoding step adds no host read of ours: generate_hypotheses reads the host as often for 8 new tokens as
    for 3 (its reads are per call: the inputs' checks, the candidates' tokens and log-probabilities)."""
    mcl, _, _, _ = wrapped_model("llama", num_hypotheses=3)
    prompts = torch.randint(3, 80, (2, 5), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": prompts, "attention_mask": torch.ones_like(prompts)}
    reads = []
    for new_tokens in (3, 8):
        with host_syncs(monkeypatch) as counts:
            generate_hypotheses(mcl, None, inputs, strategy=strategy, num_beams=num_beams, max_new_tokens=new_tokens,
                                min_new_tokens=new_tokens, eos_token_id=7, pad_token_id=0)
        reads.append(sum(counts.values()))
    assert reads[0] == reads[1], reads
    assert reads[0] <= 7, reads  # 6 greedy and sampling, 7 beam search (docs/benchmarks.md)
