"""The text tasks' part of a recipe run (translation, bilingual): each run is a `loramcl train --config` file trained
by ``training.fit.train`` on data/{train,validation}.jsonl, decoded by ``decoding.predictions.generate`` at equal
forward budget and scored by ``training.reference_nll.nll`` (the NLL of every test reference under every
hypothesis: paper Table 1)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from loramcl.recipes import runner
from loramcl.recipes.experiment import Experiment
from loramcl.recipes.grid import DecodeConfig, System, equal_budget_systems
from loramcl.utils.run_record import RunFile
from loramcl.utils.validate import require

SMOLLM2_FOLDER = "SmolLM2-135M-Instruct"


@dataclass(frozen=True, kw_only=True)
class TextExperiment(Experiment):
    """experiment.yaml of a text task: the runs' model, beside the common settings."""

    packaged_model: str | None = None
    """'smollm2': convert the packaged SmolLM2-135M-Instruct into <out>/SmolLM2-135M-Instruct and train on it (the
    run files' `model`); None: the run files' `model` is a local folder."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.packaged_model in (None, "smollm2"), f"packaged_model must be smollm2 or null, got "
               f"{self.packaged_model!r}")


class TextTask(runner.Task):
    """A text task: prompts and references in data/*.jsonl, runs trained and decoded by the `loramcl` commands'
    library functions. A subclass gives its experiment, its data stage and its report."""

    scores_references = True
    references_key: ClassVar[str] = "references"
    """The test file's field holding what the NLL table scores after each prompt."""

    def build_model(self) -> str | None:
        if self.experiment.packaged_model is None:
            return None
        from loramcl.models.pretrained import convert_smollm2

        return str(self.stages.timed("convert model", convert_smollm2, self.root / SMOLLM2_FOLDER))

    def run_values(self, run: str, model: str | None) -> dict:
        from loramcl.recipes.files import run_arguments

        return run_arguments(self.folder, run, self.root, model, self.quick_settings if self.quick else None,
                             runner.COMMON)

    def check(self, model: str, values: dict[str, dict]) -> None:
        self.chat_template = self.run_chat_template(next(iter(values.values())))
        for run, v in values.items():
            require(self.run_chat_template(v) == self.chat_template, f"run {run}: every run of a recipe folder "
                   "trains with the same prompt format (data: chat_template)")

    @staticmethod
    def run_chat_template(values: dict) -> bool:
        from loramcl.training.config import DataConfig

        return DataConfig(**RunFile.of(values).data).chat_template

    def systems(self, values: dict[str, dict], budgets: list[int]) -> list[System]:
        """Each decoded run (default: every run with K = 1 or K = candidates) x each decoding x each budget."""
        k = self.experiment.candidates
        hypotheses = {run: self.hypotheses(v) for run, v in values.items()}
        decoded = self.experiment.decoded_runs(list(values), [run for run, n in hypotheses.items() if n in (1, k)])
        return equal_budget_systems({run: hypotheses[run] for run in decoded}, k, budgets,
                                    mcl_strategies=self.experiment.mcl_decodings)

    def train(self, run: str, values: dict) -> None:
        from loramcl.mcl.config import MCLConfig
        from loramcl.training.config import DataConfig, TrainConfig
        from loramcl.training.fit import train
        from loramcl.training.runs import quantization_settings, run_settings

        run_file = RunFile.of(values)
        data = dict(run_file.data)
        if not (self.data / "validation.jsonl").is_file():  # no validation pairs given: the runs train without
            data["validation_file"] = None
        mcl, data_config = MCLConfig.from_dict(values["mcl"]), DataConfig(**data)
        training = TrainConfig(**run_file.training)
        # QLoRA-MCL: recorded as `loramcl train` records it; the decoding reads it back from the run's run.json
        settings = run_settings(run_file.model, mcl, data_config, training, run_file.dtype)
        settings |= quantization_settings(run_file.quantization)
        self.stages.train(f"train {run}", Path(run_file.out), settings, train, model=run_file.model,
                          out=run_file.out, mcl=mcl, data=data_config, training=training, resume=True,
                          threads=self.threads, dtype=run_file.dtype, quantization=run_file.quantization)

    def decode(self, system: System, values: dict, arguments: dict, decode: DecodeConfig) -> None:
        from loramcl.decoding.predictions import generate
        from loramcl.utils.inputs import PEFT_FOLDER

        run_file, single = RunFile.of(values), self.hypotheses(values) == 1
        generate(model=run_file.model, input=str(self.test), out=str(self.stages.predictions(system.name)),
                 adapters=str(self.decoded_folder(system) / (PEFT_FOLDER if single else "")), device=self.device,
                 batch_size=decode.batch_size, chat_template=self.chat_template, dtype=run_file.dtype, **arguments)

    def score(self, run: str, values: dict, decode: DecodeConfig, out: Path) -> None:
        from loramcl.training.reference_nll import nll

        run_file = RunFile.of(values)
        nll(model=run_file.model, adapters=str(self.scored_folder(run)), input=str(self.test), out=str(out),
            references_key=self.references_key, chat_template=self.chat_template, batch_size=decode.batch_size,
            dtype=run_file.dtype, device=self.device)
