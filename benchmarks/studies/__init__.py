"""Studies that train models for a table: ``python -m benchmarks.studies.NAME`` from the repository root."""
