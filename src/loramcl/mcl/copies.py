"""The K copies of a batch: how every model input is copied, cut and checked, where the copies are made, and the
hooks that make them (docs/architecture.md, "Decisions as implemented": "Where the K copies are made").

In an MCL forward the hypotheses share one call of the base model: at the entry of the expansion module (the smallest
transformers model holding every adapter) each per-example input [B, ...] becomes K copies [K*B, ...], hypothesis-
major, and the adapted layers route copy k through hypothesis k. Frozen modules beside the path to it (a vision or
audio tower) run once on B rows.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import Cache
from transformers.utils import ModelOutput

from loramcl.mcl.context import is_shared_context
from loramcl.mcl.layers import INDEXED, HypothesisRouting
from loramcl.mcl.scope import CallScope, ForwardCall

# Keyword inputs that never carry a batch dimension even when one of their sizes happens to equal B.
NOT_PER_EXAMPLE = frozenset({"cache_position"})


def batch_dim(name: str | None, value: torch.Tensor) -> int:
    """The dimension of a per-example model input that runs over the examples.

    transformers' inputs are batch-first, except multimodal rotary positions (M-RoPE, Qwen2-VL and its
    successors): ``position_ids`` of shape [3 or 4, B, T]. This is the rule transformers itself applies when it
    copies inputs for beam search (``GenerationMixin._expand_inputs_for_generation``).
    """
    return 1 if name is not None and name.endswith("position_ids") and value.dim() == 3 else 0


def _map_input(value, leaf, name: str | None = None):
    """``leaf(item, name)`` for every item of a model input, through dicts, lists, tuples (namedtuples too) and
    ``ModelOutput``s, each item named by its key (a list's items by the list's name)."""
    if isinstance(value, ModelOutput):
        return type(value)(**{key: _map_input(item, leaf, key) for key, item in value.items()})
    if isinstance(value, dict):
        return type(value)((key, _map_input(item, leaf, key)) for key, item in value.items())
    if isinstance(value, list | tuple):
        items = [_map_input(item, leaf, name) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return leaf(value, name)


def _examples_dim(value: torch.Tensor, name: str | None, batch: int) -> int | None:
    """The dimension of a tensor input that runs over the ``batch`` examples (``batch_dim``); None where the tensor is
    not per example: 0-dimensional, named in ``NOT_PER_EXAMPLE``, or a broadcast (size 1 there while B > 1)."""
    if value.dim() == 0 or name in NOT_PER_EXAMPLE:
        return None
    dim = batch_dim(name, value)
    return None if value.shape[dim] == 1 and batch != 1 else dim


def repeat_examples(value, copies: int, batch: int, name: str | None = None):
    """``copies`` copies of a model input, copy-major: copy c of a batch-first tensor [B, ...] is rows
    c*B ... (c+1)*B - 1 of the result [copies*B, ...]. The one K-copy rule (docs/architecture.md, "Where the K copies
    are made"), for any input:

    - dicts, lists, tuples and ``ModelOutput``s: every element (e.g. Gemma3's dict of attention masks);
    - a tensor: repeated along its batch dimension (``batch_dim``), except when it has size 1 there while
      B > 1 (broadcast over the batch, e.g. positions [1, T]) or is named in ``NOT_PER_EXAMPLE``. A tensor
      whose first size is not B holds per-example items flattened over the batch in example order (Qwen2-VL's
      image patches [N, d] with ``image_grid_thw`` [n_images, 3]; all images or crops of a LLaVA batch):
      repeating it copy-major keeps copy c's items in the order of copy c's placeholder tokens;
    - anything else (None, numbers, strings, an empty cache) as it is. A cache holding past keys and values is
      refused: its layout is the model's own.
    """
    if copies == 1:
        return value

    def repeat(item, key: str | None):
        if torch.is_tensor(item):
            dim = _examples_dim(item, key, batch)
            if dim is None:
                return item
            if dim != 0 and item.shape[dim] != batch:
                raise ValueError(f"input {key!r} of shape {tuple(item.shape)} should have the batch ({batch}) on "
                                 f"dimension {dim}: its K copies cannot be made")
            return item.repeat(*(copies if d == dim else 1 for d in range(item.dim())))
        if is_shared_context(item):  # the context computed once (loramcl.mcl.context): its cache makes its own copies
            return item
        if isinstance(item, Cache) and item.get_seq_length() > 0:
            raise ValueError(f"input {key!r} is a cache of past keys and values: its K copies cannot be made; run "
                             "the hypotheses on the full inputs instead")
        return item

    return _map_input(value, repeat, name)


def select_examples(value, block: slice, batch: int, name: str | None = None):
    """Examples ``block`` of a model input of ``batch`` examples (two-pass WTA's scoring pass in blocks), by the
    rules of ``repeat_examples``: a tensor is sliced along its batch dimension, kept where it is not per example;
    anything else stays as it is. Raises ``ExamplesNotSeparable`` where the examples' rows cannot be told apart: a
    tensor whose batch dimension is not ``batch`` (items flattened over the batch, e.g. Qwen2-VL's image patches)
    or a cache.
    """
    def select(item, key: str | None):
        if torch.is_tensor(item):
            dim = _examples_dim(item, key, batch)
            if dim is None:
                return item
            if item.shape[dim] != batch:
                raise ExamplesNotSeparable(f"input {key!r} of shape {tuple(item.shape)} has {item.shape[dim]} rows "
                                           f"for {batch} examples (items flattened over the batch)")
            return item[(slice(None),) * dim + (block,)]
        if isinstance(item, Cache):
            raise ExamplesNotSeparable(f"input {key!r} is a cache, whose rows are the model's own")
        return item

    return _map_input(value, select, name)


class ExamplesNotSeparable(ValueError):
    """The inputs of a batch cannot be cut into blocks of examples from their shapes."""


class RowsPerExampleUnknown(RuntimeError):
    """Rows of an adapted module cannot be assigned to examples (e.g. a different number of image patches per
    example in a vision tower), so one hypothesis per example cannot be routed there."""


def batch_size_of(inputs: dict, strict: bool = True) -> int | None:
    for name in ("input_ids", "inputs_embeds", "decoder_input_ids", "input_features", "input_values", "pixel_values"):
        if torch.is_tensor(inputs.get(name)):
            return inputs[name].shape[0]
    if not strict:
        return None
    raise ValueError(f"cannot tell the batch size from the inputs {sorted(inputs)}: pass input_ids or inputs_embeds")


def tensor_inputs(args: tuple, kwargs: dict) -> Iterator[tuple[str | None, torch.Tensor]]:
    """(name, tensor) for every per-example tensor of a module call, nested ones included (named by their key)."""
    def walk(name, value):
        if torch.is_tensor(value):
            if value.dim() > 0 and name not in NOT_PER_EXAMPLE:
                yield name, value
        elif isinstance(value, dict):
            for key, item in value.items():
                yield from walk(key, item)
        elif isinstance(value, list | tuple):
            for item in value:
                yield from walk(name, item)

    for value in args:
        yield from walk(None, value)
    for name, value in kwargs.items():
        yield from walk(name, value)


def equal_copies(value: torch.Tensor, copies: int) -> bool:
    """Whether ``value`` [C*N, ...] is C equal blocks along dim 0."""
    blocks = value.view(copies, value.shape[0] // copies, -1) if value.is_contiguous() else value.reshape(
        copies, value.shape[0] // copies, -1)  # [C, N, rest]
    return all(torch.equal(blocks[0], blocks[c]) for c in range(1, copies))


def first_copy(value, copies: int):
    """The first of C copies of a module input, nested containers walked: a tensor [C*N, ...] -> [N, ...]."""
    if torch.is_tensor(value):
        return value[:value.shape[0] // copies] if value.dim() > 0 and value.shape[0] > 1 else value
    if isinstance(value, dict):
        return type(value)((key, first_copy(item, copies)) for key, item in value.items())
    if isinstance(value, list | tuple):
        items = [first_copy(item, copies) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value


def find_expansion_module(model: nn.Module, layer_names: list[str]) -> str:
    """The smallest transformers model (e.g. LlamaModel, T5Stack, a vision tower) holding every adapted layer:
    the K copies are made at its entry, where per-example inputs are batch-first. The whole model if none."""
    parts = [name.split(".") for name in layer_names]
    common = []
    for level in zip(*parts, strict=False):
        if len(set(level)) > 1:
            break
        common.append(level[0])
    while common:
        name = ".".join(common)
        if isinstance(model.get_submodule(name), PreTrainedModel):
            return name
        common.pop()
    return ""


def find_branches(model: nn.Module, expansion_name: str, layer_names: list[str]) -> list[str]:
    """The modules inside the expansion module through which the adapted layers are reached: its children that
    hold adapters (a list of blocks gives its blocks), e.g. the vision tower and the language model of a VLM, the
    encoder and decoder of T5, the decoder blocks of Llama. Their inputs tell whether each example has its own
    rows (``CopyHooks._check_rows_per_example``)."""
    branches = []

    def visit(prefix: str, module: nn.Module) -> None:
        for child_name, child in module.named_children():
            name = f"{prefix}.{child_name}" if prefix else child_name
            if not any(layer == name or layer.startswith(name + ".") for layer in layer_names):
                continue
            if isinstance(child, nn.ModuleList | nn.ModuleDict):
                visit(name, child)
            else:
                branches.append(name)

    visit(expansion_name, model.get_submodule(expansion_name))
    return branches


def find_shared_modules(model: nn.Module, expansion_name: str, layer_names: list[str],
                         output_layer_name: str | None) -> list[str]:
    """The frozen modules beside the path from the model's root to the expansion module (their siblings along it),
    without adapters and other than the output layer: e.g. the vision tower and projector of a VLM whose adapters
    are in its language model, an audio tower, an encoder without adapters. They run before the K copies in training;
    ``CopyHooks._run_on_one_copy`` runs them once when decoding copies of a batch too."""
    if not expansion_name:
        return []
    # A module also used inside the expansion module (T5's `shared` embeddings are its decoder's embed_tokens) sees
    # per-hypothesis inputs there: not shared.
    inside = {id(module) for module in model.get_submodule(expansion_name).modules()}
    names, prefix = [], ""
    for part in expansion_name.split("."):
        for child_name, _ in model.get_submodule(prefix).named_children():
            name = f"{prefix}.{child_name}" if prefix else child_name
            if child_name == part or name == output_layer_name:
                continue
            if output_layer_name and output_layer_name.startswith(name + "."):
                continue
            if any(layer == name or layer.startswith(name + ".") for layer in layer_names):
                continue
            if id(model.get_submodule(name)) in inside:
                continue
            names.append(name)
        prefix = f"{prefix}.{part}" if prefix else part
    return names


class CopyHooks:
    """The hooks that make and check the K copies of a batch inside the base model's call, and their state.

    base_model: the model holding the adapted layers; routing: the routing its layers share; scope: the call in
    progress (``expand_batch``); expansion_module_name, shared_module_names, branch_names: where the copies are made,
    the frozen modules run once on one copy, the modules whose rows per example are checked (the ``find_*`` functions
    of this module compute them).
    """

    def __init__(self, base_model: nn.Module, routing: HypothesisRouting, num_hypotheses: int, scope: CallScope,
                 expansion_module_name: str, shared_module_names: list[str], branch_names: list[str]) -> None:
        self.base_model, self.routing, self.num_hypotheses, self.scope = base_model, routing, num_hypotheses, scope
        self.expansion_module_name = expansion_module_name
        self.shared_module_names = shared_module_names
        self.branch_names = branch_names
        # Decoding K copies of a batch runs each shared module (a frozen tower before the adapters) once, on one
        # copy; False runs it on all K copies (the same result, K times the work; for benchmarks).
        self.share_frozen_modules = True
        self.main_rows: int | None = None  # rows of the base model's main input in the current call
        self._shared_calls: dict[int, int] = {}  # id(shared module) -> copies its running call was given
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def install(self) -> None:
        base = self.base_model
        self._handles.append(base.register_forward_pre_hook(self._record_main_rows, with_kwargs=True))
        expansion = base.get_submodule(self.expansion_module_name)
        self._handles.append(expansion.register_forward_pre_hook(self._expand_rows, with_kwargs=True))
        for name in self.shared_module_names:
            module = base.get_submodule(name)
            self._handles.append(module.register_forward_pre_hook(self._run_on_one_copy, with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._copy_outputs, with_kwargs=True))
        for name in self.branch_names:
            check = functools.partial(self._check_rows_per_example, name)
            self._handles.append(base.get_submodule(name).register_forward_pre_hook(check, with_kwargs=True))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def check_ran(self, call: ForwardCall) -> None:
        if call.expand_batch is not None:
            raise RuntimeError(
                f"the batch was never duplicated for the K hypotheses: module '{self.expansion_module_name}' did not "
                "run during this forward. Please report this model class to loramcl.")

    def _expand_rows(self, module: nn.Module, args: tuple, kwargs: dict):
        """Make the K copies of every per-example input, hypothesis-major: [B, ...] -> [K*B, ...]."""
        call = self.scope.call
        batch = call.expand_batch
        if batch is None:
            return None
        call.expand_batch = None
        k = self.num_hypotheses
        self.routing.rows = k * batch
        return repeat_examples(args, k, batch), {n: repeat_examples(v, k, batch, n) for n, v in kwargs.items()}

    def _run_on_one_copy(self, module: nn.Module, args: tuple, kwargs: dict):
        """While the batch is C identical copies (decoding, ``use_hypotheses(index, copies=True)``), give a shared
        module only the first copy: every per-example input [C*N, ...] -> [N, ...] (a size-1 broadcast stays). The
        copies are checked to be equal, so the module runs on all of them whenever they are not (no silent
        misroute): e.g. inputs that differ per hypothesis."""
        copies = self.routing.copies
        self._shared_calls[id(module)] = 1
        if not self.share_frozen_modules or not copies or copies < 2:
            return None
        tensors = list(tensor_inputs(args, kwargs))
        one_copy = all(value.shape[0] == 1 or value.shape[0] % copies == 0 and equal_copies(value, copies)
                       for _, value in tensors) and any(value.shape[0] > 1 for _, value in tensors)
        if not one_copy:
            return None
        self._shared_calls[id(module)] = copies
        return first_copy(args, copies), first_copy(kwargs, copies)

    def _copy_outputs(self, module: nn.Module, args: tuple, kwargs: dict, output):
        """The shared module's outputs on one copy, repeated for the C copies (copy-major, as ``repeat_examples``)."""
        copies = self._shared_calls.pop(id(module), 1)
        if copies == 1:
            return None
        rows = next((v.shape[0] for _, v in tensor_inputs(args, kwargs) if v.shape[0] > 1), 1)  # of one copy
        return repeat_examples(output, copies, rows)

    def _record_main_rows(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        inputs = kwargs if kwargs else dict(zip(("input_ids",), args, strict=False))
        self.main_rows = batch_size_of(inputs, strict=False)

    def _check_rows_per_example(self, name: str, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """With one hypothesis per example (indexed routing, not copies), the adapted layers of ``name`` give each
        example rows/E consecutive rows. That is right only if the module's main input (its first per-example
        tensor that is not a broadcast: hidden states, pixel values, audio features) has one row per example (E, or
        the E*beams rows of beam search); image patches or crops whose number varies per example cannot be assigned
        to their examples from their shapes, so they are refused, not misrouted."""
        routing = self.routing
        if routing.mode != INDEXED or routing.per_copy:
            return
        examples = routing.index.numel()
        for input_name, value in tensor_inputs(args, kwargs):
            size = value.shape[batch_dim(input_name, value)]
            if size == 1:  # a broadcast over the batch tells nothing
                continue
            if size not in (examples, self.main_rows or examples):
                raise RowsPerExampleUnknown(
                    f"one hypothesis per example cannot be routed in '{name}': its input {input_name or '#0'} has "
                    f"{size} rows for {examples} examples (e.g. image patches or crops whose number varies per "
                    "example), so its rows cannot be assigned to examples. Decode all hypotheses at once "
                    "(generate_hypotheses, use_hypotheses(index, copies=True)), one hypothesis for every row "
                    "(use_hypotheses(k)), or keep adapters out of that module (target_modules).")
            return
