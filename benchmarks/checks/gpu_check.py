"""The GPU check (issue 50): what a user with a GPU runs, run in one prepared script, each step with its own time limit
and printing as it goes, for the 15 minutes a GPU machine is lent now and then.

Steps, in the order they run (each with a time limit: STEPS; the measured minutes are in docs/benchmarks.md):
  environment   torch, transformers, PEFT, the device and its memory
  main-job      the README's main job, `loramcl markov --quick true`: Trainer puts it on the GPU
  commands      `loramcl train` (bf16 base), then `generate`, `nll`, `evaluate`, `export` with --device cuda, on a
                tiny Llama with a word-level tokenizer
  paper-alma    the ALMA-7B recipe's first steps at full size (a Llama-2-7B-shaped folder with random weights, built
                on the GPU) through `loramcl train --config translation/alma/...`, the recipe's micro-batch
  paper-clotho  the Clotho recipe's first steps at full size (Qwen2-Audio-7B-shaped, random weights, 30 s clips in
                Clotho's layout) through `loramcl audio-captioning --recipes <copy> --stop_after train`
  qlora         a tiny Llama in bitsandbytes nf4 and int8 on the GPU: a step, decoding, export against PEFT
  recipes-quick `loramcl audio-captioning --quick` and `loramcl image-captioning --quick` with --device cuda in bf16
  suite         benchmarks/speed/suite.py at llama-1b (256 tokens), its training and decoding sections, one repeat
  paper-textcaps  the TextCaps recipe's first steps at full size (LLaVA-NeXT-7B-shaped, random weights, a processor
                built offline, generated images in TextCaps 0.1's layout) through `loramcl image-captioning --recipes
                <copy> --stop_after train`
  compiled-1b   the suite's compiled section at llama-1b (loramcl K = 5 and the bare base decoding the same rows,
  compiled-8b   eager and compiled; a training step eager and compiled) with PEFT's batch of the same rows beside
                them (its peers section); at llama-8b the training step at 1024 tokens (issue 65's goals)
Each paper step prints the peak allocated and reserved GPU memory beside the memory plan's training peak
(benchmarks/studies/memory_plan.py) and what is left of an H100's 80 GB; train_log.json's last step time and tokens per
second.

    bash benchmarks/checks/gpu_wheels.sh                       # here, once: the wheels the GPU machine lacks (.whl/)
    python -m benchmarks.checks.gpu_check --out OUT            # there (docs/benchmarks.md, "The GPU check")
    python -m benchmarks.checks.gpu_check --dry-run --out OUT  # CI: the same steps at tiny shapes, the commands on a
                                                               # fake accelerator (checks/fake_accelerator.py), but
                                                               # DRY_SLOW's (--steps names them: a slow test)

This file is the runner (the steps, their limits, the summary); what a step runs in a process of its own (models,
recipe copies, the loramcl commands under a helper printing the GPU's peaks) is benchmarks/checks/gpu_check_helpers.py.

Writes OUT/gpu_check.md (one table: step, status, seconds, numbers) and OUT/gpu_check.json, rewritten after each step,
so that a run cut short still says what it did. A step whose limit would pass --budget (seconds of steps, 480 by default:
a 15-minute lease less the machine's start, the wheels' install and a margin) is skipped and said so; all eight took
about 9.5 minutes on an H200, and the three of issue 65 make it more than one lease: `--steps` chooses, in the order
given (docs/benchmarks.md has the two runs that split it). The dry run's default budget is unbounded: none is
skipped. Every path the steps write into a recipe copy is absolute (the copy reads a
relative one relative to its own folder), so OUT may be relative to any folder.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.checks.gpu_check_helpers import INTERNAL, MARK, RECIPES, ROOT


@dataclass
class Context:
    work: Path
    dry: bool
    python: str = sys.executable

    def __post_init__(self) -> None:
        # absolute: the steps' commands run in the checkout's root and write these paths into recipe copies, whose
        # relative paths would be read relative to the copy's folder (docs/guide/cli.md, "Recipe files")
        self.work = Path(self.work).absolute()

    @property
    def device(self) -> str:
        return "fakegpu" if self.dry else "cuda"  # the dry run's accelerator: benchmarks/checks/fake_accelerator.py

    @property
    def host_device(self) -> str:
        """Where this script's own helpers build models: the CPU in the dry run (its fake device is the commands')."""
        return "cpu" if self.dry else "cuda"

    @property
    def dtype(self) -> str:
        return "float32" if self.dry else "bfloat16"

    def internal(self, name: str, *args) -> list[str]:
        """The helper ``name`` (benchmarks/checks/gpu_check_helpers.py) in a process of its own."""
        return [self.python, "-m", __spec__.name, "--internal", name, *(["--dry-run"] if self.dry else []),
                "--work", str(self.work), "--", *map(str, args)]

    def loramcl(self, *args) -> list[str]:
        """A loramcl command in-process under this script's helper, which prints the GPU's memory peaks after it."""
        return self.internal("cli", *args)


@dataclass
class Step:
    name: str
    limit: int  # seconds on the GPU
    dry_limit: int  # seconds on the CPU at tiny shapes
    commands: Callable[[Context], list[list[str]]]
    numbers: dict = field(default_factory=dict)


def _environment(ctx: Context) -> list[list[str]]:
    return [ctx.internal("environment")]


def _main_job(ctx: Context) -> list[list[str]]:
    short = ["--steps", "6"] if ctx.dry else []  # the CPU's 100 quick steps take minutes: 6 take the same path
    return [ctx.loramcl("markov", "--quick", "true", "--out", ctx.work / "markov", "--threads", "1", *short)]


def _commands(ctx: Context) -> list[list[str]]:
    model, data, run = ctx.work / "tiny-llama", ctx.work / "tiny-data", ctx.work / "tiny-run"
    preds, device = ctx.work / "tiny-preds.jsonl", ["--device", ctx.device]
    return [
        ctx.internal("tiny-llama", model, data),
        ctx.loramcl("train", "--model", model, "--out", run, "--data.train_file", data / "train.jsonl",
                    "--data.max_length", "32", "--dtype", ctx.dtype, "--mcl.num_hypotheses", "2", "--mcl.r", "4",
                    "--mcl.target_modules", "[q_proj, v_proj]", "--training.steps", "4", "--training.batch_size", "4",
                    "--training.logging_steps", "2", "--training.save_every", "0", "--threads", "1"),
        ctx.loramcl("generate", "--model", model, "--adapters", run, "--input", data / "test.jsonl", "--out", preds,
                    "--dtype", ctx.dtype, "--max_new_tokens", "4", "--strategy", "beam", "--budget", "4", *device),
        ctx.loramcl("nll", "--model", model, "--adapters", run, "--input", data / "test.jsonl",
                    "--out", ctx.work / "tiny-nll.jsonl", "--dtype", ctx.dtype, *device),
        ctx.loramcl("evaluate", "--predictions", preds, "--references", data / "test.jsonl",
                    "--metrics", "sacrebleu,chrf,div2", "--tokenize", "false", "--out", ctx.work / "tiny-eval"),
        ctx.loramcl("export", run, "--out", ctx.work / "tiny-exported"),
    ]


def _paper_alma(ctx: Context) -> list[list[str]]:
    model, data, alma = ctx.work / "alma-model", ctx.work / "alma-data.jsonl", RECIPES / "translation" / "alma"
    # the recipe's micro-batch of 16 examples (48 rows at K = 3), 2 of them: 3 steps, the first a warm-up
    batch = ["--training.batch_size", "32", "--training.gradient_accumulation_steps", "2"] if not ctx.dry else [
        "--training.batch_size", "4", "--training.gradient_accumulation_steps", "2"]
    return [
        ctx.internal("llama-model", model),
        ctx.internal("alma-data", model, data),
        ctx.loramcl("train", "--config", alma / "common.yaml", "--config", alma / "mcl.yaml", "--model", model,
                    "--out", ctx.work / "alma-run", "--data.train_file", data, "--data.validation_file", data,
                    "--training.steps", "3", "--training.logging_steps", "1", "--training.save_every", "0",
                    "--training.eval_every", "0", *batch, *([] if not ctx.dry else ["--dtype", "float32",
                                                                                    "--training.tf32", "false"])),
        ctx.internal("plan", "translation/alma", "mcl", ctx.work / "alma-run"),
        ctx.internal("remove", model),
    ]


def _paper_recipe(task: str, recipe_name: str, model_name: str, run: str) -> Callable[[Context], list[list[str]]]:
    """A paper recipe's first steps at full size: the helper ``MODEL_NAME-model`` makes the model folder, the helper
    ``RECIPE_NAME-recipe`` a copy of the recipe (TASK's folder RECIPE_NAME) reading it, `loramcl TASK --recipes <copy>
    --stop_after train` trains ``run``, its training log is read beside the memory plan, the folder is removed."""
    def commands(ctx: Context) -> list[list[str]]:
        model, recipe = ctx.work / f"{model_name}-model", ctx.work / f"{recipe_name}-recipe"
        return [
            ctx.internal(f"{model_name}-model", model),
            ctx.internal(f"{recipe_name}-recipe", model, recipe),
            ctx.loramcl(task, "--recipes", recipe, "--stop_after", "train", "--runs", f"[{run}]",
                        "--device", ctx.device, "--threads", "1"),
            ctx.internal("plan", f"{task.replace('-', '_')}/{recipe_name}", run, recipe / "out" / run),
            ctx.internal("remove", model),
        ]
    return commands


def _qlora(ctx: Context) -> list[list[str]]:
    return [ctx.internal("qlora")]


def _recipes_quick(ctx: Context) -> list[list[str]]:
    commands = []
    for task, folder in (("audio-captioning", "audio_captioning"), ("image-captioning", "image_captioning")):
        recipe = ctx.work / f"{folder}-quick"
        commands += [ctx.internal("quick-recipe", folder, recipe),
                     ctx.loramcl(task, "--recipes", recipe, "--quick", "true", "--device", ctx.device, "--threads", "1")]
    return commands


def _suite(ctx: Context) -> list[list[str]]:
    if ctx.dry:  # the tiny shape's training section (tests/system/test_benchmark_suite.py runs the rest)
        measured = ["--shape", "tiny", "--sections", "training", "--seqs", "16"]
    else:
        measured = ["--shape", "llama-1b", "--device", "cuda", "--dtype", "bfloat16", "--seqs", "256",
                    "--new-tokens", "32", "--sections", "training", "decoding"]
    return [[ctx.python, "-m", SUITE, *measured, "--steps", "1", "--repeats", "1", "--out", str(ctx.work / "suite")]]


# The compiled rows (issue 65): the suite's compiled section (loramcl K = 5 and the bare base decoding the same rows,
# eager and compiled, greedy and beam 2; a training step at K = 1 and 5, eager and compiled) with PEFT's mixed-adapter
# batch of the same K = 5 rows beside them (its peers section), at Llama-3.2-1B's and Llama-3.1-8B's shapes. The dry
# variant: the tiny shape on the CPU, compiled with aot_eager (the same graphs, no C++ build: inductor builds for
# minutes on the CPU; tests/decoding/test_compiled_decoding.py compiles so too).
SUITE = "benchmarks.speed.suite"
COMPILED_SEQS = {"llama-1b": 256, "llama-8b": 1024}  # the training rows' length: the issue's K = 1 goal at 8B, 1024


def _compiled(shape: str) -> Callable[[Context], list[list[str]]]:
    def commands(ctx: Context) -> list[list[str]]:
        out = ctx.work / f"compiled-{shape}"
        if ctx.dry:
            measured = ["--shape", "tiny", "--backend", "aot_eager", "--threads", "1", "--seqs", "16", "--steps", "1",
                        "--repeats", "1"]
        else:
            measured = ["--shape", shape, "--device", "cuda", "--dtype", "bfloat16", "--seqs",
                        str(COMPILED_SEQS[shape]), "--new-tokens", "32", "--steps", "3", "--repeats", "2"]
        return [[ctx.python, "-m", SUITE, *measured, "--sections", "compiled", "peers",
                 "--peers", "5/greedy/1", "5/beam2/1", "--out", str(out)],
                ctx.internal("compiled-numbers", out)]
    return commands


# Limits: about 1.5x what each step took on an H200 (2026-11-28, docs/benchmarks.md "The GPU check"); each loramcl
# command is a process of its own, ~8 s of imports there. Dry limits: at least 2.5x each step's time with --jobs 2 on
# two cores shared with other work (2026-11-29, the same section), about 2x the slowest CI machine seen (commands:
# 143 s there, 112 s here): a dry step stops only when it hangs, never because CI's machine was slow.
DRY_TEXTCAPS, DRY_COMPILED = 100, 200  # 2026-11-29 here: 28.9 s and 65.6 s
# The last three steps (issue 65) have not run on a GPU yet: their GPU limits are estimates (paper-textcaps: the
# Clotho step's; the compiled steps: inductor's builds of 4 decoding graphs and 2 training graphs, about a minute
# each at 8B), their dry limits 2.5x their dry time here.
STEPS = [Step("environment", 30, 60, _environment), Step("main-job", 60, 150, _main_job),
         Step("commands", 150, 300, _commands), Step("paper-alma", 140, 150, _paper_alma),
         Step("paper-clotho", 170, 200, _paper_recipe("audio-captioning", "clotho", "qwen2-audio", "mcl-annealed")),
         Step("qlora", 45, 120, _qlora),
         Step("recipes-quick", 150, 450, _recipes_quick), Step("suite", 120, 200, _suite),
         Step("paper-textcaps", 190, DRY_TEXTCAPS, _paper_recipe("image-captioning", "textcaps", "llava-next", "mcl")),
         Step("compiled-1b", 200, DRY_COMPILED, _compiled("llama-1b")),
         Step("compiled-8b", 480, DRY_COMPILED, _compiled("llama-8b"))]
# The dry run without --steps: all but the compiled steps (65 s each here, aot_eager at the tiny shape), recipes-quick
# (101 s of a core in CI: the audio and image quick recipes on the fake accelerator, which CI runs on the CPU in
# tests/recipes/, their training on the fake accelerator in paper-clotho and paper-textcaps), suite (33 s: its dry
# variant is the tiny shape's training section on the CPU, which tests/system/test_benchmark_suite.py runs), and since
# issue 63 main-job and commands (about 150 s of a core: a process per command, ~8 s of imports each; what they run is
# run in-process on the fake accelerator by tests/system/test_fake_accelerator.py, the Markov training and `loramcl
# train`, `generate` of each strategy, `nll` and `evaluate`): more than CI's 15 minutes can hold.
# tests/system/test_gpu_check.py runs the six in a test marked slow, and parses every loramcl command line of every
# step, the GPU's and the dry run's, through `loramcl.cli.main` in CI.
DRY_SLOW = ("main-job", "commands", "recipes-quick", "suite", "compiled-1b", "compiled-8b")
DRY_DEFAULT = [s.name for s in STEPS if s.name not in DRY_SLOW]


# ---- running the steps --------------------------------------------------------------------------------------------

def run_command(command: list[str], deadline: float, numbers: dict, name: str) -> str:
    """Run ``command`` until ``deadline`` (time.monotonic()), printing its lines as they come and reading its
    GPU_CHECK lines into ``numbers``; its status: ok, failed (exit code) or timeout."""
    print(f"[{name}] $ {' '.join(Path(c).name if i == 1 else c for i, c in enumerate(command))}", flush=True)
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                               start_new_session=True, env=os.environ | {"PYTHONUNBUFFERED": "1"})
    timer = _Killer(process, deadline)
    for line in process.stdout:
        line = line.rstrip()
        if line.startswith(MARK):
            numbers.update(json.loads(line[len(MARK):]))
        print(f"[{name}] {line}", flush=True)
    process.wait()
    timer.cancel()
    if timer.fired:
        return "timeout"
    return "ok" if process.returncode == 0 else f"failed (exit {process.returncode})"


class _Killer:
    """Kills a process and its children at a deadline."""

    def __init__(self, process: subprocess.Popen, deadline: float) -> None:
        import threading

        self.fired = False
        self.process = process
        self.timer = threading.Timer(max(0.0, deadline - time.monotonic()), self._kill)
        self.timer.daemon = True
        self.timer.start()

    def _kill(self) -> None:
        self.fired = True
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def cancel(self) -> None:
        self.timer.cancel()


def run_steps(ctx: Context, steps: list[Step], budget: float, out: Path, jobs: int = 1) -> list[dict]:
    """Each step in turn (``jobs`` > 1: that many at a time, for the dry run on a machine of several cores; a GPU's
    steps run one by one), the summary rewritten as each ends; a step whose limit would pass ``budget`` is skipped."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    started, lock = time.monotonic(), threading.Lock()
    results = [{"step": step.name, "limit_s": step.dry_limit if ctx.dry else step.limit, "numbers": {},
                "status": "not run", "seconds": 0.0} for step in steps]

    def run(step: Step, row: dict) -> None:
        limit, spent = row["limit_s"], time.monotonic() - started
        if spent + limit > budget:
            row |= {"status": f"skipped (budget: {spent:.0f} s spent of {budget:.0f})"}
        else:
            print(f"\n== {step.name} (at most {limit} s; {spent:.0f} s of {budget:.0f} spent) ==", flush=True)
            step_start = time.monotonic()
            deadline, status = step_start + limit, "ok"
            for command in step.commands(ctx):
                status = run_command(command, deadline, row["numbers"], step.name)
                if status != "ok":
                    break
            row |= {"status": status, "seconds": round(time.monotonic() - step_start, 1)}
            print(f"== {step.name}: {status} in {row['seconds']} s", flush=True)
        with lock:
            write_summary(results, ctx, out)

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        list(pool.map(run, steps, results))
    return results


def write_summary(results: list[dict], ctx: Context, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps({"dry_run": ctx.dry, "steps": results}, indent=1) + "\n")
    lines = [f"# GPU check{' (dry run: the CPU, tiny shapes)' if ctx.dry else ''}", "",
             "| step | status | seconds (limit) | numbers |", "|---|---|---|---|"]
    for row in results:
        numbers = ", ".join(f"{k} {v}" for k, v in row["numbers"].items())
        lines.append(f"| {row['step']} | {row['status']} | {row['seconds']} ({row['limit_s']}) | {numbers} |")
    (out / "gpu_check.md").write_text("\n".join(lines) + "\n")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("runs/gpu-check"), help="folder of gpu_check.md and .json")
    parser.add_argument("--work", type=Path, help="folder of the steps' models, data and runs (default: OUT/work)")
    parser.add_argument("--dry-run", action="store_true", help="the same steps on the CPU at tiny shapes")
    parser.add_argument("--budget", type=float, help="seconds for all steps (default: 480 on a GPU; the dry run: the "
                        "sum of its steps' limits, none skipped)")
    parser.add_argument("--steps", nargs="+", choices=[s.name for s in STEPS], help="these steps only, in the order "
                        "given (default: all; the dry run: all but the compiled steps, which --steps names)")
    parser.add_argument("--jobs", type=int, default=1, help="steps run at a time (the dry run on several cores; a "
                        "GPU's one by one)")
    parser.add_argument("--internal", choices=sorted(INTERNAL), help=argparse.SUPPRESS)
    parser.add_argument("args", nargs="*", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    ctx = Context(work=args.work or args.out / "work", dry=args.dry_run)
    if args.internal:
        INTERNAL[args.internal](ctx, args.args)
        return
    if not ctx.dry:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("gpu_check: torch sees no GPU here; --dry-run runs the steps on the CPU")
    ctx.work.mkdir(parents=True, exist_ok=True)
    by_name = {step.name: step for step in STEPS}
    names = args.steps or (DRY_DEFAULT if ctx.dry else list(by_name))
    steps = [by_name[name] for name in dict.fromkeys(names)]  # in the order given: the last ones where time is left
    if args.jobs > 1 and not ctx.dry:
        raise SystemExit("gpu_check: --jobs runs steps side by side, for the dry run: on one GPU they would share "
                         "its memory and time each other")
    budget = args.budget if args.budget is not None else float("inf") if ctx.dry else 480.0  # dry: none skipped
    results = run_steps(ctx, steps, budget, args.out, args.jobs)
    print(f"\n{(args.out / 'gpu_check.md').read_text()}")
    failed = [row["step"] for row in results if row["status"] != "ok"]
    if failed:
        raise SystemExit(f"gpu_check: not ok: {', '.join(failed)}")


if __name__ == "__main__":
    main()
