"""What `loramcl <command>` says while it works (docs/guide/cli.md, "Progress, warnings, logs and interruptions"): every
warning as one line, the library's progress through the `loramcl` logger, no message written after a progress bar's
text, and an interruption that says how to continue."""

import inspect
import json
import logging
import warnings
from pathlib import Path

from test_cli import run_main, workdir  # noqa: F401 (workdir: the folder of docs/guide/cli.md's table, a fixture)

import loramcl
from loramcl.cli import VERBOSITY_ENV, commands, main
from loramcl.training.trainer import MCLTrainer

PACKAGE = Path(loramcl.__file__).parent


def on_screen(text: str) -> list[str]:
    """The lines a terminal shows of ``text``: a carriage return goes back to the start of the line, and what follows
    writes over what was there."""
    lines = []
    for raw in text.split("\n"):
        shown = ""
        for part in raw.split("\r"):
            shown = part + shown[len(part):]
        lines.append(shown.rstrip())
    return [line for line in lines if line]


def fake_command(monkeypatch, function) -> None:
    monkeypatch.setattr("loramcl.cli.commands", lambda: {"fake": function})


def test_every_warning_is_one_line_and_names_a_foreign_category(monkeypatch, capsys):
    """The library's warnings (its categories, or a plain UserWarning from its code) as `loramcl <command>: warning:
    <message>`; another package's with its category and package; a message over several lines on one."""
    transformers_file = str(Path(__import__("transformers").__file__))

    def warns(x: int = 1):
        """A command that warns."""
        from loramcl.utils.inputs import PromptFormatWarning

        warnings.warn("the prompts differ", PromptFormatWarning, stacklevel=1)
        warnings.warn_explicit("checkpoint 4 is incomplete;\n  resuming from 2", UserWarning,
                               str(PACKAGE / "checkpoints.py"), 160)
        warnings.warn_explicit("`foo` is deprecated", FutureWarning, transformers_file, 10)
        warnings.warn_explicit("from elsewhere", UserWarning, transformers_file, 11)

    fake_command(monkeypatch, warns)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        main(["fake"])
    assert capsys.readouterr().err.splitlines() == [
        "loramcl fake: warning: the prompts differ",
        "loramcl fake: warning: checkpoint 4 is incomplete; resuming from 2",
        "loramcl fake: warning: FutureWarning from transformers: `foo` is deprecated",
        "loramcl fake: warning: UserWarning from transformers: from elsewhere"]


def test_the_library_logs_its_progress_at_the_level_asked_for(monkeypatch, capsys):
    """The `loramcl` logger's information on stdout (where the prints went), its warnings on stderr as one line;
    LORAMCL_VERBOSITY=warning leaves the information out; outside a command the library says nothing below a
    warning."""
    def logs(x: int = 1):
        """A command whose library logs."""
        logging.getLogger("loramcl.training.fit").info("trained 10 of 20 parameters in 1 s: run")
        logging.getLogger("loramcl.recipes").warning("a stage\nwas slow")

    fake_command(monkeypatch, logs)
    main(["fake"])
    captured = capsys.readouterr()
    assert captured.out == "trained 10 of 20 parameters in 1 s: run\n"
    assert captured.err == "loramcl fake: warning: a stage was slow\n"
    monkeypatch.setenv(VERBOSITY_ENV, "warning")
    main(["fake"])
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == "loramcl fake: warning: a stage was slow\n"
    monkeypatch.setenv(VERBOSITY_ENV, "loud")
    code, _, err = run_main(["fake"], capsys)
    assert code == 1 and err == ("loramcl fake: error: LORAMCL_VERBOSITY must be one of debug, info, warning, error; "
                                 "got 'loud'\n")
    logger = logging.getLogger("loramcl")
    assert logger.handlers == [] and logger.propagate and logger.level == logging.NOTSET  # as before the command


def test_an_error_never_follows_a_progress_bar_on_its_line(monkeypatch, capsys):
    """An open tqdm bar is cleared before the error is written: the error starts its own line."""
    def fails(x: int = 1):
        """A command that fails under its progress bar."""
        from tqdm import tqdm

        bar = tqdm(total=3)
        bar.update(1)
        raise ValueError("token 120 is outside the vocabulary")

    fake_command(monkeypatch, fails)
    code, _, err = run_main(["fake"], capsys)
    assert code == 1 and "/3 [" in err  # the bar was drawn
    assert "loramcl fake: error: token 120 is outside the vocabulary" in on_screen(err)


def train_argv(workdir, out: str) -> list[str]:
    """A 4-step training with a checkpoint every 2 steps, of the hypotheses `loramcl train` gives without --mcl.*."""
    return ["train", "--model", str(workdir / "tiny"), "--out", str(workdir / out), "--data.train_file",
            str(workdir / "train.jsonl"), "--training.steps", "4", "--training.batch_size", "4",
            "--training.save_every", "2", "--training.logging_steps", "1", "--threads", "1"]


def stop_at_step(monkeypatch, step: int, error: BaseException) -> None:
    """Raise ``error`` in the training step after ``step`` optimizer steps."""
    original = MCLTrainer.training_step

    def training_step(self, *args, **kwargs):
        if self.state.global_step == step:
            raise error
        return original(self, *args, **kwargs)

    monkeypatch.setattr(MCLTrainer, "training_step", training_step)


def test_a_failed_training_closes_its_bar_before_the_error(workdir, monkeypatch, capsys):
    """The error of a training that fails midway is the last line, alone on it, after the bar's last state."""
    stop_at_step(monkeypatch, 1, ValueError("w120 is outside this model's vocabulary"))
    code, _, err = run_main(train_argv(workdir, "failed"), capsys)
    assert code == 1
    screen = on_screen(err)
    assert screen[-1] == "loramcl train: error: w120 is outside this model's vocabulary"
    assert "1/4" in screen[-2]  # the bar, where it stopped, on its own line
    assert err.endswith("\nloramcl train: error: w120 is outside this model's vocabulary\n")


def test_an_interrupted_training_says_how_to_continue_and_that_continues_it(workdir, monkeypatch, capsys):
    """Ctrl-C after 2 of 4 steps: the line says to add --resume true, and the same command with it finishes the run
    from checkpoint-2 (without it, the checkpoints would be refused)."""
    argv = train_argv(workdir, "interrupted")
    with monkeypatch.context() as patch:
        stop_at_step(patch, 2, KeyboardInterrupt())
        code, _, err = run_main(argv, capsys)
    assert code == 130
    assert on_screen(err)[-1] == ("loramcl train: interrupted; the same command with --resume true continues it from "
                                  "its newest checkpoint (written every --training.save_every steps)")
    main([*argv, "--resume", "true"])
    out = capsys.readouterr().out
    assert f"resuming from the newest whole checkpoint in {workdir / 'interrupted' / 'checkpoints'}\n" in out
    assert out.splitlines()[-1].startswith("trained ") and out.endswith(f": {workdir / 'interrupted'}\n")
    run = json.loads((workdir / "interrupted" / "run.json").read_text())
    assert run["resumed_from"] == "checkpoint-2" and run["settings"]["mcl"]["num_hypotheses"] == 2


def test_an_interrupted_task_command_says_its_finished_stages_are_reused(monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("loramcl.recipes.runner.run_recipe", interrupted)
    tasks = [name for name, function in commands().items()
             if callable(function) and "recipes" in inspect.signature(function).parameters]
    assert set(tasks) == {"bilingual", "translation", "audio-captioning", "spoken-translation", "image-captioning"}
    for task in tasks:
        code, _, err = run_main([task], capsys)
        assert code == 130 and err == (f"loramcl {task}: interrupted; run the same command again to continue: its "
                                       "finished stages are reused and an interrupted training resumes from its "
                                       "newest checkpoint\n")
