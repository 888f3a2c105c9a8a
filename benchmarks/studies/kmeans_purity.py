"""Could k-means of the targets start the split? The purity of k-means clusters of the base model's features of each
training example's target against the example's known mode, on the defaults study's three tasks (issue 63).

Issue 63 proposes a start from the data: the first training steps' winners taken from a k-means of the targets'
base-model features instead of the hypotheses' NLL. That pays only if the clusters follow the modes, so this measures
it first. The tasks are the defaults study's (``defaults_study.build_task``: markov K = 3 chains, bilingual K = 2
languages, short K = 3 languages), its first ``--examples`` training rows, each with its mode. Per example, the base
model reads prompt + target + end-of-sequence as training tokenizes it (``encode_pairs``), and each feature kind is the
mean, over the target's positions (labels != -100: the target's tokens and the end-of-sequence), of

  middle       the output of the middle decoder layer (layer L // 2 of L),
  last         the output of the last decoder layer (the residual stream before the final norm),
  head-input   the input of the output layer (the last layer's output after the final norm),

each clustered as it is (``raw``) and standardised per dimension over the examples (``z``: the residual stream has a
few dimensions far larger than the rest, which weigh most in a Euclidean k-means). k-means: sklearn's KMeans, K the
task's number of modes, k-means++ seeding, the best of 30 restarts, seeded.

Per task and kind: cluster purity (the share of examples whose cluster's majority mode is theirs; chance: the largest
mode's share), the defaults study's *mode purity* of the same table (the share of examples in their mode's most
frequent cluster: what its WTA runs scored 0.66-0.97, high for a collapse too), normalised mutual information (0 for
clusters independent of the modes, 1 for clusters that are the modes) and the cluster sizes.

    python -m benchmarks.studies.kmeans_purity --model models/SmolLM2-135M-Instruct --tasks markov bilingual short
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.studies import defaults_study as study

KINDS = ("middle", "last", "head-input")
SCALINGS = ("raw", "z")


def target_features(model, tokenizer, rows: list[dict], batch_size: int = 32) -> dict[str, np.ndarray]:
    """{kind: [N, hidden]}: the mean over each row's target positions of the middle and last decoder layers' outputs
    and of the output layer's input (the base model alone, no adapters)."""
    from loramcl.data.prompts import collate, encode_pairs, pad_token_id

    decoder = model.get_decoder()
    layers = decoder.layers
    captured: dict[str, torch.Tensor] = {}

    def keep(kind):
        def hook(module, inputs, output):
            captured[kind] = output[0] if isinstance(output, tuple) else output  # [B, T, H]
        return hook

    handles = [layers[len(layers) // 2 - 1].register_forward_hook(keep("middle")),
               layers[-1].register_forward_hook(keep("last"))]
    encoded = encode_pairs(tokenizer, [r["prompt"] for r in rows], [r["target"] for r in rows])
    order = sorted(range(len(rows)), key=lambda i: len(encoded[i]["input_ids"]))  # batches of like lengths
    features = {kind: [] for kind in KINDS}
    try:
        for start in range(0, len(rows), batch_size):
            batch = collate([encoded[i] for i in order[start:start + batch_size]], pad_token_id(tokenizer))
            with torch.no_grad():
                captured["head-input"] = decoder(input_ids=batch["input_ids"],
                                                 attention_mask=batch["attention_mask"]).last_hidden_state
            target = (batch["labels"] != -100).unsqueeze(-1).float()  # [B, T, 1]
            for kind in KINDS:
                pooled = (captured[kind].float() * target).sum(1) / target.sum(1)  # [B, H]
                features[kind].append(pooled.numpy())
    finally:
        for handle in handles:
            handle.remove()
    back = np.argsort(order)  # the rows' own order again
    return {kind: np.concatenate(parts)[back] for kind, parts in features.items()}


def cluster(features: np.ndarray, clusters: int, scaling: str, seed: int = 0) -> np.ndarray:
    """k-means cluster ids [N] of the features as they are (``raw``) or standardised per dimension (``z``);
    k-means++ seeding, the best of 30 restarts (10 left the Markov task's result depending on the seed)."""
    from sklearn.cluster import KMeans

    if scaling == "z":
        features = (features - features.mean(0)) / (features.std(0) + 1e-6)
    return KMeans(n_clusters=clusters, n_init=30, random_state=seed).fit_predict(features)


def purity(modes: list[int], clusters: np.ndarray, count: int) -> dict:
    """Cluster purity, the defaults study's mode purity, NMI and sizes of ``clusters`` against the known ``modes``."""
    from sklearn.metrics import normalized_mutual_info_score

    table = [[int(sum(m == mode and c == k for m, c in zip(modes, clusters, strict=True))) for k in range(count)]
             for mode in range(max(modes) + 1)]  # [mode][cluster]
    return {"purity": sum(max(column) for column in zip(*table)) / len(modes),
            "mode_purity": study.mode_purity(table),
            "nmi": float(normalized_mutual_info_score(modes, clusters)),
            "sizes": sorted((int(s) for s in np.bincount(clusters, minlength=count)), reverse=True),
            "table": table}


def measure(model_path: Path, tasks: list[str], data: Path, examples: int, seed: int = 0) -> list[dict]:
    """One result per task and feature kind (the task's data built as the defaults study builds it)."""
    from transformers import AutoTokenizer

    from loramcl.models import load_model

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = load_model(str(model_path))
    results = []
    for task in tasks:
        study.build_task(task, data / task, train=2000, test=60)  # the study's own sizes: the same training rows
        rows = study.read_rows(data / task / "train.jsonl")[:examples]
        modes = [r["mode"] for r in rows]
        chance = max(np.bincount(modes)) / len(modes)
        started = time.perf_counter()
        features = target_features(model, tokenizer, rows)
        for kind in KINDS:
            for scaling in SCALINGS:
                ids = cluster(features[kind], study.TASKS[task], scaling, seed)
                results.append({"task": task, "K": study.TASKS[task], "examples": len(rows), "kind": kind,
                                "scaling": scaling, "chance": chance, **purity(modes, ids, study.TASKS[task]),
                                "seconds": round(time.perf_counter() - started, 1)})
    return results


def table(results: list[dict]) -> str:
    lines = ["| task | K | examples | features | cluster purity | chance (largest mode) | mode purity | NMI | "
             "cluster sizes |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['task']} | {r['K']} | {r['examples']} | {r['kind']}, {r['scaling']} | {r['purity']:.2f} | "
                     f"{r['chance']:.2f} | {r['mode_purity']:.2f} | {r['nmi']:.2f} | "
                     f"{' / '.join(map(str, r['sizes']))} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=Path("models/SmolLM2-135M-Instruct"))
    parser.add_argument("--tasks", nargs="+", default=list(study.MAIN_TASKS), choices=list(study.TASKS))
    parser.add_argument("--examples", type=int, default=1000, help="the first training rows of each task")
    parser.add_argument("--seed", type=int, default=0, help="k-means' seed")
    parser.add_argument("--data", type=Path, default=None,
                        help="where the tasks' data is built (the defaults study's OUT/data; default: a temporary "
                             "folder)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results (with the tables) here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from transformers.utils import logging

    logging.set_verbosity_error()
    with tempfile.TemporaryDirectory() as scratch:
        results = measure(args.model, args.tasks, args.data or Path(scratch), args.examples, args.seed)
    print(table(results))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
