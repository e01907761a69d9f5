"""The internet lab's per-host flags, shared by the benchmarks that run over it.

    --delay MS,...    one-way delay from a host to the core: a path's round trip is twice the sum
                      of its two hosts' delays
    --jitter MS,...   up to this much more per packet (a flow is never reordered)
    --loss PCT,...    percent of the packets a host sends that are lost
    --up MBIT,...     uplink rate;  --down MBIT,...  downlink rate
    --queue MS        what each link's queue holds, in milliseconds of its rate

A list gives host i its i-th value, the last one repeated past its end. The lab itself is
tests/support/internet.py (namespaces, TUN devices) and tests/support/router.py (the path model).
"""

from __future__ import annotations

import argparse
import contextlib
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tests.support.internet import InternetLab

PATH_FLAGS = ("delay", "jitter", "loss", "up", "down")
UNITS = ("_ms", "_ms", "_pct", "_mbit", "_mbit")
"""Each flag's unit, as its key in a result is named (`delay_ms`, …)."""


def floats(text: str) -> list[float]:
    """'25,50' → [25.0, 50.0] (argparse type: a per-host list)."""
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of numbers: {text!r}") from None
    if not values or any(not math.isfinite(value) or value < 0 for value in values):
        raise argparse.ArgumentTypeError(f"not a list of numbers ≥ 0: {text!r}")
    return values


def add_path_flags(arguments: argparse.ArgumentParser, **defaults: str) -> None:
    """The lab's flags; `defaults` (e.g. delay="25,50") where a benchmark always runs in the lab,
    None elsewhere (then the lab is used only when one of them is given: `wants_lab`)."""
    helps = {
        "delay": ("MS,...", "one-way delay to the core, per host"),
        "jitter": ("MS,...", "up to this much more delay per packet, per host"),
        "loss": ("PCT,...", "percent of the packets a host sends that are lost"),
        "up": ("MBIT,...", "uplink rate, per host"),
        "down": ("MBIT,...", "downlink rate, per host"),
    }
    for name, (metavar, text) in helps.items():
        default = floats(defaults[name]) if name in defaults else None
        arguments.add_argument(f"--{name}", type=floats, default=default, metavar=metavar, help=text)
    arguments.add_argument("--queue", type=float, default=100.0, metavar="MS", help="queue per link")


def check_path_flags(arguments: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if any(value >= 100 for value in args.loss or ()):
        arguments.error("--loss must be below 100 (percent)")
    if any(value <= 0 for value in (*(args.up or ()), *(args.down or ()))) or args.queue <= 0:
        arguments.error("--up, --down and --queue must be positive")


def wants_lab(args: argparse.Namespace) -> bool:
    return any(getattr(args, name) is not None for name in PATH_FLAGS)


@contextlib.contextmanager
def lab_for(
    args: Any, hosts: int, *, bootstrap: bool = True, rate: float | None = None
) -> Iterator[InternetLab]:
    """The lab with `hosts` hosts. With `bootstrap`, host 0 is the bootstrap peer's: it takes the
    lists' first values and node i (host i + 1) their i-th; without, host i takes the i-th. `rate`
    (Mbit/s, e.g. --bandwidth) where --up or --down is not given. Stopped and deleted on the way
    out."""
    from tests.support.internet import InternetLab, links

    def shifted(values: list[float] | None, default: float) -> list[float]:
        if not values:
            return [default]
        return [values[0], *values] if bootstrap else values

    lab = InternetLab.start(
        links(
            hosts,
            delay_ms=shifted(args.delay, 0.0),
            jitter_ms=shifted(args.jitter, 0.0),
            loss_pct=shifted(args.loss, 0.0),
            up_mbit=shifted(args.up, rate or 1000.0),
            down_mbit=shifted(args.down, rate or 1000.0),
            queue_ms=args.queue,
        )
    )
    try:
        yield lab
    finally:
        lab.stop()


def lab_figures(args: argparse.Namespace) -> dict[str, Any]:
    """The lab's settings, for a benchmark's result."""
    return {f"{name}{unit}": getattr(args, name) for name, unit in zip(PATH_FLAGS, UNITS, strict=True)}
