from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import LocalSwarm, socket_files, stale_sockets


@pytest.fixture
def swarm(tmp_path: Path) -> Iterator[LocalSwarm]:
    """A fresh local swarm; every process it started is stopped by PID and none may be left over."""
    sockets_before = socket_files()
    local = LocalSwarm(tmp_path)
    try:
        yield local
    finally:
        orphans = local.stop()
    assert orphans == [], f"processes outlived their parents: {local.children.orphan_commands}"
    assert stale_sockets(sockets_before) == set(), "stale p2pd sockets left in /tmp"


DURATIONS = Path(__file__).with_name("durations.json")
"""Seconds each test over 2 s took in a full run on 2 cores (`pytest --durations=120`): only the
order of the tests depends on it, never a result."""
UNLISTED_MULTI_PROCESS_S = 10


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Longest first: the parallel workers start the long tests early and the many short ones fill
    in at the end, instead of one worker finishing a minute-long test alone. A test not listed in
    DURATIONS counts as 10 s if it starts processes (a swarm, or marked slow), else as instant."""
    recorded = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}

    def expected(item: pytest.Item) -> float:
        multi_process = item.get_closest_marker("slow") or "swarm" in getattr(item, "fixturenames", ())
        return float(recorded.get(item.nodeid, UNLISTED_MULTI_PROCESS_S if multi_process else 0))

    items.sort(key=expected, reverse=True)
