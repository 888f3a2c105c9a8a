"""The task recipes: the shared runner on this level, then one folder per task holding its code (its command, its
readers, its report) beside its recipe files (``<task>/*.yaml``, packaged with loramcl): ``markov``, ``bilingual``,
``translation``, ``audio_captioning``, ``image_captioning``, ``spoken_translation``. A task imports the runner and the
floors below it, never another task (tests/system/test_layout.py).

The shared runner is what every task recipe is made of, so that recipes stay thin (docs/architecture.md,
"Recipes: one shared runner"):

- ``runner``: ``run_recipe``, the stage loop every task command runs, and ``Task``, what a task gives it (its
  experiment settings, data, the training of a run, the decoding of a system, its report).
- ``steps``: the step library (a run's settings, the training stage, decoding to JSONL, scoring the references to
  JSONL) and ``ProcessorTask``, which composes them for the tasks whose examples are built from a processor.
- ``command``: each task command generated from its Task, the options every task command shares written once.
- ``experiment``: the settings every experiment.yaml holds; ``text``: what the two text tasks share.
- ``files``: recipe files (a common file + one per run, merged section by section), the packaged recipes by name;
  ``catalog``: `loramcl recipes` (list, copy).
- ``stages``: an output folder whose stages are skipped when their outputs exist with the same settings, training
  stages resumed from their last checkpoint, and wall times collected for the report.
- ``grid``: the systems compared (a trained run x a decoding strategy x a forward budget) and their decoding
  arguments at an equal forward budget (paper §4.1), plus the decoding settings shared by every system.
- ``report``: the tables and figures every recipe report has (runs, quality and diversity per system, wins per
  reference group, training curves).
"""
