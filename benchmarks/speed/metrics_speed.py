"""Wall time of `loramcl evaluate` on 1,000 items x 5 candidates x 5 references (issue: <= 60 s on 2 CPU cores).

    .venv/bin/python -m benchmarks.speed.metrics_speed [--items 1000] [--candidates 5] [--references 5]

Synthetic caption-like sentences (seeded), written as preds.jsonl / refs.jsonl in a temporary folder, then the
CLI function runs twice: the captioning preset without SPICE/SPIDEr (no CoreNLP jars offline) and the translation
preset. Prints the time of each step (METEOR's JVM runs beside the Python metrics: its time overlaps).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

SUBJECTS = ["a man", "a woman", "two dogs", "a small child", "a group of people", "an old car", "a brown horse",
            "the birds", "a young girl", "some water", "a train", "a crowd", "the wind", "a musician", "a cat"]
VERBS = ["is walking", "runs", "is playing", "sits", "is singing", "passes by", "flows", "is barking", "waits",
         "is talking", "rides", "chirps", "blows", "is standing", "jumps"]
PLACES = ["on the beach", "in a park", "along the street", "near a river", "in the kitchen", "at the station",
          "under a tree", "in the rain", "on a bridge", "in the distance", "behind the house", "in a field"]
EXTRAS = ["", "", "while it rains", "with a loud noise", "in the morning", "as cars pass", "and people talk",
          "slowly", "quickly", "next to a fence"]


def sentence(rng: random.Random) -> str:
    words = " ".join(w for w in (rng.choice(SUBJECTS), rng.choice(VERBS), rng.choice(PLACES), rng.choice(EXTRAS)) if w)
    return words[0].upper() + words[1:] + rng.choice([".", ".", "!", ""])


def variant(text: str, rng: random.Random) -> str:
    """A candidate near a reference: a few words dropped or swapped for another sentence's words."""
    words = text.split()
    for _ in range(rng.randint(0, 3)):
        i = rng.randrange(len(words))
        words[i] = rng.choice(sentence(rng).split())
    return " ".join(words)


def write_fixture(folder: Path, items: int, candidates: int, references: int, seed: int = 0) -> tuple[Path, Path]:
    rng = random.Random(seed)
    preds, refs = folder / "preds.jsonl", folder / "refs.jsonl"
    with preds.open("w") as p, refs.open("w") as r:
        for i in range(items):
            item_refs = [sentence(rng) for _ in range(references)]
            cands = [variant(rng.choice(item_refs), rng) if rng.random() < 0.7 else sentence(rng)
                     for _ in range(candidates)]
            p.write(json.dumps({"id": i, "candidates": cands}) + "\n")
            r.write(json.dumps({"id": i, "references": item_refs, "lang": "en" if i % 2 else "fr"}) + "\n")
    return preds, refs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=1000)
    parser.add_argument("--candidates", type=int, default=5)
    parser.add_argument("--references", type=int, default=5)
    args = parser.parse_args()

    from loramcl.metrics.evaluate import evaluate

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        preds, refs = write_fixture(folder, args.items, args.candidates, args.references)
        runs = {"captioning": dict(metrics="captioning", exclude="spice,spider", group_key="lang"),
                "translation": dict(metrics="translation")}
        results = {}
        for run, options in runs.items():
            start = time.perf_counter()
            paths = evaluate(str(preds), str(refs), out=str(folder / "eval"), name=run, **options)
            results[run] = (time.perf_counter() - start, json.loads(Path(paths["json"]).read_text())["timing_s"])
    print(f"\n{args.items} items x {args.candidates} candidates x {args.references} references")
    for run, (seconds, steps) in results.items():
        print(f"  {run:12s} {seconds:6.1f} s   steps: " + ", ".join(f"{k} {v:.1f}" for k, v in steps.items()))
    print(f"  {'both':12s} {sum(s for s, _ in results.values()):6.1f} s")


if __name__ == "__main__":
    main()
