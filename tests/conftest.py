"""The suite's fixtures and its one marker.

`@pytest.mark.procs` marks a test that starts processes (nodes, ranks, all-reduce members, the CLI):
`pytest -m "not procs"` runs the others, which need nothing but the test process. A test that
starts a process without the mark fails (`_processes_only_where_marked`), so the mark stays true.
"""

from __future__ import annotations

import multiprocessing.process
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.helpers import LocalSwarm, socket_files, stale_sockets

_started = [0]
"""Processes started in this pytest process so far (subprocess or multiprocessing)."""


def _counting(start: Any) -> Any:
    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        _started[0] += 1
        return start(self, *args, **kwargs)

    return counted


subprocess.Popen.__init__ = _counting(subprocess.Popen.__init__)  # type: ignore[method-assign]
multiprocessing.process.BaseProcess.start = _counting(multiprocessing.process.BaseProcess.start)  # type: ignore[method-assign]


@pytest.fixture(autouse=True)
def _processes_only_where_marked(request: pytest.FixtureRequest) -> Iterator[None]:
    before = _started[0]
    yield
    if _started[0] > before and request.node.get_closest_marker("procs") is None:
        pytest.fail("this test starts processes: mark it @pytest.mark.procs (tests/conftest.py)")


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
    """A test with a swarm starts processes: marked. Those tests run first: the parallel workers
    then start the long ones early and the many short ones fill in at the end, instead of one
    worker finishing a minute-long test alone."""
    for item in items:
        if "swarm" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.procs)
    items.sort(key=lambda item: item.get_closest_marker("procs") is None)
