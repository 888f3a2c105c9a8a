"""Docs run as written (issue 35): every fenced block of README.md and docs/**/*.md is named in the REGISTRY of
tests/docs_blocks.py, which says how each line is exercised on tiny models, and a block the registry does not name
(or an entry no block has) fails the suite.

Each block runs in its own folder, a copy of one prepared per module (`base`), holding what the docs assume:
  models/SmolLM2-135M-Instruct   a tiny random LlamaForCausalLM with SmolLM2-135M-Instruct's own tokenizer and
                                 chat template (read from the packaged GGUF); `convert-smollm2`, `bilingual` and
                                 `translation` get this folder in place of the real model (the harness's one
                                 replacement of a packaged model; the recipes' tests convert the real one:
                                 tests/conftest.py smollm2_folder). Whisper-base is converted for real, once.
  train.jsonl, test.jsonl        prompt -> target pairs; prompts with their references, no "id" (as `generate` and
                                 `nll` read them)
  prompts.jsonl, preds.jsonl, refs.jsonl, nll.jsonl   small files in the formats of docs/guide/metrics.md, decoding.md
  runs/bilingual, runs/translation   the tiny model and data/ as the first stages of `loramcl bilingual --quick` and
                                 `loramcl translation --quick` write them (bilingual's train.jsonl cut to 32 pairs)
  runs/mcl                       a K = 2 LoRA-MCL run of 2 steps (the docs' BASE / CKPT / MCL_RUN placeholders)
  my_chains.json                 three 2-state chains (docs/experiments/markov.md's --chains file)
`loramcl` lines run in-process through loramcl.cli.main. What the harness changes in a command is in its entry (`why`);
long runs are cut short (training steps, `--quick true`, `--stop_after data` with `covered_by` naming the test that
runs the rest), and a paper-scale command stops, as written, with its one-line message naming the missing model or
data. Without espeak-ng on the PATH, the spoken-translation lines must stop with its one-line message instead.
Blocks that fail today because of the code, not the doc, are in EXPECTED (strict xfail, on the named error only).
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import re
import runpy
import shutil
import sys

import pytest
import torch
from docs_blocks import (
    DATA_FILES,
    EXPECTED,
    REGISTRY,
    ROOT,
    SETUP,
    Check,
    Launch,
    Make,
    Module,
    Output,
    Run,
    Block,
    expand,
    extract_blocks,
    is_assignment,
    llama_cpp_recipe,
)

BLOCKS = extract_blocks()


def _items():
    return [(b.file, item) for b in BLOCKS for item in b.items()]


def test_every_doc_block_is_registered_and_every_entry_is_a_doc_block():
    items = set(_items())
    missing = sorted(items - set(REGISTRY))
    stale = sorted(set(REGISTRY) - items)
    assert not missing, "doc lines with no entry in tests/docs_blocks.py (say how each is exercised): " + \
        "; ".join(f"{f}: {i!r}" for f, i in missing)
    assert not stale, "registry entries that name no doc line (update them with the doc): " + \
        "; ".join(f"{f}: {i!r}" for f, i in stale)
    blocks = {(b.file, b.items()[0]) for b in BLOCKS}
    assert not set(EXPECTED) - blocks, f"EXPECTED names no block: {sorted(set(EXPECTED) - blocks)}"
    assert not set(SETUP) - blocks, f"SETUP names no block: {sorted(set(SETUP) - blocks)}"


def test_each_change_to_a_doc_command_says_why_and_names_tests_that_exist():
    for (file, item), spec in REGISTRY.items():
        changed = any(getattr(spec, name, None) for name in ("replace", "append", "parse_only", "fails", "subs"))
        if changed or isinstance(spec, (Make, Check, Launch)):
            assert spec.why, f"{file}: {item!r}: the registry changes or does not run it: say why"
        _covered(getattr(spec, "covered_by", None))


LINKED = ("README.md", "CHANGELOG.md", *(p.relative_to(ROOT).as_posix() for p in sorted((ROOT / "docs").rglob("*.md"))))


def _prose(file: str) -> str:
    """The file's text without its fenced blocks (a `# comment` in a bash block is no heading)."""
    return re.sub(r"(?ms)^\s*(```+|~~~+).*?^\s*\1\s*$", "", (ROOT / file).read_text(encoding="utf-8"))


def _anchors(file: str) -> set[str]:
    """The anchors GitHub gives the headings of a markdown file: lower case, punctuation dropped, spaces to hyphens,
    a repeated one numbered -1, -2, ..."""
    anchors, seen = set(), {}
    for heading in re.findall(r"(?m)^#{1,6}\s+(.+?)\s*#*\s*$", _prose(file)):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def test_every_link_and_docs_path_of_the_docs_resolves():
    """A relative link of README.md, CHANGELOG.md and docs/ names a file that exists, and its #anchor a heading of
    that file; a `docs/....md` path named in their prose exists (the docs moved into docs/guide/ and
    docs/experiments/: a stale path is a dead end for the reader)."""
    broken = []
    for file in LINKED:
        text = _prose(file)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            resolved = (ROOT / file).parent / path if path else ROOT / file
            if not resolved.exists():
                broken.append(f"{file}: ({target}): no file {path}")
            elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved.relative_to(ROOT).as_posix()):
                broken.append(f"{file}: ({target}): no heading #{anchor} in {path or file}")
        for path in re.findall(r"(?<![\w/.-])docs/[\w/]+\.md", text):
            if not (ROOT / path).is_file():
                broken.append(f"{file}: {path} does not exist")
    assert not broken, "dead links in the docs: " + "; ".join(broken)


def test_the_readme_tables_commands_are_doc_lines_that_run():
    """Each `loramcl ...` command quoted in README.md's prose (the table of tasks) is a line of a doc block that the
    registry exercises, so that the table's commands run as written too."""
    quoted = re.findall(r"`(loramcl [^`]+)`", _prose("README.md"))
    assert quoted, "README.md quotes no loramcl command"
    items = {item for _, item in REGISTRY}
    assert not [c for c in quoted if c not in items], \
        f"README.md quotes commands that no doc block runs: {[c for c in quoted if c not in items]}"


def test_code_blocks_say_their_language_and_output_blocks_hold_no_command():
    for block in BLOCKS:
        kinds = {type(REGISTRY.get((block.file, i))) for i in block.items()}
        if block.lang == "":
            assert kinds == {Output}, f"{block.name}: an unlabelled block must be registered as Output"
            commands = [ln for ln in block.text.splitlines()
                        if ln.strip().split(" ")[0] in ("loramcl", "python", "pip", "make", "accelerate")]
            assert not commands, f"{block.name}: an output block holds commands {commands}: label it bash"
        else:
            assert block.lang in ("bash", "python"), f"{block.name}: unknown block language {block.lang!r}"
            assert Output not in kinds, f"{block.name}: a {block.lang} block is code, not an output"


def _llama_cpp_commands(text: str) -> list:
    return [c.words for c in Block("serving.md", 0, "bash", text).commands()]


def test_the_serving_guides_llama_cpp_recipe_converts_serves_and_requests_every_hypothesis():
    """Issue 56: the guide's llama.cpp blocks convert the base and h0, h1 (each with --base), start llama-server with
    both unapplied, and send one request per hypothesis naming both scales; each fault is caught."""
    text = "\n".join(b.text for b in BLOCKS if b.file == "docs/guide/serving.md"
                     and re.search(r"llama|localhost:8080", b.text))
    base, folders = "models/SmolLM2-135M-Instruct", ["exported-folded/h0", "exported-folded/h1"]
    llama_cpp_recipe(_llama_cpp_commands(text), folders, base)
    h1 = next(ln for ln in text.splitlines() if "convert_lora_to_gguf.py exported-folded/h1" in ln)
    scale = ', {"id": 1, "scale": 0.0}'
    for fault, broken in [("not every hypothesis", text.replace(h1, "")),
                          ("--base", text.replace(f" --base {base} --outfile exported-folded/h1", " --outfile "
                                                  "exported-folded/h1")),
                          ("every adapter 0 ... 1", text.replace(scale, "", 1)),
                          ("without \"lora\"", re.sub(r', "lora": \[[^]]*\]', "", text, count=1)),
                          ("applies every adapter", text.replace(" --lora-init-without-apply", ""))]:
        with pytest.raises(AssertionError, match=re.escape(fault)):
            llama_cpp_recipe(_llama_cpp_commands(broken), folders, base)


# ---------------------------------------------------------------------------------------------------------------
# the folder the docs assume


@pytest.fixture(scope="module")
def tiny_smollm2(tmp_path_factory):
    """A tiny random LlamaForCausalLM with SmolLM2-135M-Instruct's tokenizer and chat template."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from loramcl.models import smollm2_gguf

    gguf = smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    out = tmp_path_factory.mktemp("tiny") / "SmolLM2-135M-Instruct"
    torch.manual_seed(0)
    # 32 wide, every projection too: the recipes' ranks (up to 24) fit every adapted layer
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _link_copy(source, target) -> None:
    """A copy whose large files (model weights and tokenizers, never rewritten) are hard links."""
    def copy(src, dst):
        (os.link if os.path.getsize(src) > 1 << 20 else shutil.copy2)(src, dst)

    shutil.copytree(source, target, copy_function=copy, dirs_exist_ok=True)


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_smollm2):
    root = tmp_path_factory.mktemp("docs")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        _patch_models(patch, tiny_smollm2)
        _write_files(root)
        assert cli(["convert-smollm2", "--out", "models/SmolLM2-135M-Instruct"])[0] == 0
        assert cli(["convert-whisper-base", "--out", "models/whisper-base"])[0] == 0
        assert cli(["bilingual", "--quick", "true", "--stop_after", "data"])[0] == 0
        train = root / "runs/bilingual/data/train.jsonl"
        train.write_text("".join(train.read_text().splitlines(keepends=True)[:32]))
        assert cli(["translation", "--quick", "true", "--stop_after", "data"])[0] == 0
        assert cli(["train", "--model", "models/SmolLM2-135M-Instruct", "--out", "runs/mcl", "--data.train_file",
             "train.jsonl", "--mcl.num_hypotheses", "2", "--mcl.target_modules", "[q_proj, v_proj]",
             "--training.steps", "2", "--training.batch_size", "4"])[0] == 0
    return root


_WHISPER = {}  # the real Whisper-base conversion (and each context cut of it), made once per module


def _patch_models(patch, tiny) -> None:
    """`convert_smollm2` writes the tiny model; Whisper-base is converted for real once, then linked."""
    from pathlib import Path

    import loramcl.models.pretrained
    import loramcl.recipes.spoken_translation.reproduce as spoken

    convert_whisper_base, build_whisper = loramcl.models.pretrained.convert_whisper_base, spoken.build_model

    def convert_smollm2(out, tokenizer_only=False):  # the tiny model holds the tokenizer too
        if not (out := Path(out)).joinpath("config.json").is_file():
            _link_copy(tiny, out)
        return out

    def cached(key, make, out):
        out = Path(out)
        if key not in _WHISPER:
            _WHISPER[key] = make(out)
        elif not (out / "config.json").is_file():
            _link_copy(_WHISPER[key], out)
        return out

    patch.setattr(loramcl.models.pretrained, "convert_whisper_base", lambda out: cached("full", convert_whisper_base, out))
    patch.setattr(spoken, "build_model", lambda out, seconds: cached(seconds, lambda o: build_whisper(o, seconds),
                                                                      out))
    patch.setattr(loramcl.models.pretrained, "convert_smollm2", convert_smollm2)


def _write_files(root) -> None:
    def jsonl(name, rows):
        (root / name).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))

    for block in BLOCKS:  # docs/guide/data.md's example files, as the doc shows them, and chat.jsonl as its python
        if block.file == "docs/guide/data.md" and block.first_line in DATA_FILES:  # block converts it
            (root / block.first_line).write_text(block.text.split("\n", 1)[1] + "\n", encoding="utf-8")
    from datasets import load_dataset

    chat = load_dataset("json", data_files=str(root / "chat.jsonl"), split="train")
    chat.to_parquet(root / "chat.parquet")
    chat.save_to_disk(root / "chat-saved")

    words = ["the file", "a folder", "open it", "save the file", "close the window", "print a page"]
    fr = ["le fichier", "un dossier", "ouvrez-le", "enregistrer le fichier", "fermer la fenêtre", "imprimer"]
    de = ["die Datei", "ein Ordner", "öffnen", "Datei speichern", "Fenster schließen", "eine Seite drucken"]
    jsonl("train.jsonl", [{"prompt": f"Translate: {w}", "target": t} for i, w in enumerate(words)
                          for t in (fr[i], de[i])])
    jsonl("test.jsonl", [{"prompt": f"Translate: {w}", "references": [fr[i], de[i]]} for i, w in enumerate(words[:3])])
    jsonl("prompts.jsonl", [{"id": f"p{i}", "prompt": f"Translate: {w}"} for i, w in enumerate(words[:3])])
    jsonl("preds.jsonl", [{"id": f"img{i}", "candidates": [fr[i], de[i], w]} for i, w in enumerate(words[:3])])
    jsonl("refs.jsonl", [{"id": f"img{i}", "references": [fr[i], de[i], w], "lang": "fr" if i % 2 else "de"}
                         for i, w in enumerate(words[:3])])
    jsonl("nll.jsonl", [{"id": f"img{i}", "nll": [[1.0 + i, 2.0, 3.0]] * 3} for i in range(3)])
    three = [[[0.9, 0.1], [0.2, 0.8]], [[0.1, 0.9], [0.8, 0.2]], [[0.5, 0.5], [0.5, 0.5]]]
    (root / "my_chains.json").write_text(json.dumps({"chains": three, "weights": [0.4, 0.3, 0.3], "seq_len": 32}))


@pytest.fixture
def workdir(base, tmp_path, monkeypatch, tiny_smollm2):
    folder = tmp_path / "w"
    _link_copy(base, folder)
    monkeypatch.chdir(folder)
    _patch_models(monkeypatch, tiny_smollm2)
    threads = torch.get_num_threads()
    yield folder
    torch.set_num_threads(threads)  # a command's --threads must not change the tests after it


# ---------------------------------------------------------------------------------------------------------------
# running a block


def cli(argv) -> tuple[int, str]:
    """loramcl.cli.main(argv): (exit status, last stderr line), stderr read through a temporary redirect."""
    import contextlib
    import io

    from loramcl.cli import main

    err = io.StringIO()
    code = 0
    with contextlib.redirect_stderr(err):
        try:
            main(list(argv))
        except SystemExit as stop:
            code = stop.code or 0
    lines = [ln for ln in err.getvalue().splitlines() if ln.strip()]
    return code, (lines[-1] if lines else "")


def _apply(words, replace, append, what) -> list[str]:
    text = "\x00".join(words)
    for old, new in replace:
        assert old in text, f"{what}: the registry replaces {old!r}, which the doc line no longer has"
        text = text.replace(old, new)
    return [w for w in text.split("\x00") if w] + list(append)


def _run_cli(argv, run: Run, what: str, folder) -> None:
    fails = run.fails
    if run.espeak and shutil.which("espeak-ng") is None:
        fails = "espeak-ng is not installed: .*apt-get install espeak-ng"
    code, last = cli(argv)
    if fails:
        assert code != 0 and re.search(fails, last), f"{what}: expected the error {fails!r}, got exit {code}: {last}"
        return
    assert code == 0, f"{what}: exit {code}: {last}"
    for path in run.outputs:
        assert (folder / path).exists(), f"{what}: {path} was not written"


def _covered(test: str | None) -> None:
    """A covered_by entry names a test function that exists."""
    if test is None:
        return
    file, name = test.split("::")
    tree = ast.parse((ROOT / file).read_text(encoding="utf-8"))
    assert name in {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}, f"no test {test}"


def _module(words, spec: Module, what: str, folder) -> None:
    import argparse

    argv = _apply(words, spec.replace, spec.append, what)
    while "=" in argv[0] and not argv[0].startswith("-"):  # `NAME=value script ...`: an environment for the script
        argv = argv[1:]
    if argv[0].endswith(("python", "python3")) and argv[1] == "-m":
        target, args, run = argv[2], argv[3:], runpy.run_module
    else:
        target, args, run = str(ROOT / argv[1]), argv[2:], runpy.run_path
        assert (ROOT / argv[1]).is_file(), f"{what}: {argv[1]} does not exist"

    class Parsed(Exception):
        pass

    parse = argparse.ArgumentParser.parse_known_args

    def parse_then_stop(self, args=None, namespace=None):  # parse_args reads through parse_known_args
        _, unknown = parse(self, args, namespace)
        assert not unknown, f"{what}: {target} does not know {unknown}"
        raise Parsed

    saved = sys.argv, list(sys.path)
    sys.argv = [target, *args]
    try:
        with pytest.MonkeyPatch.context() as patch:
            if spec.parse_only:
                patch.setattr(argparse.ArgumentParser, "parse_known_args", parse_then_stop)
            try:
                run(target, run_name="__main__")
            except Parsed:
                pass
            else:
                assert not spec.parse_only, f"{what}: parsed no options"
    finally:
        sys.argv, sys.path[:] = saved
    for path in spec.outputs:
        assert (folder / path).exists(), f"{what}: {path} was not written"


def _launch(words, spec: Launch, what: str, folder) -> None:
    from accelerate.commands.launch import launch_command_parser

    at = words.index("-m")
    assert words[at + 1] == "loramcl.cli", f"{what}: launches {words[at + 1]}, not loramcl.cli"
    launcher = launch_command_parser().parse_args(list(words[2:at + 2]) + ["--"])
    assert launcher.module and launcher.training_script == "loramcl.cli"
    assert launcher.num_processes == int(words[words.index("--num_processes") + 1])
    _run_cli(_apply(words[at + 2:], spec.run.replace, spec.run.append, what), spec.run, what, folder)


def _make(words, spec: Make, what: str) -> None:
    import subprocess

    done = subprocess.run(["make", "-n", *words[1:]], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"{what}: {done.stderr}"
    for text in spec.shows:
        assert text in done.stdout, f"{what}: `make -n` does not show {text!r}:\n{done.stdout}"


def exercise(block, folder) -> None:
    for step in SETUP.get((block.file, block.items()[0]), ()):
        if callable(step):
            step(folder)
        else:
            code, last = cli(step)
            assert code == 0, f"{block.name}: setup {step}: exit {code}: {last}"
    if block.lang == "python":
        spec = REGISTRY[(block.file, block.items()[0])]
        code = block.text
        for old, new in spec.subs:
            assert old in code, f"{block.name}: the registry binds {old!r}, which the block no longer has"
            code = code.replace(old, new)
        with _logging_restored():  # a block may configure logging (docs/guide/cli.md): not for the tests after it
            exec(compile(code, block.name, "exec"), NAMESPACES[spec.namespace](folder))  # noqa: S102
        return
    variables = {}
    for command in block.commands():
        what = f"{block.name}: {command.key}"
        if is_assignment(command.words):
            name, value = command.words[0].split("=", 1)
            variables[name] = value
            continue
        spec = REGISTRY[(block.file, command.key)]
        loop_name, values = command.loop or (None, (None,))
        for value in values:
            words = expand(command.words, {**variables, **({loop_name: value} if loop_name else {})})
            if isinstance(spec, Run):
                assert words[0].endswith("loramcl"), f"{what}: not a loramcl command"
                _run_cli(_apply(words[1:], spec.replace, spec.append, what), spec, what, folder)
            elif isinstance(spec, Module):
                _module(words, spec, what, folder)
            elif isinstance(spec, Launch):
                _launch(words, spec, what, folder)
            elif isinstance(spec, Make):
                _make(words, spec, what)
            elif isinstance(spec, Check):
                spec.check(command.line)
            else:
                raise AssertionError(f"{what}: a bash line registered as {type(spec).__name__}")
            _covered(getattr(spec, "covered_by", None))


class ExpectedFailure(Exception):
    """The error an EXPECTED entry names (any other error fails its strict xfail test)."""


def _block_params():
    params = []
    for block in BLOCKS:
        if block.lang == "":
            continue
        expected = EXPECTED.get((block.file, block.items()[0]))
        marks = [pytest.mark.xfail(strict=True, reason=f"issue 35: {expected.reason}", raises=ExpectedFailure)
                 ] if expected else []
        params.append(pytest.param(block, id=block.name, marks=marks))
    return params


@pytest.mark.parametrize("block", _block_params())
def test_doc_block_runs_as_written(block, workdir):
    expected = EXPECTED.get((block.file, block.items()[0]))
    try:
        exercise(block, workdir)
    except Exception as error:
        if expected and re.search(expected.match, str(error)):
            raise ExpectedFailure(str(error)) from error
        raise


# ---------------------------------------------------------------------------------------------------------------
# what the python blocks' free names are bound to


def _tiny(folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = folder / "models/SmolLM2-135M-Instruct"
    return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)


def _training(folder) -> dict:
    from transformers import TrainingArguments

    from loramcl.data.prompts import collate, encode_pairs

    model, tokenizer = _tiny(folder)
    rows = encode_pairs(tokenizer, ["Translate: the file", "Translate: a folder"] * 2,
                        ["le fichier", "ein Ordner", "die Datei", "un dossier"])
    args = TrainingArguments(output_dir=str(folder / "trainer"), max_steps=2, per_device_train_batch_size=2,
                             report_to=[], save_strategy="no", use_cpu=True)
    return dict(hf_model=model, base=model, tokenizer=tokenizer, tok=tokenizer, training_args=args, rows=rows,
                batch=collate(rows, pad_token_id=tokenizer.pad_token_id), prompts=["a prompt", "another prompt"])


def _use(folder) -> dict:
    names = _training(folder)
    names["prompt"] = dict(names["tokenizer"]("a prompt", return_tensors="pt"))
    return names | dict(fresh_hf_model=_tiny(folder)[0], i=0, k=1)


def _baselines(folder) -> dict:
    return _training(folder) | dict(base2=_tiny(folder)[0])


def _decoding(folder, num_hypotheses: int = 3) -> dict:
    from loramcl import MCLConfig, get_mcl_model
    from loramcl.baselines import MoEConfig, get_moe_model
    from loramcl.decoding import equal_budget, generate_hypotheses

    names = _training(folder)
    mcl = get_mcl_model(_tiny(folder)[0], MCLConfig(num_hypotheses=num_hypotheses, r=4, alpha=8,
                                                    target_modules=["q_proj", "v_proj"]))
    moe = get_moe_model(_tiny(folder)[0], MoEConfig(num_experts=3, r=4, alpha=8, target_modules=["q_proj", "v_proj"]))
    return names | dict(model=mcl, mcl=mcl, moe=moe, mle=_tiny(folder)[0], i=0, k=1,
                        generate_hypotheses=generate_hypotheses, equal_budget=equal_budget)


def _audio(folder) -> dict:
    import numpy as np
    from transformers import AutoProcessor, Qwen2AudioForConditionalGeneration

    from loramcl.decoding import generate_hypotheses
    from loramcl.models import tiny_qwen2_audio
    from loramcl.recipes.audio_captioning.prompts import CaptionEncoder

    path = tiny_qwen2_audio(folder / "tiny-qwen2-audio", ["a", "dog", "barks"])
    processor = AutoProcessor.from_pretrained(path)
    clip = np.random.default_rng(0).standard_normal(16_000).astype("float32")
    return dict(mle=Qwen2AudioForConditionalGeneration.from_pretrained(path), processor=processor,
                batch=CaptionEncoder(processor).generation_batch([clip]), generate_hypotheses=generate_hypotheses)


@contextlib.contextmanager
def _logging_restored():
    import logging

    root, ours = logging.getLogger(), logging.getLogger("loramcl")
    saved = (list(root.handlers), root.level, ours.level)
    try:
        yield
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
        ours.setLevel(saved[2])


def _metrics(folder) -> dict:
    candidates = [["a dog barks", "a cat sleeps"], ["two men talk", "a man talks"]]
    references = [["a dog is barking", "the dog barks loudly"], ["men are talking", "two men speak", "a talk"]]
    return dict(candidates=candidates, references=references, langs=["en", "fr"],
                texts=["A dog, barking!", "Two men talk."], cands_tok=candidates, refs_tok=references)


NAMESPACES = {"plain": lambda folder: {}, "use": _use, "baselines": _baselines, "decoding": _decoding,
              "diverse": lambda f: _decoding(f, 2), "audio": _audio, "metrics": _metrics}
