"""`loramcl <command>`: each command is a function whose signature and docstring are its CLI (jsonargparse),
so `loramcl <command> --help` documents it and `--config file.yaml` reads the same arguments from a file (its
paths relative to that file).

A mistake ends the command with one line on stderr, `loramcl <command>: error: <what to change>`, and exit status
2 (a wrong option or value) or 1 (anything else); `--debug` or LORAMCL_DEBUG=1 shows the traceback instead.
docs/guide/cli.md lists the usual mistakes and their messages.
"""

from __future__ import annotations

import contextlib
import difflib
import inspect
import logging
import os
import re
import sys
import warnings

from loramcl.utils.threads import check_threads, settle_before_torch

DEBUG_ENV = "LORAMCL_DEBUG"
VERBOSITY_ENV = "LORAMCL_VERBOSITY"
VERBOSITIES = ("debug", "info", "warning", "error")
EXIT_USAGE, EXIT_FAILURE, EXIT_INTERRUPTED = 2, 1, 130


def commands() -> dict:
    """{name: function} of every `loramcl` command (light imports: torch loads inside the functions)."""
    from loramcl.decoding.predictions import generate
    from loramcl.metrics.evaluate import evaluate, plot_tradeoff
    from loramcl.models.pretrained import convert_smollm2_command, convert_whisper_base_command
    from loramcl.recipes.audio_captioning.reproduce import audio_captioning
    from loramcl.recipes.bilingual.reproduce import bilingual
    from loramcl.recipes.catalog import copy_recipe, list_recipes
    from loramcl.recipes.image_captioning.reproduce import image_captioning
    from loramcl.recipes.markov.reproduce import markov
    from loramcl.recipes.spoken_translation.reproduce import spoken_translation
    from loramcl.recipes.translation.reproduce import translation
    from loramcl.training.export import export
    from loramcl.training.fit import train
    from loramcl.training.reference_nll import nll

    return {"markov": markov, "bilingual": bilingual, "translation": translation, "audio-captioning": audio_captioning,
            "spoken-translation": spoken_translation, "image-captioning": image_captioning, "train": train,
            "generate": generate, "export": export, "nll": nll, "evaluate": evaluate, "plot-tradeoff": plot_tradeoff,
            "convert-smollm2": convert_smollm2_command, "convert-whisper-base": convert_whisper_base_command,
            "recipes": {"_help": "List the recipes that ship with loramcl, or copy one to edit.", "list": list_recipes,
                        "copy": copy_recipe}}


# On a GPU, torch's caching allocator keeps segments of the sizes first asked for: the ALMA recipe's training reserved
# 76.0 GB for 52.8 GB allocated on an H200 (issue 50), 4 GB under an H100's 80. Expandable segments grow and shrink
# one mapping instead (docs/benchmarks.md, "The GPU check"). Read by torch at the first CUDA allocation; no effect
# on the CPU. PYTORCH_ALLOC_CONF is the name since torch 2.9, PYTORCH_CUDA_ALLOC_CONF the older one.
ALLOCATOR_SETTINGS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args or os.environ.get(DEBUG_ENV, "").strip() not in ("", "0")
    args = [a for a in args if a != "--debug"]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing downloads at run time
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    if not any(os.environ.get(name) for name in ALLOCATOR_SETTINGS):  # the user's own allocator settings win
        os.environ[ALLOCATOR_SETTINGS[0]] = "expandable_segments:True"
    from jsonargparse import CLI, set_parsing_settings

    from loramcl import __version__

    # the dataclasses' field docstrings are the help of their options (--data.*, --training.*, --mcl.*, ...); read
    # only for a help, since reading them takes a tenth of a second
    set_parsing_settings(docstring_parse_attribute_docstrings=any(a in ("-h", "--help") or a.endswith(".help")
                                                                   for a in args))
    table = commands()
    command = next((a for a in args if a in table), None)
    if command == "recipes" and args[-1] == "recipes":
        args.append("list")  # `loramcl recipes` alone lists them
    args = _non_finite_values(_packaged_configs(args))
    if command is not None and callable(table[command]):
        args = _bare_booleans(args, table[command])
        if "threads" in inspect.signature(table[command]).parameters and not {"-h", "--help"} & set(args):
            settle_before_torch()  # a command that runs a model: the free cores, and OpenMP's waits
    prefix = f"loramcl {command}" if command else "loramcl"
    try:
        with _one_line_warnings(prefix), _library_log(prefix), _quiet_import_noise():
            # `loramcl recipes copy <task>/<name> <dir>` and `loramcl export RUN` take positional arguments; every
            # other command takes options, never abbreviated (argparse would take --training.step for
            # --training.steps without a word)
            CLI(table, args=args, as_positional=command in ("recipes", "export"), exit_on_error=False,
                allow_abbrev=False, parser_class=_parser_class(),
                version=f"{__version__} ({os.path.dirname(os.path.abspath(__file__))})")
    except KeyboardInterrupt:
        if debug:
            raise
        say(f"{prefix}: interrupted{_how_to_continue(command, table)}")
        raise SystemExit(EXIT_INTERRUPTED) from None
    except BrokenPipeError:  # the reader of our output stopped (`loramcl recipes | head`): nothing left to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush cannot fail again
        raise SystemExit(0) from None
    except Exception as error:
        if debug:
            raise
        usage = _is_usage_error(error)
        say(f"{prefix}: error: {error_message(error, table, command)}")
        raise SystemExit(EXIT_USAGE if usage else EXIT_FAILURE) from None


def say(line: str, file=None) -> None:
    """Print ``line`` on a line of its own (stderr by default), never after a progress bar's text: open tqdm bars are
    cleared first and drawn again below it (tqdm's public ``external_write_mode``, as ``tqdm.write`` does)."""
    file = sys.stderr if file is None else file
    tqdm = sys.modules.get("tqdm")  # no bar can be open unless tqdm was imported; importing it here costs time
    if tqdm is None or not hasattr(tqdm, "tqdm"):
        print(line, file=file, flush=True)
        return
    with tqdm.tqdm.external_write_mode(file=file):
        print(line, file=file, flush=True)


def _how_to_continue(command: str | None, table: dict) -> str:
    """What continues an interrupted command: `train` resumes from its newest checkpoint with --resume true; a task
    command (one that takes --recipes: the recipe runner) reuses its finished stages and resumes its training."""
    if command == "train":
        return ("; the same command with --resume true continues it from its newest checkpoint (written every "
                "--training.save_every steps)")
    function = table.get(command)
    if callable(function) and "recipes" in inspect.signature(function).parameters:
        return ("; run the same command again to continue: its finished stages are reused and an interrupted "
                "training resumes from its newest checkpoint")
    return ""


@contextlib.contextmanager
def _one_line_warnings(prefix: str):
    """Every warning shown while a command runs as one line, `loramcl <command>: warning: <message>`; one from
    another package says its category and package (`... warning: FutureWarning from transformers: ...`)."""
    shown = warnings.showwarning

    def one_line(message, category, filename, lineno, file=None, line=None):
        text = " ".join(str(message).split())
        if not _is_ours(category, filename):
            text = f"{category.__name__} from {_package_of(filename)}: {text}"
        say(f"{prefix}: warning: {text}", file)

    warnings.showwarning = one_line
    try:
        yield
    finally:
        warnings.showwarning = shown


# Log records other packages write as they are imported, on every model command, that tell a user of loramcl nothing
# to act on: {logger: the start of the message}. Checked on torchao 0.18, bitsandbytes 0.50, torch 2.13.
IMPORT_NOISE = {
    # torchao's CUDA extensions (_C_mxfp8, _C_cutlass_90a) on a machine without their CUDA: torchao runs without them
    "torchao": "Failed to load ",
    # torchao registers Enum classes with torch's pytree, which torch 2.13 deprecates: a note to torchao's authors
    "torch.utils._pytree": "%s is an Enum subclass and is now natively supported",
    # bitsandbytes' optional CPU kernel package `kernels`; without it bitsandbytes uses its own CPU code
    "bitsandbytes.backends.cpu.ops": "Failed to load CPU gemm_4bit_forward",
}


class _ImportNoise(logging.Filter):
    def __init__(self, start: str) -> None:
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno < logging.ERROR and str(record.msg).startswith(self.start))


@contextlib.contextmanager
def _quiet_import_noise():
    """The records of ``IMPORT_NOISE`` left out while a command runs; every other record of those loggers shows."""
    filters = [(logging.getLogger(name), _ImportNoise(start)) for name, start in IMPORT_NOISE.items()]
    for logger, noise in filters:
        logger.addFilter(noise)
    try:
        yield
    finally:
        for logger, noise in filters:
            logger.removeFilter(noise)


def _is_ours(category: type, filename: str) -> bool:
    """A warning of loramcl: of a category it defines, or a plain UserWarning raised from its code."""
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    return category.__module__.split(".")[0] == "loramcl" or (
        category is UserWarning and os.path.abspath(filename).startswith(package))


def _package_of(filename: str) -> str:
    """The top-level package (or module) of the file ``filename``, read off the import path (e.g. transformers)."""
    path = os.path.abspath(filename)
    roots = sorted((os.path.abspath(p) + os.sep for p in sys.path if p), key=len, reverse=True)
    root = next((r for r in roots if path.startswith(r)), None)
    if root is None:
        return os.path.basename(path)
    return path[len(root):].split(os.sep)[0].removesuffix(".py")


class _LogLines(logging.Handler):
    """The `loramcl` logger's records while a command runs: information on stdout, where the command's own lines
    go; warnings and errors on stderr as `loramcl <command>: warning: ...`."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record)
            if record.levelno >= logging.WARNING:
                say(f"{self.prefix}: {record.levelname.lower()}: {' '.join(text.split())}")
            else:
                say(text, sys.stdout)
        except Exception:
            self.handleError(record)


@contextlib.contextmanager
def _library_log(prefix: str):
    """The library's `loramcl` logger shown while a command runs, at the level LORAMCL_VERBOSITY names (debug,
    info: the default, warning, error), as TRANSFORMERS_VERBOSITY does for transformers' messages."""
    name = os.environ.get(VERBOSITY_ENV, "info").strip().lower() or "info"
    if name not in VERBOSITIES:
        raise ValueError(f"{VERBOSITY_ENV} must be one of {', '.join(VERBOSITIES)}; got {name!r}")
    logger = logging.getLogger("loramcl")
    handler, saved = _LogLines(prefix), (logger.level, logger.propagate)
    logger.addHandler(handler)
    logger.setLevel(getattr(logging, name.upper()))
    logger.propagate = False  # shown once, by this handler
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])  # through setLevel, which empties the loggers' cache of enabled levels
        logger.propagate = saved[1]


def _parser_class() -> type:
    """jsonargparse's parser, checking after parsing what no option's type says: a count of CPU threads (--threads of
    every command that takes it) is at least 1, refused before any work (torch would say "set_num_threads expects a
    positive integer" after the imports, naming no option)."""
    from argparse import ArgumentError

    from jsonargparse import ArgumentParser

    class Parser(ArgumentParser):
        def parse_args(self, *args, **kwargs):
            config = super().parse_args(*args, **kwargs)
            command = config.get("subcommand")
            try:
                check_threads(config.get(f"{command}.threads") if isinstance(command, str) else None)
            except ValueError as error:
                raise ArgumentError(None, f"--{error}") from None
            return config

    return Parser


def _packaged_configs(args: list[str]) -> list[str]:
    """``args`` with each `--config` naming a packaged recipe file (`bilingual/common.yaml`, or its path inside the
    package) replaced by the file's text, so that its `./` paths are read relative to the current folder as the task
    commands read them (jsonargparse reads a --config file's paths relative to the file)."""
    from loramcl.recipes.files import packaged_config

    args = list(args)
    for i, arg in enumerate(args):
        if arg == "--config" and i + 1 < len(args) and (text := packaged_config(args[i + 1])) is not None:
            args[i + 1] = text
        elif arg.startswith("--config=") and (text := packaged_config(arg.split("=", 1)[1])) is not None:
            args[i] = "--config=" + text
    return args


def _is_usage_error(error: Exception) -> bool:
    from argparse import ArgumentError

    return isinstance(error, ArgumentError)


def error_message(error: Exception, table: dict, command: str | None) -> str:
    """One line saying what went wrong: jsonargparse's parse errors in the options' own words, any other error's
    message (with its type when it is not one of the usual input errors)."""
    text = _union_member_error(" ".join(str(error).split()))
    if _is_usage_error(error):
        return _usage_message(text, table, command)
    if command and callable(table.get(command)):
        text = _named_as_typed(error, text, table[command])
    if isinstance(error, ValueError | TypeError | OSError | RuntimeError) and text:
        return text
    hint = f" (a bug? --debug or {DEBUG_ENV}=1 shows the traceback)"
    return f"{type(error).__name__}: {text}{hint}" if text else f"{type(error).__name__}{hint}"


def _named_as_typed(error: BaseException | None, text: str, function) -> str:
    """``text`` with the value it starts with named as the command line names it (`--training.learning_rate`,
    `--top_p`), for an OptionError (loramcl.utils.validate) about an option of ``function``: a field of the
    configuration that one of its parameters takes, or one of its options."""
    import dataclasses
    import typing

    from loramcl.utils.validate import OptionError

    while error is not None and not isinstance(error, OptionError):  # jsonargparse wraps a `Config | None`'s error
        error = error.__cause__
    if error is None or not error.option or not text.startswith(error.option):
        return text
    try:
        hints = typing.get_type_hints(function)
    except Exception:  # an annotation that does not resolve: the message stays as written
        return text
    groups = [name for name, hint in hints.items() if error.owner is not None and dataclasses.is_dataclass(error.owner)
              and error.owner in (hint, *typing.get_args(hint))]
    fields = {field.name for field in dataclasses.fields(error.owner)} if groups else set()
    if len(groups) == 1 and error.option in fields:
        return f"--{groups[0]}.{text}"
    if error.option in _option_names(function):  # an argument of the command, or a field its **kwargs take
        return f"--{text}"
    return text


# a plain type as jsonargparse's errors name it: "Expected a <class 'float'>", "Expected a typing.Literal['auto']"
_PLAIN_TYPE = r"a (?:<class '\w+'>|typing\.Literal\[[^\]]*\])"


def _union_member_error(text: str) -> str:
    """jsonargparse's error for an option typed `Config | None` lists what failed for each member of the union:
    keep the config's own error (the None member's is noise), with the option's key in front of a nested key."""
    match = re.match(r'(?:Parser key "(.*?)": )?Does not validate against any of the Union subtypes .*? Errors: - (.*)',
                     text)
    if not match:
        return text
    listed, given = re.match(r"(.*?)(?: Given value type: .*? Given value: (.*))?$", match[2]).groups()
    errors = [e for e in re.split(r" - (?=Expected a |Problem with given class_path )", listed)
              if not e.startswith("Expected a <class 'NoneType'>")]
    if given is not None and errors and all(re.fullmatch(f"Expected {_PLAIN_TYPE}", e) for e in errors):
        # `float | None`, `float | Literal['auto']` (--diversity_penalty, --mcl.epsilon): said as a lone float's
        # error is, "Expected a <class 'float'>. Got value: -nan", which _usage_message words "must be a number"
        kinds = " or ".join(e.removeprefix("Expected ") for e in errors)
        return f'Parser key "{match[1]}": Expected {kinds}. Got value: {given}' if match[1] else \
            f"Expected {kinds}. Got value: {given}"
    inner = re.sub(r"^Problem with given class_path '.*?': ", "", errors[0]) if errors else match[2]
    if match[1] and (nested := re.match(r'Parser key "(.*?)": (.*)', inner)):
        return f'Parser key "{match[1]}.{nested[1]}": {nested[2]}'
    return f'Parser key "{match[1]}": {inner}' if match[1] and not inner.startswith("Parser key") else inner


def _usage_message(text: str, table: dict, command: str | None) -> str:
    def option(key: str) -> str:
        return "--" + (key.removeprefix(f"{command}.") if command else key)

    if match := re.match(r"argument (?:\S+\.)?subcommand: invalid choice: '(.*?)'", text):
        group = table[command] if isinstance(table.get(command), dict) else table  # `loramcl recipes <command>`
        choices = [name for name in group if not name.startswith("_")]
        close = difflib.get_close_matches(match[1], choices, n=1)
        suggestion = f" (did you mean {close[0]}?)" if close else ""
        return f"unknown command {match[1]!r}{suggestion}; the commands are {', '.join(choices)}"
    if match := re.match(r"the following arguments are required: (.*)", text):
        keys = [key.strip() for key in match[1].split(",")]
        if command == "recipes":  # positional arguments of `loramcl recipes copy`
            return (f"missing {' '.join('<' + key.rsplit('.', 1)[-1] + '>' for key in keys)}: "
                    "loramcl recipes copy <task>/<name> <dir> (loramcl recipes lists them)")
        return "missing required options " + ", ".join(option(key) for key in keys)
    if match := re.match(r"unrecognized arguments: (.*)", text):
        unknown = [a for a in match[1].split() if a.startswith("--")] or match[1].split()[:1]
        suggestion = _suggestion(unknown[0], table, command) if unknown else ""
        see = f"; see loramcl {command} --help" if command else ""
        return f"unknown option {' '.join(unknown)}{suggestion}{see}"
    if match := re.match(r"Subcommand '.*?' does not accept option '(.*?)'", text):  # a key of a --config file
        if match[1] == "ensemble":  # a recipe's ensemble run (issue 55) is assembled, not trained
            return ("this --config file is a recipe's ensemble run (ensemble: [its members]), which no single training "
                    "makes: the task's command trains its member runs and assembles them (name it in the recipe's "
                    "experiment.yaml or --runs, docs/guide/baselines.md), or train each member's file with loramcl "
                    "train and assemble them with loramcl.assemble_hypotheses")
        see = f"; see loramcl {command} --help" if command else ""
        return f"unknown option {match[1]} in a --config file{_suggestion(match[1], table, command, prefix='')}{see}"
    if match := re.match(r'Parser key "(.*?)": (.*)', text):
        key, problem = option(match[1]), match[2]
        if nested := re.match(r"Option '(.*?)' is not accepted", problem):  # in a block typed `Config | None`
            see = f"; see loramcl {command} --{match[1].removeprefix(f'{command}.')}.help" if command else ""
            return f"unknown option {key}.{nested[1]}{_suggestion(f'{key}.{nested[1]}', table, command)}{see}"
        if literal := re.match(r"Expected a typing\.Literal\[(.*)\]\. Got value: (.*)", problem):
            choices = ", ".join(c.strip().strip("'\"") for c in literal[1].split(","))
            return f"{key} must be one of {choices}; got {literal[2]!r}"
        if typed := re.match(rf"Expected ({_PLAIN_TYPE}(?: or {_PLAIN_TYPE})*)\. Got value: (.*)", problem):
            kinds = re.findall(r"<class '(\w+)'>|typing\.Literal\[(.*?)\]", typed[1])
            words = [{"int": "an integer", "float": "a number", "bool": "true or false"}.get(name, f"a {name}") if name
                     else " or ".join(c.strip().strip("'\"") for c in choices.split(",")) for name, choices in kinds]
            return f"{key} must be {' or '.join(words)}; got {typed[2]!r}"
        return f"{key}: {problem}"
    return text


def _suggestion(option: str, table: dict, command: str | None, prefix: str = "--") -> str:
    """' (did you mean --name?)' for the command's option closest to ``option`` (--flag, flag=value or file key)."""
    known = _option_names(table[command]) if command and callable(table[command]) else []
    close = difflib.get_close_matches(option.lstrip("-").split("=")[0], known, n=1)
    return f" (did you mean {prefix}{close[0]}?)" if close else ""


def _option_names(function) -> list[str]:
    """The options of a command as jsonargparse reads them off its signature: its parameters, `section.field` for a
    dataclass-typed parameter (also one typed `Config | None`) and the section itself, the fields a `**kwargs` is
    resolved to."""
    from jsonargparse import ArgumentParser

    try:
        parser = ArgumentParser(exit_on_error=False)
        parser.add_function_arguments(function)
        keys = list(parser.get_defaults().keys())
    except Exception:  # a signature jsonargparse cannot read: the suggestion is a convenience only
        return []
    keys += [f"{name}.{field}" for name, fields in _sections(function).items() for field in fields]
    return list(dict.fromkeys(keys + sorted({key.split(".")[0] for key in keys if "." in key})))


def _sections(function) -> dict[str, dict[str, object]]:
    """{parameter: {field: its type}} for each parameter of ``function`` typed with a dataclass (or `Config | None`):
    the `--parameter.field` options."""
    import dataclasses
    import typing

    try:
        hints = typing.get_type_hints(function)
        sections = {}
        for name, hint in hints.items():
            config = next((t for t in (hint, *typing.get_args(hint)) if dataclasses.is_dataclass(t)), None)
            if config is not None:
                sections[name] = typing.get_type_hints(config)
    except Exception:  # an annotation that does not resolve: no section is known
        return {}
    return sections


def _non_finite_values(args: list[str]) -> list[str]:
    """``args`` with `--option -inf` (or -nan, -infinity) written `--option=-inf`: argparse takes a word that starts
    with '-' and is no plain negative number for an option, and would say only "expected one argument"; joined, the
    option's own check names what is wrong with the value."""
    out: list[str] = []
    for arg in args:
        if out and out[-1].startswith("--") and "=" not in out[-1] and arg.lower() in ("-inf", "-infinity", "-nan"):
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def _bare_booleans(args: list[str], function) -> list[str]:
    """``args`` with a true/false option of ``function`` given bare (`--quick`, `--mcl.scoring`, followed by nothing
    or by another option) written out as `--quick true`, which jsonargparse needs."""
    import typing

    try:
        hints = typing.get_type_hints(function)
    except Exception:  # an annotation that does not resolve: the options stay as given
        return args
    flags = {f"--{name}" for name in inspect.signature(function).parameters
             if hints.get(name) in (bool, bool | None)}
    flags |= {f"--{name}.{field}" for name, fields in _sections(function).items()
              for field, hint in fields.items() if hint in (bool, bool | None)}
    out = []
    for i, arg in enumerate(args):
        out.append(arg)
        if arg in flags and (i + 1 == len(args) or args[i + 1].startswith("--")):
            out.append("true")
    return out


if __name__ == "__main__":
    main()
