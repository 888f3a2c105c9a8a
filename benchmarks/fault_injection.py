"""Fault injection: adapter folders damaged, edited or converted, and base models edited, then loaded; bad command
lines (numeric options out of their domain, output paths, devices and data files at fault) given to `loramcl train`,
`generate`, `nll` and `evaluate`; and training killed with SIGKILL at random moments, rerun with the same command, its
final adapters compared with an uninterrupted run's.

    python benchmarks/fault_injection.py --kills 48 --file-trials 24 --seed 0   # CPU, about 15 s per kill
    python benchmarks/fault_injection.py --kills 0 --no-inputs                  # the file families only (a minute)
    python benchmarks/fault_injection.py --kills 0 --file-trials 0              # the bad inputs only (4 minutes)

**Bad inputs** (in this process): benchmarks/fault_inputs.py's docstring says how the trials are generated and
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

**Kills**: every run is the same command, `fault_injection.py --child OUT`: it trains a tiny Llama (built here from a
config, K=3, relaxed WTA, adapter dropout so that the restored RNG state matters) for 16 steps with a checkpoint every 2
steps, keeping the last 2 (`save_total_limit`), calling `train(resume_from_checkpoint=True)` whether or not OUT
holds checkpoints, and writes its final adapters to OUT/final.safetensors. No manual step exists between a kill
and the rerun.

Each trial starts a run in a fresh folder and kills it: half of the kills at a uniformly random time of the
training phase, half at a random offset inside a randomly chosen checkpoint write (the child announces each
write; the offset is drawn up to the longest write measured in the uninterrupted runs). A kill that left an
unpublished `incomplete-checkpoint-N/checkpoint-N` behind landed inside a write: without atomic checkpoints, that
folder would have been the newest `checkpoint-N`, half-written. Then the command is rerun once; it counts as resumed
if it exits 0, and as identical if its final adapters equal the uninterrupted run's bit for bit. Two
uninterrupted runs are compared first, so that "identical" means something.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fault_files import file_trials, print_file_table
from fault_inputs import failed, input_trials, print_input_table

STEPS, SAVE_EVERY, KEEP = 16, 2, 2


# ---- the training run (child process) ---------------------------------------------------------------------------

def child(out: str) -> None:
    import safetensors.torch
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback, TrainingArguments
    from transformers.utils import logging

    from loramcl import MCLConfig, MCLTrainer, get_mcl_model

    logging.set_verbosity_error()
    torch.set_num_threads(1)  # bit-for-bit reproducible runs

    def say(*words) -> None:
        print(*words, f"{time.monotonic():.6f}", flush=True)

    class AnnouncingTrainer(MCLTrainer):
        def _save_checkpoint(self, model, trial) -> None:
            say("save", self.state.global_step)
            super()._save_checkpoint(model, trial)
            say("saved", self.state.global_step)

    class Start(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            say("start", state.global_step)

    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    mcl = get_mcl_model(base, MCLConfig(num_hypotheses=3, r=4, alpha=8, dropout=0.1, loss="relaxed", epsilon=0.1,
                                        target_modules=["q_proj", "v_proj", "down_proj"]))
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": ids, "attention_mask": torch.ones(16, dtype=torch.long), "labels": ids}
            for ids in torch.randint(3, 90, (96, 16), generator=g)]
    args = TrainingArguments(output_dir=out, max_steps=STEPS, per_device_train_batch_size=4, learning_rate=1e-2,
                             lr_scheduler_type="constant",  # an extra or a missing step would show in the adapters
                             save_strategy="steps", save_steps=SAVE_EVERY, save_total_limit=KEEP, logging_steps=1,
                             report_to=[], use_cpu=True, disable_tqdm=True, seed=0, data_seed=0)
    trainer = AnnouncingTrainer(mcl, args=args, train_dataset=data, callbacks=[Start()])
    trainer.train(resume_from_checkpoint=True)  # the same call on a fresh folder and after a kill
    final = os.path.join(out, "final.safetensors")
    safetensors.torch.save_file(mcl.adapter_state_dict(), final + ".tmp")
    os.replace(final + ".tmp", final)
    say("done", trainer.state.global_step)


# ---- the injector (parent process) ------------------------------------------------------------------------------

def start(out: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.Popen([sys.executable, __file__, "--child", str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def events(line: str) -> tuple[str, int, float] | None:
    words = line.split()
    if len(words) == 3 and words[0] in ("start", "save", "saved", "done"):
        return words[0], int(words[1]), float(words[2])
    return None


def run_to_end(out: Path) -> tuple[int, list[tuple[str, int, float]], str]:
    process = start(out)
    stdout, stderr = process.communicate(timeout=600)
    return process.returncode, [e for line in stdout.splitlines() if (e := events(line))], stderr


def adapters_equal(a: Path, b: Path) -> bool:
    import safetensors.torch
    import torch

    x, y = safetensors.torch.load_file(a), safetensors.torch.load_file(b)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def uninterrupted(root: Path) -> tuple[Path, float, float]:
    """(final adapters, length of the training phase, longest checkpoint write) of two uninterrupted runs, which
    must end identical."""
    finals, trainings, writes = [], [], []
    for name in ("reference-a", "reference-b"):
        code, seen, stderr = run_to_end(root / name)
        if code != 0:
            raise SystemExit(f"the uninterrupted run failed:\n{stderr[-3000:]}")
        at = {(kind, step): t for kind, step, t in seen}
        trainings.append(at[("done", STEPS)] - at[("start", 0)])
        writes += [at[("saved", s)] - at[("save", s)] for s in range(SAVE_EVERY, STEPS + 1, SAVE_EVERY)]
        finals.append(root / name / "final.safetensors")
    if not adapters_equal(*finals):
        raise SystemExit("two uninterrupted runs ended with different adapters: the comparison would mean nothing")
    return finals[0], min(trainings), max(writes)


def trial(out: Path, rng: random.Random, in_write: bool, training: float, longest_write: float) -> dict:
    process = start(out)
    record = {"aimed_at": None, "killed": False}
    if in_write:
        step = rng.randrange(SAVE_EVERY, STEPS + 1, SAVE_EVERY)
        record["aimed_at"] = f"write of checkpoint-{step}"
        target, delay = ("save", step), rng.uniform(0, longest_write)
    else:
        delay = rng.uniform(0, training)
        record["aimed_at"] = f"{delay:.3f} s into training"
        target = ("start", 0)
    for line in process.stdout:  # wait for the announced moment, then for the random delay
        event = events(line)
        if event and event[:2] == target:
            time.sleep(delay)
            break
    if process.poll() is None:
        os.kill(process.pid, signal.SIGKILL)
    process.communicate()
    record["killed"] = process.returncode == -signal.SIGKILL
    unpublished = [folder / folder.name.removeprefix("incomplete-") for folder in out.glob("incomplete-checkpoint-*")]
    unpublished = [folder for folder in unpublished if folder.is_dir()]  # a write the kill cut short
    record["left_a_half_written_checkpoint"] = bool(unpublished)
    record["half_written_files"] = sorted(p.name for folder in unpublished for p in folder.iterdir())
    record["checkpoints_after_kill"] = sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-"))
    code, seen, stderr = run_to_end(out)  # the same command again, nothing done by hand in between
    record["resumed"] = code == 0
    record["resumed_at_step"] = next((step for kind, step, _ in seen if kind == "start"), None)
    if code != 0:
        record["error"] = stderr[-2000:]
    return record


def kill_trials(root: Path, kills: int, rng: random.Random) -> list[dict]:
    reference, training, longest_write = uninterrupted(root)
    print(f"uninterrupted: 2 runs, identical adapters; training phase {training:.2f} s, "
          f"longest checkpoint write {longest_write * 1000:.1f} ms")
    records = []
    for i in range(kills):
        out = root / f"trial-{i}"
        out.mkdir()
        record = trial(out, rng, in_write=i % 2 == 1, training=training, longest_write=longest_write)
        final = out / "final.safetensors"
        record["identical"] = record["resumed"] and final.exists() and adapters_equal(reference, final)
        records.append(record)
        print(f"kill {i + 1:3d}: aimed at {record['aimed_at']:<26} half-written checkpoint left: "
              f"{'yes' if record['left_a_half_written_checkpoint'] else 'no ':<3}  resumed at step "
              f"{record['resumed_at_step']}  identical: {record['identical']}", flush=True)
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=48, help="number of trials, each with one SIGKILL (0: none)")
    parser.add_argument("--file-trials", type=int, default=24,
                        help="trials of each random file family (damaged weights, base rows edited; 0: no file "
                             "families)")
    parser.add_argument("--inputs", action=argparse.BooleanOptionalAction, default=True,
                        help="the bad-CLI-input family (benchmarks/fault_inputs.py; --no-inputs: none)")
    parser.add_argument("--input-limit", type=float, default=30.0,
                        help="seconds a bad-input trial may run before it counts as 'ran on'")
    parser.add_argument("--input-only", help="run only the bad-input trials whose 'command: fault' contains this")
    parser.add_argument("--input-before", help="a --json file written by an earlier version (PYTHONPATH at its src): "
                                               "the bad-input table then shows 'before -> now'")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill moments and of the file damages")
    parser.add_argument("--json", help="write every trial's record to this file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child)
    if args.kills < 0 or args.file_trials < 0 or (args.kills + args.file_trials == 0 and not args.inputs):
        parser.error("--kills and --file-trials must be >= 0, and one of them at least 1 with --no-inputs")
    if args.input_limit <= 0:
        parser.error(f"--input-limit must be a number of seconds > 0, got {args.input_limit}")
    before = json.loads(Path(args.input_before).read_text())["inputs"]["trials"] if args.input_before else None
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
            (root / "inputs").mkdir()
            started = time.monotonic()
            inputs = input_trials(root / "inputs", args.input_limit, args.input_only)
            seconds = round(time.monotonic() - started, 1)
            report["inputs"] = {"summary": print_input_table(inputs, before), "seconds": seconds, "trials": inputs}
            print(f"{len(inputs)} bad-input trials in {seconds} s")
            failures += sum(failed(r) for r in inputs)
        records = kill_trials(root, args.kills, rng) if args.kills else []
    if args.kills:
        killed = [r for r in records if r["killed"]]
        summary = {
            "kills tried": len(killed),
            "kills inside a checkpoint write (left a half-written incomplete-checkpoint-N/checkpoint-N)":
                sum(r["left_a_half_written_checkpoint"] for r in killed),
            "resumed with no manual step": sum(r["resumed"] for r in killed),
            "identical adapters": sum(r["identical"] for r in killed),
            "runs that ended before the kill (not counted)": len(records) - len(killed),
        }
        for key, value in summary.items():
            print(f"{key}: {value}")
        report["kills"] = {"summary": summary, "trials": records}
        failures += len(killed) - summary["identical adapters"]
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    if failures:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
