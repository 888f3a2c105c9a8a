"""Who learns from which example, beyond the loss: the balancing bias (``MCLConfig.balance="bias"``) and the symmetry
break of a staged split (``MCLConfig.split_after``), as two ``TrainerCallback`` s that ``MCLTrainer`` adds when the
option is on (``assignment_callbacks``). docs/guide/scores.md, "Balanced assignment and a staged split", gives the
equations and when to use them.

The bias b [K] is training state, not a parameter: the training step subtracts it from the NLLs before it picks the
winners (``loramcl.mcl.losses.balanced``), evaluation and decoding never see it. It lives on the device in
``LogStore.balance_bias`` (the trainer passes it to ``mcl_step`` and logs it as ``bias_h{k}``), is updated after every
optimizer step from that step's wins, summed over the micro-batches of gradient accumulation
(``LogStore.step_wins``) and over the ranks, and is written into the checkpoint's ``trainer_state.json`` (Trainer's
``stateful_callbacks``, through ``ExportableState``: read on the host only when a checkpoint is written), from which
a resumed run takes it back: float32 values round-trip through JSON exactly, so a resumed run is bit-identical.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from loramcl.mcl.config import MCLConfig
from loramcl.mcl.fingerprint import whole_tensor
from loramcl.mcl.losses import shared_phase, split_step
from loramcl.mcl.model import MCLModel
from loramcl.training.logs import LogStore

Reduce = Callable[[torch.Tensor], torch.Tensor]  # a sum over the ranks (accelerator.reduce)


def bias_step(wins: torch.Tensor, rate: float) -> torch.Tensor:
    """The change of the balancing bias after an optimizer step whose examples hypothesis k won ``wins[k]`` times
    ([K], summed over its micro-batches and ranks): rate * sign(1/K - share_k), share_k = wins_k / sum(wins)
    (DeepSeek-V3's update), computed on the integers as sign(sum(wins) - K * wins_k), so that an exactly fair share
    moves nothing. A hypothesis that won less than its share gets a higher bias, so wins more of the next steps."""
    return rate * torch.sign(wins.sum() - wins.shape[0] * wins).to(torch.float32)  # [K]


class BalancingBias(TrainerCallback, ExportableState):
    """The balancing bias of ``config`` (``balance="bias"``): ``log_store.balance_bias`` [K] (0 at the start of a run,
    the checkpoint's on resume) moved by ``bias_step`` after every optimizer step outside a staged split's shared
    phase (where no winner is trained, and the bias stays put). ``reduce``: the sum over the ranks.

    Trainer's own restoring of callbacks (``restore_callback_states_from_checkpoint=True``) rebuilds a callback from
    its saved arguments alone, which cannot hold the trainer's store: this callback restores itself, and a rebuilt
    one says so."""

    def __init__(self, config: MCLConfig | None = None, log_store: LogStore | None = None,
                 reduce: Reduce | None = None) -> None:
        self.config, self.log_store, self.reduce = config, log_store, reduce
        if log_store is not None:
            k, device = config.num_hypotheses, log_store.wins.device
            log_store.balance_bias = torch.zeros(k, dtype=torch.float32, device=device)  # [K]
            log_store.step_wins = torch.zeros(k, dtype=torch.long, device=device)  # [K]

    def state(self) -> dict:
        """What ``trainer_state.json`` holds: the bias [K] as floats (a host read, when a checkpoint is written)."""
        return {"args": {}, "attributes": {"saved_bias": self.log_store.balance_bias.tolist()}}

    def on_train_begin(self, args, state, control, **kwargs):
        if self.log_store is None:
            raise ValueError("restore_callback_states_from_checkpoint=True rebuilds MCLTrainer's balancing bias "
                             "(MCLConfig.balance='bias') without the trainer; leave it False: the bias is restored "
                             "from the checkpoint either way")
        saved = state.stateful_callbacks.get(type(self).__name__) if state.global_step > 0 else None
        bias = (saved or {}).get("attributes", {}).get("saved_bias")  # None: a new run, or a checkpoint without it
        if bias is not None and len(bias) != self.config.num_hypotheses:
            raise ValueError(f"the checkpoint's balancing bias has {len(bias)} values, for "
                             f"{self.config.num_hypotheses} hypotheses: resume with the hypotheses it was trained with")
        self.log_store.balance_bias.copy_(torch.tensor(bias or [0.0] * self.config.num_hypotheses,
                                                       dtype=torch.float32))
        self.log_store.step_wins.zero_()
        # a checkpoint written without this callback has no entry, which Trainer's checkpoint writer expects
        state.stateful_callbacks.setdefault(type(self).__name__, self.state())

    def on_step_end(self, args, state, control, **kwargs):
        wins = self.reduce(self.log_store.step_wins.clone())  # [K]: every micro-batch of every rank (a collective)
        self.log_store.step_wins.zero_()
        if not shared_phase(state.global_step - 1, self.config, state.max_steps):  # the step just taken
            self.log_store.balance_bias += bias_step(wins, self.config.balance_rate)


def break_symmetry(model: MCLModel, scale: float, seed: int) -> None:
    """B_k += scale * rms(B) * noise for every adapted layer's lora_B [K, r, d_out], rms over the whole tensor (all K
    hypotheses), noise ~ N(0, 1) drawn on the CPU from a generator seeded with ``seed``, layer after layer: the same
    on every rank and device. Sharded tensors (FSDP2) are gathered, perturbed whole and cut again."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, layer in model.mcl_layers():
            lora_b = layer.lora_B
            whole = whole_tensor(lora_b)  # a collective for a DTensor: every rank, every layer, in order
            noise = torch.randn(whole.shape, generator=generator).to(whole.device)
            rms = whole.float().pow(2).mean().sqrt()
            perturbed = (whole.float() + scale * rms * noise).to(whole.dtype)
            if hasattr(lora_b, "placements"):
                from torch.distributed.tensor import distribute_tensor

                perturbed = distribute_tensor(perturbed, lora_b.device_mesh, lora_b.placements, src_data_rank=None)
            lora_b.copy_(perturbed)


class SymmetryBreak(TrainerCallback):
    """A staged split's one-time symmetry break (``break_symmetry`` with ``config.split_noise``, seeded by the run's
    ``seed``), when the optimizer step that ends the shared phase has been taken (``global_step`` reaches
    ``split_step``), before the configured loss's first step and before a checkpoint of that step is written: a run
    resumed from a checkpoint at or after that step has it in its adapters and never reaches that step again, one
    resumed from before reaches it and applies it then."""

    def __init__(self, model: MCLModel, seed: int) -> None:
        self.model, self.seed = model, seed

    def on_step_end(self, args, state, control, **kwargs):
        config = self.model.mcl_config
        if state.global_step == split_step(config, state.max_steps):
            break_symmetry(self.model, config.split_noise, self.seed)


def assignment_callbacks(trainer) -> list[TrainerCallback]:
    """The callbacks an ``MCLTrainer`` adds for its model's options: ``BalancingBias`` with ``balance="bias"``,
    ``SymmetryBreak`` with ``split_after`` > 0, K >= 2 and ``split_noise`` > 0; none when they are off (nothing in
    the run or its files changes then). Read from the trainer: its model, ``log_store``, accelerator and seed."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    config, callbacks = model.mcl_config, []
    if config.balance == "bias":
        callbacks.append(BalancingBias(config, trainer.log_store, lambda total: trainer.accelerator.reduce(total)))
    if config.split_after and config.num_hypotheses > 1 and config.split_noise > 0:
        callbacks.append(SymmetryBreak(model, trainer.args.seed))
    return callbacks
