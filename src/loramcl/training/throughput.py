"""How fast a run trains, in MCLTrainer's training logs: tokens per second, step time, and on a GPU the peak memory
since the previous log and the model FLOP utilisation (docs/guide/cli.md, "Progress, warnings, logs").

Tokens are counted on the device where the batch is (a sum per micro-batch, no host read: docs/architecture.md,
"Where the code of the MCL model lives") and read once per log, with the clock, after the device has finished its
queued work.
"""

from __future__ import annotations

import time

import torch
from transformers import TrainerCallback

from loramcl.mcl.nll import IGNORE_INDEX

try:  # the callbacks whose state Trainer keeps in each checkpoint (trainer_state.json: stateful_callbacks)
    from transformers.trainer_callback import ExportableState
except ImportError:  # moved: no checkpoint keeps the seconds, a resumed run's earlier ones are unknown (None)
    ExportableState = object

# Dense bf16 tensor-core peaks of NVIDIA's data sheets (FLOP/s, without sparsity), matched in this order against
# torch.cuda.get_device_name: the H200 has the H100 SXM's compute (989.4 TFLOP/s) with more, faster memory; the
# H100 PCIe card is clocked lower. NVL variants and other devices are not listed: no MFU is logged for them rather
# than a guess.
PEAK_BF16_FLOPS = (("H100 PCIe", 756e12), ("H100 NVL", None), ("H200 NVL", None), ("H100", 989.4e12),
                   ("H200", 989.4e12), ("A100", 312e12))
GB = 1e9


def peak_flops(device_name: str) -> float | None:
    """The dense bf16 peak of the GPU called ``device_name`` (FLOP/s), or None when it is not known."""
    for name, peak in PEAK_BF16_FLOPS:
        if name in device_name:
            return peak
    return None


def flops_per_token(parameters: int, num_hypotheses: int, two_pass: bool) -> float:
    """The usual estimate of a training step's model FLOPs per token of the batch, 6 N per token and row that runs
    forward and backward (2 N forward, 4 N backward) and 2 N per row that runs forward only: K rows per token
    (relaxed, annealed, one-pass WTA: 6 N K), or two-pass WTA's K forward-only rows and one winner row
    ((2 K + 6) N). N counts every parameter, frozen ones too; a frozen weight needs no weight gradient, so the
    backward's 4 N over-counts LoRA's by about 2 N (as every 6 N D figure for LoRA does)."""
    k = num_hypotheses
    return float(parameters) * ((2 * k + 6) if two_pass and k > 1 else 6 * k)


def gpu_fields(device: torch.device, seconds: float, flops: float | None) -> dict[str, float]:
    """Peak allocated and reserved memory since the last call (GB; the counters are then reset), and the model FLOP
    utilisation of ``flops`` done in ``seconds`` where the device's peak is known. {} off a CUDA device."""
    if device.type != "cuda":
        return {}
    fields = {"peak_allocated_gb": torch.cuda.max_memory_allocated(device) / GB,
              "peak_reserved_gb": torch.cuda.max_memory_reserved(device) / GB}
    torch.cuda.reset_peak_memory_stats(device)
    peak = peak_flops(torch.cuda.get_device_name(device))
    if peak is not None and flops is not None and seconds > 0:
        fields["mfu"] = flops / seconds / peak
    return fields


class Throughput(TrainerCallback):
    """Counts each micro-batch's tokens (``count``) and times the optimizer steps from the first one after a log
    to the next log (``logs``): an evaluation or checkpoint that falls on a logging step is outside that interval,
    one between two logs is inside it."""

    def __init__(self, device: torch.device, flops_per_token: float | None, processes: int = 1) -> None:
        self.device, self.flops_per_token, self.processes = device, flops_per_token, processes
        self.counts = torch.zeros(2, dtype=torch.long, device=device)  # [labelled tokens, all tokens] since the log
        self.started: float | None = None  # the clock at the first step after the last log
        self.first_step = 0

    def on_train_begin(self, args, state, control, **kwargs):
        self.counts.zero_()
        self.started = None
        gpu_fields(self.device, 0.0, None)  # the peaks of the first log are those of training, not of loading

    def on_step_begin(self, args, state, control, **kwargs):
        if self.started is None:
            self.started, self.first_step = time.perf_counter(), state.global_step

    def count(self, inputs: dict) -> None:
        """Add a micro-batch's labelled tokens (labels other than -100) and all its tokens (attention masks; the
        token ids where there is none), on the device (no host read)."""
        labels, ids = inputs.get("labels"), inputs.get("input_ids")
        masks = [inputs[name] for name in ("attention_mask", "decoder_attention_mask")
                 if torch.is_tensor(inputs.get(name))]
        if torch.is_tensor(labels):
            self.counts[0] += (labels != IGNORE_INDEX).sum()  # a 0-dim tensor adds to any device's
        if masks:
            self.counts[1] += sum(mask.sum() for mask in masks)
        elif torch.is_tensor(ids):
            self.counts[1] += ids.numel()

    def logs(self, step: int, reduce) -> dict[str, float]:
        """The fields of the training log at ``step``; ``reduce`` sums a tensor over the processes. Resets."""
        labelled, tokens = reduce(self.counts.clone()).tolist()  # the one host read, after the queued work
        self.counts.zero_()
        if self.started is None or step <= self.first_step:
            return {}
        seconds = time.perf_counter() - self.started
        self.started = None
        fields = {"tokens_per_second": tokens / seconds, "labelled_tokens_per_second": labelled / seconds,
                  "step_time": seconds / (step - self.first_step)}
        flops = None if self.flops_per_token is None else self.flops_per_token * tokens / self.processes
        return fields | gpu_fields(self.device, seconds, flops)


class TrainingClock(TrainerCallback, ExportableState):
    """A run's training seconds across resumes. Every checkpoint keeps the seconds trained until it was written (this
    callback's state in its ``trainer_state.json``, Trainer's place for callback state: ``ExportableState``); a run
    resumed from it starts from them (``earlier``), None when the checkpoint holds none (written before loramcl kept
    them): the earlier processes' time is then unknown."""

    def __init__(self) -> None:
        self.earlier: float | None = 0.0  # the seconds before this train() call (restored by Trainer when asked)
        self.started: float | None = None

    @classmethod
    def of(cls, trainer) -> TrainingClock:
        """The trainer's clock (Trainer replaces it by a new one when ``restore_callback_states_from_checkpoint``)."""
        return next(c for c in trainer.callback_handler.callbacks if isinstance(c, cls))

    def on_train_begin(self, args, state, control, **kwargs):
        name = type(self).__name__
        self.earlier = 0.0  # a new run; a resumed one (global_step > 0) starts from its checkpoint's seconds
        if state.global_step:
            stored = state.stateful_callbacks.get(name)
            if isinstance(stored, list):  # Trainer's form for several callbacks of one class: there is one
                stored = stored[0]
            self.earlier = (stored or {}).get("attributes", {}).get("earlier")
        self.started = time.perf_counter()
        # a checkpoint written without this callback has no entry, and Trainer indexes it at every save (KeyError)
        state.stateful_callbacks.setdefault(name, self.state())

    @property
    def seconds(self) -> float | None:
        """The run's seconds so far (this call's and the earlier ones), None when the earlier ones are unknown."""
        if self.earlier is None:
            return None
        return self.earlier + (time.perf_counter() - self.started if self.started is not None else 0.0)

    def state(self) -> dict:
        # at a checkpoint: the seconds so far become the "earlier" seconds of a run resumed from it
        return {"args": {}, "attributes": {"earlier": self.seconds}}


__all__ = ["Throughput", "TrainingClock", "flops_per_token", "gpu_fields", "peak_flops"]
