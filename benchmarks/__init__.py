"""Benchmarks: `python -m benchmarks.<name> --json`; the last line printed is one JSON object."""
