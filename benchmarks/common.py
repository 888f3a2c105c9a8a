"""What the benchmarks share: models built from configs with random weights, the paper's grouped-conv layer, the
timer of interleaved steps, peak memory (in this process or a fresh one), K-hypothesis decoding and markdown tables.

The scripts of speed/, checks/ and studies/ import it as ``benchmarks.common``: they run as modules from the
repository root (``python -m benchmarks.speed.suite``), which puts the root on their path.
"""

from __future__ import annotations

import copy
import itertools
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from loramcl import MCLLoraLinear, mcl_loss
from loramcl.decoding import generate_hypotheses
from loramcl.mcl.step import MCLStepOutput, mcl_step, scoring_block

# LoRA on attention's q, k, v and the MLP's up and down projections (the paper's audio and vision setting)
TARGETS = ["q_proj", "k_proj", "v_proj", "up_proj", "down_proj"]


def small_llama_arguments(parser) -> None:
    """The command-line options of the scripts that time a small random Llama: where it runs and its size."""
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=576)  # SmolLM2-135M's width
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")


def start(args) -> None:
    """Set torch's CPU threads (``--threads``, 0: torch's default) and silence transformers' warnings."""
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers.utils import logging

    logging.set_verbosity_error()


def small_llama_config(layers: int, hidden: int, vocab: int, positions: int):
    """The benchmarks' small Llama: heads of 64, a third as many key/value heads, MLP 8/3 of the width."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
                       num_hidden_layers=layers, num_attention_heads=hidden // 64,
                       num_key_value_heads=max(hidden // 192, 1), max_position_embeddings=positions)


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_model(model_class, config, device: str | torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """``model_class(config)`` with random weights made directly on ``device`` in ``dtype`` (an 8B model never
    passes through the CPU in float32; ``torch.device("meta")`` gives the shapes without any memory)."""
    with torch.device(device), default_dtype(dtype):
        return model_class(config)


def twin(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model``'s modules sharing its parameters and buffers: several MCL wrappings of one frozen base
    side by side in one process, for the memory of one base."""
    shared = {id(tensor): tensor for tensor in itertools.chain(model.parameters(), model.buffers())}
    return copy.deepcopy(model, shared)


def perturb_adapters(mcl, std: float = 0.02) -> None:
    """Non-zero B (zero at init), so that the hypotheses differ as they do after some training."""
    with torch.no_grad():
        for _, layer in mcl.mcl_layers():
            layer.lora_B.normal_(std=std)


class GroupedConvLoraLinear(MCLLoraLinear):
    """The paper's grouped-convolution LoRA (App. G footnote), on our hypothesis-major rows."""

    def _adapter_delta(self, h: torch.Tensor) -> torch.Tensor:
        if self.routing.mode != "stacked":
            return super()._adapter_delta(h)
        k, (rows, length, d_in), r, d_out = self.num_hypotheses, h.shape, self.r, self.out_features
        batch = rows // k
        x = h.view(k, batch, length, d_in).permute(1, 0, 3, 2).reshape(batch, k * d_in, length)  # copy
        # the float32 master adapters in h's dtype, as MCLLoraLinear computes (conv1d refuses mixed dtypes)
        weight_a = self._first_factor(h.dtype).transpose(1, 2).reshape(k * r, d_in, 1)  # group g: A_g^T
        weight_b = self._second_factor(h.dtype).transpose(1, 2).reshape(k * d_out, r, 1)
        y = F.conv1d(F.conv1d(x, weight_a, groups=k), weight_b, groups=k)  # [B, K*d_out, T]
        return y.view(batch, k, d_out, length).permute(1, 0, 3, 2).reshape(rows, length, d_out)  # copy


def use_grouped_conv(mcl) -> None:
    for _, layer in mcl.mcl_layers():
        layer.__class__ = GroupedConvLoraLinear


def train_step(variant: str, mcl, batch: dict, optimizer) -> MCLStepOutput | None:
    """One training step (forward, backward, optimizer) of ``mcl`` on ``batch`` (its ``target_index``, if any, passed
    as such), computed as ``variant`` says: loop (K forwards of one hypothesis each, then one backward: the reference
    the stacked forward replaces), or MCLTrainer's own step (``loramcl.mcl.step.mcl_step``): wta-two-pass (score all
    K without gradient, then forward and backward the winners only), wta-two-pass-blocks (the same with the scoring
    pass in blocks of examples: what MCLTrainer runs for loss="wta"), or anything else: one forward of the K
    hypotheses stacked. Returns the step's outputs (loss, winners, ...; None for loop)."""
    if variant == "loop":
        nll = torch.stack([mcl(**batch, hypotheses=h).nll for h in range(mcl.num_hypotheses)], dim=1)  # [B, K]
        loss, outputs = mcl_loss(nll, mcl.mcl_config)[0], None
    else:
        inputs = {name: value for name, value in batch.items() if name != "target_index"}
        per_block = scoring_block(len(batch["labels"]), mcl.num_hypotheses) if variant.endswith("blocks") else None
        outputs = mcl_step(mcl, inputs, mcl.mcl_config, two_pass=variant.startswith("wta-two-pass"),
                           examples_per_block=per_block, target_index=batch.get("target_index"))
        loss = outputs.loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return outputs


def synchronize(device: str | torch.device) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def timed(run: Callable[[], object], device: str | torch.device) -> float:
    """Seconds of ``run()``, the device's queued work included."""
    synchronize(device)
    started = time.perf_counter()
    run()
    synchronize(device)
    return time.perf_counter() - started


def interleaved_medians(runs: dict[Hashable, Callable[[], object]], repeats: int, device: str | torch.device,
                        warmup: int = 1) -> dict[Hashable, float]:
    """Median seconds of each run after ``warmup`` untimed calls; the runs take turns round by round, so that the
    machine's drifts hit all of them alike."""
    for run in runs.values():
        for _ in range(warmup):
            run()
    times = {key: [] for key in runs}
    for _ in range(repeats):
        for key, run in runs.items():
            times[key].append(timed(run, device))
    return {key: statistics.median(values) for key, values in times.items()}


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class ResidentPeak(threading.Thread):
    """Samples the resident set every half millisecond until stopped (torch ops release the GIL)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak, self._done = resident_bytes(), threading.Event()

    def run(self) -> None:
        while not self._done.wait(0.0005):
            self.peak = max(self.peak, resident_bytes())

    def stop(self) -> int:
        self._done.set()
        self.join()
        return max(self.peak, resident_bytes())


# glibc maps every allocation of 64 KiB or more on its own and unmaps it when freed, so that a freed tensor leaves
# the resident set at once: set it in the environment of a process that measures CPU memory (read at start-up).
RELEASE_FREED_MEMORY = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def peak_mib(device: str | torch.device, run: Callable[[], object]) -> float:
    """Peak memory of ``run()`` above what was in use before it: CUDA's allocated memory, or the resident set."""
    if str(device).startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        run()
        return (torch.cuda.max_memory_allocated() - before) / 2**20
    before = resident_bytes()
    sampler = ResidentPeak()
    sampler.start()
    run()
    return (sampler.stop() - before) / 2**20


def module_command(module: str, *arguments: str) -> list[str]:
    """The command line running the benchmark ``module`` (``__spec__.name``: benchmarks.speed.suite) in a new
    interpreter, as every benchmark runs: ``python -m``, in this process's folder (the repository root)."""
    return [sys.executable, "-m", module, *arguments]


def in_fresh_process(module: str, arguments: list[str], env: dict[str, str] | None = None) -> dict:
    """The JSON that ``python -m module *arguments`` prints on its last line, run in a fresh process (nothing else in
    its memory: the peak it measures is its own) with this process's environment updated by ``env``."""
    command = module_command(module, *arguments)
    output = subprocess.run(command, capture_output=True, text=True, check=True, env={**os.environ, **(env or {})})
    return json.loads(output.stdout.strip().splitlines()[-1])


def restart_releasing_freed_memory(module: str) -> None:
    """Run this command again as ``python -m module`` with RELEASE_FREED_MEMORY in its environment (glibc reads it
    at start-up only), unless it is there already: the resident set then measures the tensors alive."""
    if any(os.environ.get(name) != value for name, value in RELEASE_FREED_MEMORY.items()):
        os.execve(sys.executable, module_command(module, *sys.argv[1:]), {**os.environ, **RELEASE_FREED_MEMORY})


def decode(mcl, inputs: dict, strategy: str, beams: int, new_tokens: int, hypotheses: list[int] | None = None):
    """K candidates per input in one ``generate_hypotheses`` call, each forced to ``new_tokens`` tokens so that every
    side decodes the same number of steps (repetition penalty 1.1, the paper's)."""
    return generate_hypotheses(mcl, None, inputs, strategy=strategy, num_beams=beams, hypotheses=hypotheses,
                               max_new_tokens=new_tokens, min_new_tokens=new_tokens, repetition_penalty=1.1)


def decode_loop(mcl, inputs: dict, strategy: str, beams: int, new_tokens: int):
    """The same candidates from a loop of K calls, one hypothesis each: ``[K][B][1]``."""
    return [decode(mcl, inputs, strategy, beams, new_tokens, hypotheses=[k]) for k in range(mcl.num_hypotheses)]


def decoding_sides(mcl, inputs: dict, strategy: str, beams: int, new_tokens: int) -> dict[str, Callable[[], list]]:
    """The two sides of the decoding benchmark: one batched generate of the K hypotheses, a loop of K generates."""
    return {"batched": lambda: decode(mcl, inputs, strategy, beams, new_tokens),
            "loop": lambda: decode_loop(mcl, inputs, strategy, beams, new_tokens)}


def same_tokens(batched, looped) -> float:
    """Share of the candidates that the batched and the looped decoding gave token for token alike."""
    pairs = [(row[h].token_ids, looped[h][i][0].token_ids) for i, row in enumerate(batched) for h in range(len(row))]
    return sum(a == b for a, b in pairs) / len(pairs)


def print_table(header: list[str], rows: list[list]) -> None:
    """A markdown table: the header, its rule, one line per row (each cell as ``str`` gives it)."""
    print("| " + " | ".join(header) + " |")
    print("|---" * len(header) + "|")
    for row in rows:
        print("| " + " | ".join(str(cell) for cell in row) + " |")
