"""The best-checkpoint family of benchmarks/checks/fault_injection.py, and the run its kill trials kill: `loramcl train`
with ``training.keep_best`` on a tiny Llama (2 layers, width 32, a word tokenizer), K = 2, adapter dropout 0.1 (so the
restored RNG state matters), 40 steps at a constant learning rate of 0.1 (an extra or a missing step would show),
validation and a checkpoint every 2 steps, always with ``--resume true`` (the same command on a fresh folder and after
a kill). Its 4 validation pairs are not among the 8 training pairs, so the validation loss falls and then rises: the
best is step 28, not the last (``uninterrupted`` checks that the best is earlier than a later checkpoint).

**The run** (``child``, a process of its own: ``python -m benchmarks.checks.fault_best ROOT OUT SEED``) calls
``loramcl.cli.main`` with that command line, after wrapping three methods so that it announces, with the time, each
start of training (``start N``), each checkpoint write (``save N`` when it starts, ``saved N`` once renamed
into place) and each validation's best-folder
step (``best N`` before ``BestAdapters.on_evaluate``, ``bested N`` after it when it wrote ``OUT/best`` for step N).

**Damage to the best checkpoint** (``best_trials``): an uninterrupted run (twice: identical, so that "identical"
means something) gives the right ending; another run of the same command is killed as soon as its first checkpoint
after the best step is written (checkpoint-30; its ``best/`` is then step 28, as at the end); a third with another
seed gives foreign adapters. Each case copies the killed run, damages its ``best/`` (or nothing: the control, which
must end silent and right), and reruns the same command. The outcome is
- *refused clearly*: a non-zero exit with the command's one line ``loramcl train: error: ...``, no "(a bug? ...)"
  hint, naming ``OUT/best`` (or a file in it);
- *refused, unclear*: any other refusal that is not a traceback;
- *traceback*: a traceback, or the "(a bug? ...)" hint of an unexpected exception;
- *warned*: exit 0 with a ``loramcl train: warning:`` line about the best folder that the control does not print;
- *silent, right*: exit 0, no such warning, and the run ends with the uninterrupted run's best (``best.json``'s step
  and ``eval_loss``, and the same adapter tensors) and last adapters;
- *silent, wrong*: anything else that exits 0 without a word (a best lost, replaced or wrong);
- *ran on*: still running after ``--best-limit`` seconds.
Each record also says whether the damaged ``best/`` was left as it was (a refusal must delete nothing).

The ensemble cases assemble the uninterrupted run (m0) and the other seed's (m1), as the recipe runner does
(``loramcl.recipes.ensemble.assemble(..., best=True)``, in a process of its own), after one damage: a member's
``best.json`` truncated, or set to ``{"step": 999, "eval_loss": -5}``; m1's best adapter files copied into m0/best;
and ``assemble_hypotheses([m0, m0])``; and m1's best adapter files copied into m0/best, read by `loramcl nll --adapters
m0/best` (as the recipes' 'm0@best' NLL row reads it). Refused clearly: an error naming the member's folder that is not
a bare JSON/type/key error (for `nll`, the command's one error line); *traceback*: such a bare error, or the "(a bug?
...)" hint; silent, right: the undamaged members' files (the assembly, the NLL file).

Written against the command line and the public functions only, so that ``PYTHONPATH`` at an earlier checkout's
``src`` measures that version (``--json`` there, ``--best-before`` that file here prints both columns).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import module_command, print_table

STEPS, EVERY = 40, 2
TRAIN = [{"prompt": f"w{5 + i} w{6 + i}", "target": f"w{20 + i} w{21 + i}"} for i in range(8)]
VALIDATION = [{"prompt": f"w{7 + i} w{5 + i}", "target": f"w{30 + i} w{22 + i}"} for i in range(4)]
STAGING = "incomplete-"  # loramcl.training.checkpoints.STAGING_PREFIX
SELF_KILL = "FAULT_BEST_SELF_KILL"  # the environment variable of a run that kills itself inside a best write
OUTCOMES = ("refused clearly", "refused, unclear", "warned", "silent, right", "silent, wrong", "traceback", "ran on")


def command(root: Path, out: Path, seed: int) -> list[str]:
    """`loramcl train`'s arguments of every run here (after a kill: the same, nothing done by hand)."""
    return ["train", "--model", str(root / "tiny"), "--out", str(out),
            "--data.train_file", str(root / "train.jsonl"), "--data.validation_file", str(root / "val.jsonl"),
            "--data.max_length", "64", "--training.steps", str(STEPS), "--training.batch_size", "2",
            "--training.warmup_steps", "0", "--training.logging_steps", "1", "--training.learning_rate", "0.1",
            "--training.scheduler", "constant", "--training.eval_every", str(EVERY), "--training.save_every",
            str(EVERY), "--training.keep_best", "true", "--training.seed", str(seed), "--mcl.num_hypotheses", "2",
            "--mcl.dropout", "0.1", "--resume", "true"]


def build_folder(root: Path) -> None:
    """root/tiny (a tiny Llama with a word tokenizer), root/train.jsonl, root/val.jsonl and root/refs.jsonl (the
    validation pairs as `loramcl nll` reads references)."""
    import torch

    from benchmarks.checks.fault_inputs import _jsonl
    from benchmarks.tiny import tiny_llama, word_tokenizer

    torch.manual_seed(0)
    base = tiny_llama(max_position_embeddings=64)
    base.save_pretrained(root / "tiny")
    word_tokenizer().save_pretrained(root / "tiny")
    (root / "train.jsonl").write_text(_jsonl(TRAIN))
    (root / "val.jsonl").write_text(_jsonl(VALIDATION))
    (root / "refs.jsonl").write_text(_jsonl([{"id": str(i), "prompt": row["prompt"], "references": [row["target"]]}
                                             for i, row in enumerate(VALIDATION)]))


# ---- the run (a process of its own) --------------------------------------------------------------------------------

def child(root: str, out: str, seed: int) -> None:
    import torch
    from transformers import TrainerCallback

    import loramcl.training.best as best
    import loramcl.training.checkpoints as checkpoints
    import loramcl.training.trainer as trainer
    from loramcl.cli import main

    torch.set_num_threads(1)  # bit-for-bit reproducible runs
    record = Path(out) / "best" / "best.json"

    def say(*words) -> None:
        print(*words, f"{time.monotonic():.6f}", flush=True)

    class Start(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            say("start", state.global_step)

    mcl_trainer, on_evaluate = trainer.MCLTrainer, best.BestAdapters.on_evaluate
    init, save, publish = mcl_trainer.__init__, mcl_trainer._save_checkpoint, checkpoints.publish
    evaluate = mcl_trainer.evaluate

    def announcing_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.add_callback(Start())

    def announcing_validation(self, *args, **kwargs):
        say("evaluate", self.state.global_step)  # the validation, then (in its on_evaluate) the best folder's write
        return evaluate(self, *args, **kwargs)

    def announcing_save(self, model, trial):
        say("save", self.state.global_step)
        save(self, model, trial)  # written in incomplete-checkpoint-N/, renamed by a callback: publish, below

    def announcing_publish(folder: str) -> None:
        publish(folder)
        if Path(folder).name.startswith("checkpoint-"):
            say("saved", Path(folder).name.removeprefix("checkpoint-"))

    def announcing_evaluate(self, args, state, control, **kwargs):
        trainer_state["step"] = state.global_step
        say("best", state.global_step)
        result = on_evaluate(self, args, state, control, **kwargs)
        try:
            wrote = json.loads(record.read_text()).get("step") == state.global_step
        except (OSError, ValueError, AttributeError):
            wrote = False
        if wrote:
            say("bested", state.global_step)
        return result

    aim = os.environ.get(SELF_KILL)  # "STEP:POINT": SIGKILL this process at that point of that step's best write
    if aim:
        kill_step, kill_point = (int(word) for word in aim.split(":"))
        write, publish_best = best.write_adapters, best.publish

        def at(point: int, folder) -> None:
            if point == kill_point and trainer_state["step"] == kill_step and STAGING in str(folder):
                os.kill(os.getpid(), signal.SIGKILL)

        def killing_write(model, folder, *args, **kwargs):
            at(0, folder)  # the write begun (an earlier staging folder removed), nothing written yet
            write(model, folder, *args, **kwargs)
            at(1, folder)  # the adapters and the tokenizer written, not best.json

        def killing_publish(folder: str) -> None:
            at(2, staging_folder_of(folder))  # everything written, the rename not done
            publish_best(folder)

        best.write_adapters, best.publish = killing_write, killing_publish
    trainer_state = {"step": None}
    mcl_trainer.__init__, mcl_trainer._save_checkpoint = announcing_init, announcing_save
    mcl_trainer.evaluate = announcing_validation
    checkpoints.publish = announcing_publish  # the checkpoints' (best.py holds its own name for it: best writes)
    best.BestAdapters.on_evaluate = announcing_evaluate
    code = main(command(Path(root), Path(out), seed))
    say("done", STEPS)
    sys.exit(code)


def staging_folder_of(folder: str) -> str:
    return str(Path(folder).parent / f"{STAGING}{Path(folder).name}")


def start(root: Path, out: Path, seed: int = 0, self_kill: str | None = None) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop(SELF_KILL, None)
    if self_kill:
        env[SELF_KILL] = self_kill
    return subprocess.Popen(module_command(__spec__.name, str(root), str(out), str(seed)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def events(line: str) -> tuple[str, int, float] | None:
    words = line.split()
    if len(words) == 3 and words[0] in ("start", "save", "saved", "evaluate", "best", "bested", "done"):
        return words[0], int(words[1]), float(words[2])
    return None


def run_to_end(root: Path, out: Path, seed: int = 0, limit: float = 600) -> tuple[int | None, list, str]:
    """(exit code, None if it ran past ``limit`` seconds; the announced events; stderr) of one run."""
    process = start(root, out, seed)
    try:
        stdout, stderr = process.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        process.kill()
        stdout, stderr = process.communicate()
        return None, [], stderr
    return process.returncode, [e for line in stdout.splitlines() if (e := events(line))], stderr


def kill_at(root: Path, out: Path, target: tuple[str, int], delay: float) -> subprocess.Popen:
    """Run the command in ``out`` and SIGKILL it ``delay`` seconds after it announces ``target`` (or when it ends)."""
    process = start(root, out)
    for line in process.stdout:
        event = events(line)
        if event and event[:2] == target:
            time.sleep(delay)
            break
    if process.poll() is None:
        process.kill()
    process.communicate()
    return process


# ---- comparing runs -------------------------------------------------------------------------------------------------

def tensors_equal(a: Path, b: Path) -> bool:
    import safetensors.torch
    import torch

    if not (a.is_file() and b.is_file()):
        return False
    x, y = safetensors.torch.load_file(a), safetensors.torch.load_file(b)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def best_of(out: Path) -> dict | None:
    """best.json's step and eval_loss (None: unreadable or missing)."""
    try:
        record = json.loads((out / "best" / "best.json").read_text())
        return {"step": record["step"], "eval_loss": record["eval_loss"]}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def differences(out: Path, reference: Path) -> list[str]:
    """How ``out`` ends otherwise than the uninterrupted ``reference`` (empty: the same last and best adapters)."""
    found = []
    if not tensors_equal(out / "mcl_adapters.safetensors", reference / "mcl_adapters.safetensors"):
        found.append("last adapters differ")
    kept, right = best_of(out), best_of(reference)
    if kept != right:
        found.append(f"best.json {kept} (uninterrupted: {right})")
    if not tensors_equal(out / "best" / "mcl_adapters.safetensors", reference / "best" / "mcl_adapters.safetensors"):
        found.append("best adapters differ" if (out / "best" / "mcl_adapters.safetensors").is_file()
                     else "best adapters missing")
    return found


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()} if folder.is_dir() else {}


# ---- damage to OUT/best ---------------------------------------------------------------------------------------------

def _edit_record(**values):
    def edit(out: Path, other: Path) -> None:
        path = out / "best" / "best.json"
        path.write_text(json.dumps(json.loads(path.read_text()) | values, indent=1) + "\n")
    return edit


def _delete(name: str):
    return lambda out, other: (out / "best" / name).unlink()


def _truncate(out: Path, other: Path) -> None:
    path = out / "best" / "best.json"
    path.write_bytes(path.read_bytes()[:10])  # '{\n "step":' ... cut inside the first field's value


def _foreign(out: Path, other: Path) -> None:
    for name in ("mcl_adapters.safetensors", "mcl_config.json"):  # a whole, consistent adapter folder of another run
        shutil.copy(other / "best" / name, out / "best" / name)


CASES = {
    "nothing damaged (the control)": lambda out, other: None,
    "best/best.json deleted": _delete("best.json"),
    "best/mcl_adapters.safetensors deleted": _delete("mcl_adapters.safetensors"),
    "best/ adapters replaced by another seed's run's": _foreign,
    'best.json "eval_loss": 0.0': _edit_record(eval_loss=0.0),
    f'best.json "step": 999 (a {STEPS}-step run)': _edit_record(step=999),
    "best.json truncated": _truncate,
    'best.json "eval_loss": "low"': _edit_record(eval_loss="low"),
}


def classify_train(code: int | None, stderr: str, out: Path, reference: Path, control_warnings: set[str]) -> dict:
    lines = [line.replace(str(out), "OUT") for line in stderr.splitlines()]
    errors = [line for line in lines if line.startswith("loramcl train: error:")]
    warned = [line for line in lines if line.startswith("loramcl train: warning:") and "best" in line
              and line not in control_warnings]
    record = {"message": (errors or warned or [""])[-1][:400], "differences": differences(out, reference)}
    if code is None:
        record["outcome"] = "ran on"
    elif code != 0:
        bug = "Traceback" in stderr or "(a bug?" in stderr
        clear = len(errors) == 1 and "OUT/best" in errors[0]
        record["outcome"] = "traceback" if bug else "refused clearly" if clear else "refused, unclear"
        if not errors:
            record["message"] = stderr.strip().splitlines()[-1][:400] if stderr.strip() else ""
    elif warned:
        record["outcome"] = "warned"
    else:
        record["outcome"] = "silent, wrong" if record["differences"] else "silent, right"
    return record


def uninterrupted(root: Path, name: str, seed: int = 0) -> tuple[Path, dict[tuple[str, int], float]]:
    out = root / name
    code, seen, stderr = run_to_end(root, out, seed)
    if code != 0:
        raise SystemExit(f"the uninterrupted run {name} failed:\n{stderr[-3000:]}")
    return out, {(kind, step): t for kind, step, t in seen}


def references(root: Path) -> tuple[Path, list[dict]]:
    """The uninterrupted run (twice: they must be identical) and the announced moments of each."""
    first, at_first = uninterrupted(root, "reference-a")
    second, at_second = uninterrupted(root, "reference-b")
    if differences(second, first):
        raise SystemExit(f"two uninterrupted runs differ ({differences(second, first)}): comparisons would mean "
                         "nothing")
    return first, [at_first, at_second]


def best_trials(root: Path, limit: float, only: str | None = None) -> list[dict]:
    """Each CASES damage to a killed run's best/, resumed; then the ensemble cases (``only``: those whose name
    contains it). A record per case."""
    build_folder(root)
    cases = {case: damage for case, damage in CASES.items() if only is None or only in case}
    if cases:
        cases = {**dict(list(CASES.items())[:1]), **cases}  # the control: its warnings are the baseline
    reference, _ = references(root)
    other, _ = uninterrupted(root, "other-seed", seed=1)
    ensembles = {case: damage for case, damage in ENSEMBLE_CASES.items() if only is None or only in case}
    records = resumed_trials(root, reference, other, cases, limit) if cases else []
    return records + ensemble_trials(root, reference, other, ensembles)


def resumed_trials(root: Path, reference: Path, other: Path, cases: dict, limit: float) -> list[dict]:
    best_step = best_of(reference)["step"]
    killed_after = best_step + EVERY - best_step % EVERY  # the first checkpoint after the best step
    if killed_after >= STEPS:
        raise SystemExit(f"the uninterrupted run's best is step {best_step}: no later checkpoint to kill after")
    snapshot = root / "killed"
    kill_at(root, snapshot, ("saved", killed_after), 0.0)
    if best_of(snapshot) != best_of(reference):
        raise SystemExit(f"the run killed after checkpoint-{killed_after} holds best {best_of(snapshot)}, not the "
                         f"uninterrupted run's {best_of(reference)}")
    print(f"best-checkpoint damage: uninterrupted runs identical, best step {best_step} of {STEPS}; each case copies "
          f"a run killed after checkpoint-{killed_after}", flush=True)
    records, control_warnings = [], set()
    for i, (case, damage) in enumerate(cases.items()):
        out = root / f"case-{i}"
        shutil.copytree(snapshot, out)
        damage(out, other)
        damaged = files_of(out / "best")
        started = time.monotonic()
        code, _, stderr = run_to_end(root, out, limit=limit)
        if i == 0:
            control_warnings = {line.replace(str(out), "OUT") for line in stderr.splitlines()}
        record = {"family": "resumed run", "case": case, "code": code, "seconds": round(time.monotonic() - started, 1),
                  **classify_train(code, stderr, out, reference, control_warnings)}
        record["best kept as it was"] = files_of(out / "best") == damaged
        records.append(record)
        print_record(record)
    return records


# ---- ensembles ------------------------------------------------------------------------------------------------------

ASSEMBLE = """
import json, sys
from pathlib import Path
root, case = Path(sys.argv[1]), sys.argv[2]
if case == "duplicate":
    from transformers import AutoModelForCausalLM
    from loramcl.mcl.ensemble import assemble_hypotheses
    model = assemble_hypotheses(AutoModelForCausalLM.from_pretrained(root / "tiny"), [root / "m0", root / "m0"])
    model.save_pretrained(root / "ens")
else:
    from loramcl.recipes.ensemble import assemble
    assemble(root, "ens", {"model": str(root / "tiny")}, ["m0", "m1"], best=True)
"""


def _assemble(root: Path, case: str) -> tuple[int, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    if case == "nll":  # m0's best read as the recipes' 'm0@best' NLL row reads it
        argv = ["-c", "from loramcl.cli import main; main()", "nll", "--model", str(root / "tiny"), "--adapters",
                str(root / "m0" / "best"), "--input", str(root.parent / "refs.jsonl"), "--out", str(root / "nll.jsonl")]
    else:
        argv = ["-c", ASSEMBLE, str(root), case]
    done = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env)
    return done.returncode, done.stderr


ENSEMBLE_CASES = {
    "recipe: m0's best.json truncated": lambda root: _truncate(root / "m0", root),
    'recipe: m0\'s best.json set to {"step": 999, "eval_loss": -5}':
        lambda root: (root / "m0" / "best" / "best.json").write_text('{"step": 999, "eval_loss": -5}\n'),
    "recipe: m1's best adapter files copied into m0/best": lambda root: _foreign(root / "m0", root / "m1"),
    "assemble_hypotheses([m0, m0])": None,
    "m1's best adapter files copied into m0/best, read by `loramcl nll --adapters m0/best`":
        lambda root: _foreign(root / "m0", root / "m1"),
}


def ensemble_trials(root: Path, reference: Path, other: Path, cases: dict) -> list[dict]:
    def members(folder: Path) -> None:
        folder.mkdir()
        shutil.copytree(reference, folder / "m0", ignore=shutil.ignore_patterns("checkpoints"))
        shutil.copytree(other, folder / "m1", ignore=shutil.ignore_patterns("checkpoints"))
        os.symlink(root / "tiny", folder / "tiny")

    if not cases:
        return []
    right = root / "ensemble-right"
    members(right)
    for case in ("members", "nll"):
        code, stderr = _assemble(right, case)
        if code != 0:
            raise SystemExit(f"the undamaged members failed ({case}):\n{stderr[-3000:]}")
    records = []
    for i, (case, damage) in enumerate(cases.items()):
        folder = root / f"ensemble-{i}"
        members(folder)
        if damage is not None:
            damage(folder)
        damaged = files_of(folder / "m0" / "best")
        kind = "duplicate" if damage is None else "nll" if "loramcl nll" in case else "members"
        code, stderr = _assemble(folder, kind)
        lines = [line for line in stderr.strip().splitlines() if line.strip()]
        last = lines[-1] if lines else ""
        warned = [line for line in lines if "Warning" in line and ("m0" in line or "duplicate" in line.lower()
                                                                  or "same" in line.lower())]
        record = {"family": "ensemble", "case": case, "code": code,
                  "message": (warned or [last if code else ""])[-1][:400]}
        if code != 0:
            bare = any(last.startswith(kind) for kind in ("json.decoder.JSONDecodeError", "TypeError", "KeyError",
                                                          "AttributeError", "IndexError"))
            named = str(folder / "m0") in last and (kind != "nll" or last.startswith("loramcl nll: error:"))
            record["outcome"] = "traceback" if bare or "(a bug?" in last or not named else "refused clearly"
        elif warned:
            record["outcome"] = "warned"
        elif damage is None:
            record["outcome"] = "silent, wrong"  # two identical hypotheses
        elif kind == "nll":
            same = (folder / "nll.jsonl").read_text() == (right / "nll.jsonl").read_text()
            record["outcome"] = "silent, right" if same else "silent, wrong"
        else:
            same = (tensors_equal(folder / "ens" / "best" / "mcl_adapters.safetensors",
                                  right / "ens" / "best" / "mcl_adapters.safetensors")
                    and (folder / "ens" / "best" / "best.json").read_text()
                    == (right / "ens" / "best" / "best.json").read_text())
            record["outcome"] = "silent, right" if same else "silent, wrong"
        record["best kept as it was"] = files_of(folder / "m0" / "best") == damaged
        records.append(record)
        print_record(record)
    return records


# ---- the table ----------------------------------------------------------------------------------------------------

def print_record(record: dict) -> None:
    extra = f" ({'; '.join(record['differences'])})" if record.get("differences") and record["outcome"] in (
        "silent, wrong", "warned") else ""
    print(f"  {record['case']}: {record['outcome']}{extra} rc={record['code']}: {record['message']}", flush=True)


def best_table(records: list[dict], before: list[dict] | None = None) -> list[dict]:
    """One row per family and an 'all' row: trials and the count of each outcome ('before -> now' with before)."""
    def counts(rows: list[dict]) -> dict[str, int]:
        return {outcome: sum(r["outcome"] == outcome for r in rows) for outcome in OUTCOMES}

    rows = []
    for family in ("resumed run", "ensemble", None):
        now = [r for r in records if family in (None, r["family"])]
        row = {"family": family or "all", "trials": len(now), **counts(now)}
        if before is not None:
            earlier = counts([r for r in before if family in (None, r["family"])])
            row |= {o: f"{earlier[o]} -> {row[o]}" for o in OUTCOMES}
        rows.append(row)
    return rows


def print_best_table(records: list[dict], before: list[dict] | None = None) -> list[dict]:
    rows = best_table(records, before)
    print_table(["family", "cases", *OUTCOMES], [[row["family"], row["trials"], *(row[o] for o in OUTCOMES)]
                                                 for row in rows])
    if before is not None:
        was = {r["case"]: r["outcome"] for r in before}
        for r in records:
            print(f"  {r['case']}: {was.get(r['case'], 'not run')} -> {r['outcome']}")
    return rows


if __name__ == "__main__":
    child(sys.argv[1], sys.argv[2], int(sys.argv[3]))
