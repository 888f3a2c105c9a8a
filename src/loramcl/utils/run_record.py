"""A training run's files as the recipes read them back, typed: its run file (``RunFile``: the settings of a
`loramcl train --config` file, which a recipe merges from common.yaml and <run>.yaml, and which run.json records
under "settings") and its run.json (``RunRecord``). The defaults every reader assumes for a setting left out are
written here once (a run file without `dtype` trains in float32). Imports nothing heavy."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path

from loramcl.utils.files import read_json
from loramcl.utils.inputs import RUN_RECORD


@dataclass(frozen=True, kw_only=True)
class RunFile:
    """The settings of one training run: a recipe's run file (common.yaml + <run>.yaml, merged) or the "settings" of
    its run.json. ``values`` holds the whole mapping: the method's configuration block (``method_block``) and a task's
    own settings (e.g. the audio task's eval_examples)."""

    model: str | None = None
    """The base model's folder (or a Hugging Face id of the local cache)."""
    out: str | None = None
    """Where the run writes its adapters, checkpoints and run.json (a run file's; run.json does not record it)."""
    method: str = "mcl"
    """The trained method: "mcl" (LoRA-MCL; K = 1: LoRA-MLE), "moe" or "multihead"; configured by its block."""
    dtype: str = "float32"
    """The compute dtype of the base model."""
    quantization: str | None = None
    """The quantization of the base (QLoRA-MCL), None for none; recorded only where there is one."""
    training: dict = field(default_factory=dict)
    """The `training:` block (``training.config.TrainConfig``'s fields)."""
    data: dict = field(default_factory=dict)
    """The `data:` block of a run on dataset files (``training.config.DataConfig``'s fields)."""
    ensemble: list[str] | None = None
    """The member runs of an ensemble run (``recipes.ensemble``), None for a trained run."""
    values: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def of(cls, values: dict | RunFile) -> RunFile:
        """The run file of a mapping of settings (a setting it leaves out takes its default); a RunFile as it is."""
        if isinstance(values, RunFile):
            return values
        return cls(**{f.name: values[f.name] for f in fields(cls) if f.name in values and f.name != "values"},
                   values=values)

    @property
    def method_block(self) -> dict | None:
        """The configuration block of the run's method (`mcl:` for LoRA-MCL), None when the file has none."""
        return self.values.get(self.method)


@dataclass(frozen=True, kw_only=True)
class RunRecord:
    """A finished training run's run.json, written last by `loramcl train` (``training.fit.fit``) or by the assembly
    of an ensemble (``recipes.ensemble.assemble``). ``values`` holds the whole record as written (what a report
    copies): also threads, train_examples, the specialisation verdict, an ensemble's members."""

    settings: RunFile
    """What decided the run (``training.runs.run_settings``)."""
    seconds: float
    """The run's training wall time: the process that finished it, plus for a resumed run the processes before the
    checkpoint it resumed, as that checkpoint recorded them (``seconds_before_resume``)."""
    trainable_parameters: int
    total_parameters: int | None = None
    resumed_from: str | None = None
    """The checkpoint the finishing process resumed from, None when it trained from the start."""
    seconds_before_resume: float | None = None
    """Of ``seconds``, those of the processes before ``resumed_from``; None for a run resumed from a checkpoint that
    did not record them (written before loramcl kept them: ``seconds`` is then the finishing process's only)."""
    settings_stamp: str | None = None
    """``training.runs.settings_stamp`` of the settings; None in a run.json written before loramcl recorded it."""
    values: dict = field(default_factory=dict, repr=False, compare=False)

    REQUIRED = ("settings", "seconds", "trainable_parameters")

    @property
    def seconds_partial(self) -> bool:
        """Whether ``seconds`` leaves earlier processes out: the run's (resumed from a checkpoint that did not record
        them) or, for an ensemble, some member's (``seconds_counted_from_resume`` names them)."""
        return (bool(self.resumed_from) and self.seconds_before_resume is None
                or bool(self.values.get("seconds_counted_from_resume")))

    @classmethod
    def of(cls, values: dict | RunRecord) -> RunRecord:
        """The record of a run.json's mapping (a field it leaves out takes its default); a RunRecord as it is."""
        if isinstance(values, RunRecord):
            return values
        given = {f.name: values[f.name] for f in fields(cls) if f.name in values and f.name != "values"}
        return cls(**given | {"settings": RunFile.of(values["settings"])}, values=values)

    @classmethod
    def read(cls, run: str | Path, remedy: str = "it was damaged or edited: train the run again") -> RunRecord:
        """The run.json of the finished run in folder ``run``; an error of one line naming the file when it cannot be
        read or lacks what every run.json holds, ending with ``remedy``."""
        path = Path(run) / RUN_RECORD
        values = read_json(path, remedy)
        if not isinstance(values, dict) or not isinstance(values.get("settings"), dict):
            raise ValueError(f"{path} holds no run settings (\"settings\": {{...}}): {remedy}")
        missing = [name for name in cls.REQUIRED if name not in values]
        if missing:
            raise ValueError(f"{path} lacks {', '.join(missing)}: {remedy}")
        return cls.of(values)
