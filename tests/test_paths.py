"""What a node measured of its paths: the deadlines an attempt derives from them, what its record
publishes of them, and what the status makes of a record's (a stranger's) claims."""

from __future__ import annotations

import functools
import math

import pytest

from p2ptrain.comm.net.paths import MAX_PATHS, PATH_ROUND_TRIPS, PathBook
from p2ptrain.comm.reduce.barrier import BEATS_PER_TIMEOUT
from p2ptrain.node.record_extras import MAX_PUBLISHED_LINKS, RecordExtras
from p2ptrain.swarm.election import LINKS_FIELD
from p2ptrain.swarm.records import ROUND_TRIPS_FIELD
from p2ptrain.swarm.status import MAX_SHOWN_PATHS, measured_paths

A, B, C = b"\xaa" * 32, b"\xbb" * 32, b"\xcc" * 32


def key(index: int) -> bytes:
    """A peer key whose record prefix (its first 8 bytes) is its own."""
    return index.to_bytes(8, "big") * 4


def test_an_attempt_waits_eight_round_trips_of_its_slowest_measured_path_never_less_than_configured() -> None:
    book = PathBook()
    deadline = functools.partial(book.failure_timeout, configured=5.0, cap=BEATS_PER_TIMEOUT * 5.0)
    assert deadline([A, B]) == 5.0  # nothing measured: the configured value
    book.measured(round_trips={A: 0.01, B: 0.8})
    assert deadline([A]) == 5.0  # a 10 ms path: never shorter than configured
    assert deadline([A, B]) == pytest.approx(PATH_ROUND_TRIPS * 0.8)
    assert deadline([A, C]) == 5.0  # C unmeasured, B not a member
    book.measured(round_trips={B: 30.0})  # a path that claims more is held at the cap
    assert deadline([A, B]) == BEATS_PER_TIMEOUT * 5.0
    assert book.failure_timeout([B], configured=5.0, cap=1.0) == 5.0  # a cap under it: configured


def test_a_round_trip_that_grows_counts_at_once_one_that_shrinks_by_halves() -> None:
    book = PathBook()
    book.measured(round_trips={A: 0.2})
    book.measured(round_trips={A: 1.0})
    assert book.round_trips[A] == 1.0
    book.measured(round_trips={A: 0.2})
    assert book.round_trips[A] == pytest.approx(0.6)
    book.measured(round_trips={A: math.inf, B: math.nan, C: -1.0})  # never a deadline's input
    assert book.round_trips == {A: pytest.approx(0.6)}


def test_a_link_that_kept_up_forgets_its_rate_and_the_book_is_bounded() -> None:
    book = PathBook()
    book.measured(rates={A: 5e6, B: math.inf})
    assert book.rates == {A: 5e6}
    book.measured(rates={A: math.inf})
    assert book.rates == {}
    many = {key(index): 0.1 for index in range(MAX_PATHS + 10)}
    book.measured(round_trips=many)
    assert len(book.round_trips) == MAX_PATHS
    assert key(0) not in book.round_trips  # the longest unmeasured went first


def test_a_record_publishes_the_newest_paths_and_the_status_reads_them_back() -> None:
    book = PathBook()
    book.measured(round_trips={A: 0.23, B: 0.0414}, rates={A: 5e6})
    extra = RecordExtras(book).extra_for({"loss": 3.0}, 4, named=())
    assert extra["loss"] == 3.0
    assert measured_paths(extra) == [
        {"to": A.hex()[:16], "rtt_ms": 230.0, "mbps": 40.0},
        {"to": B.hex()[:16], "rtt_ms": 41.4, "mbps": None},
    ]
    many = {key(index): 0.1 for index in range(3 * MAX_PUBLISHED_LINKS)}
    book.measured(round_trips=many)
    published = RecordExtras(book).extra_for({}, 4, named=())[ROUND_TRIPS_FIELD]
    assert len(published) == MAX_PUBLISHED_LINKS
    assert key(3 * MAX_PUBLISHED_LINKS - 1).hex()[:16] in published


def test_the_status_shows_no_junk_a_stranger_puts_in_its_record() -> None:
    junk = {
        ROUND_TRIPS_FIELD: {
            "abc": 12.0,
            "not hex": 5.0,
            "a" * 40: 5.0,
            "b": math.inf,
            "c": True,
            "d": -3.0,
            "e": "fast",
            **{f"{index:04x}": 1.0 for index in range(100)},
        },
        LINKS_FIELD: ["not", "a", "dict"],
    }
    shown = measured_paths(junk)
    assert shown[0] == {"to": "abc", "rtt_ms": 12.0, "mbps": None}
    assert len(shown) <= MAX_SHOWN_PATHS
    assert all(set(path["to"]) <= set("0123456789abcdef") and len(path["to"]) <= 16 for path in shown)
    assert measured_paths({ROUND_TRIPS_FIELD: "a string"}) == []
