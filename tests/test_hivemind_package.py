"""hivemind's DHT without its package extras (swarm/hivemind_package.py), in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.procs
"""Every test here starts processes."""

CHECK = """
import sys
import p2ptrain.swarm.dht, p2ptrain.swarm.bootstrap, p2ptrain.node.agent, p2ptrain.cli.join
heavy = {name.split(".")[0] for name in sys.modules} & {"scipy", "torch"}
print(sorted(heavy), "hivemind.averaging" in sys.modules)
import hivemind
from hivemind.utils import get_dht_time, ValueWithExpiration
from hivemind.utils.timed_storage import get_dht_time as defined
print(hivemind.__version__ == "1.1.12", get_dht_time is defined, "torch" in sys.modules)
print(hivemind.DHT.__module__, hivemind.utils.MPFuture.__name__, "hivemind.averaging" in sys.modules)
"""


def test_the_node_loads_the_dht_without_torch_or_hiveminds_averager_and_the_package_still_works_whole() -> (
    None
):
    result = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "[] False",
        "True True False",
        "hivemind.dht.dht MPFuture False",
    ], result.stdout
