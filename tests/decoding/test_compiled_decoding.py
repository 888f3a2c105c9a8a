"""Decoding on a static KV cache with the step compiled (``compile=True``, issue 54): the same tokens and
log-probabilities as eager decoding (CPU, float32), for greedy, sampling and beam search; a clear error naming the
option where a static cache cannot serve. The equality tests compile with the "aot_eager" backend (the graphs
torch.compile makes, without inductor's C++ build); one test runs inductor itself."""

import pytest
import torch
from conftest import wrapped_model
from test_generation import left_padded_prompts, mcl_case
from tiny_models import build_model

from loramcl.decoding import compiled, generate_hypotheses
from loramcl.mcl.compat import UpstreamChanged
from loramcl.utils.validate import OptionError

NEW_TOKENS = 5


@pytest.fixture
def aot_eager(monkeypatch):
    """Compile with the aot_eager backend; dynamo's caches emptied before and after (a test's graphs are its own)."""
    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _decoded(candidates) -> list:
    return [[(c.token_ids, round(c.log_prob, 4), c.hypothesis) for c in row] for row in candidates]


def _eager_and_compiled(model, inputs, **options) -> tuple[list, list]:
    eager = generate_hypotheses(model, None, inputs, max_new_tokens=NEW_TOKENS, **options)
    compiled_ = generate_hypotheses(model, None, inputs, max_new_tokens=NEW_TOKENS, compile=True, **options)
    return _decoded(eager), _decoded(compiled_)


@pytest.mark.parametrize("options", [dict(strategy="greedy"), dict(strategy="sample", temperature=0.8, seed=3),
                                     dict(strategy="beam", num_beams=2)], ids=["greedy", "sample", "beam"])
def test_compiled_decoding_gives_eager_decodings_tokens(aot_eager, options):
    """K = 3 hypotheses on left-padded prompts; the steps ran compiled (dynamo's frame counter), as one graph (no
    graph break), on a static cache (``check_static_cache``, after every compiled generate)."""
    mcl, inputs = mcl_case("llama")
    torch._dynamo.utils.counters.clear()
    eager, compiled_ = _eager_and_compiled(mcl, inputs, **options)
    assert compiled_ == eager
    assert torch._dynamo.utils.counters["frames"]["ok"] > 0
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])


def test_a_single_model_baseline_compiles_too(aot_eager):
    """Beam search returning K sequences on a plain transformers model."""
    model = build_model("llama").eval()
    eager, compiled_ = _eager_and_compiled(model, left_padded_prompts(), strategy="beam", num_beams=3, num_sequences=3)
    assert compiled_ == eager


def test_inductor_compiles_the_decoding_step():
    """The default backend (inductor, its C++ build on the CPU), once, on the smallest case: greedy, K = 2."""
    torch._dynamo.reset()
    mcl, _, _, _ = wrapped_model("llama", num_hypotheses=2)
    prompts = left_padded_prompts(lengths=(3, 5))
    try:
        eager, compiled_ = _eager_and_compiled(mcl, prompts)
    finally:
        torch._dynamo.reset()
    assert compiled_ == eager


@pytest.mark.parametrize("options,match", [
    (dict(strategy="diverse_beam", num_beams=1, diversity_penalty=0.5), "runs its own steps"),
    (dict(strategy="greedy", compile="yes"), "must be true or false")])
def test_what_compile_cannot_serve_is_refused_naming_the_option(options, match):
    with pytest.raises(OptionError, match=match) as error:
        generate_hypotheses(build_model("llama"), None, left_padded_prompts(), **{"compile": True, **options})
    assert error.value.option == "compile"


def test_a_context_computed_once_is_refused_with_compile():
    """adapt_context=False decodes from its own dynamic cache of the context: generate_hypotheses refuses compile
    before decoding, and the model's own generate refuses a static cache rather than decode on another one."""
    mcl, _, _, _ = wrapped_model("llama", num_hypotheses=2, adapt_context=False)
    with pytest.raises(OptionError, match="adapt_context=False.*compile=False") as error:
        generate_hypotheses(mcl, None, left_padded_prompts(), compile=True)
    assert error.value.option == "compile"
    prompts = left_padded_prompts()
    with pytest.raises(ValueError, match="cache_implementation='static'"), torch.no_grad(), mcl.use_hypotheses(0):
        mcl.generate(**prompts, max_new_tokens=2, cache_implementation="static")


def test_what_generate_would_decode_eagerly_is_refused(monkeypatch):
    """A quantizer that does not compile, weights offloaded to the CPU, or a generate that decoded on another cache
    than the static one asked for: an error, never an eager decoding called compiled."""
    model = build_model("llama").eval()
    model.hf_quantizer = type("Quantizer", (), {"is_compileable": False})()
    with pytest.raises(ValueError, match="quantized with Quantizer.*compile=False"):
        compiled.check_compilable(model)
    del model.hf_quantizer
    model.hf_device_map = {"model.layers.0": 0, "model.layers.1": "cpu"}
    with pytest.raises(ValueError, match="offloaded.*compile=False"):
        compiled.check_compilable(model)
    del model.hf_device_map
    from transformers.cache_utils import DynamicCache

    output = type("Output", (), {"cache": DynamicCache()})()
    with pytest.raises(UpstreamChanged, match="DynamicCache, not the static KV cache"):
        compiled.check_static_cache(output, model)


def test_a_shared_adapter_decodes_compiled_as_eager(aot_eager):
    """MCLConfig.shared_r: the shared pair's un-gathered matmul inside the compiled step, in one graph."""
    mcl, _, _, _ = wrapped_model("llama", num_hypotheses=3, shared_r=2)
    with torch.no_grad():
        for _, layer in mcl.mcl_layers():
            layer.lora_B.normal_(std=0.5)
            layer.shared_B.normal_(std=0.5)
    torch._dynamo.utils.counters.clear()
    eager, compiled_ = _eager_and_compiled(mcl, left_padded_prompts(), strategy="greedy")
    assert compiled_ == eager
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
