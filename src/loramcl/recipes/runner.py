"""The one recipe runner: model -> data -> train -> decode -> NLL -> evaluate -> report for every task, each stage run
once per settings (``stages.Stages``) and timed for the report. A task gives only what is its own (``Task``): its
experiment settings, its model and data, how one run trains and how one system decodes, its report."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

from loramcl.recipes.experiment import BEST, Experiment, trained_run
from loramcl.recipes.grid import DecodeConfig, System, chosen_budgets, one_per_strategy
from loramcl.recipes.stages import Stages
from loramcl.utils.files import write_json
from loramcl.utils.inputs import check_device, check_output
from loramcl.utils.run_record import RunFile
from loramcl.utils.threads import check_threads, use_threads
from loramcl.utils.validate import require

EXPERIMENT, COMMON = "experiment.yaml", "common.yaml"
STOP_AFTER = ("data", "train")


class Task(ABC):
    """One task's part of a recipe run. The runner (``run_recipe``) calls the hooks in order and owns what is
    skipped, the stage records and the timings; a hook that is a stage runs it through ``self.stages``."""

    experiment_type: ClassVar[type[Experiment]]
    default_recipes: ClassVar[str]
    """The packaged recipe run when --recipes is not given."""

    quick_settings: ClassVar[dict] = {}
    """Run-file settings of a quick run, merged last (e.g. {"training": {"steps": 2}})."""

    quick_decoding: ClassVar[dict] = {}
    """DecodeConfig settings of a quick run (fewer tokens)."""

    scores_references: ClassVar[bool] = False
    """Whether the task scores every test reference under every hypothesis of the runs of its NLL table
    (``score``; experiment.yaml's ``nll_table``)."""

    options: ClassVar[dict] = {}
    """The task command's help of a shared option where the task says more (name -> text), and its own options
    (name -> ``recipes.command.Option``, an experiment setting); the Task's docstring is the command's description."""

    option_order: ClassVar[tuple[str, ...] | None] = None
    """The command's options in this order (default: the shared ones, then the task's own)."""

    def __init__(self, folder: Path, experiment: Experiment, stages: Stages, quick: bool, threads: int | None,
                 device: str) -> None:
        self.folder, self.experiment, self.stages = folder, experiment, stages
        self.quick, self.threads, self.device = quick, threads, device
        self.root = stages.root
        self.model: str | None = None
        """The model folder every run trains, once the runner has read the runs."""
        self.data = self.root / "data"
        self.test = self.data / "test.jsonl"
        """The test inputs and references every system decodes and is scored on, written by ``prepare_data``."""

    def build_model(self) -> str | None:
        """The model folder this command builds or converts (e.g. a packaged model), or None: the run files name it."""
        return None

    def tiny_model(self, folder: str, builder: str, words: Sequence[str]) -> str | None:
        """With experiment.yaml's `packaged_model: tiny-random`: the tiny random model this command builds into
        root/<folder> with ``loramcl.models.<builder>(out, words)`` (its vocabulary: the synthetic data's
        ``words``), once per vocabulary (the CPU recipes' model); else None (the run files name the model)."""
        import importlib

        if getattr(self.experiment, "packaged_model", None) != "tiny-random":
            return None
        model = self.root / folder
        build = getattr(importlib.import_module("loramcl.models"), builder)
        self.stages.run("build model", model / "built.json", {"words": words}, build, str(model), words)
        return str(model)

    def run_values(self, run: str, model: str | None) -> dict:
        """The settings of one run: common.yaml + <run>.yaml, its output at root/<run>, ``model`` when given, the
        quick run's settings last."""
        from loramcl.recipes.files import run_values

        return run_values(self.folder, run, self.root, model, self.quick_settings if self.quick else None, COMMON)

    def check(self, model: str, values: dict[str, dict]) -> None:
        """Checks of the runs' settings against each other, before any work (the runner has checked one model)."""
        return None

    @abstractmethod
    def systems(self, values: dict[str, dict], budgets: list[int]) -> list[System]:
        """The systems compared at the forward ``budgets``. ``values``: each run's settings, and those of each
        '<run>@best' of ``decoded`` (the run's), so that a system of '<run>@best' is built as one of '<run>' is (its
        ``System.best`` set)."""

    def hypotheses(self, values: dict) -> int:
        """How many candidates a run's model decodes as one model: its K (1 for a single model)."""
        from loramcl.recipes.files import num_hypotheses

        return num_hypotheses(values)

    @abstractmethod
    def prepare_data(self, model: str, values: dict[str, dict]) -> None:
        """The data stage(s): write ``self.test`` and what the runs train on under ``self.data``."""

    def trained_runs(self, runs: list[str], systems: list[System]) -> list[str]:
        """The runs trained, in order: every run; for a task that scores its references, the decoded runs first, then
        those of the NLL table (a quick run: the decoded runs only)."""
        if not self.scores_references:
            return runs
        decoded = list(dict.fromkeys(system.run for system in systems))
        table = [] if self.quick else [trained_run(entry) for entry in self.experiment.table_runs(runs)]
        return list(dict.fromkeys(decoded + table))

    @abstractmethod
    def train(self, run: str, values: dict) -> None:
        """The training stage of one run (``self.stages.train``)."""

    @abstractmethod
    def decode(self, system: System, values: dict, arguments: dict, decode: DecodeConfig) -> None:
        """Write ``self.stages.predictions(system.name)``: K candidates per test input (``generate_hypotheses``
        ``arguments``)."""

    def decoding_settings(self) -> dict:
        """What else a decoding stage's candidates depend on (e.g. the prompt), beside its arguments and run."""
        return {}

    def scored_runs(self, runs: list[str], systems: list[System]) -> list[str]:
        """The trained ``runs`` whose NLL of every test reference is computed (``score``): those of the NLL table, for
        a task that scores its references."""
        if not self.scores_references:
            return []
        table = self.experiment.nll_table
        return list(runs) if table is None else [entry for entry in table if trained_run(entry) in runs]

    def scored_folder(self, run: str) -> Path:
        """The adapters an NLL table entry scores: root/<run>, or root/<run>/best for '<run>@best'."""
        from loramcl.utils.inputs import BEST_FOLDER

        return self.root / trained_run(run) / (BEST_FOLDER if run.endswith(BEST) else "")

    def decoded_folder(self, system: System) -> Path:
        """The adapters ``system`` decodes: root/<run>, or root/<run>/best for a system of '<run>@best'."""
        return self.scored_folder(system.entry)

    def score(self, run: str, values: dict, decode: DecodeConfig, out: Path) -> None:
        """Write to ``out`` the NLL of every test reference under every hypothesis of ``run`` (an NLL table entry: a
        run, or '<run>@best'; its adapters are ``scored_folder(run)``)."""
        raise NotImplementedError(f"{type(self).__name__} scores no run")

    def evaluate(self, systems: list[System]) -> None:
        """Evaluation stages of their own, before the report (default: the report evaluates)."""
        return None

    @abstractmethod
    def report(self, systems: list[System], runs: list[str]) -> dict:
        """Write report.md (and figures) under the root; return what report.json holds."""


def run_recipe(task_type: type[Task], out: str | None = None, recipes: str | None = None, quick: bool = False,
               budgets: list[int] | None = None, stop_after: str | None = None, runs: list[str] | None = None,
               threads: int | None = None, device: str = "cpu", **settings) -> dict:
    """Run a task's recipe folder (the arguments are those of every task command); ``settings`` replace
    experiment.yaml's where given (not None)."""
    import dataclasses

    from loramcl.recipes.ensemble import (
        ASSEMBLED,
        assemble,
        check_best_adapters,
        ensemble_values,
        ensembles,
        with_members,
    )
    from loramcl.recipes.files import recipe_folder, run_names
    from loramcl.training.runs import file_stamp, run_record, run_stamp

    require(stop_after in (None, *STOP_AFTER), f"stop_after must be one of {STOP_AFTER}, got {stop_after!r}")
    require(runs is None or stop_after == "train", "runs selects the runs to train: use it with stop_after: train")
    check_threads(threads)
    folder = recipe_folder(recipes, task_type.default_recipes, [EXPERIMENT, COMMON])
    experiment = task_type.experiment_type.read(folder / EXPERIMENT)
    given = {name: value for name, value in settings.items() if value is not None}
    if given:
        experiment = dataclasses.replace(experiment, **given)
    check_data_files(folder, experiment, task_type.default_recipes)  # before torch loads: a second, not ten
    check_output(out if out is not None else experiment.out, folder=True)
    check_device(device)  # imports torch
    threads = use_threads(threads)
    stages = Stages(Path(out if out is not None else experiment.out))
    root = stages.root
    chosen = chosen_budgets(budgets, experiment.budgets, quick)
    task = task_type(folder, experiment, stages, quick, threads, device)

    model = task.build_model()
    names = run_names(folder, reserved=(EXPERIMENT, COMMON))
    unknown = sorted(set(runs or []) - set(names))
    require(not unknown, f"runs: no run file for {unknown} (runs: {names})")
    values = {run: task.run_values(run, model) for run in names}
    members = ensembles(values)  # {ensemble run: its member runs}
    for run, runs_of in members.items():
        values[run] = ensemble_values(run, runs_of, values)
    model = values[names[0]]["model"]
    for run, v in values.items():
        require(v["model"] == model, f"run {run}: every run of a recipe folder trains the same model ({model})")
    task.model = model
    if task.scores_references:
        for entry in experiment.table_runs(names):  # each run of the NLL table has its run file
            check_keeps_best("nll_table", entry, "scores", values, members)
    else:
        require(experiment.nll_table is None, f"nll_table: {task_type.__name__} scores no test reference")
    decoded_best = [entry for entry in experiment.decoded_runs(names) if entry.endswith(BEST)]
    for entry in decoded_best:
        check_keeps_best("decoded", entry, "decodes", values, members)
    task.check(model, values)
    # a '<run>@best' of decoded is built as the run's systems are, from its settings; System reads the '@best'
    systems = task.systems(values | {entry: values[trained_run(entry)] for entry in decoded_best}, chosen)
    require(systems or task.scores_references, f"decoded: {experiment.decoded!r} decodes no run and "
            f"{task_type.__name__} scores no test reference, so there is nothing to report: name a run in decoded, "
            "or leave decoded out to decode every run")
    if quick:  # every decoding code path, with fewer decodes
        systems = one_per_strategy(systems)
    trained = with_members(task.trained_runs(names, systems) if runs is None else runs, members)

    task.prepare_data(model, values)
    if stop_after == "data":
        return {"data": str(task.data)}
    for run in trained:  # retrained when its recipe or its data changed, resumed when it was interrupted
        if run in members:  # its members, trained before it, as one K-hypothesis model
            stamps = {member: run_stamp(root / member) for member in members[run]}
            best = run + BEST in [*(experiment.nll_table or []), *(experiment.decoded or [])]  # members' best too
            stages.run(f"assemble {run}", root / run / ASSEMBLED, {"members": stamps, "best": best}, assemble, root,
                       run, values[run], members[run], best)
        else:
            task.train(run, values[run])
    if stop_after == "train":
        return {"runs": {run: str(root / run) for run in trained}}

    decode = DecodeConfig(**(experiment.decoding | (task.quick_decoding if quick else {})))
    for system in systems:
        if system.best:  # checked on every read, also when its predictions are reused
            check_best_adapters(root, system.run, members.get(system.run), f"decoded's {system.entry} decodes it")
        arguments = system.decoding(experiment.candidates, task.hypotheses(values[system.run]) == 1, decode)
        stages.decode(system, arguments, decode.batch_size, task.test, task.decode, system, values[system.run],
                      dict(arguments), decode, extra=task.decoding_settings())
    for run in task.scored_runs(trained, systems):
        path, trained_as = root / "nll" / f"{run}.jsonl", trained_run(run)  # run: 'mle' or 'mle@best'
        if run.endswith(BEST):  # checked on every read, also when its scores are reused
            check_best_adapters(root, trained_as, members.get(trained_as))
        stages.run(f"nll {run}", path.with_suffix(".settings.json"),
                   {"trained": run_stamp(root / trained_as), "test": file_stamp(task.test)}, task.score, run,
                   values[trained_as], decode, path)
    task.evaluate(systems)

    report = stages.timed("report", task.report, systems, trained)
    report["timing_s"] = stages.timings | {"runs": {run: run_record(root / run).seconds for run in trained}}
    write_json(root / "report.json", report, ensure_ascii=False)
    print((root / "report.md").read_text(encoding="utf-8"))
    print(f"report: {root / 'report.md'} (+ report.json, figures/)")
    return report


def check_keeps_best(setting: str, entry: str, reads: str, values: dict[str, dict],
                     members: dict[str, list[str]]) -> None:
    """Before any work: an entry '<run>@best' of experiment.yaml's ``setting`` (decoded, nll_table), which ``reads``
    the run's best-validation adapters, names a run that keeps them (an ensemble: whose members all do)."""
    if not entry.endswith(BEST):
        return
    run = trained_run(entry)
    lacking = [member for member in members.get(run, [run])  # an ensemble's best: its members'
               if (RunFile.of(values[member]).training or {}).get("keep_best") is not True]
    require(not lacking, f"{setting}: {entry} {reads} the best-validation adapters of {run}, but {', '.join(lacking)} "
            "keeps none: set `training: {keep_best: true}` in its run file (an ensemble's: in its members'), or name "
            f"{run}")


def check_data_files(folder: Path, experiment: Experiment, default_recipes: str) -> None:
    """Before any work: each data file experiment.yaml names exists, else one line naming the first one missing, where
    it comes from (experiment.yaml's ``sources``) and where to put it (nothing is downloaded at run time)."""
    from loramcl.recipes.catalog import command_of
    from loramcl.recipes.files import is_packaged, packaged_recipes

    missing = [(name, path) for name, path in experiment.data_files().items() if not Path(path).is_file()]
    if not missing:
        return
    name, path = missing[0]
    others = f"; missing too: {', '.join(n for n, _ in missing[1:])}" if len(missing) > 1 else ""
    source = experiment.sources.get(name)
    if is_packaged(folder):
        recipe = folder.resolve().relative_to(packaged_recipes().resolve()).as_posix()
        elsewhere = (f"or point a copy of the recipe at it (loramcl recipes copy {recipe} DIR, then its {name} in "
                     f"DIR/{EXPERIMENT})")
        if recipe != default_recipes:
            elsewhere += f"; the default recipe needs no download: loramcl {command_of(recipe)} without --recipes"
    else:
        elsewhere = f"or set {name} in {folder / EXPERIMENT} to where it is"
    raise FileNotFoundError(f"{path} does not exist: the recipe {folder} reads it as its {name}"
                            f"{f', {source}' if source else ''}{others}; nothing is downloaded at run time: put it "
                            f"there, {elsewhere}")
