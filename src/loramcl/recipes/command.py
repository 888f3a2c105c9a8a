"""Each task's command (`loramcl audio-captioning`, ...) generated from its Task: the options every task command
shares, with their types, defaults and help, are written once here; a Task gives its description (its docstring), the
help of an option where it says more for that task, and options of its own (experiment settings). The CLI reads the
generated function's signature and docstring as it reads any command's (jsonargparse, ``loramcl.cli.commands``)."""

from __future__ import annotations

import inspect
import textwrap
from collections.abc import Callable
from dataclasses import dataclass

from loramcl.recipes import runner


@dataclass(frozen=True)
class Option:
    """One parameter of a task command: its type, default and help (its line of `loramcl <task> --help`)."""

    annotation: object
    default: object
    help: str


OPTIONS = {
    "out": Option(str | None, None, "output folder (default: experiment.yaml's `out`)."),
    "recipes": Option(str | None, None, "recipe folder with experiment.yaml, common.yaml and one file per run, or a "
                      "packaged recipe's name (default: the task's default recipe; `loramcl recipes` lists them)."),
    "quick": Option(bool, False, "a few examples, a few training steps per run, the smallest budget: checks the "
                    "whole pipeline (numbers meaningless)."),
    "budgets": Option(list[int] | None, None, "forward budgets to decode at (default: experiment.yaml's)."),
    "stop_after": Option(str | None, None, '"data" or "train": stop after that stage.'),
    "runs": Option(list[str] | None, None, "train only these runs (with stop_after train)."),
    "threads": Option(int | None, None, "torch CPU threads (default: the cores that are free when the command "
                      "starts)."),
    "device": Option(str, "cpu", "e.g. cpu or cuda."),
}
"""The options of every task command (``run_recipe``'s arguments), in their order."""


def task_command(task_type: type[runner.Task], name: str) -> Callable[..., dict]:
    """The command function ``name`` of ``task_type``: the options of OPTIONS (a Task's ``options`` replace the help
    of one with a text, or replace or add an option with an ``Option``; ``option_order`` reorders them), its
    docstring the Task's followed by the options' help; calling it runs ``run_recipe``, a task's own options being
    experiment settings."""
    given = task_type.options
    unknown = [key for key, value in given.items() if isinstance(value, str) and key not in OPTIONS]
    if unknown:
        raise TypeError(f"{task_type.__name__}.options: help for no option {unknown}; give an Option to add one")
    options = {key: Option(option.annotation, option.default, given[key]) if isinstance(given.get(key), str)
               else given.get(key, option) for key, option in OPTIONS.items()}
    options |= {key: value for key, value in given.items() if key not in OPTIONS}
    order = task_type.option_order or tuple(options)
    if sorted(order) != sorted(options):
        raise TypeError(f"{task_type.__name__}.option_order must name each option once: {sorted(options)}")
    signature = inspect.Signature([inspect.Parameter(key, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                     default=options[key].default,
                                                     annotation=options[key].annotation) for key in order],
                                  return_annotation=dict)

    def command(*args, **kwargs) -> dict:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        shared = {key: arguments.pop(key) for key in OPTIONS}
        return runner.run_recipe(task_type, **shared, **arguments)

    args = "\n".join(textwrap.fill(f"{key}: {options[key].help}", 116, initial_indent="    ",
                                   subsequent_indent="        ", break_on_hyphens=False) for key in order)
    command.__signature__ = signature
    command.__annotations__ = {key: options[key].annotation for key in order} | {"return": dict}
    command.__doc__ = f"{inspect.cleandoc(task_type.__doc__)}\n\nArgs:\n{args}\n"
    command.__name__ = command.__qualname__ = name
    command.__module__ = task_type.__module__
    return command
