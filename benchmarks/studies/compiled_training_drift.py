"""Compiled training's drift (issue 61): the same tiny LoRA-MCL model trained on the same batches eagerly and with
``TrainConfig(compile=True)`` (Trainer's torch_compile), step by step, to tell a winner flipped by rounding from a
compiled step that computes something else.

Per step and loss: the loss eager / compiled, the examples whose winner (argmin_k of the NLL [B, K] the loss saw)
differs between the two runs, the largest |NLL eager - NLL compiled| of the step, and the smallest gap between the two
lowest NLLs of an example (eager's): a winner flips by rounding only where that gap is within the NLLs' difference.
After the first flip the two runs train different hypotheses on that example, so their losses part; before it they
must agree to rounding.

    python -m benchmarks.studies.compiled_training_drift --threads 1                      # inductor (C++, ~minutes)
    python -m benchmarks.studies.compiled_training_drift --threads 1 --backend aot_eager  # traced, no C++ compilation

The model and rows are the tiny Llama of benchmarks/tiny.py (the tests'); tests/training/test_trainer_compile.py runs
``drift`` and checks that the losses agree until a winner flips.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import tempfile
from pathlib import Path

import torch

from benchmarks.tiny import tiny_llama, token_rows
from loramcl import MCLConfig, MCLTrainer, TrainConfig, get_mcl_model
from loramcl.training.fit import training_arguments

LOSSES = {"wta": {}, "relaxed": {"epsilon": 0.05}, "annealed": {"temperature0": 1.0, "temperature_decay": 0.9}}


class _Recording(MCLTrainer):
    """MCLTrainer keeping each training step's loss, the NLL [B, K] its loss saw and the winners [B] it trained
    (two-pass WTA: those its scoring pass drew; one pass: the loss weights' argmax, ties broken as the loss broke
    them)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.recorded: list[tuple[float, torch.Tensor, torch.Tensor]] = []

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = super().compute_loss(model, inputs, True, num_items_in_batch)
        if model.training:  # the step's winners (loramcl.mcl.step.MCLStepOutput)
            self.recorded.append((loss.detach().item(), outputs.nll.detach().float().cpu(), outputs.winners.cpu()))
        return (loss, outputs) if return_outputs else loss


def train(loss: str, steps: int, k: int, rows: list[dict], out: Path, backend: str | None,
          learning_rate: float = 1e-2) -> tuple[list[tuple[float, torch.Tensor]], torch.Tensor]:
    """Each step's (loss, NLL [B, K]) and the trained adapters (flattened) of one run: eager (``backend`` None) or
    compiled with ``backend``."""
    torch.manual_seed(0)
    mcl = get_mcl_model(tiny_llama(), MCLConfig(num_hypotheses=k, r=4, alpha=8, loss=loss, **LOSSES[loss],
                                                        target_modules=["q_proj", "v_proj", "down_proj"]))
    training = TrainConfig(steps=steps, batch_size=4, learning_rate=learning_rate, warmup_steps=0, logging_steps=1,
                           save_every=0, eval_every=0, compile=backend is not None)
    args = training_arguments(training, str(out), evaluating=False, use_cpu=True, disable_tqdm=True,
                              **({"torch_compile_backend": backend} if backend else {}))
    trainer = _Recording(mcl, args=args, train_dataset=rows)
    with contextlib.redirect_stdout(io.StringIO()):  # Trainer's log lines and the verdict: the table says it
        trainer.train()
    adapters = torch.cat([p.detach().flatten() for p in mcl.parameters() if p.requires_grad])
    return trainer.recorded, adapters


def top_two_gap(nll: torch.Tensor) -> torch.Tensor:
    """[B]: the second lowest NLL of each example less its lowest (inf for K = 1)."""
    if nll.shape[1] < 2:
        return torch.full((nll.shape[0],), float("inf"))
    lowest = nll.topk(2, dim=1, largest=False).values
    return lowest[:, 1] - lowest[:, 0]


def drift(loss: str, steps: int = 6, k: int = 2, backend: str = "inductor", examples: int = 24,
          learning_rate: float = 1e-2) -> dict:
    """Eager and compiled training of ``loss`` side by side: per step, the losses, the winners that differ, the
    largest NLL difference and the smallest top-two gap; the adapters' largest difference at the end."""
    rows = token_rows(examples, 8, 0, prompt=2)
    with tempfile.TemporaryDirectory() as folder:
        eager, eager_adapters = train(loss, steps, k, rows, Path(folder) / "eager", None, learning_rate)
        compiled, compiled_adapters = train(loss, steps, k, rows, Path(folder) / "compiled", backend, learning_rate)
    table = []
    for step, ((loss_e, nll_e, won_e), (loss_c, nll_c, won_c)) in enumerate(zip(eager, compiled, strict=True), 1):
        flipped = (won_e != won_c).nonzero().flatten().tolist()
        gap = top_two_gap(nll_e)
        table.append({"step": step, "loss_eager": loss_e, "loss_compiled": loss_c, "flipped": flipped,
                      "flipped_ties": [i for i in flipped if gap[i].item() == 0.0],
                      "nll_difference": (nll_e - nll_c).abs().max().item(), "smallest_gap": gap.min().item(),
                      "flipped_gap": max((gap[i].item() for i in flipped), default=None)})
    return {"loss": loss, "k": k, "backend": backend, "steps": table,
            "adapters_difference": (eager_adapters - compiled_adapters).abs().max().item()}


def first_flip(result: dict) -> int | None:
    """The first step at which a winner differs between the runs (None: none did)."""
    return next((row["step"] for row in result["steps"] if row["flipped"]), None)


def markdown(result: dict) -> str:
    lines = [f"{result['loss']}, K = {result['k']}, {result['backend']}: adapters {result['adapters_difference']:.1e} "
             "apart at the end", "",
             "| step | loss eager | loss compiled | winners that differ (exact ties) | max abs NLL difference "
             "| smallest top-two gap | largest gap of a differing winner |", "|---|---|---|---|---|---|---|"]
    for row in result["steps"]:
        flipped_gap = "" if row["flipped_gap"] is None else f"{row['flipped_gap']:.1e}"
        lines.append(f"| {row['step']} | {row['loss_eager']:.6f} | {row['loss_compiled']:.6f} | "
                     f"{len(row['flipped'])} ({len(row['flipped_ties'])}) | {row['nll_difference']:.1e} | "
                     f"{row['smallest_gap']:.1e} | {flipped_gap} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--losses", nargs="+", choices=sorted(LOSSES), default=["wta", "relaxed", "annealed"])
    parser.add_argument("--k", type=int, nargs="+", default=[2], help="hypotheses (default 2)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--examples", type=int, default=24, help="training rows (batches of 4)")
    parser.add_argument("--learning-rate", type=float, default=1e-2)
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (default inductor, as "
                        "--training.compile true; aot_eager: traced, no C++ compilation)")
    parser.add_argument("--fallback-random", action="store_true", help="inductor draws its random numbers with "
                        "torch's eager RNG (torch._inductor.config.fallback_random), as eager does")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.fallback_random:
        importlib.import_module("torch._inductor.config").fallback_random = True
    for loss in args.losses:
        for k in args.k:
            result = drift(loss, args.steps, k, args.backend, args.examples, args.learning_rate)
            print(markdown(result) + "\n", flush=True)


if __name__ == "__main__":
    main()
