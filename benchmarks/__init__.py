"""Benchmarks, checks and studies of loramcl, in rooms by role; run each script as a module from the repository root:

    .venv/bin/python -m benchmarks.speed.suite --shape cpu-small --threads 1

- ``speed/``: speed and memory measurements (the suite, the training step, decoding, data preparation, threads);
- ``checks/``: the fault-injection harnesses, the GPU check and what it needs (its wheels, the fake accelerator of
  its dry run), serving through vLLM against our decoding;
- ``studies/``: scripts that train models for a table of docs/benchmarks.md or docs/guide/scores.md (the defaults
  study, the default settings, the memory plan, compiled training's drift);
- ``common.py`` and ``tiny.py`` (here): what the scripts share, imported as ``benchmarks.common`` and
  ``benchmarks.tiny``.
"""
