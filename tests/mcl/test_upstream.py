"""A transformers internal that moves is a clear error, never a wrong answer (loramcl.mcl.compat, docs/architecture.md
"What we rely on in transformers and PEFT"). Each test simulates one move on the installed release."""

import functools

import pytest
import torch
import transformers
from conftest import randomize_adapters, wrapped_model
from torch import nn
from transformers import TrainingArguments

from loramcl import MCLTrainer
from loramcl.decoding import generate_hypotheses
from loramcl.mcl.compat import CACHE_ARGUMENTS, UpstreamChanged, cache_argument, given_cache
from loramcl.mcl.context import check_context_read, is_shared_context, share_context
from loramcl.training.trainer import PRIVATE_TRAINER_CALLS, PRIVATE_TRAINER_OVERRIDES


def _decoder():
    mcl, _, inputs, labels = wrapped_model("llama", adapt_context=False)
    randomize_adapters(mcl, std=0.3)
    return mcl, inputs, labels


def _forward_dropping(mcl, which):
    """Make the base model ignore the caches ``which(cache)`` selects, as a model would that took its cache under
    another name (it lands in **kwargs and is dropped); the signature stays the model's own."""
    forward = mcl.base_model.forward

    @functools.wraps(forward)
    def dropping(*args, **kwargs):
        for name in CACHE_ARGUMENTS:
            if kwargs.get(name) is not None and which(kwargs[name]):
                kwargs.pop(name)
        return forward(*args, **kwargs)

    mcl.base_model.forward = dropping


def test_the_cache_goes_under_the_name_the_installed_transformers_takes():
    mcl, _, _ = _decoder()
    expected = "cache" if "cache" in transformers.generation.utils.ALL_CACHE_NAMES else "past_key_values"
    assert cache_argument(mcl.base_model) == expected
    assert given_cache({"past_key_values": 1}) == 1 and given_cache({"cache": 2, "past_key_values": None}) == 2

    class NoCache(nn.Module):
        def forward(self, input_ids):
            return input_ids

    with pytest.raises(UpstreamChanged, match=r"transformers \d.*NoCache.forward takes no cache.*adapt_context=True"):
        cache_argument(NoCache())


def test_a_decoding_whose_shared_cache_is_ignored_fails_loudly():
    mcl, inputs, _ = _decoder()
    prompts = {"input_ids": inputs["input_ids"], "attention_mask": torch.ones_like(inputs["input_ids"])}
    assert generate_hypotheses(mcl, inputs=prompts, max_new_tokens=3)  # the installed release reads it
    _forward_dropping(mcl, is_shared_context)
    with pytest.raises(UpstreamChanged, match=r"did not read the shared context in layers 0, 1 .*adapt_context=True"):
        generate_hypotheses(mcl, inputs=prompts, max_new_tokens=3)


def test_a_decoding_handed_another_cache_fails_loudly():
    mcl, inputs, _ = _decoder()
    prompts = {"input_ids": inputs["input_ids"], "attention_mask": torch.ones_like(inputs["input_ids"])}

    def replace_cache(module, args, kwargs):  # generate starting a cache of its own instead of ours
        name = next(name for name in CACHE_ARGUMENTS if kwargs.get(name) is not None)
        if is_shared_context(kwargs[name]):
            return args, {**kwargs, name: transformers.DynamicCache(config=module.config)}
        return args, kwargs

    mcl.base_model.register_forward_pre_hook(replace_cache, with_kwargs=True)
    with pytest.raises(UpstreamChanged, match="did not hand LlamaForCausalLM the shared context's cache"):
        generate_hypotheses(mcl, inputs=prompts, max_new_tokens=3)


def test_training_on_a_context_the_model_did_not_keep_or_read_fails_loudly():
    mcl, inputs, labels = _decoder()
    labels = labels.clone()
    labels[:, :4] = -100
    _forward_dropping(mcl, lambda cache: True)  # the context's call does not fill its cache
    with pytest.raises(UpstreamChanged, match=r"the context's forward left 0 of its 3 positions.*adapt_context=True"):
        mcl(**inputs, labels=labels)
    # a shared cache that no layer updated (a model that kept its own copy of the cache, say): named layer by layer
    cache = transformers.DynamicCache(config=mcl.base_model.config)
    cache.update(torch.zeros(2, 2, 4, 8), torch.zeros(2, 2, 4, 8), 0)
    cache.update(torch.zeros(2, 2, 4, 8), torch.zeros(2, 2, 4, 8), 1)
    shared = share_context(cache, copies=3, length=4)
    shared.layers[0].update(torch.zeros(6, 2, 1, 8), torch.zeros(6, 2, 1, 8))
    with pytest.raises(UpstreamChanged, match=r"LlamaForCausalLM did not read the shared context in layer 1 of"):
        check_context_read(shared, mcl.base_model)


def test_a_masked_prefill_that_cannot_see_the_cache_fails_loudly():
    """The reference path (context_once=False) counts positions from the cache; under a name it does not know (the
    5.24 rename before this check existed), every step was taken for the prefill: wrong tokens, no error."""
    mcl, inputs, _ = _decoder()
    mcl.context_once = False
    prompts = {"input_ids": inputs["input_ids"], "attention_mask": torch.ones_like(inputs["input_ids"])}
    assert generate_hypotheses(mcl, inputs=prompts, max_new_tokens=3)

    def rename(module, args, kwargs):
        return args, {("kv_cache" if name in CACHE_ARGUMENTS else name): value for name, value in kwargs.items()}

    mcl.base_model.register_forward_pre_hook(rename, with_kwargs=True)
    with pytest.raises(UpstreamChanged, match=r"1 new token\(s\) of a 9-token prompt and no cache"):
        generate_hypotheses(mcl, inputs=prompts, max_new_tokens=3)


def test_diverse_beam_search_refuses_a_cache_it_cannot_find():
    from loramcl.decoding.diverse_beam import _reorder_cache

    mcl, _, _ = _decoder()
    with pytest.raises(UpstreamChanged, match="no cache under any of .*use_cache=False"):
        _reorder_cache(mcl.base_model, {"use_cache": True, "kv_cache": object()}, torch.arange(2))
    _reorder_cache(mcl.base_model, {"use_cache": False}, torch.arange(2))  # nothing to reorder


def test_the_private_trainer_overrides_are_listed_and_checked():
    import re
    from pathlib import Path

    from loramcl.training import trainer

    overridden = {name for name in MCLTrainer.__dict__ if name.startswith("_") and not name.startswith("__")
                  and hasattr(transformers.Trainer, name)}
    assert overridden == set(PRIVATE_TRAINER_OVERRIDES)  # docs/architecture.md lists the same
    source = Path(trainer.__file__).read_text()
    called = {name for name in re.findall(r"(?:self|super\(\))\.(_[a-z]\w*)\(", source)
              if name not in MCLTrainer.__dict__ and callable(getattr(transformers.Trainer, name, None))}
    assert called | overridden == set(PRIVATE_TRAINER_CALLS) | set(PRIVATE_TRAINER_OVERRIDES)
    # issue 37: the trainer stands on Trainer's public hooks; each private override left is one no hook replaces
    assert len(PRIVATE_TRAINER_OVERRIDES) <= 4 and not PRIVATE_TRAINER_CALLS and not called


@pytest.mark.parametrize("name", PRIVATE_TRAINER_OVERRIDES + PRIVATE_TRAINER_CALLS)
def test_a_trainer_without_a_private_method_we_rely_on_is_refused(tmp_path, monkeypatch, name):
    mcl, _, _ = _decoder()
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, save_strategy="no")
    monkeypatch.delattr(transformers.Trainer, name)
    with pytest.raises(UpstreamChanged, match=rf"Trainer has no {name}, which MCLTrainer overrides"):
        MCLTrainer(mcl, args=args)


def test_a_trainer_that_writes_checkpoints_elsewhere_is_refused_at_the_first_save(tmp_path, monkeypatch):
    """MCLTrainer stages a checkpoint by pointing its arguments' output_dir at a staging folder, where Trainer writes
    it (then it is published whole): a Trainer that no longer writes there is an UpstreamChanged, not a checkpoint
    published half-written or lost."""
    mcl, inputs, labels = _decoder()
    rows = [{"input_ids": inputs["input_ids"][i].tolist(), "attention_mask": inputs["attention_mask"][i].tolist(),
             "labels": labels[i].tolist()} for i in range(len(labels))]
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, max_steps=1, save_steps=1,
                             per_device_train_batch_size=2)
    monkeypatch.setattr(transformers.Trainer, "_get_output_dir", lambda self, trial=None: str(tmp_path))
    with pytest.raises(UpstreamChanged, match="did not write checkpoint-1 into the output_dir of its arguments"):
        MCLTrainer(mcl, args=args, train_dataset=rows).train()

