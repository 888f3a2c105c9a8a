"""Preparing prompt/completion rows for training: loramcl.data.prepare_dataset against TRL's SFTTrainer on the same
rows and tokenizer, side by side in one run (time and peak memory).

Each side runs in a fresh process on the same N rows (an in-memory datasets.Dataset, so neither reads a cache):
  loramcl   prepare_dataset(rows, tokenizer, max_length=1024): input_ids and labels on the completion
  trl       SFTTrainer(tiny model, SFTConfig(max_length=1024), rows): its own preparation (EOS added, tokenized,
            labels built, truncated, fully masked rows dropped); the model is a 1-layer Llama of width 8, so the
            trainer's construction is its preparation
Both sides' examples are checked equal (input_ids and labels) on the first rows before the timing is reported.

    .venv/bin/python -m benchmarks.speed.data_prep --tokenizer models/SmolLM2-135M-Instruct            # 100,000 rows
    .venv/bin/python -m benchmarks.speed.data_prep --tokenizer models/SmolLM2-135M-Instruct --rows 1000

Peak memory: the peak resident set of the process during the preparation, above its resident set before it.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import time

from benchmarks.common import in_fresh_process, resident_bytes

WORDS = ("the cat sat on a mat while two dogs ran across green fields under blue sky near old stone bridge over "
         "quiet river where children played with red ball and yellow kite").split()


def rows(n: int, seed: int = 0) -> list[dict]:
    """n prompt/completion rows of 8-24 and 4-16 words."""
    draw = random.Random(seed)
    return [{"prompt": " ".join(draw.choices(WORDS, k=draw.randint(8, 24))) + ":",
             "completion": " " + " ".join(draw.choices(WORDS, k=draw.randint(4, 16)))} for _ in range(n)]


def prepare(side: str, tokenizer_path: str, n: int) -> dict:
    """One side's preparation of n rows in this process: seconds, peak MiB above the start, first examples."""
    from datasets import Dataset, disable_progress_bars
    from transformers import AutoTokenizer

    disable_progress_bars()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    data = Dataset.from_list(rows(n))
    if side == "trl":
        from trl import SFTConfig, SFTTrainer

        from benchmarks.tiny import tiny_llama

        model = tiny_llama(vocab_size=len(tokenizer), hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=2048)
        args = SFTConfig(output_dir="/tmp/data_prep_trl", report_to=[], max_length=1024, use_cpu=True, bf16=False,
                         completion_only_loss=True)
    else:
        from loramcl.data import prepare_dataset
    before = resident_bytes() / 2**20
    started = time.perf_counter()
    if side == "trl":
        prepared = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer).train_dataset
    else:
        prepared = prepare_dataset(data, tokenizer, max_length=1024)
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    first = [{"input_ids": e["input_ids"], "labels": e["labels"]} for e in prepared.select(range(min(50, n)))]
    return {"side": side, "rows": n, "examples": len(prepared), "seconds": seconds,
            "peak_mib": max(peak - before, 0.0), "first": first}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", default="models/SmolLM2-135M-Instruct")
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--side", choices=("loramcl", "trl"), help=argparse.SUPPRESS)  # a child process
    args = parser.parse_args()
    if args.side:
        print(json.dumps(prepare(args.side, args.tokenizer, args.rows)))
        return
    results = {}
    for side in ("loramcl", "trl"):
        results[side] = in_fresh_process(__spec__.name, ["--side", side, "--tokenizer", args.tokenizer, "--rows",
                                                          str(args.rows)],
                                         {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    ours, trl = results["loramcl"], results["trl"]
    if ours["first"] != trl["first"] or ours["examples"] != trl["examples"]:
        raise SystemExit("the two preparations differ: no timing reported")
    print(f"{args.rows:,} prompt/completion rows, tokenizer {args.tokenizer}, same examples on both sides")
    print("| preparation | seconds | rows/s | peak MiB above start |\n|---|---|---|---|")
    for side in ("loramcl", "trl"):
        r = results[side]
        print(f"| {side} | {r['seconds']:.2f} | {args.rows / r['seconds']:,.0f} | {r['peak_mib']:.0f} |")
    print(f"loramcl / trl: time {ours['seconds'] / trl['seconds']:.2f}x, peak memory "
          f"{ours['peak_mib'] / max(trl['peak_mib'], 1e-9):.2f}x")


if __name__ == "__main__":
    main()
