"""The internet lab's two routers, the Python reference (router.py) and its compiled twin
(router.c), give a path the same shape: a TCP connection between two hosts takes the path's round
trip to set up, a bulk transfer never beats the sender's uplink, and a lossy path loses packets.
Bounds that a slow or busy machine cannot break: lower bounds on time, counts of packets."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.support.internet import InternetLab, links, missing, running_lab
from tests.support.router import compiled_router

DELAY_MS = 40.0
"""Each host's one-way delay to the core: a round trip of 160 ms between the two."""
UP_MBIT = 20.0
BULK_BYTES = 1 << 20

SERVER = """
import socket, sys
listener = socket.create_server((sys.argv[1], 9000))
print("listening", flush=True)
connection, _ = listener.accept()
while connection.recv(1 << 16):
    pass
connection.sendall(b"done")
"""

CLIENT = """
import json, socket, sys, time
started = time.monotonic()
connection = socket.create_connection((sys.argv[1], 9000))
connected = time.monotonic()
connection.sendall(bytes(int(sys.argv[2])))
connection.shutdown(socket.SHUT_WR)
assert connection.recv(4) == b"done"
print(json.dumps({"connect_s": connected - started, "bulk_s": time.monotonic() - connected}))
"""


@pytest.fixture(params=["python", "compiled"])
def lab(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[InternetLab]:
    if request.param == "compiled" and missing() is None:
        assert compiled_router() is not None, "router.c did not build (a C compiler is part of make install)"
    if request.param == "python":
        monkeypatch.setenv("P2PTRAIN_LAB_ROUTER", "python")
    paths = links(2, delay_ms=[DELAY_MS], loss_pct=[2, 0], up_mbit=[UP_MBIT])
    with running_lab(paths, seed=3) as network:
        yield network


@pytest.mark.procs
def test_a_path_takes_its_round_trip_its_uplink_and_its_loss(lab: InternetLab) -> None:
    server = subprocess.Popen(
        [*lab.prefix(1), sys.executable, "-c", SERVER, lab.address(1)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "listening"
        said = subprocess.run(
            [*lab.prefix(0), sys.executable, "-c", CLIENT, lab.address(1), str(BULK_BYTES)],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        assert server.wait(timeout=30) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    timing = json.loads(said.stdout)
    round_trip = lab.round_trip_s(0, 1)
    assert timing["connect_s"] >= 0.95 * round_trip, timing  # SYN out, SYN-ACK back
    # the bytes cannot leave faster than the uplink, and the last one still has a one-way delay to go
    assert timing["bulk_s"] >= BULK_BYTES * 8 / (UP_MBIT * 1e6) + round_trip / 2, timing
    lab.stop()
    host0, host1 = (lab.counts[lab.namespace(index)] for index in (0, 1))
    assert host0["sent"] > BULK_BYTES // 1500 and host0["lost"] > 0, lab.counts  # 2 % of ~700 lost
    assert host1["sent"] > 0 and host1["lost"] == 0, lab.counts  # its ACKs, on a path without loss
    assert lab.router_cpu_s is not None
