"""CPU threads on an idle machine and beside another job: torch's default against `--threads 1`, one thread per core
with OpenMP's waiting threads asleep, and the commands' default (the free cores, waiting threads asleep).

Times two documented commands end to end, each in a fresh process as a user runs them: `loramcl markov --seeds 1`
(the main job, shortened) and docs/guide/cli.md's first `loramcl train` on a small Qwen2 with SmolLM2's tokenizer and an
ambiguous question set. "Beside another job" is a process spinning on one core (busy), or another torch program on
every core (torch-job), for the whole run. Prints each setting's seconds and its ratio to the fastest setting of the
same command and load, measured in one run, and the load average after each (nothing else should run):

    python -m benchmarks.speed.threads --out /tmp/threads            # about 20 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

# "torch's default" imports torch before the command line sets OMP_WAIT_POLICY, as any program did before it did.
SETTINGS = {
    "torch default (a thread per core, spinning)": ("torch-first", "cores"),
    "--threads 1": ("cli", 1),
    "a thread per core, sleeping": ("cli", "cores"),
    "default (free cores, sleeping)": ("cli", None),
}
# busy: beside a process spinning on one core for the whole run; torch-job: beside another torch program on every
# core (two threads of matrix products, as a second training or a test suite would be)
LOADS = ("idle", "busy", "torch-job")
LOAD_PROGRAMS = {"busy": "while True: pass",
                 "torch-job": "import torch\ntorch.set_num_threads(2)\na = torch.randn(256, 256)\nwhile True: a @ a"}
QUESTIONS = [("Name a colour", ["red", "green", "blue"]), ("Name a fruit", ["apple", "pear", "plum"]),
             ("Name an animal", ["cat", "dog", "horse"]), ("Name a metal", ["iron", "gold", "tin"])]


def build_inputs(root: Path) -> dict:
    """A small Qwen2 with SmolLM2's tokenizer (the packaged model's, `convert-smollm2 --tokenizer_only`) and 200
    questions, each with three equally right answers."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from loramcl.models import convert_smollm2

    model = root / "qwen2-small"
    if not (model / "config.json").is_file():
        convert_smollm2(model, tokenizer_only=True)
        tokenizer = AutoTokenizer.from_pretrained(model)
        config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                             tie_word_embeddings=True)
        Qwen2ForCausalLM(config).save_pretrained(model)
    data = root / "questions.jsonl"
    rng = random.Random(0)
    with data.open("w") as f:
        for _ in range(200):
            question, answers = rng.choice(QUESTIONS)
            f.write(json.dumps({"prompt": question + ":", "target": " " + rng.choice(answers)}) + "\n")
    return {"model": str(model), "data": str(data)}


def commands(inputs: dict, out: Path, steps: int, markov_steps: int) -> dict[str, list[str]]:
    return {
        "markov": ["markov", "--seeds", "1", "--steps", str(markov_steps), "--out", str(out / "markov")],
        "train": ["train", "--model", inputs["model"], "--out", str(out / "train"), "--data.train_file",
                  inputs["data"], "--mcl.num_hypotheses", "3", "--mcl.target_modules", "[q_proj, v_proj]",
                  "--training.steps", str(steps)],
    }


def timed(argv: list[str], setting: tuple, timeout: float) -> float | None:
    """Seconds of one command in a fresh process (None: still running after ``timeout``)."""
    import psutil

    start, threads = setting
    cores = psutil.cpu_count(logical=False) or os.cpu_count()
    if threads == "cores":
        threads = cores
    argv = argv + (["--threads", str(threads)] if threads is not None else [])
    code = f"from loramcl.cli import main; main({argv!r})"
    if start == "torch-first":
        code = "import torch\n" + code
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    began = time.perf_counter()
    try:
        subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=timeout,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return None
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="/tmp/loramcl-threads")
    parser.add_argument("--steps", type=int, default=100, help="training steps of the train command")
    parser.add_argument("--markov_steps", type=int, default=60)
    parser.add_argument("--timeout", type=float, default=600, help="seconds after which a run counts as too slow")
    parser.add_argument("--loads", nargs="+", default=list(LOADS), choices=LOADS, help="the conditions to run")
    parser.add_argument("--commands", nargs="+", default=["markov", "train"], choices=["markov", "train"])
    args = parser.parse_args()
    root = Path(args.out)
    root.mkdir(parents=True, exist_ok=True)
    inputs = build_inputs(root)
    results = []
    for load in args.loads:
        for name in args.commands:
            for setting, how in SETTINGS.items():
                argv = commands(inputs, root / "runs" / str(len(results)), args.steps, args.markov_steps)[name]
                spin = subprocess.Popen([sys.executable, "-c", LOAD_PROGRAMS[load]]) if load != "idle" else None
                try:
                    seconds = timed(argv, how, args.timeout)
                finally:
                    if spin is not None:
                        spin.kill()
                        spin.wait()
                results.append({"load": load, "command": name, "setting": setting, "seconds": seconds,
                                "load_average": round(os.getloadavg()[0], 2)})  # a check that nothing else ran
                print(json.dumps(results[-1]), flush=True)
    print("\n| load | command | setting | seconds | / fastest |\n|---|---|---|---|---|")
    for row in results:
        same = [r["seconds"] for r in results if (r["load"], r["command"]) == (row["load"], row["command"])
                and r["seconds"] is not None]
        seconds = f"{row['seconds']:.1f}" if row["seconds"] is not None else f"> {args.timeout:.0f}"
        ratio = f"{row['seconds'] / min(same):.2f}" if row["seconds"] is not None else "-"
        print(f"| {row['load']} | {row['command']} | {row['setting']} | {seconds} | {ratio} |")
    (root / "threads.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
