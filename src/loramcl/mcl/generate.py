"""``MCLModel.generate``: decoding the hypotheses chosen by ``use_hypotheses``, and with ``adapt_context=False`` the
prompt run once without adapters (one copy of identical copies), generate going on from that shared cache; or,
with ``MCLModel.context_once = False``, the adapters masked on the prompt at every step (the reference).

Free functions of the model, through its public surface: ``base_model``, ``mcl_config``, ``routing``,
``hypotheses_chosen``, ``adapters_disabled``, ``disable_adapters``, ``run_base``, ``label_logits``,
``context_once``, ``adapter_dtype``.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn
from transformers.cache_utils import DynamicCache

from loramcl.mcl.compat import cache_argument, check_token_ids, given_cache, upstream_error
from loramcl.mcl.context import check_context_read, check_split_inputs, share_context
from loramcl.mcl.copies import batch_size_of, equal_copies, first_copy, repeat_examples
from loramcl.mcl.logits import output_layer_of
from loramcl.mcl.scope import ForwardCall


def generate(model, *args, **kwargs):
    """``base_model.generate`` with the hypotheses chosen by an enclosing ``use_hypotheses`` block."""
    model.check_usable()
    check_token_ids(model.base_model, kwargs.get("input_ids", args[0] if args else None))
    if not model.hypotheses_chosen:
        raise RuntimeError("choose the hypotheses to decode: `with model.use_hypotheses(k): model.generate(...)`")
    with contiguous_head_input(model.base_model):
        if model.mcl_config.adapt_context or model.adapters_disabled:
            return model.base_model.generate(*args, **kwargs)
        return _generate_without_context(model, *args, **kwargs)


@contextlib.contextmanager
def contiguous_head_input(base: nn.Module):
    """The output layer reads a contiguous input while generate runs (``generate``; the benchmarks' bare base too).
    Its prefill hands it the last position's states, a strided slice [rows, 1, d] of [rows, T, d]; on a weight that
    does not require grad (a frozen base) torch's matmul does not fold that slice into one matrix product but runs a
    batched one over the weight expanded rows times: 390 ms against 45 ms for SmolLM2's [40, 1, 576] x [576, 49152]
    on one CPU thread (torch 2.13). The copy costs [rows, d] once per generate; the logits are the same products."""
    head = output_layer_of(base)
    if not isinstance(head, nn.Module):
        yield
        return

    def contiguous(module: nn.Module, args: tuple):
        if args and torch.is_tensor(args[0]) and not args[0].is_contiguous():
            return (args[0].contiguous(), *args[1:])
        return None

    hook = head.register_forward_pre_hook(contiguous)
    try:
        yield
    finally:
        hook.remove()


def _generate_without_context(model, input_ids: torch.Tensor | None = None, **kwargs):
    """adapt_context=False decoding: the adapters act from the prompt's last position (whose output predicts the
    first new token) on. The prompt minus its last token is run once, on one copy of the batch when it holds
    identical copies (decoding K hypotheses at once), without adapters; generate goes on from that shared cache
    for every copy and beam. ``context_once=False``: the full prefill with the adapters masked on the context."""
    if getattr(model.base_model.config, "is_encoder_decoder", False):
        return _generate_encoder_once(model, input_ids, **kwargs)
    check_split_inputs({"input_ids": input_ids, **{n: v for n, v in kwargs.items() if torch.is_tensor(v)}},
                       type(model.base_model).__name__)
    if kwargs.get("cache_implementation") not in (None, "dynamic"):
        raise ValueError(f"adapt_context=False decodes from its own dynamic cache of the prompt, shared by the copies: "
                         f"leave cache_implementation={kwargs['cache_implementation']!r} out (in generate_hypotheses: "
                         "compile=False)")
    if given_cache(kwargs) is not None or kwargs.get("use_cache") is False:
        raise ValueError("adapt_context=False decodes from its own cache of the prompt: leave the cache "
                         "(cache / past_key_values) and use_cache out")
    rows, length = input_ids.shape
    mask = kwargs.get("attention_mask")
    mask = torch.ones_like(input_ids) if mask is None else mask  # [R, T], prompts left-padded
    if not model.context_once:
        hook = model.base_model.register_forward_pre_hook(
            functools.partial(_mask_prompt, model, length, generating=True), with_kwargs=True)
        try:
            return model.base_model.generate(input_ids=input_ids, **kwargs)
        finally:
            hook.remove()
            model.routing.positions = None
    if length == 1:  # the prompt is its last token: no context
        return model.base_model.generate(input_ids=input_ids, **kwargs)
    copies = model.routing.copies or 1
    if copies > 1 and not (rows % copies == 0 and equal_copies(input_ids, copies) and equal_copies(mask, copies)):
        copies = 1
    batch = rows // copies
    positions = kwargs.get("position_ids")
    if positions is None:  # as generate numbers left-padded prompts
        positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
    cache, name = DynamicCache(config=model.base_model.config), cache_argument(model.base_model)
    context = {"input_ids": input_ids[:batch, :-1], "attention_mask": mask[:batch, :-1],
               "position_ids": positions[:batch, :-1], name: cache, "use_cache": True}
    nothing = torch.zeros_like(context["input_ids"], dtype=torch.bool)  # no logits on the context
    has_output_layer = model.label_logits.output_layer_name is not None
    # the scores read the last prompt position, in the prefill below, not in this call
    with torch.no_grad(), model.disable_adapters(), model.label_logits.not_capturing():
        model.run_base(context, ForwardCall(logit_positions=nothing if has_output_layer else None))
    cache = share_context(cache, copies, length=length - 1, keep=True)

    def check_first_step(module: nn.Module, args: tuple, kwargs: dict, output) -> None:
        check.remove()
        _check_first_step(cache, length - 1, module, args, kwargs)

    check = model.base_model.register_forward_hook(check_first_step, with_kwargs=True)
    try:
        return model.base_model.generate(input_ids=input_ids, **{name: cache}, **kwargs)
    finally:
        check.remove()


def _mask_prompt(model, prompt_length: int, module: nn.Module, args: tuple, kwargs: dict,
                 generating: bool = False) -> None:
    """Before each forward of a generate (``generating``) or of a teacher-forced sequence: the adapters masked on
    the positions before the prompt's last."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    past = given_cache(kwargs)
    start = past.get_seq_length() if past is not None else 0
    if generating and start == 0 and ids.shape[1] < prompt_length:
        # a step after the prefill whose cache we cannot see: positions would be counted from 0
        raise upstream_error(f"generate gave {type(module).__name__} {ids.shape[1]} new token(s) of a "
                             f"{prompt_length}-token prompt and no cache under any of cache / past_key_values",
                             "decode with MCLModel.context_once = True (the default)")
    adapted = torch.arange(start, start + ids.shape[1], device=ids.device) >= prompt_length - 1  # [n]
    model.routing.positions = None if bool(adapted.all()) else (
        adapted.expand(ids.shape[0], -1).unsqueeze(-1).to(model.adapter_dtype()))  # [rows, n, 1]


def _generate_encoder_once(model, input_ids: torch.Tensor | None = None, **kwargs):
    """An encoder-decoder: the encoder runs once without adapters (on one copy of identical copies), the decoder
    with them."""
    if kwargs.get("encoder_outputs") is not None:
        raise ValueError("adapt_context=False runs the encoder itself: leave encoder_outputs out")
    encoder_inputs = {n: v for n, v in kwargs.items() if torch.is_tensor(v) and not n.startswith("decoder_")}
    if input_ids is not None:
        encoder_inputs["input_ids"] = input_ids
    copies = model.routing.copies or 1
    rows = batch_size_of(encoder_inputs)
    if copies > 1 and not all(v.shape[0] == rows and rows % copies == 0 and equal_copies(v, copies)
                              for v in encoder_inputs.values()):
        copies = 1
    with torch.no_grad(), model.disable_adapters():
        encoded = model.base_model.get_encoder()(**first_copy(encoder_inputs, copies), return_dict=True)
    encoded = repeat_examples(encoded, copies, rows // copies)
    rest = {n: v for n, v in kwargs.items() if n not in encoder_inputs or n == "attention_mask"}
    return model.base_model.generate(encoder_outputs=encoded, **rest)


def _check_first_step(cache, context_length: int, module: nn.Module, args: tuple, kwargs: dict) -> None:
    """After the first forward of a generate that decodes from a shared context: the model was handed that cache
    (under the name it takes, generate starting no cache of its own), read it in every layer, and it grew by the
    step's tokens."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    fallback = "use MCLConfig(adapt_context=True), or MCLModel.context_once = False"
    if given_cache(kwargs) is not cache:
        raise upstream_error(f"generate did not hand {type(module).__name__} the shared context's cache at its first "
                             "step (another cache or none)", fallback)
    check_context_read(cache, module)
    if ids is not None and cache.get_seq_length() != context_length + ids.shape[1]:
        raise upstream_error(f"after generate's first step the cache holds {cache.get_seq_length()} positions, not the "
                             f"context's {context_length} and the step's {ids.shape[1]}", fallback)

