"""An internet lab: one network namespace per host, joined by a userspace router (router.py).

    lab = InternetLab.start([Link(...), ...])   # host i: namespace lab.namespace(i), address 10.88.0.(i+1)
    lab.prefix(i) + argv                         # a command inside host i
    lab.stop()                                   # the router first, then every namespace

Each host namespace has a TUN device `tun0` holding its address, with the lab's /16 routed through
it; the router process (run as root in the caller's namespace) attaches to every TUN device and
forwards packets between them with each host's delay, jitter, loss, rates and queues. No traffic
leaves the lab's namespaces. Socket buffers inside a host are raised (net.ipv4.tcp_rmem/wmem, per
namespace) to hold a long fat path's window, as a tuned host's are; `missing()` says why this
machine cannot run it.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from tests.support import netlab
from tests.support.netlab import run_checked
from tests.support.router import Link

SUBNET = "10.88"
NAMESPACE_PREFIX = "p2pi"
TCP_BUFFERS = "4096 131072 33554432"  # min, default, max: up to 32 MiB (a 350 ms path at 500 Mbit/s)


def missing() -> str | None:
    """Why this machine cannot run the lab (None when it can)."""
    if os.geteuid() != 0:
        return "the internet lab needs root (network namespaces, TUN devices)"
    if shutil.which("ip") is None:
        return "ip (iproute2) is not installed"
    if not os.path.exists("/dev/net/tun"):
        return "/dev/net/tun is missing"
    return None


def address(index: int) -> str:
    return f"{SUBNET}.{index // 250}.{index % 250 + 1}"


def links(
    hosts: int,
    *,
    delay_ms: Sequence[float] = (0.0,),
    jitter_ms: Sequence[float] = (0.0,),
    loss_pct: Sequence[float] = (0.0,),
    up_mbit: Sequence[float] = (1000.0,),
    down_mbit: Sequence[float] = (1000.0,),
    queue_ms: float = 100.0,
) -> list[Link]:
    """`hosts` links; each list gives host i its i-th value, the last value repeated past its end
    (one value: every host alike)."""

    def nth(values: Sequence[float], index: int) -> float:
        return float(values[min(index, len(values) - 1)])

    return [
        Link(
            namespace="",
            address=address(index),
            delay_ms=nth(delay_ms, index),
            jitter_ms=nth(jitter_ms, index),
            loss=nth(loss_pct, index) / 100,
            up_mbit=nth(up_mbit, index),
            down_mbit=nth(down_mbit, index),
            queue_ms=queue_ms,
        )
        for index in range(hosts)
    ]


@dataclass
class InternetLab:
    links: list[Link]
    tag: str = field(default_factory=lambda: secrets.token_hex(3))
    namespaces: list[str] = field(default_factory=list)
    router: subprocess.Popen[bytes] | None = None
    counts: dict[str, dict[str, int]] = field(default_factory=dict)
    """Per host, once stopped: packets sent, lost, and dropped by a full queue."""
    router_cpu_s: float | None = None
    """The router's CPU seconds, once stopped (near one core's worth: the lab is the bottleneck)."""
    folder: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="p2ptrain-internet-")))

    @classmethod
    def start(cls, links: list[Link], *, seed: int = 0) -> InternetLab:
        """The namespaces, their TUN devices and the router; everything undone if a part fails."""
        lab = cls(links=[])
        try:
            for index, link in enumerate(links):
                name = lab._host(index, link.address)
                lab.links.append(replace(link, namespace=name))
            lab._start_router(seed)
        except BaseException:
            lab.stop()
            raise
        return lab

    def namespace(self, index: int) -> str:
        return self.links[index].namespace

    def address(self, index: int) -> str:
        return self.links[index].address

    def prefix(self, index: int) -> tuple[str, ...]:
        """What runs a command inside host `index` (`ip netns exec` execs it: the same PID)."""
        return ("ip", "netns", "exec", self.namespace(index))

    def round_trip_s(self, a: int, b: int) -> float:
        """The path's round trip without queueing or jitter."""
        return 2 * (self.links[a].delay_ms + self.links[b].delay_ms) / 1000

    def _host(self, index: int, host_address: str) -> str:
        name = f"{NAMESPACE_PREFIX}{self.tag}h{index}"
        run_checked("ip", "netns", "add", name)
        self.namespaces.append(name)
        inside = ("ip", "-n", name)
        run_checked(*inside, "link", "set", "lo", "up")
        run_checked(*inside, "tuntap", "add", "dev", "tun0", "mode", "tun")
        run_checked(*inside, "addr", "add", f"{host_address}/16", "dev", "tun0")
        run_checked(*inside, "link", "set", "tun0", "up")
        run_checked(*inside, "route", "add", "default", "dev", "tun0")  # so an address lookup finds tun0
        settings = [f"{setting}={TCP_BUFFERS}" for setting in ("net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem")]
        run_checked("ip", "netns", "exec", name, "sysctl", "-q", "-w", *settings)
        return name

    def _start_router(self, seed: int) -> None:
        spec, ready = self.folder / "links.json", self.folder / "ready"
        spec.write_text(json.dumps([asdict(link) for link in self.links]))
        argv = [sys.executable, "-m", "tests.support.router", "--spec", str(spec), "--ready", str(ready)]
        argv += ["--counts", str(self.folder / "counts.json"), "--seed", str(seed)]
        log = open(self.folder / "router.log", "wb")  # noqa: SIM115 (the router's whole life)
        root = Path(__file__).resolve().parents[2]
        self.router = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=root)
        log.close()
        deadline = time.monotonic() + 30
        while not ready.exists():
            if self.router.poll() is not None or time.monotonic() > deadline:
                said = (self.folder / "router.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"the lab's router did not start:\n{said}")
            time.sleep(0.05)

    def stop(self) -> None:
        """Stop the router by PID, then delete every namespace (their TUN devices go with them)."""
        if self.router is not None and self.router.poll() is None:
            self.router.terminate()
            try:
                self.router.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.router.kill()
                self.router.wait()
        for name in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        self.namespaces.clear()
        counts = self.folder / "counts.json"
        if counts.exists():
            said = json.loads(counts.read_text())
            self.counts, self.router_cpu_s = said["hosts"], said["cpu_s"]
        shutil.rmtree(self.folder, ignore_errors=True)


@contextlib.contextmanager
def running_lab(links: list[Link], *, seed: int) -> Iterator[InternetLab]:
    """A lab for a test: skipped where this machine cannot run one; afterwards no namespace of it
    is left and its router ended cleanly."""
    import pytest  # only tests take this path

    reason = missing()
    if reason is not None:
        pytest.skip(reason)
    network = InternetLab.start(links, seed=seed)
    try:
        yield network
    finally:
        network.stop()
    assert leftover_namespaces(network.tag) == []
    assert network.router is not None and network.router.returncode == 0


def leftover_namespaces(tag: str) -> list[str]:
    """The namespaces of the lab tagged `tag` that still exist."""
    return netlab.leftover_namespaces(tag, prefix=NAMESPACE_PREFIX)
