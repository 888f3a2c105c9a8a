"""Speed and memory measurements: ``python -m benchmarks.speed.NAME`` from the repository root."""
