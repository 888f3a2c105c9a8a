"""Checks: fault injection, the GPU check, serving through vLLM; ``python -m benchmarks.checks.NAME`` from the
repository root."""
