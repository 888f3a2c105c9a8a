"""Decoding on a static KV cache with the decoding step compiled (``Decoding(compile=True)``, issue 54).

transformers' ``generate`` allocates the static cache (``cache_implementation="static"``: the longest sequence's
positions for K*B*beams rows at once, so every step has the same shapes); the steps after the prefill run the model's
forward through ``torch.compile`` (CUDA graphs with ``mode="reduce-overhead"`` on a GPU: a step is one graph replay).
The MCL hypotheses are one batched generate already (``MCLLoraLinear``'s decoding forward inside the compiled step).

The step is compiled here (``compiled_steps``), not by generate's own ``compile_config``: transformers 5.24 compiles
the steps of greedy decoding and sampling only (``GenerationMixin._valid_auto_compile_criteria``), beam search runs
them eagerly, and off CUDA it compiles only when a private flag of ``CompileConfig`` says so. So generate's own
compilation is turned off (``disable_compile``) and one mechanism serves every strategy and device.

Where a static cache cannot serve (the context computed once, diverse beam search's own loop, the stochastic
router's sampled experts), ``decoding.options.plan`` refuses ``compile`` naming the option; where torch.compile or
the static cache would not apply (a quantizer that does not compile, offloaded weights, a model without ``Cache``
support) the call is refused before decoding, and the cache generate used is checked after it: never an eager or
dynamic-cache decoding that says it was compiled.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
from torch import nn

from loramcl.mcl.compat import upstream_error

# torch.compile's backend for the decoding step. Tests set "aot_eager" (the same graphs, no C++ compiler).
BACKEND = "inductor"


def generate_options() -> dict:
    """generate's arguments for a compiled decoding: the static cache, and generate's own compilation off (the steps
    are compiled by ``compiled_steps``)."""
    return {"cache_implementation": "static", "disable_compile": True}


@contextlib.contextmanager
def compiled_steps(model: nn.Module) -> Iterator[None]:
    """While a ``generate`` of ``model`` (the transformers model whose forward it calls) runs: its first call (the
    prefill, whose length varies) runs eagerly, every later one (a step: one token per row on the static cache)
    through ``torch.compile`` of its forward, made once per model and mode and kept on it (dynamo's guards then
    reuse the graphs from one generate to the next; a new batch size or cache length compiles again). The MCL
    forward compiles whole in every decoding routing (tests/mcl/test_compile.py) and so does the tiny Llama's step
    (tests/decoding/test_compiled_decoding.py); ``fullgraph`` stays off so that a model class whose own forward
    breaks the graph still decodes, compiled in parts, instead of failing."""
    mode = "reduce-overhead" if next(model.parameters()).device.type == "cuda" else "default"
    had_own = "forward" in model.__dict__  # e.g. accelerate's hooks set the instance's forward
    own, eager = model.__dict__.get("forward"), model.forward
    key = (BACKEND, mode, getattr(eager, "__func__", eager))
    kept = model.__dict__.get("_loramcl_compiled_forward")
    if kept is None or kept[0] != key:
        kept = model.__dict__["_loramcl_compiled_forward"] = (key, torch.compile(eager, backend=BACKEND, mode=mode,
                                                                                fullgraph=False))
    calls = 0

    @functools.wraps(eager)  # generate reads the forward's signature (which inputs it takes)
    def forward(*args, **kwargs):
        nonlocal calls
        calls += 1
        return (eager if calls == 1 else kept[1])(*args, **kwargs)

    model.forward = forward
    try:
        yield
    finally:
        if had_own:
            model.forward = own
        else:
            del model.forward  # the class's forward again


def check_compilable(model: nn.Module) -> None:
    """Refuse what transformers' generate would decode eagerly, or without a static cache, despite ``compile``."""
    name = type(model).__name__
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and not getattr(quantizer, "is_compileable", False):
        raise ValueError(f"compile: {name} is quantized with {type(quantizer).__name__}, which torch.compile does not "
                         "compile in transformers' generate: decode with compile=False")
    devices = set(getattr(model, "hf_device_map", {}).values())
    if "disk" in devices or ("cpu" in devices and len(devices) > 1):
        raise ValueError(f"compile: {name} has weights offloaded to the CPU or disk (device_map), which "
                         "transformers' generate does not compile: decode with compile=False")
    if not getattr(type(model), "_supports_default_dynamic_cache", lambda: True)():
        raise ValueError(f"compile: {name} keeps a cache of its own kind, not the static KV cache compiled decoding "
                         "runs on: decode with compile=False")


def check_static_cache(output, model: nn.Module) -> None:
    """After a compiled decoding: generate decoded on the static cache it was asked for."""
    from transformers.cache_utils import EncoderDecoderCache, StaticCache

    cache = getattr(output, "cache", None)
    if cache is None:
        cache = getattr(output, "past_key_values", None)
    cache = cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache
    if not isinstance(cache, StaticCache):
        raise upstream_error(f"generate decoded {type(model).__name__} on a {type(cache).__name__}, not the static KV "
                             "cache that compile=True asks for", "decode with compile=False")
