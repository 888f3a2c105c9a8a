"""Where the library makes the host wait for the GPU: one two-pass WTA training step and one K-hypothesis generate
(greedy, beam, diverse beam) run under ``torch.cuda.set_sync_debug_mode("warn")``, every synchronising call counted
by the first frame of loramcl (or of transformers, when the sync is theirs) that led to it.

    python -m benchmarks.speed.host_syncs --device cuda --dtype bfloat16   # needs a GPU: CUDA alone reports syncs

A warm-up of each run goes first (allocator and kernel caches), then the counted run. Prints a table per run and
writes it as JSON with ``--out``.
"""

from __future__ import annotations

import argparse
import json
import traceback
import warnings
from collections import Counter
from pathlib import Path

import torch

from benchmarks.common import train_step
from benchmarks.speed.suite_shapes import SHAPES, Suite
from loramcl.decoding import generate_hypotheses


def first_frame(stack: list[traceback.FrameSummary]) -> str:
    """The innermost frame of loramcl on the stack, else of transformers, else the innermost Python frame."""
    for package in ("/loramcl/", "/transformers/"):
        frames = [f for f in stack if package in f.filename and "warnings" not in f.filename]
        if frames:
            frame = frames[-1]
            return f"{frame.filename.split(package)[-1]}:{frame.lineno} {frame.name} [{package.strip('/')}]"
    return f"{stack[-1].filename}:{stack[-1].lineno}"


def count_syncs(run) -> Counter:
    """``run()`` with CUDA's sync debug mode on: how many synchronising calls each call site made."""
    sites: Counter = Counter()
    previous = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            sites[first_frame(traceback.extract_stack()[:-1])] += 1
        else:
            previous(message, category, filename, lineno, file, line)

    warnings.showwarning = record
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = previous
    return sites


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--shape", default="tiny", choices=list(SHAPES))
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not (args.device.startswith("cuda") and torch.cuda.is_available()):
        raise SystemExit("host_syncs.py: CUDA's sync debug mode reports host synchronisations on a GPU only "
                         "(--device cuda on a machine with one)")
    suite = Suite(SHAPES[args.shape], args.device, getattr(torch, args.dtype))
    shape = suite.shape
    batch = suite.batch(shape.seqs[0], shape.seqs[0] * 3 // 4, shape.batch)
    prompt = {name: value[:1, : shape.prompt] for name, value in suite.batch(shape.prompt, 0, 1).items()
              if name != "labels"}
    results = {}
    for loss, variant in (("wta", "wta-two-pass-blocks"), ("relaxed", "stacked")):
        mcl, optimizer = suite.wrap(args.k, loss=loss)
        train_step(variant, mcl, batch, optimizer)  # warm-up
        results[f"train {variant}"] = count_syncs(lambda: train_step(variant, mcl, batch, optimizer))
    mcl = mcl.eval()
    for strategy, extra in (("greedy", {}), ("beam", {"num_beams": 2}),
                            ("diverse_beam", {"num_beams": 2, "diversity_penalty": 0.8})):
        def run():
            return generate_hypotheses(mcl, None, prompt, strategy=strategy, max_new_tokens=shape.new_tokens,
                                       min_new_tokens=shape.new_tokens, **extra)
        run()
        results[f"generate {strategy}"] = count_syncs(run)
    for run, sites in results.items():
        print(f"\n{run}: {sum(sites.values())} host syncs")
        for site, count in sites.most_common():
            print(f"  {count:5d}  {site}")
    if args.out:
        args.out.write_text(json.dumps({"shape": args.shape, "k": args.k, "device": torch.cuda.get_device_name(),
                                        "new_tokens": shape.new_tokens, "runs": results}, indent=1))


if __name__ == "__main__":
    main()
