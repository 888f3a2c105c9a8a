"""The study across budgets on spoken translation (issue 64's 4th task): a copy of the `loramcl spoken-translation`
recipe (docs/experiments/spoken_translation.md) with its runs at several step budgets, written here and run by the
recipe's own command, which already compares LoRA-MCL, LoRA-MLE and the K-seed ensemble with an NLL table.

Per budget B and seed s, run files made of the packaged ones with `training:` overridden (steps B, training seed,
validation and a checkpoint every B / 5 steps, keep_best):
  mcl-B-s<s>           LoRA-MCL with today's default loss (K = 2 of rank 8, relaxed WTA with epsilon 0.05: the
                       packaged mcl-relaxed.yaml, `loramcl train`'s loss)
  mcl-annealed-B-s<s>  the recipe's own LoRA-MCL (mcl.yaml: annealed MCL, the paper's)
  mle-B-s<s>           LoRA-MLE of rank 16 (equal trainable parameters)
  mle-r8-B-s<m>        LoRA-MLE of rank 8, training seeds m = 2 s and 2 s + 1: the members of
  ensemble-B-s<s>      the K-seed ensemble (K = 2)
experiment.yaml decodes the four from their best checkpoints ('<run>@best': an ensemble's, its members' best) at
budget 2 (MCL greedy per hypothesis, LoRA-MLE beam 2, diverse beam of 2 groups (lambda 0.8) and 2 samples) and scores
every run's oracle NLL of the test references at its last and best adapters.

    python -m benchmarks.studies.budget_study --out /tmp/budgets --budgets 60 200 600 --seeds 0 1 \
        --spoken_recipe /tmp/spoken-budgets
    loramcl spoken-translation --recipes /tmp/spoken-budgets --threads 1
"""

from __future__ import annotations

from pathlib import Path

KEPT = ("common.yaml",)  # copied as it is; every run file is written from the packaged ones


def read_yaml(path: Path) -> dict:
    import yaml

    return yaml.safe_load(path.read_text(encoding="utf-8")) or {}


def write_yaml(path: Path, values: dict, header: str) -> None:
    import yaml

    path.write_text(f"# {header}\n" + yaml.safe_dump(values, sort_keys=False, allow_unicode=True), encoding="utf-8")


def run_file(packaged: Path, name: str, budget: int, seed: int, evaluations: int) -> dict:
    """The packaged run file ``name`` with its `training:` block at ``budget`` steps and training seed ``seed``."""
    from loramcl.recipes.files import merged

    every = max(1, budget // evaluations)
    return merged(read_yaml(packaged / f"{name}.yaml"), {"training": {
        "steps": budget, "seed": seed, "eval_every": every, "save_every": every, "keep_best": True}})


def write_recipe(folder: Path, out: Path, budgets: list[int], seeds: list[int], evaluations: int = 5) -> list[str]:
    """A spoken-translation recipe in ``folder`` (written whole, its outputs in ``out``) with the runs of every budget
    and seed; returns the command that runs it."""
    import shutil

    from loramcl.recipes.files import packaged_recipes

    packaged = packaged_recipes() / "spoken_translation"
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("*.yaml"):
        stale.unlink()
    for name in KEPT:
        shutil.copy(packaged / name, folder / name)
    decoded = []
    for budget in budgets:
        for seed in seeds:
            members = [f"mle-r8-{budget}-s{m}" for m in (2 * seed, 2 * seed + 1)]
            runs = {f"mcl-{budget}-s{seed}": ("mcl-relaxed", seed), f"mcl-annealed-{budget}-s{seed}": ("mcl", seed),
                    f"mle-{budget}-s{seed}": ("mle", seed),
                    members[0]: ("mle-r8", 2 * seed), members[1]: ("mle-r8", 2 * seed + 1)}
            for run, (packaged_run, run_seed) in runs.items():
                write_yaml(folder / f"{run}.yaml", run_file(packaged, packaged_run, budget, run_seed, evaluations),
                           f"{packaged_run}.yaml at {budget} steps, training seed {run_seed} (budget_study)")
            ensemble = f"ensemble-{budget}-s{seed}"
            write_yaml(folder / f"{ensemble}.yaml", {"ensemble": members},
                       f"the K-seed ensemble of {', '.join(members)} (budget_study)")
            decoded += [f"{run}-{budget}-s{seed}@best" for run in ("mcl", "mcl-annealed", "mle")] + [f"{ensemble}@best"]
    table = [entry for run in decoded for entry in (run.removesuffix("@best"), run)]
    experiment = read_yaml(packaged / "experiment.yaml") | {
        "out": str(out), "decoded": decoded, "nll_table": table, "budgets": [2], "mcl_decodings": ["greedy"],
        "diversity_penalties": [0.8], "tta": [], "sampling": [{"temperature": 1.0}]}
    write_yaml(folder / "experiment.yaml", experiment, "spoken translation at budgets "
               f"{', '.join(map(str, budgets))} steps, seeds {', '.join(map(str, seeds))} (budget_study)")
    return ["loramcl", "spoken-translation", "--recipes", str(folder), "--threads", "1"]
