"""The bad-CLI-input family of benchmarks/checks/fault_injection.py: every numeric option of `loramcl train`,
`generate`, `nll` and `evaluate` given values outside its domain, and output paths, devices and data files at fault,
each run through ``loramcl.cli.main`` in this process on a tiny Llama folder (with a tokenizer) and its adapters, built
once.

**Generated, not picked.** The numeric options are read off each command's signature as its command line reads them
(jsonargparse: the arguments, the fields of the configurations they take, ``--data.*``, ``--training.*``, ``--mcl.*``,
``--moe.*``, ``--multihead.*``, and the ``Decoding`` fields ``generate``'s ``**decoding`` resolves to), so that an
option added later is covered. An integer option gets 0, -1, a huge integer (10^18), 1.5, nan, inf and a word; a real
one 0, -1, nan, inf, -inf, 1e30 and a word; a list of integers each of these inside a list and ``[]``. The option's
default is left out (``--training.seed 0`` is no fault). An option that acts only beside another setting
(``ACTIVE_WITH``: ``--mcl.epsilon`` with ``--mcl.loss relaxed``, the sampling options with ``--strategy sample``) gets
its values in the commands' defaults and again beside that setting. A few values are in the option's domain by its
meaning (``IN_DOMAIN``, each with the reason: ``--training.save_every 10^18`` saves no checkpoint; those of
``--diversity_penalty`` only beside its strategy): they must be accepted and are counted apart. Path faults: ``--out``
an existing folder where a file is written, an existing file where a folder is, below a file, in a folder without
write permission (not applicable when run as root, whom permissions do not stop), and the inputs, the model and the
adapters a folder or a file of the other kind or missing. Device faults (``generate``, ``nll``): cuda and cuda:0 on this
CPU-only torch, cuda:x, gpu, CPU, meta, mps. Data faults: empty, blank, missing or non-text fields, a line that is not
JSON or not an object, an empty file, bytes that are not UTF-8, a prompt longer than the model's 64 positions, NLL files
with NaN, negative or miscounted values.

**Outcomes.** A trial is
- *refused clearly*: exit 1 or 2, and stderr holds one line besides the command's warnings and finished progress
  bars, ``loramcl <command>: error: ...``, at the start of its line (no progress bar before it), without the "(a bug?
  --debug ...)" hint, naming what is at fault: an option fault its option as typed (``--training.learning_rate``), a
  path fault the option or the path, a device fault ``--device``, a data fault the file, its option's word or the
  field;
- *refused, unclear*: any other non-zero exit (the reason is listed);
- *accepted*: exit 0 (listed, since a value outside the domain then did work; *accepted, in domain* apart);
- *ran on*: still running after the time limit (``--input-limit`` seconds, SIGALRM; the work is cut there);
- *not applicable*: the unwritable folder as root; with ``--input-before``, a trial of an option the earlier version
  lacks.
A refusal is *before work* when the trial did not load the model (no ``from_pretrained`` of a transformers model:
the hook counts the calls) and wrote nothing where the command writes (its ``--out``, compared before and after).

Written against the command line only (``loramcl.cli.main``, its options read off the signatures), so that it also
measures an earlier version (``PYTHONPATH`` at its ``src``): ``--json`` there, then ``--input-before`` that file here
prints both columns.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import re
import signal
import sys
import time
import typing
import warnings
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import print_table
from benchmarks.tiny import tiny_llama, word_tokenizer

HUGE = 10**18
INT_VALUES = ("0", "-1", str(HUGE), "1.5", "nan", "inf", "ten")
REAL_VALUES = ("0", "-1", "nan", "inf", "-inf", "1e30", "ten")
COMMANDS = ("train", "generate", "nll", "evaluate")
# (option as typed, value): in the domain by the option's meaning (its help, or what torch takes): it must be accepted
IN_DOMAIN = {
    ("--training.eval_every", "0"): "its help: 0 validates at the end only",
    ("--training.eval_every", str(HUGE)): "validation at the end only",
    ("--training.save_every", "0"): "its help: 0 writes no checkpoint",
    ("--training.save_every", str(HUGE)): "no checkpoint before the end",
    ("--training.max_grad_norm", "0"): "its help: 0 clips nothing",
    ("--training.max_grad_norm", "1e30"): "no clipping in effect",
    ("--training.logging_steps", str(HUGE)): "no loss logged before the end",
    ("--training.keep_checkpoints", str(HUGE)): "every checkpoint kept",
    ("--training.batch_size", str(HUGE)): "every example in one batch",
    ("--training.adam_beta2", "0"): "in [0, 1), as torch's AdamW takes it",
    ("--data.eval_examples", str(HUGE)): "every validation example",
    ("--mcl.logits_chunk_size", str(HUGE)): "the logits computed in one chunk",
    ("--mcl.layers_to_transform", "0"): "block 0 exists",
    ("--mcl.epsilon", "0"): "its help: in [0, (K-1)/K]; 0 makes the relaxed loss vanilla WTA (paper eq. 4)",
    **{(f"--{block}.temperature0", "1e30"): "its help: > 0 (the K weights stay uniform until it decays)"
       for block in ("mcl", "multihead")},
    **{(f"--{block}.temperature_min", "0"): "its help: the loss turns into vanilla WTA below it (0: never)"
       for block in ("mcl", "multihead")},
    ("--batch_size", str(HUGE)): "every prompt or reference in one batch",
    ("--hypotheses", "[0]"): "hypothesis 0 exists",
    ("--top_k", str(HUGE)): "more tokens than the vocabulary: no limit (transformers takes the vocabulary's size)",
    ("--diversity_penalty", "0"): "its help: in [0, inf), 0 penalises nothing",
    ("--diversity_penalty", "1e30"): "its help: in [0, inf) (no hypothesis repeats another's token)",
    ("--temperature", "1e30"): "its help: > 0 (sampling from the uniform distribution)",
    ("--repetition_penalty", "1e30"): "its help: > 0",
}
# Options whose IN_DOMAIN values are in the domain only beside the setting they act with (ACTIVE_WITH): elsewhere the
# option belongs to another strategy and is refused.
IN_DOMAIN_ONLY_BESIDE_ITS_SETTING = {"--diversity_penalty"}
# Options that act only beside another setting: their values are tried there too, with the setting (None: the option
# left out), besides in the commands' defaults.
ANNEALED, RELAXED, SCORED = {"--mcl.loss": "annealed"}, {"--mcl.loss": "relaxed"}, {"--mcl.scoring": "true"}
HEADS_ANNEALED = {"--multihead.loss": "annealed"}
SINGLE = {"--adapters": None, "--num_beams": "4", "--num_sequences": "2"}  # a single-model baseline
ACTIVE_WITH = {
    "--mcl.epsilon": RELAXED, "--mcl.temperature0": ANNEALED, "--mcl.temperature_decay": ANNEALED,
    "--mcl.temperature_min": ANNEALED, "--mcl.scoring_weight": SCORED, "--training.scoring_learning_rate": SCORED,
    "--multihead.epsilon": {"--multihead.loss": "relaxed"}, "--multihead.temperature0": HEADS_ANNEALED,
    "--multihead.temperature_decay": HEADS_ANNEALED, "--multihead.temperature_min": HEADS_ANNEALED,
    "--moe.router_std": {"--moe.router_init": "normal"},
    "--num_beams": {"--strategy": "beam"}, "--budget": {"--strategy": "beam"},
    "--num_sequences": SINGLE | {"--strategy": "beam"},
    "--num_beam_groups": SINGLE | {"--strategy": "diverse_beam", "--diversity_penalty": "1.0"},
    "--diversity_penalty": {"--strategy": "diverse_beam", "--num_beams": "2"},
    **{f"--{name}": {"--strategy": "sample"} for name in ("temperature", "top_k", "top_p", "typical_p", "seed")},
}
OUTCOMES = ("refused clearly", "refused, unclear", "accepted", "accepted, in domain", "ran on", "not applicable")


@dataclass
class Trial:
    family: str  # numeric options, paths, devices, data
    command: str
    fault: str  # what was done, e.g. "--top_p 1.5", "--out an existing folder"
    argv: list[str]
    names: tuple[str, ...]  # the message must contain one of these
    writes: str  # where the command writes (its --out): nothing may appear there before the refusal
    folder: Path  # the trial's own folder: its stdout and stderr
    in_domain: str = ""
    not_applicable: str = ""

    @property
    def key(self) -> str:
        return f"{self.command}: {self.fault}"


# ---- the options of a command, as its command line reads them ------------------------------------------------------

def _kind(hint) -> str | None:
    """'int', 'float' or 'int list' for a numeric type hint (None: not numeric); None members are dropped."""
    members = [m for m in (typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, type(int | None))
                           else (hint,)) if m is not type(None)]
    if int in members:
        return "int"
    if float in members:
        return "float"
    lists = [typing.get_args(m)[0] for m in members if typing.get_origin(m) is list and typing.get_args(m)]
    return "int list" if lists == [int] else None


def command_options(function) -> dict[str, tuple[object, object]]:
    """{option without --: (its type hint, its default)} of a command: its parameters, the fields of a configuration a
    parameter takes (``section.field``), and what jsonargparse resolves a ``**kwargs`` to (``generate``'s Decoding
    fields)."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_function_arguments(function)
    options = {}
    for action in parser._actions:  # jsonargparse keeps each option's full type hint on its action
        hint = getattr(action, "_typehint", None) or action.type
        if not action.option_strings or action.dest.endswith(".help") or action.dest in ("help", "config"):
            continue
        config = next((t for t in (hint, *typing.get_args(hint)) if dataclasses.is_dataclass(t)), None)
        if config is not None:  # a block typed `Config | None` (--moe, --multihead) comes whole: its fields
            hints = typing.get_type_hints(config)
            options |= {f"{action.dest}.{f.name}": (hints[f.name], f.default) for f in dataclasses.fields(config)}
        else:
            options[action.dest] = (hint, action.default)
    return options


def _same_number(value: str, other) -> bool:
    try:
        return other is not None and not isinstance(other, bool) and float(value) == float(other)
    except (TypeError, ValueError):
        return False


# ---- the folder: a tiny Llama with a tokenizer, its adapters, good files ------------------------------------------

def _jsonl(rows: list) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)


PROMPTS = [{"id": "a", "prompt": "w5 w6 w7"}, {"id": "b", "prompt": "w8 w9"}]
REFERENCES = [{"id": "a", "prompt": "w5 w6 w7", "references": ["w10 w11", "w12"]},
              {"id": "b", "prompt": "w8 w9", "references": ["w13 w14"]}]
PAIRS = [{"prompt": f"w{5 + i} w{6 + i}", "target": f"w{20 + i} w{21 + i}"} for i in range(4)]
PREDICTIONS = [{"id": "a", "candidates": ["w10 w11", "w12 w13"]}, {"id": "b", "candidates": ["w13 w14", "w15"]}]
NLL = [{"id": "a", "nll": [[1.0, 2.0], [1.5, 0.5]]}, {"id": "b", "nll": [[1.0, 2.0]]}]


def build_folder(root: Path) -> None:
    import torch

    from loramcl import MCLConfig, get_mcl_model

    torch.manual_seed(0)
    base = tiny_llama(max_position_embeddings=64)
    base.save_pretrained(root / "tiny")
    word_tokenizer().save_pretrained(root / "tiny")
    get_mcl_model(base, MCLConfig(num_hypotheses=2, r=4, target_modules=["q_proj", "v_proj"])).save_pretrained(
        root / "adapters")
    for name, rows in (("prompts", PROMPTS), ("refs", REFERENCES), ("train", PAIRS), ("preds", PREDICTIONS),
                       ("nll", NLL)):
        (root / f"{name}.jsonl").write_text(_jsonl(rows))
    (root / "a folder").mkdir()
    (root / "a file.txt").write_text("not a folder\n")


def base_arguments(root: Path, trial: Path) -> dict[str, dict[str, str]]:
    """Each command's good options (short work: 4 training steps of 2 examples, 4 new tokens); a fault replaces one."""
    return {
        "train": {"--model": f"{root}/tiny", "--out": f"{trial}/run", "--data.train_file": f"{root}/train.jsonl",
                  "--data.max_length": "64", "--training.steps": "4", "--training.batch_size": "2",
                  "--training.warmup_steps": "0", "--training.logging_steps": "1",
                  "--mcl.num_hypotheses": "2"},  # the default, given: earlier versions needed an --mcl option
        "generate": {"--model": f"{root}/tiny", "--adapters": f"{root}/adapters", "--input": f"{root}/prompts.jsonl",
                     "--out": f"{trial}/preds.jsonl", "--max_new_tokens": "4"},
        "nll": {"--model": f"{root}/tiny", "--adapters": f"{root}/adapters", "--input": f"{root}/refs.jsonl",
                "--out": f"{trial}/nll.jsonl"},
        "evaluate": {"--predictions": f"{root}/preds.jsonl", "--references": f"{root}/refs.jsonl",
                     "--out": f"{trial}/eval", "--metrics": "bleu4,div2", "--tokenize": "false"},
    }


# ---- the trials ---------------------------------------------------------------------------------------------------

def trials(root: Path) -> list[Trial]:
    from loramcl.cli import commands

    table = commands()
    found: list[Trial] = []
    options = {command: command_options(table[command]) for command in COMMANDS}

    def add(family: str, command: str, fault: str, changes: dict, names: tuple[str, ...], **extra) -> None:
        folder = root / "trials" / str(len(found))
        known = options[command]
        arguments = {k: v for k, v in base_arguments(root, folder)[command].items() if k[2:] in known} | changes
        argv = [command] + [word for k, v in arguments.items() if v is not None for word in (k, v)]
        found.append(Trial(family, command, fault, argv, names, arguments["--out"], folder, **extra))

    for command in COMMANDS:
        base = base_arguments(root, root)[command]
        for option, (hint, default) in options[command].items():
            kind, typed = _kind(hint), f"--{option}"
            if kind is None:
                continue
            values = [f"[{v}]" for v in INT_VALUES] + ["[]"] if kind == "int list" else [
                v for v in (REAL_VALUES if kind == "float" else INT_VALUES)
                if not _same_number(v, default) and not _same_number(v, base.get(typed))]
            block = option.split(".")[0]  # a baseline's block is read with its --method, without an --mcl option
            method = {"--method": block, "--mcl.num_hypotheses": None} if block in ("moe", "multihead") else {}
            for context in ({}, ACTIVE_WITH.get(typed)):
                if context is None or any(k[2:] not in options[command] for k in context):  # an earlier version's
                    continue
                said = " ".join([f"{k} {v}" for k, v in context.items() if v is not None and k != typed] +
                                [f"no {k}" for k, v in context.items() if v is None])
                in_domain = {} if typed in IN_DOMAIN_ONLY_BESIDE_ITS_SETTING and not context else IN_DOMAIN
                for value in values:
                    add("numeric options", command, f"{typed} {value}" + (f" ({said})" if said else ""),
                        method | context | {typed: value}, (typed,), in_domain=in_domain.get((typed, value), ""))
    _path_trials(root, add)
    _device_trials(add)
    _data_trials(root, add)
    return found


def _path_trials(root: Path, add) -> None:
    folder, file, missing = f"{root}/a folder", f"{root}/a file.txt", f"{root}/missing"
    unwritable = root / "read-only"
    unwritable.mkdir(exist_ok=True)
    unwritable.chmod(0o555)
    as_root = os.geteuid() == 0
    root_says = "run as root, whom permissions do not stop" if as_root else ""
    writes_a_file = {"generate": "preds.jsonl", "nll": "nll.jsonl"}
    for command, name in writes_a_file.items():
        add("paths", command, "--out an existing folder", {"--out": folder}, ("--out", folder))
        add("paths", command, "--out below a file", {"--out": f"{file}/{name}"}, ("--out", file))
        add("paths", command, "--out in a folder without write permission", {"--out": f"{unwritable}/{name}"},
            ("--out", str(unwritable)), not_applicable=root_says)
        add("paths", command, "--input a folder", {"--input": folder}, ("--input", folder))
        add("paths", command, "--input missing", {"--input": missing}, ("--input", missing))
        add("paths", command, "--model a file", {"--model": file}, ("--model", file))
        add("paths", command, "--adapters a file", {"--adapters": file}, ("--adapters", file))
        add("paths", command, "--adapters the model folder", {"--adapters": f"{root}/tiny"},
            ("--adapters", f"{root}/tiny"))
    add("paths", "generate", "--tokenizer a file", {"--tokenizer": file}, ("--tokenizer", file))
    add("paths", "train", "--out an existing file", {"--out": file}, ("--out", file))
    add("paths", "train", "--out below a file", {"--out": f"{file}/run"}, ("--out", file))
    add("paths", "train", "--out in a folder without write permission", {"--out": f"{unwritable}/run"},
        ("--out", str(unwritable)), not_applicable=root_says)
    add("paths", "train", "--data.train_file a folder", {"--data.train_file": folder}, ("--data.train_file", folder))
    add("paths", "train", "--data.validation_file missing", {"--data.validation_file": missing},
        ("--data.validation_file", missing))
    add("paths", "train", "--model a file", {"--model": file}, ("--model", file))
    add("paths", "train", "--scores_for a file", {"--scores_for": file, "--mcl.num_hypotheses": None},
        ("--scores_for", file))
    add("paths", "evaluate", "--out an existing file", {"--out": file}, ("--out", file))
    add("paths", "evaluate", "--out below a file", {"--out": f"{file}/eval"}, ("--out", file))
    add("paths", "evaluate", "--out in a folder without write permission", {"--out": f"{unwritable}/eval"},
        ("--out", str(unwritable)), not_applicable=root_says)
    add("paths", "evaluate", "--predictions a folder", {"--predictions": folder}, ("--predictions", folder))
    add("paths", "evaluate", "--references missing", {"--references": missing}, ("--references", missing))
    add("paths", "evaluate", "--nll a folder", {"--nll": folder}, ("--nll", folder))


def _device_trials(add) -> None:
    for command in ("generate", "nll"):
        for device in ("cuda", "cuda:0", "cuda:x", "gpu", "CPU", "meta", "mps"):
            add("devices", command, f"--device {device}", {"--device": device}, ("--device",))


LONG = " ".join(f"w{5 + i % 80}" for i in range(100))  # 100 tokens: more than the model's 64 positions
NOT_UTF8 = b'{"prompt": "w5 \xff\xfe"}\n'


def _data_trials(root: Path, add) -> None:
    """One bad line (the second: its id is the good line's) or one bad file per trial, in the trial's own file."""
    prompt, ref, pair, pred = PROMPTS[1], REFERENCES[1], PAIRS[1], PREDICTIONS[1]
    cases = {
        ("generate", "--input", "prompts.jsonl"): {
            "an empty prompt": {**prompt, "prompt": ""}, "a blank prompt": {**prompt, "prompt": "   "},
            "a prompt that is a number": {**prompt, "prompt": 5}, "no prompt field": {"id": "b", "text": "w5"},
            "a line that is not JSON": '{"prompt": "w5"', "a line that is a JSON list": ["w5"],
            "a prompt longer than the positions": {**prompt, "prompt": LONG}},
        ("nll", "--input", "refs.jsonl"): {
            "an empty prompt": {**ref, "prompt": ""}, "an empty reference": {**ref, "references": ["w5", ""]},
            "no reference": {**ref, "references": []}, "a reference that is a number": {**ref, "references": 5},
            "no references field": {"id": "b", "prompt": "w5"}, "a line that is not JSON": '{"prompt": "w5"',
            "a prompt longer than the positions": {**ref, "prompt": LONG}},
        ("train", "--data.train_file", "train.jsonl"): {
            "an empty prompt": {**pair, "prompt": ""}, "an empty target": {**pair, "target": ""},
            "a target that is a list": {**pair, "target": ["w5", "w6"]}, "no target field": {"prompt": "w5"},
            "a line that is not JSON": '{"prompt": "w5"', "a line that is a list of numbers": [1, 2],
            "a prompt longer than the positions": {**pair, "prompt": LONG}},
        ("evaluate", "--predictions", "preds.jsonl"): {
            "no candidates field": {"id": "b", "text": "w5"}, "no candidate": {**pred, "candidates": []},
            "a candidate that is a number": {**pred, "candidates": ["w5", 5]},
            "a line that is not JSON": '{"id": "b"', "an id the references lack": {**pred, "id": "z"}},
        ("evaluate", "--references", "refs.jsonl"): {
            "an empty reference": {**ref, "references": [""]}, "no references field": {"id": "b", "prompt": "w5"},
            "a line that is not JSON": '{"id": "b"'},
        ("evaluate", "--nll", "nll.jsonl"): {
            "a NaN": {"id": "b", "nll": [[float("nan"), 1.0]]}, "a negative NLL": {"id": "b", "nll": [[-1.0, 1.0]]},
            "one column too few": {"id": "b", "nll": [[1.0]]},
            "one row too many": {"id": "b", "nll": [[1.0, 1.0]] * 2}},
    }
    originals = {"prompts.jsonl": PROMPTS, "refs.jsonl": REFERENCES, "train.jsonl": PAIRS, "preds.jsonl": PREDICTIONS,
                 "nll.jsonl": NLL}
    data = root / "data"
    data.mkdir(exist_ok=True)
    for (command, option, name), faults in cases.items():
        good = originals[name]
        whole = {"an empty file": b""} | ({} if option == "--nll" else {"bytes that are not UTF-8": NOT_UTF8})
        for fault, line in [*faults.items(), *whole.items()]:
            path = data / f"{len(list(data.iterdir()))}-{name}"
            if isinstance(line, bytes):
                path.write_bytes(line)
            else:
                path.write_text(_jsonl(good[:1]) + (line if isinstance(line, str) else json.dumps(line)) + "\n" +
                                _jsonl(good[2:]))
            at_fault = tuple(k for k in good[1] if isinstance(line, dict) and line.get(k, None) != good[1][k])
            names = (name, option[2:], *(f'"{k}"' for k in at_fault))  # the file, its option's word, the field
            add("data", command, f"{option} with {fault}", {option: str(path)}, names)


# ---- running one trial --------------------------------------------------------------------------------------------

class RanOn(BaseException):
    """The trial's time limit passed (a BaseException: no `except Exception` of the code under test catches it)."""


def _time_is_up(signum, frame):
    raise RanOn


LOADS: list[str] = []
PROGRESS_BAR = re.compile(r"\d+%\|")  # a tqdm bar (loading weights, decoding) on a line of its own


def count_model_loads() -> None:
    """Record every transformers model loaded from a folder (``PreTrainedModel.from_pretrained``, which every Auto
    class and model class calls) in LOADS."""
    from transformers import PreTrainedModel

    load = PreTrainedModel.from_pretrained.__func__

    def counted(cls, *args, **kwargs):
        LOADS.append(cls.__name__)
        return load(cls, *args, **kwargs)

    PreTrainedModel.from_pretrained = classmethod(counted)


def _state(path: str) -> set:
    """(file, size, mtime) of everything at ``path``: what the command wrote there shows as a difference."""
    place = Path(path)
    paths = [place, *place.rglob("*")] if place.is_dir() else [place] if place.exists() else []
    with contextlib.suppress(OSError):
        return {(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in paths}
    return set()


@contextlib.contextmanager
def _captured(folder: Path):
    """stdout and stderr of everything in this process (Python, transformers' log handlers, C) into two files."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(folder / "stdout", "wb") as out, open(folder / "stderr", "wb") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def run_trial(trial: Trial, limit: float) -> dict:
    from loramcl.cli import main

    record = {"family": trial.family, "command": trial.command, "fault": trial.fault, "argv": trial.argv}
    if trial.not_applicable:
        return record | {"outcome": "not applicable", "why": trial.not_applicable}
    folder = trial.folder
    folder.mkdir(parents=True, exist_ok=True)
    written_before = _state(trial.writes)
    LOADS.clear()
    warnings.simplefilter("default", append=True)  # a warning already shown by an earlier trial shows again
    code, ran_on, escaped = None, False, ""
    start = time.monotonic()
    with _captured(folder):
        previous = signal.signal(signal.SIGALRM, _time_is_up)
        signal.setitimer(signal.ITIMER_REAL, limit)
        try:
            main(list(trial.argv))
            code = 0
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
        except RanOn:
            ran_on = True
        except BaseException as error:  # noqa: BLE001 - what escaped the command line is itself a finding
            escaped = f"{type(error).__name__}: {error}"
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    record["seconds"] = round(time.monotonic() - start, 2)
    stderr = (folder / "stderr").read_text(errors="replace")
    with contextlib.suppress(Exception):
        import torch

        torch.set_num_threads(1)  # as this process started, whatever --threads a trial set
    gc.collect()
    record |= {"exit": code, "model_loaded": bool(LOADS), "wrote": _state(trial.writes) != written_before}
    prefix = f"loramcl {trial.command}: "
    lines = [line for line in stderr.split("\n") if line.strip() and not line.startswith(prefix + "warning: ")
             and not (PROGRESS_BAR.search(line) and ": error: " not in line)]
    errors = [line for line in lines if ": error: " in line]
    record["message"] = (errors[-1] if errors else lines[-1] if lines else escaped)[:600]
    if ran_on:
        return record | {"outcome": "ran on", "why": f"still running after {limit:g} s"}
    if escaped:
        return record | {"outcome": "refused, unclear", "why": f"escaped the command line: {escaped[:300]}"}
    if code == 0:
        outcome = "accepted, in domain" if trial.in_domain else "accepted"
        return record | {"outcome": outcome, "why": trial.in_domain or "exit 0"}
    if trial.in_domain:
        record["refused_in_domain"] = True
    problems = []
    if code not in (1, 2):
        problems.append(f"exit {code}")
    if len(lines) != 1:
        problems.append(f"{len(lines)} lines besides the warnings")
    if not errors or not errors[-1].startswith(prefix + "error: "):
        problems.append("no line starting with " + repr(prefix + "error: "))
    if "(a bug?" in record["message"]:
        problems.append("the (a bug?) hint")
    if not any(name in record["message"] for name in trial.names):
        problems.append(f"names none of {', '.join(trial.names)}")
    record["before_work"] = not record["model_loaded"] and not record["wrote"]
    return record | {"outcome": "refused, unclear" if problems else "refused clearly", "why": "; ".join(problems)}


def input_trials(root: Path, limit: float, only: str | None = None) -> list[dict]:
    """Build the folder, run every trial (those whose key contains ``only``), one record each."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # as the threads check reads it: no quarter second to count cores
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    build_folder(root)
    count_model_loads()
    records = []
    for trial in trials(root):
        if only and only not in trial.key:
            continue
        record = run_trial(trial, limit)
        for key in ("argv", "message"):  # the temporary folder's name, which changes from run to run, said once
            record[key] = json.loads(json.dumps(record.get(key, "")).replace(str(root), "ROOT"))
        records.append(record)
        print(f"{trial.family:<16} {trial.key[:78]:<78} {record['outcome']:<20} {record.get('seconds', 0):6.2f} s"
              + (f"  {record['why']}" if record["outcome"] not in ("refused clearly", "accepted, in domain") else ""),
              flush=True)
    return records


# ---- the table ----------------------------------------------------------------------------------------------------

def failed(record: dict) -> bool:
    """A trial that counts against the command line: a value accepted outside its domain, an unclear refusal, a
    command that ran on."""
    return record["outcome"] in ("refused, unclear", "accepted", "ran on")


def input_table(records: list[dict], before: list[dict] | None = None) -> list[dict]:
    """Counts per family (and command) and outcome; with ``before``, each count as "before -> now", a trial of an
    option or a file the earlier version lacks counting as not applicable there."""
    earlier = {f"{r['command']}: {r['fault']}": r for r in before or []}
    rows = []
    groups = [(f, c) for f, c in dict.fromkeys((r["family"], r["command"]) for r in records)]
    for family, command in [*groups, ("all", "")]:
        mine = [r for r in records if family == "all" or (r["family"], r["command"]) == (family, command)]
        row = {"family": family, "command": command, "trials": len(mine)}
        for outcome in OUTCOMES:
            now = sum(r["outcome"] == outcome for r in mine)
            after_work = sum(r["outcome"] == outcome and not r.get("before_work", True) for r in mine)
            row[outcome] = (now, after_work)
            if before is not None:
                then = [earlier.get(f"{r['command']}: {r['fault']}") for r in mine]
                was = sum((t["outcome"] if t else "not applicable") == outcome for t in then)
                row[outcome] += (was,)
        rows.append(row)
    return rows


def print_input_table(records: list[dict], before: list[dict] | None = None) -> list[dict]:
    rows = input_table(records, before)

    def cell(count: tuple) -> str:
        now = f"{count[0]}" + (f" ({count[1]} after work)" if count[1] else "")
        return f"{count[2]} → {now}" if before is not None else now

    print()
    print_table(["family", "command", "trials", *OUTCOMES],
                [[row["family"], row["command"], row["trials"], *(cell(row[o]) for o in OUTCOMES)] for row in rows])
    print(("(before → now) " if before is not None else "") +
          "(after work: refused once the model had loaded, or once something was written where the command writes)")
    listed = [r for r in records if r["outcome"] != "refused clearly"]
    if listed:
        print(f"\n{len(listed)} trials not refused clearly (each one's whole command line is in --json's argv):")
    for r in listed:
        print(f"- [{r['outcome']}] loramcl {r['command']} ... {r['fault']}: {r.get('why', '')}"
              + (f": {r['message']}" if r.get("message") and r["outcome"] != "accepted, in domain" else ""))
    return rows
