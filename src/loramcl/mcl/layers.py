"""MCLLoraLinear: a frozen linear layer plus K stacked LoRA adapters (paper eq. 8; docs/architecture.md, "Decisions
as implemented": "Own stacked layer").

All K hypotheses run in one batched matmul per layer. Rows are hypothesis-major: with K*B rows,
hypothesis k owns rows k*B ... (k+1)*B - 1, a contiguous view, so no permute is needed. A shared adapter
(``MCLConfig.shared_r``) is one more LoRA pair that every row runs, un-gathered: one plain matmul on all rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from loramcl.mcl.compat import tensor_version
from loramcl.mcl.quantization import compute_dtype

STACKED, SINGLE, INDEXED, DISABLED = "stacked", "single", "indexed", "disabled"


@dataclass
class HypothesisRouting:
    """Which hypothesis each row of the current forward uses; one object shared by all layers of a model.

    - ``stacked``: K*B rows, hypothesis-major (the MCL training forward);
    - ``single``: every row uses ``hypothesis``;
    - ``indexed``: row group i uses ``index[i]`` (a LongTensor); a layer seeing n*len(index) rows gives
      each index entry n consecutive rows (e.g. [B*T, d] inputs, or beams kept inside their row).
      ``per_copy``: the entries are identical copies of one batch (decoding K hypotheses at once), so every
      layer's rows split evenly among them, even where the rows per example vary (image patches); otherwise
      they are examples, whose rows the model checks (``MCLModel``);
    - ``disabled``: the adapters are off, every row runs the frozen base layer only.

    The routing stays as set after a forward, so activation checkpointing recomputes with the same one.
    """

    mode: str = STACKED
    hypothesis: int = 0
    index: torch.Tensor | None = None
    per_copy: bool = False
    ordered: bool = False  # indexed: index is 0 ... K-1 in order, so row group k runs hypothesis k (no gather)
    rows: int | None = None  # stacked: the K*B rows the K copies of the batch made (set where they are made)
    copies: int | None = None  # use_hypotheses(index, copies=True): the batch is len(index) identical copies
    # [rows, T, 1]: 1 where the adapters act, 0 where they are masked (adapt_context=False computed on the full
    # sequence, the reference of the context-once path); None: everywhere
    positions: torch.Tensor | None = None


def linear_features(layer: nn.Module) -> tuple[int, int]:
    """(d_in, d_out) of an ``nn.Linear`` or a transformers ``Conv1D``, the layers MCL adapters wrap."""
    if isinstance(layer, nn.Linear):
        return layer.in_features, layer.out_features
    if isinstance(layer, Conv1D):
        d_in, d_out = layer.weight.shape  # Conv1D stores W as [d_in, d_out]
        return d_in, d_out
    raise TypeError(f"MCLLoraLinear wraps nn.Linear or transformers Conv1D, got {type(layer).__name__}")


class MCLLoraLinear(nn.Module):
    """``base(x) + (alpha / r) * dropout(x) @ A_k @ B_k`` with k the hypothesis of each row (alpha / sqrt(r) with
    ``use_rslora``).

    With a shared adapter of rank s (``shared_r``): ``base(x) + (alpha / (s + r)) * h @ ([A_s | A_k] [B_s ; B_k])``,
    h = dropout(x) read by both pairs, i.e. hypothesis k is one LoRA of rank s + r whose first s rank components every
    hypothesis shares (PEFT's LoRA of rank s + r drops its input once, so the two pairs read the same h).

    ``base_layer`` is an ``nn.Linear`` or a transformers ``Conv1D`` (GPT-2), kept frozen inside.
    """

    def __init__(self, base_layer: nn.Module, routing: HypothesisRouting, num_hypotheses: int, r: int,
                 alpha: float, dropout: float = 0.0, adapter_dtype: torch.dtype | None = None,
                 use_rslora: bool = False, shared_r: int = 0) -> None:
        super().__init__()
        in_features, out_features = linear_features(base_layer)
        self.base_layer = base_layer
        self.routing = routing
        self.num_hypotheses = num_hypotheses
        self.in_features, self.out_features = in_features, out_features
        self.r, self.shared_r = r, shared_r
        rank = r + shared_r  # one hypothesis with the shared pair is one LoRA of this rank
        self.scaling = alpha / math.sqrt(rank) if use_rslora else alpha / rank  # rsLoRA (Kalajdzievski 2023)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        # a quantized layer stores uint8/int8 codes: the adapters take the dtype it computes in, on its device
        device, dtype = base_layer.weight.device, adapter_dtype or compute_dtype(base_layer)
        self.lora_A = nn.Parameter(torch.empty(num_hypotheses, in_features, r, device=device, dtype=dtype))
        self.lora_B = nn.Parameter(torch.zeros(num_hypotheses, r, out_features, device=device, dtype=dtype))
        if shared_r:  # no attribute at all without it: the layer's state_dict and forward are those of before
            self.shared_A = nn.Parameter(torch.empty(in_features, shared_r, device=device, dtype=dtype))  # [d_in, s]
            self.shared_B = nn.Parameter(torch.zeros(shared_r, out_features, device=device, dtype=dtype))  # [s, d_out]
        # inference's copies of the adapters in the activations' dtype, kept until the weights change (``_kept``):
        # (name, dtype, transposed) -> (weight, version, storage, copy)
        self._kept_copies: dict[tuple, tuple] = {}
        self.reset_adapters()

    def reset_adapters(self) -> None:
        """PEFT's LoRA init for every hypothesis (and the shared pair, drawn after them): A ~ kaiming_uniform(a=sqrt(5))
        = U(+-1/sqrt(d_in)), B = 0."""
        bound = 1.0 / math.sqrt(self.in_features)
        with torch.no_grad():
            self.lora_A.uniform_(-bound, bound)
            self.lora_B.zero_()
            if self.shared_r:
                self.shared_A.uniform_(-bound, bound)
                self.shared_B.zero_()

    def adapter_tensors(self) -> dict[str, nn.Parameter]:
        """The trained tensors, by their name in this layer: what the adapter files hold and load freezes."""
        shared = {"shared_A": self.shared_A, "shared_B": self.shared_B} if self.shared_r else {}
        return {"lora_A": self.lora_A, "lora_B": self.lora_B, **shared}

    @property
    def weight(self) -> torch.Tensor:  # models read e.g. `self.wo.weight.dtype` (T5)
        return self.base_layer.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base_layer.bias

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        result = self.base_layer(x, *args, **kwargs)  # [..., d_out]
        routing = self.routing
        if routing.mode == DISABLED:
            return result
        # The matmuls run in the activations' dtype on the float32 master weights cast to it (autograd casts their
        # gradients back): casting x up instead would save a float32 copy of every adapted layer's input for the
        # backward pass, 2x a bfloat16 input's bytes, once per layer that reads it (q, k and v: three copies).
        h = self.dropout(x) if self.training else x  # [rows, ..., d_in]; dropout is the identity in eval mode
        if routing.per_copy and routing.positions is None and result.dtype == h.dtype and not (
                torch.is_grad_enabled()):
            # decoding (the batch is copies, one per hypothesis: generate_hypotheses): result + scaling * (h A) B in
            # one batched matmul, no delta tensor, no separate scaling. Other forwards without gradient (two-pass
            # WTA's scoring pass, evaluation) keep the training forward's arithmetic, so that they pick the same
            # winners and give the same numbers to the last bit.
            grouped, a, b = self._grouped(h, decoding=True)  # [n, m*T, d_in]
            # h A as (A^T h^T)^T from m*T = 16 rows on: the CPU's batched matmul is faster with the long side last
            projected = torch.bmm(grouped, a) if grouped.shape[1] < 16 else torch.bmm(a.mT, grouped.mT).mT.contiguous()
            out = result.reshape(grouped.shape[0], -1, self.out_features)  # [n, m*T, d_out]
            out = torch.baddbmm(out, projected, b, alpha=self.scaling)
            if self.shared_r:  # every row: one plain matmul, un-gathered
                flat = grouped.reshape(-1, self.in_features)  # [rows*T, d_in]
                out = torch.addmm(out.view(-1, self.out_features), flat @ self._kept("shared_A", h.dtype),
                                  self._kept("shared_B", h.dtype), alpha=self.scaling)
            return out.view(result.shape)
        delta = self._adapter_delta(h)  # [rows, ..., d_out], h's dtype
        if self.shared_r:  # every row, whatever its hypothesis, before the mask by position (it is part of each LoRA)
            delta = delta + h @ self.shared_A.to(h.dtype) @ self.shared_B.to(h.dtype)  # [rows, ..., d_out]
        if self.routing.positions is not None:
            if tuple(delta.shape[:2]) != tuple(self.routing.positions.shape[:2]):
                raise RuntimeError(f"adapters masked by position on {tuple(self.routing.positions.shape[:2])} (rows, "
                                   f"positions), but this layer sees {tuple(delta.shape)}")
            delta = delta * self.routing.positions.to(delta.device, delta.dtype)  # [rows, T, d_out]
        return result + (delta * self.scaling).to(result.dtype)

    def _adapter_delta(self, h: torch.Tensor) -> torch.Tensor:
        out_shape = (*h.shape[:-1], self.out_features)
        if self.routing.mode == SINGLE:
            k = self.routing.hypothesis
            return h @ self.lora_A[k].to(h.dtype) @ self.lora_B[k].to(h.dtype)  # the cast of hypothesis k's slice
        grouped, a, b = self._grouped(h)
        return torch.bmm(torch.bmm(grouped, a), b).reshape(out_shape)

    def _grouped(self, h: torch.Tensor, decoding: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Stacked or indexed routing: (h's rows grouped [n, m*T, d_in], A [n, d_in, r], B [n, r, d_out]) in h's
        dtype, group i of the rows running entry i's adapters; ``decoding``: A from the kept transposed copy on the
        CPU (``_first_factor``)."""
        routing, rows, d_in = self.routing, h.shape[0], self.in_features
        if routing.mode == STACKED:
            if rows % self.num_hypotheses:
                raise RuntimeError(f"stacked routing needs K*B rows (K={self.num_hypotheses}), got {rows}")
            if h.dim() >= 3 and routing.rows and rows != routing.rows and h.shape[1] == routing.rows:
                raise RuntimeError(
                    f"this layer sees [{rows}, {h.shape[1]}, ...] while the K copies of the batch are {routing.rows} "
                    "rows: the batch is on dimension 1 (a time-first layout, as in XLNet or FSMT), and LoRA-MCL "
                    "routes the rows of dimension 0. Such models are not supported.")
            grouped = h.reshape(self.num_hypotheses, -1, d_in)  # [K, B*T, d_in], hypothesis-major
            # [K, d_in, r], [K, r, d_out]
            return grouped, self._first_factor(h.dtype, kept=decoding), self._second_factor(h.dtype, kept=decoding)
        if routing.mode == INDEXED:
            entries = routing.index.numel()
            if rows % entries:
                raise RuntimeError(f"{rows} rows cannot be split among {entries} hypothesis indices")
            # entry i owns rows i*m ... (i+1)*m - 1 (m = rows / n): one block of consecutive rows per entry, so each
            # entry's adapters are gathered once, not once per row (issue 41: at a decoding batch of 80 rows the
            # per-row gather wrote and read GBs of weight copies per step); none when the entries are 0 ... K-1
            grouped = h.reshape(entries, -1, d_in)  # [n, m*T, d_in]
            if routing.ordered:
                return grouped, self._first_factor(h.dtype, None, decoding), self._second_factor(h.dtype, decoding)
            index = routing.index.to(self.lora_A.device)  # [n]
            return (grouped, self._first_factor(h.dtype, index, decoding),  # [n, d_in, r]
                    self._second_factor(h.dtype, decoding, index))  # [n, r, d_out]
        raise RuntimeError(f"unknown routing mode {routing.mode!r}")

    def _second_factor(self, dtype: torch.dtype, kept: bool = False, index: torch.Tensor | None = None
                       ) -> torch.Tensor:
        """B [K or n, r, d_out] in ``dtype``; ``kept``: decoding's kept copy (``_kept``). Otherwise gathered in the
        masters' dtype, then cast: the backward then sums the gradients of repeated indices in float32, not in
        bfloat16 (a bfloat16 sum moved FSDP2's two-rank run off the one-process one)."""
        if kept:
            b = self._kept("lora_B", dtype)
            return b if index is None else b.index_select(0, index)
        return (self.lora_B if index is None else self.lora_B.index_select(0, index)).to(dtype)

    def _first_factor(self, dtype: torch.dtype, index: torch.Tensor | None = None, decoding: bool = False,
                      kept: bool | None = None) -> torch.Tensor:
        """A [K or n, d_in, r] in ``dtype``; ``kept`` (default: ``decoding``): decoding's kept copy (``_kept``).
        Decoding on the CPU without gradient: a view of A^T [K, r, d_in] (contiguous): the CPU's batched matmul reads
        its columns 2-4x faster than A's own layout."""
        transposed = (decoding and self.lora_A.device.type == "cpu" and not torch.is_grad_enabled()
                      and not torch.compiler.is_compiling())
        if not (decoding if kept is None else kept) and not transposed:  # gathered, then cast (``_second_factor``)
            return (self.lora_A if index is None else self.lora_A.index_select(0, index)).to(dtype)
        a = self._kept("lora_A", dtype, transposed)  # [K, d_in, r], or A^T [K, r, d_in]
        a = a if index is None else a.index_select(0, index)
        return a.mT if transposed else a

    def _kept(self, name: str, dtype: torch.dtype, transposed: bool = False) -> torch.Tensor:
        """Adapter tensor ``name`` in ``dtype`` (``transposed``: its last two dimensions swapped, contiguous).

        Decoding without gradient (the ``decoding`` forward of generate_hypotheses' copies, never training's scoring
        pass or an evaluation: FSDP2 refills a layer's unsharded weights in place without a version bump, and a
        kept copy there was stale), a copy kept until the weight changes (its identity, version counter or storage:
        an optimizer step, a ``copy_``, a new Parameter or ``.data``, a move): a decoding step then runs no cast
        kernel per layer (bfloat16 activations on float32 masters) and no transpose. With gradient, autograd's
        cast (its backward casts the gradient back to the master's dtype). Under ``torch.compile`` the cast is in
        the graph: the check reads Python state that a graph cannot keep."""
        weight = getattr(self, name)
        if torch.is_grad_enabled() or torch.compiler.is_compiling() or (weight.dtype == dtype and not transposed):
            weight = weight.to(dtype)
            return weight.mT.contiguous() if transposed else weight
        key, version = (name, dtype, transposed), tensor_version(weight)
        kept = self._kept_copies.get(key)
        if kept is None or kept[0] is not weight or kept[1:3] != (version, weight.data_ptr()):
            copy = weight.detach().to(dtype)
            kept = self._kept_copies[key] = (weight, version, weight.data_ptr(),
                                             copy.mT.contiguous() if transposed else copy)
        return kept[3]

    def delta_weight(self, k: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight update of hypothesis k (with the shared pair) in the base layer's layout and ``dtype`` (default:
        its compute dtype)."""
        product = self.lora_A[k].float() @ self.lora_B[k].float()  # [d_in, d_out]
        if self.shared_r:
            product = product + self.shared_A.float() @ self.shared_B.float()
        delta = product * self.scaling  # [d_in, d_out]
        if isinstance(self.base_layer, nn.Linear):
            delta = delta.T  # nn.Linear stores W as [d_out, d_in]
        return delta.to(dtype or compute_dtype(self.base_layer))

    def extra_repr(self) -> str:
        shared = f", shared_r={self.shared_r}" if self.shared_r else ""
        return (f"hypotheses={self.num_hypotheses}, in={self.in_features}, out={self.out_features}, r={self.r}"
                f"{shared}, scaling={self.scaling:g}")
