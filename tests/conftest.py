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
