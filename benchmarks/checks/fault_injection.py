"""Fault injection: adapter folders damaged, edited or converted, and base models edited, then loaded; a run's best
checkpoint damaged, then resumed or assembled; bad command
lines (numeric options out of their domain, output paths, devices and data files at fault) given to `loramcl train`,
`generate`, `nll` and `evaluate`; and training killed with SIGKILL at random moments, rerun with the same command, its
final adapters compared with an uninterrupted run's.

    python -m benchmarks.checks.fault_injection --kills 48 --file-trials 24 --seed 0   # CPU, about 30 s per kill
    python -m benchmarks.checks.fault_injection --kills 0 --file-trials 0 --no-inputs --best   # best checkpoint only
    python -m benchmarks.checks.fault_injection --kills 0 --no-inputs         # the file families only (a minute)
    python -m benchmarks.checks.fault_injection --kills 0 --file-trials 0     # the bad inputs only (4 minutes)

**Bad inputs** (in this process): benchmarks/checks/fault_inputs.py's docstring says how the trials are generated and
classified (refused clearly, refused but unclear, accepted, ran on); it exits 1 if any trial is accepted outside its
option's domain, refused unclearly or runs past ``--input-limit``.

**Files** (in this process): a tiny Llama (the one below) with K=3 random adapters is saved, and each trial copies the
folder, injects one fault, loads it with ``load_mcl_model`` and, when it loads, compares every hypothesis' logits on a
fixed batch with the original's. A trial is *refused* (an error), *said* (it loads with an ``AdapterFilesWarning``,
e.g. ``BaseWeightsMismatch``), or *silent*: then with the same outputs, or with other outputs, the failure this
counts (it must be 0); it is loaded again with ``strict=True``, which must refuse whatever was said. The families:
- damaged weights: one byte flipped in the data, 4 KB zeroed, the file truncated, header bytes overwritten
  (``--file-trials`` random trials);
- the same damages with ``weights_sha256`` deleted or null (random trials);
- edited settings that change the outputs: every field of ``mcl_config`` that ``settings_sha256`` covers, and
  ``weights_dtypes``; and one edit in a file without ``settings_sha256`` (as written by earlier versions);
- edited training settings (dropout, loss, epsilon, temperatures, tie_break, scoring_weight, logits_chunk_size):
  these may be edited, and must load silently with the same outputs;
- tensors converted after save (float16, bfloat16, float64) with the checksum updated;
- the base model edited outside the earlier fingerprint's sample: one row (+0.5) of a random base tensor, a row that
  the sample of 8 evenly spaced rows missed (random trials);
- ``base_fingerprint`` deleted or null, on the right base and on another seed's.
With ``PYTHONPATH`` pointing at another checkout's ``src``, the same trials measure that version (the table of
docs/guide/reliability.md has a "before" column made so).

**Best checkpoint** (``--best``, subprocesses): benchmarks/checks/fault_best.py's docstring says how its cases are made
and classified (a killed `loramcl train --training.keep_best true` run's OUT/best damaged, then resumed with the same
command; member best folders damaged, then assembled); it exits 1 if a case ends silently wrong, in a traceback, with an
unclear refusal or runs on.

**Kills**: every run is the same command, benchmarks/checks/fault_best.py's `loramcl train` (a tiny Llama, K = 2,
adapter dropout, 40 steps at a constant learning rate, validation and a checkpoint every 2 steps,
``training.keep_best``, ``--resume true``), in a process that announces each start of training, checkpoint write and
best-folder write. No manual step exists between a kill and the rerun.

Each trial starts a run in a fresh folder and kills it with SIGKILL: a third of the kills at a uniformly random time of
the training phase, a third at a random offset inside a randomly chosen checkpoint write, a third inside a randomly
chosen write of OUT/best (one the uninterrupted run made), at an offset from the start of its validation (the write
comes right after it, and a kill lands some milliseconds after its aim). The offsets are drawn up to the longest write
of that kind (for the best folder, validation and write) measured in the uninterrupted runs. A kill that left an
unpublished `checkpoints/incomplete-checkpoint-N/checkpoint-N` or `incomplete-best/best` behind landed inside that
write: without staging, that folder would have been the newest checkpoint or the best, half-written. A kill aimed
from outside lands some milliseconds late on a loaded machine, so a best write (tens of milliseconds) is rarely hit:
``--self-kills N`` adds N trials whose run sends itself the SIGKILL inside a random best write, at one of 3 points (the
write begun, nothing written yet; its adapters and tokenizer written; its best.json written, before the rename). Then
the command is rerun once; it counts as resumed if it exits 0, and as
identical if its last adapters, its best adapters and best.json's step and loss equal the uninterrupted run's. Two
uninterrupted runs are compared first, so that "identical" means something.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.checks.fault_best import (
    EVERY,
    STEPS,
    best_of,
    best_trials,
    build_folder,
    differences,
    kill_at,
    print_best_table,
    references,
    run_to_end,
    start,
)
from benchmarks.checks.fault_files import file_trials, print_file_table
from benchmarks.checks.fault_inputs import failed, input_trials, print_input_table

STAGING = "incomplete-"  # loramcl.training.checkpoints.STAGING_PREFIX: a folder being written, renamed when whole


# ---- the kills (the run: benchmarks/checks/fault_best.py's `loramcl train` with keep_best) --------------------------

KINDS = ("a random moment of training", "a checkpoint write", "a best-folder write")


def unpublished(out: Path) -> dict[str, list[str]]:
    """The writes a kill cut short: each staged folder's inner folder (what would have been published) and its files."""
    staged = [*(out / "checkpoints").glob(f"{STAGING}checkpoint-*"), *out.glob(f"{STAGING}best")]
    inner = [folder / folder.name.removeprefix(STAGING) for folder in staged]
    return {str(folder.relative_to(out)): sorted(p.name for p in folder.iterdir()) for folder in inner
            if folder.is_dir()}


def kill_trials(root: Path, kills: int, rng: random.Random, self_kills: int = 0) -> list[dict]:
    build_folder(root)
    reference, moments = references(root)
    training = min(at[("done", STEPS)] - at[("start", 0)] for at in moments)
    writes = {"save": [], "best": []}
    for at in moments:
        writes["save"] += [at[("saved", s)] - at[("save", s)] for s in range(EVERY, STEPS + 1, EVERY)]
        writes["best"] += [at[("bested", s)] - at[("evaluate", s)] for s in range(EVERY, STEPS + 1, EVERY)
                           if ("bested", s) in at]  # the validation and the write: a kill's notice lags
    best_steps = sorted(s for kind, s in moments[0] if kind == "bested")  # the validations that wrote best/
    longest = {kind: max(times) for kind, times in writes.items()}
    print(f"uninterrupted: 2 runs, identical last and best adapters (best: {best_of(reference)}); training phase "
          f"{training:.2f} s, longest checkpoint write {longest['save'] * 1000:.1f} ms, longest validation and "
          f"best-folder write {longest['best'] * 1000:.1f} ms (best written at steps {best_steps})", flush=True)
    records = []
    for i in range(kills + self_kills):
        out = root / f"trial-{i}"
        kind = KINDS[i % 3] if i < kills else "self"
        if kind == "self":  # the run kills itself at one of 3 points of a best write
            step, point = rng.choice(best_steps), rng.randrange(3)
            aimed = f"best write at step {step}, point {point} (self)"
        elif kind == KINDS[1]:
            step = rng.randrange(EVERY, STEPS + 1, EVERY)
            target, delay, aimed = ("save", step), rng.uniform(0, longest["save"]), f"write of checkpoint-{step}"
        elif kind == KINDS[2]:
            step = rng.choice(best_steps)
            target, delay = ("evaluate", step), rng.uniform(0, longest["best"])
            aimed = f"best write at step {step}"
        else:
            delay = rng.uniform(0, training)
            target, aimed = ("start", 0), f"{delay:.3f} s into training"
        if kind == "self":
            process = start(root, out, self_kill=f"{step}:{point}")
            process.communicate()
        else:
            process = kill_at(root, out, target, delay)
        cut = unpublished(out)
        record = {"aimed_at": aimed, "killed": process.returncode == -signal.SIGKILL, "cut_short": cut,
                  "inside a checkpoint write": any(name.startswith("checkpoints/") for name in cut),
                  "inside a best write": any(name.startswith(STAGING) for name in cut),
                  "checkpoints_after_kill": sorted(p.name for p in (out / "checkpoints").glob("checkpoint-*")),
                  "best_after_kill": best_of(out)}
        code, seen, stderr = run_to_end(root, out)  # the same command again, nothing done by hand in between
        record["resumed"] = code == 0
        record["resumed_at_step"] = next((step for kind, step, _ in seen if kind == "start"), None)
        if code != 0:
            record["error"] = stderr[-2000:]
        record["differences"] = differences(out, reference) if code == 0 else ["no finished run"]
        record["identical"] = not record["differences"]
        records.append(record)
        left = ", ".join(cut) or "nothing"
        print(f"kill {i + 1:3d}: aimed at {aimed:<28} cut short: {left:<40} best on disk {record['best_after_kill']}"
              f"  resumed at step {record['resumed_at_step']}  identical last and best: {record['identical']}"
              + (f" ({'; '.join(record['differences'])})" if record["differences"] else ""), flush=True)
    return records


def timed_family(folder: Path, name: str, trials: Callable[[Path], list[dict]],
                 table: Callable[[list[dict]], list[dict]]) -> dict:
    """One family's trials run in ``folder`` (made here), its table printed, then how many took how long: the
    report's entry (summary, seconds, trials)."""
    folder.mkdir()
    started = time.monotonic()
    records = trials(folder)
    seconds = round(time.monotonic() - started, 1)
    entry = {"summary": table(records), "seconds": seconds, "trials": records}
    print(f"{len(records)} {name} trials in {seconds} s")
    return entry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=48, help="number of trials, each with one SIGKILL (0: none)")
    parser.add_argument("--self-kills", type=int, default=0,
                        help="more kill trials, each run killing itself (SIGKILL) at a random one of 3 points inside "
                             "a random best-folder write: nothing written yet, its adapters written, its best.json "
                             "written (before the rename)")
    parser.add_argument("--file-trials", type=int, default=24,
                        help="trials of each random file family (damaged weights, base rows edited; 0: no file "
                             "families)")
    parser.add_argument("--inputs", action=argparse.BooleanOptionalAction, default=True,
                        help="the bad-CLI-input family (benchmarks/checks/fault_inputs.py; --no-inputs: none)")
    parser.add_argument("--input-limit", type=float, default=30.0,
                        help="seconds a bad-input trial may run before it counts as 'ran on'")
    parser.add_argument("--input-only", help="run only the bad-input trials whose 'command: fault' contains this")
    parser.add_argument("--input-before", help="a --json file written by an earlier version (PYTHONPATH at its src): "
                                               "the bad-input table then shows 'before -> now'")
    parser.add_argument("--best", action="store_true",
                        help="the best-checkpoint family too (benchmarks/checks/fault_best.py: OUT/best damaged in a "
                             "killed run, then resumed; member best folders damaged, then assembled; 4 minutes)")
    parser.add_argument("--best-limit", type=float, default=300.0,
                        help="seconds a resumed run of the best-checkpoint family may run before it counts as "
                             "'ran on'")
    parser.add_argument("--best-only", help="run only the best-checkpoint cases whose name contains this")
    parser.add_argument("--best-before", help="a --json file written by an earlier version with --best: the "
                                              "best-checkpoint table then shows 'before -> now'")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill moments and of the file damages")
    parser.add_argument("--json", help="write every trial's record to this file")
    args = parser.parse_args()
    if min(args.kills, args.self_kills, args.file_trials) < 0 or (
            args.kills + args.self_kills + args.file_trials == 0 and not args.inputs and not args.best):
        parser.error("--kills and --file-trials must be >= 0, and one of them at least 1 with --no-inputs "
                     "(unless --best)")
    if args.input_limit <= 0 or args.best_limit <= 0:
        parser.error(f"--input-limit and --best-limit must be numbers of seconds > 0, got {args.input_limit} and "
                     f"{args.best_limit}")
    before = json.loads(Path(args.input_before).read_text())["inputs"]["trials"] if args.input_before else None
    best_before = json.loads(Path(args.best_before).read_text())["best"]["trials"] if args.best_before else None
    rng = random.Random(args.seed)
    failures = 0
    report: dict = {}
    with tempfile.TemporaryDirectory(prefix="fault-injection-") as tmp:
        root = Path(tmp)
        if args.file_trials:
            (root / "files").mkdir()
            files = file_trials(root / "files", args.file_trials, args.seed)
            report["files"] = {"summary": print_file_table(files), "trials": files}
            failures += sum(r["outcome"] == "silent, other outputs" or (r["outcome"] == "said" and
                                                                        not r["strict_refused"]) for r in files)
        if args.inputs:
            report["inputs"] = timed_family(root / "inputs", "bad-input", lambda folder: input_trials(
                folder, args.input_limit, args.input_only), lambda trials: print_input_table(trials, before))
            failures += sum(failed(r) for r in report["inputs"]["trials"])
        if args.best:
            report["best"] = timed_family(root / "best", "best-checkpoint", lambda folder: best_trials(
                folder, args.best_limit, args.best_only), lambda trials: print_best_table(trials, best_before))
            failures += sum(r["outcome"] in ("silent, wrong", "traceback", "ran on", "refused, unclear")
                            for r in report["best"]["trials"])
        if args.kills or args.self_kills:
            (root / "kills").mkdir()
            records = kill_trials(root / "kills", args.kills, rng, args.self_kills)
    if args.kills or args.self_kills:
        killed = [r for r in records if r["killed"]]
        summary = {
            "kills tried": len(killed),
            "inside a checkpoint write (left an unpublished checkpoints/incomplete-checkpoint-N/checkpoint-N)":
                sum(r["inside a checkpoint write"] for r in killed),
            "inside a best-folder write (left an unpublished incomplete-best/best)":
                sum(r["inside a best write"] for r in killed),
            "resumed with no manual step": sum(r["resumed"] for r in killed),
            "identical last and best adapters (and best.json)": sum(r["identical"] for r in killed),
            "runs that ended before the kill (not counted)": len(records) - len(killed),
        }
        for key, value in summary.items():
            print(f"{key}: {value}")
        report["kills"] = {"summary": summary, "trials": records}
        failures += len(killed) - summary["identical last and best adapters (and best.json)"]
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    if failures:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
