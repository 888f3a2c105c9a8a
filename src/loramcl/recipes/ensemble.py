"""The ensemble run kind of the recipes: a run file holding `ensemble: [run, run, ...]` names K member runs of its
folder (e.g. LoRA-MLE runs at rank r with different seeds), trained by the runner like any run, then assembled into
one K-hypothesis model folder (``loramcl.mcl.ensemble.assemble_hypotheses``) that every later stage reads as it reads
a LoRA-MCL run: the NLL table gives the oracle NLL over the members, decoding one candidate per member."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from loramcl.recipes.files import method_of, num_hypotheses
from loramcl.utils.files import write_json
from loramcl.utils.inputs import RUN_RECORD
from loramcl.utils.run_record import RunFile
from loramcl.utils.validate import require

ENSEMBLE = "ensemble"  # the run file's setting naming the members
ASSEMBLED = "ensemble.json"  # the assembly stage's record, in the ensemble's folder
SHARED = ("model", "dtype", "quantization")  # what every member and the ensemble's decoding use alike


def ensembles(values: dict[str, dict]) -> dict[str, list[str]]:
    """{ensemble run: its member runs} of a recipe folder's runs (``values``: each run's settings), checked: two or
    more distinct member runs of the folder, none an ensemble itself, each LoRA-MCL (K = 1: LoRA-MLE), with the same
    `mcl:` block but num_hypotheses and the same model, dtype and quantization."""
    found = {run: v[ENSEMBLE] for run, v in values.items() if ENSEMBLE in v}
    for run, members in found.items():
        names = isinstance(members, list) and all(isinstance(m, str) for m in members)
        require(names and len(set(members)) == len(members) >= 2, f"run {run}: ensemble must list two or more "
               f"distinct run names of its folder, got {members!r}")
        unknown = sorted(set(members) - set(values))
        require(not unknown, f"run {run}: ensemble names {unknown}, which have no run file (runs: {sorted(values)})")
        nested = sorted(set(members) & set(found))
        require(not nested, f"run {run}: its members {nested} are ensembles themselves: name their members instead")
        first = values[members[0]]
        for member in members:
            method, _ = method_of(values[member])
            require(method == "mcl", f"run {run}: member {member} trains method {method}; an ensemble's members "
                   "are LoRA-MCL runs (K = 1: LoRA-MLE)")
            block = {**values[member]["mcl"], "num_hypotheses": None}
            require(block == {**first["mcl"], "num_hypotheses": None}, f"run {run}: member {member}'s mcl: block "
                   f"differs from {members[0]}'s beyond num_hypotheses: the members of one model share their "
                   "adapters' settings (change only the training seed or data)")
            differing = [name for name in SHARED if values[member].get(name) != first.get(name)]
            require(not differing, f"run {run}: member {member} differs from {members[0]} in {differing}")
    return found


def ensemble_values(run: str, members: Sequence[str], values: dict[str, dict]) -> dict:
    """The settings the stages read of ensemble ``run``: its first member's, its own `out`, `ensemble`, and an `mcl:`
    block whose K is the sum of its members'."""
    first = values[members[0]]
    k = sum(num_hypotheses(values[member]) for member in members)
    return first | {"out": values[run]["out"], ENSEMBLE: list(members), "mcl": first["mcl"] | {"num_hypotheses": k}}


def with_members(runs: Sequence[str], found: dict[str, list[str]]) -> list[str]:
    """``runs`` in order, each ensemble preceded by those of its members not trained before it."""
    return list(dict.fromkeys(name for run in runs for name in [*found.get(run, []), run]))


def assemble(root: Path, run: str, values: dict, members: Sequence[str], best: bool = False) -> None:
    """Write root/``run``: the members' (root/<member>) hypotheses as one MCL model folder, a run.json (the members'
    stamps; seconds: the members' training time, the ensemble's training cost) and an empty train_log.json.
    ``best``: also root/``run``/best, the members' best-validation adapters (root/<member>/best, each member's own
    lowest validation loss, ``training.keep_best``) as one model, with a best.json of each member's best.json, each
    checked against its member's run first (``check_run_best``)."""
    from loramcl.mcl.ensemble import assemble_hypotheses
    from loramcl.models.load import training_model_loader
    from loramcl.training.runs import run_record
    from loramcl.utils.inputs import BEST_FOLDER
    from loramcl.utils.run_best import BEST_RECORD, check_run_best

    started = time.perf_counter()
    out = root / run
    run_file = RunFile.of(values)
    load = training_model_loader(run_file.model, run_file.dtype, run_file.quantization)
    model = assemble_hypotheses(load(), [root / member for member in members])
    model.save_pretrained(out)
    if best:
        kept = {member: check_run_best(root / member) for member in members}  # checked against the member's run
        missing = [member for member, record in kept.items() if record is None]
        require(not missing, f"run {run}: members {missing} kept no best-validation adapters ({root}/<member>/best):"
                " set `training: {keep_best: true}` in their run files and train them again")
        assemble_hypotheses(load(), [root / member / BEST_FOLDER for member in members]).save_pretrained(
            out / BEST_FOLDER)
        write_json(out / BEST_FOLDER / BEST_RECORD, {"members": kept})
    records = [run_record(root / member) for member in members]
    trainable = sum(r.trainable_parameters for r in records)  # each member's, trained on its own
    total = records[0].total_parameters + trainable - records[0].trainable_parameters
    settings = records[0].settings.values | {"mcl": model.mcl_config.to_dict(), ENSEMBLE: list(members)}
    record = {"settings": settings, "members": {m: r.seconds for m, r in zip(members, records, strict=True)},
              "resumed_from": None, "trainable_parameters": trainable, "total_parameters": total,
              "seconds": round(sum(r.seconds for r in records), 1),
              "assembly_seconds": round(time.perf_counter() - started, 1)}
    if partial := [member for member, r in zip(members, records, strict=True) if r.seconds_partial]:
        record["seconds_counted_from_resume"] = partial  # members resumed from a checkpoint without their seconds
    write_json(out / "train_log.json", [])  # no training of its own: the members' logs are theirs
    write_json(out / RUN_RECORD, record)  # last: a folder with a run.json is finished


def check_best_adapters(root: Path, run: str, members: Sequence[str] | None, reader: str | None = None) -> None:
    """Before a '<run>@best' row is scored or a '<run>@best' system decoded (or its outputs reused): root/``run``/best
    checked against the run (``check_run_best``); for an ensemble (``members``), each member's best and the record of
    the assembled one. ``reader``: what reads it, for the message (default: the NLL table's row)."""
    from loramcl.utils.inputs import BEST_FOLDER
    from loramcl.utils.run_best import BEST_RECORD, best_record, check_run_best

    kept = {name: check_run_best(root / name) for name in members or [run]}
    missing = [name for name, record in kept.items() if record is None]
    if missing:
        reader = reader or f"the {run}@best row scores it"
        raise FileNotFoundError(f"{root / missing[0] / BEST_FOLDER} does not exist, and {reader}: "
                                f"restore it from a copy, or delete {root / missing[0]} to train the run again")
    if members:
        recorded = best_record(root / run)
        require(recorded is not None and recorded.get("members") == kept, f"{root / run / BEST_FOLDER / BEST_RECORD} "
                "does not record its members' best adapters as they are now: delete "
                f"{root / run / BEST_FOLDER} and {root / run / ASSEMBLED} to assemble it again")
