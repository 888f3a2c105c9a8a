"""What the base-weights fingerprint costs on a real-size model: the sampled scheme of earlier versions (8 rows x 64
values per tensor) against the fingerprint of every value, alone and inside a whole load of adapters, side by side
in one process.

    python -m benchmarks.speed.fingerprint_cost --threads 1                     # CPU: Llama-3.2-1B's shape, float32
    python -m benchmarks.speed.fingerprint_cost --device cuda --dtype bfloat16  # on a GPU

The model (``benchmarks/speed/suite.py``'s shape, random weights) is saved to a temporary folder with K=3 adapters on
q, k, v, up and down, once with each scheme's fingerprint, and loaded back with ``from_pretrained`` (timed once, with
a first read of every weight: ``from_pretrained`` maps the file, and the weights are read when first touched).
Then, taking turns (medians of ``--repeats``, after a warm-up that also reads every page of the loaded weights):
- ``sampled`` and ``every value``: one fingerprint of the base model;
- ``load before`` and ``load now``: ``load_mcl_model`` of the adapters (read, check, wrap, copy) and ``unload``. Before,
  the fingerprint was the sampled one, computed twice (once to check, once when wrapping): reproduced here by
  loading the folder that records a sampled fingerprint with wrapping's fingerprint set to the sampled scheme.
  Now, the fingerprint of every value, computed once (wrapping reuses the checked one).
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import tempfile
from pathlib import Path
from unittest import mock

import torch

from benchmarks.common import TARGETS, interleaved_medians, start, timed
from benchmarks.speed.suite_shapes import SHAPES
from loramcl import MCLConfig, get_mcl_model, load_mcl_model
from loramcl.mcl import build
from loramcl.mcl import fingerprint as fingerprints


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-1b", choices=[n for n, s in SHAPES.items() if s.family == "llama"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--json", type=Path, help="write the results to this file")
    args = parser.parse_args()
    start(args)
    from transformers import AutoModelForCausalLM

    shape, dtype = SHAPES[args.shape], getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory(prefix="fingerprint-cost-") as tmp:
        root = Path(tmp)
        base = shape.build(args.device, dtype)
        parameters = sum(p.numel() for p in base.parameters())
        base.save_pretrained(root / "base")
        mcl = get_mcl_model(base, MCLConfig(num_hypotheses=3, r=8, alpha=16, target_modules=TARGETS))
        mcl.save_pretrained(root / "now")
        del mcl, base
        gc.collect()
        shutil.copytree(root / "now", root / "before")
        loaded = []
        loaded_in = timed(lambda: loaded.append(
            AutoModelForCausalLM.from_pretrained(root / "base", dtype=dtype).to(args.device).eval()), args.device)
        base = loaded.pop()
        # from_pretrained maps the file; the weights are read when first touched (here from the page cache): that
        # read, which a first forward also pays, belongs to the cost of a load
        first_read = timed(lambda: [p.sum() for p in base.parameters()], args.device)
        config_file = root / "before" / "mcl_config.json"
        meta = json.loads(config_file.read_text())
        meta["base_fingerprint"] = fingerprints.sampled_fingerprint(base)  # as an earlier version recorded it
        config_file.write_text(json.dumps(meta))

        def load(folder: str, wrapping_fingerprint) -> None:
            with mock.patch.object(build, "base_fingerprint", wrapping_fingerprint):
                load_mcl_model(base, root / folder, strict=True).unload()

        runs = {
            "sampled": lambda: fingerprints.sampled_fingerprint(base),
            "every value": lambda: fingerprints.base_fingerprint(base),
            "load before": lambda: load("before", fingerprints.sampled_fingerprint),
            "load now": lambda: load("now", fingerprints.base_fingerprint),
        }
        seconds = interleaved_medians(runs, args.repeats, args.device)
    results = {"shape": shape.name, "note": shape.note, "parameters": parameters, "device": args.device,
               "dtype": args.dtype, "threads": torch.get_num_threads(), "from_pretrained_s": loaded_in,
               "first_read_s": first_read,
               **{f"{key.replace(' ', '_')}_s": value for key, value in seconds.items()}}
    loaded_in += first_read
    whole_before, whole_now = loaded_in + seconds["load before"], loaded_in + seconds["load now"]
    print(f"{shape.name} ({parameters / 1e9:.2f}B parameters, {args.dtype}, {args.device}, "
          f"{torch.get_num_threads()} threads); medians of {args.repeats}")
    print(f"from_pretrained and a first read of every weight: {loaded_in:.2f} s ({first_read:.2f} s of it the read)")
    print(f"fingerprint: sampled {seconds['sampled']:.3f} s, every value {seconds['every value']:.2f} s "
          f"({seconds['every value'] / seconds['sampled']:.0f}x)")
    print(f"load_mcl_model: before {seconds['load before']:.2f} s, now {seconds['load now']:.2f} s "
          f"({seconds['load now'] / seconds['load before']:.2f}x)")
    print(f"the base and its adapters loaded: before {whole_before:.2f} s, now {whole_now:.2f} s "
          f"({whole_now / whole_before:.2f}x)")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
