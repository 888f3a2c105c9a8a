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
  suite         benchmarks/suite.py at llama-1b (256 tokens), its training and decoding sections, one repeat
  paper-textcaps  the TextCaps recipe's first steps at full size (LLaVA-NeXT-7B-shaped, random weights, a processor
                built offline, generated images in TextCaps 0.1's layout) through `loramcl image-captioning --recipes
                <copy> --stop_after train`
  compiled-1b   the suite's compiled section at llama-1b (loramcl K = 5 and the bare base decoding the same rows,
  compiled-8b   eager and compiled; a training step eager and compiled) with PEFT's batch of the same rows beside
                them (its peers section); at llama-8b the training step at 1024 tokens (issue 65's goals)
Each paper step prints the peak allocated and reserved GPU memory beside the memory plan's training peak
(benchmarks/memory_plan.py) and what is left of an H100's 80 GB; train_log.json's last step time and tokens per second.

    bash benchmarks/gpu_wheels.sh                         # here, once: the wheels the GPU machine lacks, into .whl/
    python benchmarks/gpu_check.py --out OUT              # there (docs/benchmarks.md, "The GPU check")
    python benchmarks/gpu_check.py --dry-run --out OUT    # CI: the same steps at tiny shapes, the commands on a
                                                          # fake accelerator (tests/fake_accelerator.py), but the
                                                          # compiled ones (--steps names them: a slow test)

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
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
RECIPES = ROOT / "src" / "loramcl" / "recipes"
MARK = "GPU_CHECK "  # a line a step prints with its numbers: GPU_CHECK {"name": value, ...}
H100_GB = 80.0


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
        return "fakegpu" if self.dry else "cuda"  # the dry run's accelerator: tests/fake_accelerator.py

    @property
    def host_device(self) -> str:
        """Where this script's own helpers build models: the CPU in the dry run (its fake device is the commands')."""
        return "cpu" if self.dry else "cuda"

    @property
    def dtype(self) -> str:
        return "float32" if self.dry else "bfloat16"

    def internal(self, name: str, *args) -> list[str]:
        """This script's own helper ``name`` (below) in a process of its own."""
        return [self.python, str(Path(__file__)), "--internal", name, *(["--dry-run"] if self.dry else []),
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


def _paper_clotho(ctx: Context) -> list[list[str]]:
    model, recipe = ctx.work / "qwen2-audio-model", ctx.work / "clotho-recipe"
    return [
        ctx.internal("qwen2-audio-model", model),
        ctx.internal("clotho-recipe", model, recipe),
        ctx.loramcl("audio-captioning", "--recipes", recipe, "--stop_after", "train", "--runs", "[mcl-annealed]",
                    "--device", ctx.device, "--threads", "1"),
        ctx.internal("plan", "audio_captioning/clotho", "mcl-annealed", recipe / "out" / "mcl-annealed"),
        ctx.internal("remove", model),
    ]


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
    return [[ctx.python, str(BENCHMARKS / "suite.py"), *measured, "--steps", "1", "--repeats", "1",
             "--out", str(ctx.work / "suite")]]


# The compiled rows (issue 65): the suite's compiled section (loramcl K = 5 and the bare base decoding the same rows,
# eager and compiled, greedy and beam 2; a training step at K = 1 and 5, eager and compiled) with PEFT's mixed-adapter
# batch of the same K = 5 rows beside them (its peers section), at Llama-3.2-1B's and Llama-3.1-8B's shapes. The dry
# variant: the tiny shape on the CPU, compiled with aot_eager (the same graphs, no C++ build: inductor builds for
# minutes on the CPU; tests/decoding/test_compiled_decoding.py compiles so too).
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
        return [[ctx.python, str(BENCHMARKS / "suite.py"), *measured, "--sections", "compiled", "peers",
                 "--peers", "5/greedy/1", "5/beam2/1", "--out", str(out)],
                ctx.internal("compiled-numbers", out)]
    return commands


def _paper_textcaps(ctx: Context) -> list[list[str]]:
    model, recipe = ctx.work / "llava-next-model", ctx.work / "textcaps-recipe"
    return [
        ctx.internal("llava-next-model", model),
        ctx.internal("textcaps-recipe", model, recipe),
        ctx.loramcl("image-captioning", "--recipes", recipe, "--stop_after", "train", "--runs", "[mcl]",
                    "--device", ctx.device, "--threads", "1"),
        ctx.internal("plan", "image_captioning/textcaps", "mcl", recipe / "out" / "mcl"),
        ctx.internal("remove", model),
    ]


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
         Step("paper-clotho", 170, 200, _paper_clotho), Step("qlora", 45, 120, _qlora),
         Step("recipes-quick", 150, 450, _recipes_quick), Step("suite", 120, 200, _suite),
         Step("paper-textcaps", 190, DRY_TEXTCAPS, _paper_textcaps),
         Step("compiled-1b", 200, DRY_COMPILED, _compiled("llama-1b")),
         Step("compiled-8b", 480, DRY_COMPILED, _compiled("llama-8b"))]
# The dry run without --steps: all but the compiled steps (65 s each here, aot_eager at the tiny shape: more than CI's
# dry run should grow by; tests/system/test_gpu_check.py runs them in a test marked slow).
DRY_DEFAULT = [s.name for s in STEPS if not s.name.startswith("compiled-")]


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


# ---- the helpers each step runs (--internal NAME) -----------------------------------------------------------------

def _report(**numbers) -> None:
    print(MARK + json.dumps(numbers), flush=True)


def _gpu_peaks() -> dict:
    import torch

    if not torch.cuda.is_available():
        return {}
    gb = 1e9
    return {"peak_allocated_gb": round(torch.cuda.max_memory_allocated() / gb, 2),
            "peak_reserved_gb": round(torch.cuda.max_memory_reserved() / gb, 2)}


def internal_environment(ctx: Context, args: list[str]) -> None:
    import peft
    import torch
    import transformers

    numbers = {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__}
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        numbers |= {"gpu": torch.cuda.get_device_name(), "gpu_memory_gb": round(total / 1e9, 1)}
    _report(**numbers)


def _accelerator(ctx: Context):
    """The dry run's commands run on a fake accelerator (tests/fake_accelerator.py: a second device computing on the
    CPU, where a tensor left on the CPU fails as it would beside a GPU's); the real run on the GPU as it is."""
    if not ctx.dry:
        return contextlib.nullcontext()
    sys.path.insert(0, str(ROOT / "tests"))
    from fake_accelerator import fake_accelerator

    return fake_accelerator()


def internal_cli(ctx: Context, args: list[str]) -> None:
    """``loramcl ARGS`` in this process, then the GPU's peaks and the run's last logged step (train_log.json)."""
    from loramcl.cli import main

    with _accelerator(ctx):
        try:
            main(args)
        except SystemExit as exit:
            if exit.code not in (0, None):
                raise
    if args[0] in ("generate", "nll", "evaluate", "export"):  # training resets the peaks at each log: train_log
        _report(**{f"{args[0]}_{k}": v for k, v in _gpu_peaks().items()})


def internal_tiny_llama(ctx: Context, args: list[str]) -> None:
    """A tiny Llama (the real class, random weights) with a word-level tokenizer, and prompt/completion rows."""
    import torch

    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_models import build_model, word_tokenizer

    model_folder, data = Path(args[0]), Path(args[1])
    torch.manual_seed(0)
    build_model("llama").save_pretrained(model_folder)
    word_tokenizer().save_pretrained(model_folder)
    data.mkdir(parents=True, exist_ok=True)
    for split, count in (("train", 32), ("test", 4)):
        with (data / f"{split}.jsonl").open("w") as f:
            for i in range(count):
                prompt = " ".join(f"w{3 + (i * 7 + j) % 40}" for j in range(5))
                answers = [f"w{50 + i % 5} w{60 + i % 3}", f"w{70 + i % 4}"]
                row = {"prompt": prompt, "completion": answers[i % 2]} if split == "train" else {
                    "id": str(i), "prompt": prompt, "references": answers}
                f.write(json.dumps(row) + "\n")


def internal_llama_model(ctx: Context, args: list[str]) -> None:
    """A Llama-2-7B-shaped folder (ALMA-7B's architecture) with random bf16 weights made on the GPU, and a word-level
    tokenizer standing in for its own; tiny on the CPU."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(BENCHMARKS))
    from common import build_model
    from memory_plan import _llama2

    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_models import VOCAB, word_tokenizer

    shape = _llama2() if not ctx.dry else dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                 num_attention_heads=4, num_key_value_heads=4)
    config = LlamaConfig(**{**shape, "vocab_size": 32000 if not ctx.dry else VOCAB, "bos_token_id": 1,
                            "eos_token_id": 2, "pad_token_id": 0})
    started = time.perf_counter()
    model = build_model(LlamaForCausalLM, config, ctx.host_device, getattr(torch, ctx.dtype))
    model.save_pretrained(args[0])
    word_tokenizer().save_pretrained(args[0])
    _report(model_parameters_b=round(sum(p.numel() for p in model.parameters()) / 1e9, 2),
            model_folder_s=round(time.perf_counter() - started, 1))


def internal_alma_data(ctx: Context, args: list[str]) -> None:
    """ALMA's prompt shape at its lengths (about 150 tokens an example, 50 of them the target) in prompt/completion
    rows of the stand-in tokenizer's words."""
    words = [f"w{i}" for i in range(3, 90)]
    with open(args[1], "w") as f:
        for i in range(64):
            source = " ".join(words[(i * 3 + j) % len(words)] for j in range(90))
            target = " ".join(words[(i * 5 + j) % len(words)] for j in range(50))
            f.write(json.dumps({"prompt": f"Translate this from English to German: {source}", "completion": target})
                    + "\n")


def internal_qwen2_audio_model(ctx: Context, args: list[str]) -> None:
    """A Qwen2-Audio-7B-shaped folder with random bf16 weights made on the GPU and a processor reading 30 s clips
    (128 mel bins, 750 audio tokens), its tokenizer a word-level stand-in; the tiny model on the CPU."""
    import torch
    from transformers import (
        GenerationConfig,
        Qwen2AudioConfig,
        Qwen2AudioForConditionalGeneration,
        Qwen2AudioProcessor,
        WhisperFeatureExtractor,
    )

    from loramcl.models import tiny_qwen2_audio
    from loramcl.recipes.audio_captioning.reproduce import SYNTHETIC_WORDS

    folder = Path(args[0])
    tiny_qwen2_audio(folder, SYNTHETIC_WORDS)  # the tokenizer and, on the CPU, the model
    if ctx.dry:
        return
    sys.path.insert(0, str(BENCHMARKS))
    from common import build_model
    from suite import SHAPES

    processor = Qwen2AudioProcessor.from_pretrained(folder)
    processor = Qwen2AudioProcessor(feature_extractor=WhisperFeatureExtractor(feature_size=128, chunk_length=30),
                                    tokenizer=processor.tokenizer, chat_template=processor.chat_template)
    config = Qwen2AudioConfig(**SHAPES["qwen2-audio"].config)
    config.audio_token_index = processor.tokenizer.convert_tokens_to_ids("<|AUDIO|>")
    started = time.perf_counter()
    model = build_model(Qwen2AudioForConditionalGeneration, config, "cuda", torch.bfloat16)
    model.generation_config = GenerationConfig.from_pretrained(folder)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    _report(model_parameters_b=round(sum(p.numel() for p in model.parameters()) / 1e9, 2),
            model_folder_s=round(time.perf_counter() - started, 1))


def internal_clotho_recipe(ctx: Context, args: list[str]) -> None:
    """A copy of the Clotho recipe reading ``model`` and 8 clips of 30 s (4 on the CPU, 2 s) in Clotho's layout:
    one epoch of the recipe's batch of 2."""
    import numpy as np
    import yaml
    from scipy.io import wavfile

    model, recipe = Path(args[0]).absolute(), Path(args[1]).absolute()  # written into the copy: absolute paths
    shutil.copytree(RECIPES / "audio_captioning" / ("clotho" if not ctx.dry else "tiny"), recipe, dirs_exist_ok=True)
    root, clips, seconds = recipe / "clotho-data", 8 if not ctx.dry else 4, 30.0 if not ctx.dry else 1.0
    rng = np.random.default_rng(0)
    for split in ("development", "validation", "evaluation"):
        (root / split).mkdir(parents=True, exist_ok=True)
        rows = ["file_name,caption_1,caption_2,caption_3,caption_4,caption_5"]
        for n in range(clips):
            name = f"{split}_{n}.wav"
            wavfile.write(root / split / name, 44_100,
                          (rng.standard_normal(int(44_100 * seconds)) * 3000).astype(np.int16))
            rows.append(f"{name}," + ",".join(f"a low tone number {n} {i}" for i in range(5)))
        (root / f"clotho_captions_{split}.csv").write_text("\n".join(rows) + "\n")
    experiment = yaml.safe_load((recipe / "experiment.yaml").read_text())
    experiment |= {"out": str(recipe / "out"), "root": str(root), "synthetic": False, "epochs": 1}
    experiment.pop("packaged_model", None)
    (recipe / "experiment.yaml").write_text(yaml.safe_dump(experiment))
    common = yaml.safe_load((recipe / "common.yaml").read_text())
    common |= {"model": str(model), "eval_examples": 2}
    common["training"] |= {"logging_steps": 1, "eval_every": 0, "save_every": 0}
    (recipe / "common.yaml").write_text(yaml.safe_dump(common))


LLAVA_GRIDS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]  # LLaVA-1.6's anyres grids
LLAVA_IMAGE_TOKEN = 32000


def llava_next_processor():
    """LLaVA-1.6-Vicuna-7B's processor, built offline: LLaVA-NeXT's image processor from its defaults at 336 pixels
    with the model's grids (the PIL one: the GPU machine has no torchvision), and a word-level tokenizer standing in
    for Vicuna's (loramcl.models.tiny_llava_next_processor's, over the synthetic captions' words) with '<image>' at
    the model's image token and LLaVA's chat template."""
    from transformers import LlavaNextImageProcessorPil, LlavaNextProcessor

    from loramcl.models import tiny_llava_next_processor
    from loramcl.recipes.image_captioning.textcaps import SYNTHETIC_WORDS

    words = tiny_llava_next_processor(SYNTHETIC_WORDS, image_token_id=LLAVA_IMAGE_TOKEN)
    image_processor = LlavaNextImageProcessorPil(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336},
                                                 image_grid_pinpoints=LLAVA_GRIDS)
    return LlavaNextProcessor(image_processor=image_processor, tokenizer=words.tokenizer, patch_size=14,
                              vision_feature_select_strategy="default", chat_template=words.chat_template,
                              num_additional_image_tokens=1)


def llava_next_config():
    """LLaVA-1.6-Vicuna-7B's config: benchmarks/memory_plan.py's shape (Llama-2-7B beside CLIP ViT-L/14 at 336
    pixels), its text vocabulary of 32,064 as the checkpoint's (the image token 32000 inside it)."""
    from transformers import LlavaNextConfig

    sys.path.insert(0, str(BENCHMARKS))
    from memory_plan import _CLIP_L336, _llama2

    return LlavaNextConfig(text_config={**_llama2(), "vocab_size": 32064}, vision_config=_CLIP_L336,
                           image_token_index=LLAVA_IMAGE_TOKEN, image_grid_pinpoints=LLAVA_GRIDS)


def internal_llava_next_model(ctx: Context, args: list[str]) -> None:
    """A LLaVA-NeXT-7B-shaped folder (llava_next_config) with random bf16 weights made on the GPU and the offline
    processor (llava_next_processor); on the CPU the tiny LLaVA-NeXT of the CPU recipe (loramcl.models)."""
    import torch

    from loramcl.models import tiny_llava_next
    from loramcl.recipes.image_captioning.textcaps import SYNTHETIC_WORDS

    folder = Path(args[0])
    if ctx.dry:
        tiny_llava_next(folder, SYNTHETIC_WORDS)
        return
    from transformers import LlavaNextForConditionalGeneration

    sys.path.insert(0, str(BENCHMARKS))
    from common import build_model

    processor = llava_next_processor()
    tokenizer = processor.tokenizer
    started = time.perf_counter()
    model = build_model(LlavaNextForConditionalGeneration, llava_next_config(), "cuda", torch.bfloat16)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(model.generation_config, name, getattr(tokenizer, name))
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    _report(model_parameters_b=round(sum(p.numel() for p in model.parameters()) / 1e9, 2),
            model_folder_s=round(time.perf_counter() - started, 1))


def internal_textcaps_recipe(ctx: Context, args: list[str]) -> None:
    """A copy of the TextCaps recipe (the tiny one on the CPU) reading ``model`` and a generated set in TextCaps 0.1's
    layout (loramcl's synthetic TextCaps: 8 training images, 5 captions each; anyres gives each up to 5 x 576
    patches at full size): 3 steps of the recipe's batch of 8."""
    import yaml

    from loramcl.recipes.image_captioning.textcaps import write_synthetic_textcaps

    model, recipe = Path(args[0]).absolute(), Path(args[1]).absolute()  # written into the copy: absolute paths
    shutil.copytree(RECIPES / "image_captioning" / ("textcaps" if not ctx.dry else "tiny"), recipe, dirs_exist_ok=True)
    data = write_synthetic_textcaps(recipe / "textcaps-data", {"train": 8, "val": 2})
    experiment = yaml.safe_load((recipe / "experiment.yaml").read_text())
    experiment |= {"out": str(recipe / "out"), "textcaps": str(data), "images": str(data / "images"),
                   "synthetic": False}
    experiment.pop("packaged_model", None)
    (recipe / "experiment.yaml").write_text(yaml.safe_dump(experiment))
    common = yaml.safe_load((recipe / "common.yaml").read_text())
    common |= {"model": str(model)}
    common["training"] |= {"steps": 3, "warmup_steps": 0, "logging_steps": 1, "eval_every": 0, "save_every": 0}
    (recipe / "common.yaml").write_text(yaml.safe_dump(common))


def internal_compiled_numbers(ctx: Context, args: list[str]) -> None:
    """The suite's compiled and peers rows (OUT/suite-*.json) as the summary's numbers: per decoding row the bare
    base and loramcl K = 5 eager and compiled (ms per generate) and their ratios, PEFT's mixed-adapter batch of the
    same rows; per training row eager and compiled (ms a step)."""
    results = json.loads(next(Path(args[0]).glob("suite-*.json")).read_text())
    numbers = {}
    for row in results["compiled"]:
        if row.get("training"):
            numbers |= {f"train_k{row['k']}_eager_ms": round(row["eager_ms"], 1),
                        f"train_k{row['k']}_compiled_ms": round(row["compiled_ms"], 1)}
            continue
        name = "greedy" if row["strategy"] == "greedy" else "beam2"
        numbers |= {f"{name}_{side}_ms": round(row[f"{side}_ms"], 1)
                    for side in ("bare", "bare-compiled", "loramcl", "loramcl-compiled")}
        numbers[f"{name}_compiled_over_bare_compiled"] = round(row["compiled_over_bare_compiled"], 2)
    for row in results["peers"] if isinstance(results["peers"], list) else []:
        name = "greedy" if row["strategy"] == "greedy" else "beam2"
        numbers |= {f"{name}_peft_ms": round(row["peft_ms"], 1),
                    f"{name}_peft_over_loramcl": round(row["peft_over_loramcl"], 2)}
    _report(**numbers)


def internal_quick_recipe(ctx: Context, args: list[str]) -> None:
    """A copy of a task's CPU recipe in bf16 on the GPU, scored with the metrics that need no Java (pycocoevalcap
    and its jars are not carried to the GPU machine)."""
    import yaml

    folder, recipe = args[0], Path(args[1]).absolute()  # written into the copy: absolute paths
    shutil.copytree(RECIPES / folder / "tiny", recipe, dirs_exist_ok=True)
    experiment = yaml.safe_load((recipe / "experiment.yaml").read_text())
    experiment |= {"out": str(recipe / "out"), "metrics": "sacrebleu,chrf"}
    (recipe / "experiment.yaml").write_text(yaml.safe_dump(experiment))
    common = yaml.safe_load((recipe / "common.yaml").read_text())
    common["dtype"] = ctx.dtype
    (recipe / "common.yaml").write_text(yaml.safe_dump(common))


def internal_plan(ctx: Context, args: list[str]) -> None:
    """A recipe run's training log read back (train_log.json: the peak allocated and reserved memory over its logs,
    the last log's step time, tokens per second and MFU: the steady state after the warm-up step) beside the memory
    plan's training peak, and what is left of an H100's 80 GB."""
    recipe, run, folder = args[0], args[1], Path(args[2])
    history = json.loads((folder / "train_log.json").read_text())
    history = history.get("log_history", history) if isinstance(history, dict) else history
    speeds = [entry for entry in history if "step_time" in entry]
    if not speeds:
        raise SystemExit(f"{folder}/train_log.json has no step_time: the run logged no training step")
    last = speeds[-1]
    numbers = {"step_time_s": round(last["step_time"], 3), "tokens_per_s": round(last["tokens_per_second"]),
               "labelled_tokens_per_s": round(last["labelled_tokens_per_second"])}
    if "mfu" in last:
        numbers["mfu"] = round(last["mfu"], 3)
    for name in ("peak_allocated_gb", "peak_reserved_gb"):
        if any(name in entry for entry in speeds):
            numbers[name] = round(max(entry.get(name, 0.0) for entry in speeds), 2)
    if "peak_reserved_gb" in numbers:
        numbers["h100_margin_gb"] = round(H100_GB - numbers["peak_reserved_gb"], 1)
    if not ctx.dry:
        sys.path.insert(0, str(BENCHMARKS))
        from memory_plan import plan_recipe

        plan = next(p for p in plan_recipe(recipe) if p.run == run)
        numbers["plan_training_gb"] = round(plan.training / 1e9, 1)
    _report(**numbers)


def internal_qlora(ctx: Context, args: list[str]) -> None:
    """bitsandbytes nf4 and int8 bases: a training step, decoding, and hypothesis 1 exported to PEFT giving PEFT's
    logits on the same quantized base."""
    import torch
    from peft import PeftModel
    from transformers import BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

    from loramcl import MCLConfig, get_mcl_model

    folder = ctx.work / "qlora-base"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(folder)
    compute = torch.bfloat16 if not ctx.dry else torch.float32
    kinds = {"nf4": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute),
             "int8": BitsAndBytesConfig(load_in_8bit=True)}
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(0)).to(ctx.host_device)
    for kind, quantization in kinds.items():
        def base():
            return LlamaForCausalLM.from_pretrained(folder, quantization_config=quantization,
                                                    device_map=ctx.host_device,
                                                    dtype=compute)

        mcl = get_mcl_model(base(), MCLConfig(num_hypotheses=2, r=4, target_modules=["q_proj", "v_proj"],
                                              loss="relaxed", epsilon=0.1))
        optimizer = torch.optim.AdamW([p for p in mcl.parameters() if p.requires_grad], lr=1e-2)
        loss = mcl(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        mcl.eval()
        with mcl.use_hypotheses(1):
            generated = mcl.generate(input_ids=ids[:, :6], max_new_tokens=4, do_sample=False)
        mcl.export_hypothesis(1, ctx.work / f"qlora-{kind}-h1")
        with torch.no_grad():
            ours = mcl(input_ids=ids, hypotheses=1).logits.float()
            theirs = PeftModel.from_pretrained(base(), ctx.work / f"qlora-{kind}-h1").eval()(input_ids=ids).logits
        gap = (ours.squeeze(1) - theirs.float()).abs().max().item()
        print(f"{kind}: loss {loss.item():.3f}, decoded {tuple(generated.shape)}, |ours - PEFT| {gap:.2e}")
        if not gap < 0.05:
            raise SystemExit(f"{kind}: hypothesis 1 exported to PEFT differs from loramcl by {gap}")
        _report(**{f"{kind}_peft_gap": float(f"{gap:.2e}")})


def internal_remove(ctx: Context, args: list[str]) -> None:
    """A model folder removed once its step is done: full-size folders are 14-17 GB of the machine's disk."""
    shutil.rmtree(args[0], ignore_errors=True)


INTERNAL = {name[len("internal_"):].replace("_", "-"): function for name, function in globals().items()
            if name.startswith("internal_")}


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
