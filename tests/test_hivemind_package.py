"""hivemind's DHT without its package extras (swarm/hivemind_package.py), in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import sys
import p2ptrain.swarm.dht, p2ptrain.swarm.bootstrap, p2ptrain.node.agent
averager = "hivemind.averaging"
print(sorted({name.split(".")[0] for name in sys.modules} & {"scipy"}), averager in sys.modules)
import hivemind
print(hivemind.__version__ == "1.1.12", hivemind.DHT is p2ptrain.swarm.dht.DHT, averager in sys.modules)
"""


def test_the_node_loads_the_dht_without_hiveminds_averager_and_the_package_still_works_whole():
    result = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["[] False", "True True True"], result.stdout
