from __future__ import annotations

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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Multi-process tests (a swarm, or marked slow) first: the parallel workers then start the long
    ones early and the many short ones fill in at the end, instead of one worker finishing a
    minute-long test alone."""

    def short(item: pytest.Item) -> bool:
        return not (item.get_closest_marker("slow") or "swarm" in getattr(item, "fixturenames", ()))

    items.sort(key=short)
