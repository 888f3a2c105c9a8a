"""The ground floor, below everything else and free of torch: ``validate`` (the checks every configuration and
command makes, ``OptionError``), ``inputs`` (paths, model folders, devices and outputs checked before work starts;
the warnings of adapter files), ``files`` (UTF-8 text and JSONL records read with errors naming the file and line,
checksums, atomic writes), ``threads`` (the CPU threads a command uses), ``lazy`` (names imported on first use) and
``run_best`` (a run's best adapters, OUT/best, checked against best.json and the run's records).
"""
