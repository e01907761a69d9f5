"""Timing helpers shared by the benchmarks."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any


def median_seconds(function: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """Median wall time of `function()` over `repeats` runs, after `warmup` untimed runs."""
    for _ in range(warmup):
        function()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--json", action="store_true", help="print only the JSON result line")
    return parser


def report(result: dict[str, Any], as_json: bool) -> None:
    if not as_json:
        for key, value in result.items():
            print(f"{key:>22}: {value}")
    print(json.dumps(result))
