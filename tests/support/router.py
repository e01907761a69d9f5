"""A userspace internet between network namespaces: delay, jitter, loss, rates and finite queues.

    python -m tests.support.router --spec SPEC.json --ready FILE

This kernel has no netem, so the lab (internet.py) gives every host namespace a TUN device and this
process switches the IP packets between them, the way a path through the internet treats them:

    host i ─ uplink (up_i, queue) ─ loss_i ─ delay_i + delay_j + jitter ─ downlink (down_j, queue) ─ host j

- an uplink and a downlink each serialise packets at their rate and hold at most `queue_ms` of them
  (tail drop beyond: how TCP meets a home router's buffer);
- a packet a host sends is lost with its `loss` probability (independent, per packet);
- a path's one-way delay is the sum of its two hosts' `delay_ms` (their distance to the core) plus up
  to the sum of their `jitter_ms`, drawn per packet; a flow (source, destination) is never
  reordered: a packet leaves no earlier than the one before it on that path.

One thread, one epoll loop over the TUN descriptors and a heap of timed events. Times come from
time.monotonic(); epoll's timeout is in milliseconds, so a packet may leave up to 1 ms late.
SIGTERM stops it (the TUN devices go with their namespaces).

This module is the model's reference. Where a C compiler is at hand the process runs router.c
instead, the same model compiled (built once into build/, then exec'd with the TUN descriptors
this module opened): it moves a packet for a small fraction of the CPU, which the hosts under test
otherwise share with the router on a small machine. P2PTRAIN_LAB_ROUTER=python keeps this one.
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import hashlib
import heapq
import json
import os
import random
import resource
import select
import shutil
import signal
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
CLONE_NEWNET = 0x40000000
READS_PER_WAKE = 64  # packets read from one host before the others get a turn
ARRIVE, DELIVER = 0, 1


@dataclass(frozen=True, kw_only=True)
class Link:
    """One host's access to the internet."""

    namespace: str
    address: str
    """Its IPv4 address on the TUN device."""
    delay_ms: float = 0.0
    """One-way delay to the core: a path's one-way delay is the sum of its two hosts'."""
    jitter_ms: float = 0.0
    """Up to this much more per packet (both ends' added), without reordering a flow."""
    loss: float = 0.0
    """Fraction of the packets this host sends that are lost, 0 ≤ loss < 1."""
    up_mbit: float = 1000.0
    down_mbit: float = 1000.0
    queue_ms: float = 100.0
    """What each of its two queues holds, in milliseconds of its link's rate (floor 64 KiB)."""


@dataclass
class _Host:
    link: Link
    fd: int
    up_bytes_per_s: float
    down_bytes_per_s: float
    up_queue_s: float
    down_queue_s: float
    up_free: float = 0.0
    down_free: float = 0.0
    counts: dict[str, int] = field(default_factory=lambda: {"sent": 0, "lost": 0, "dropped": 0})


def _queue_s(link: Link, bytes_per_s: float) -> float:
    return max(link.queue_ms / 1000, 64 * 1024 / bytes_per_s)


def open_tun(namespace: str, name: str = "tun0") -> int:
    """A descriptor on the TUN device `name` inside `namespace` (entered and left with setns)."""
    libc = ctypes.CDLL(None, use_errno=True)
    home = os.open("/proc/self/ns/net", os.O_RDONLY)
    target = os.open(f"/run/netns/{namespace}", os.O_RDONLY)
    try:
        if libc.setns(target, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {namespace}")
        try:
            fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
            fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
        finally:
            if libc.setns(home, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns back home")
    finally:
        os.close(home)
        os.close(target)
    return fd


class Router:
    """The switch: packets in from a host's TUN, out to another's when the path lets them."""

    def __init__(self, links: list[Link], *, seed: int = 0):
        self.random = random.Random(seed)
        self.hosts: list[_Host] = []
        for link in links:
            up, down = link.up_mbit * 1e6 / 8, link.down_mbit * 1e6 / 8
            self.hosts.append(
                _Host(link, open_tun(link.namespace), up, down, _queue_s(link, up), _queue_s(link, down))
            )
        self.by_address = {bytes(map(int, h.link.address.split("."))): i for i, h in enumerate(self.hosts)}
        self.by_fd = {host.fd: index for index, host in enumerate(self.hosts)}
        self.last_arrival: dict[tuple[int, int], float] = {}
        self.events: list[tuple[float, int, int, int, bytes]] = []
        self.sequence = 0
        self.stopped = False

    def _push(self, when: float, kind: int, host: int, packet: bytes) -> None:
        self.sequence += 1
        heapq.heappush(self.events, (when, self.sequence, kind, host, packet))

    def _sent(self, source: int, packet: bytes, now: float) -> None:
        """A packet `source` wrote: through its uplink, the loss, the path's delay."""
        if len(packet) < 20 or packet[0] >> 4 != 4:
            return  # IPv4 only (IPv6 router solicitations and the like go nowhere)
        target = self.by_address.get(packet[16:20])
        host = self.hosts[source]
        if target is None or target == source:
            return
        start = max(now, host.up_free)
        if start - now > host.up_queue_s:
            host.counts["dropped"] += 1
            return
        host.up_free = start + len(packet) / host.up_bytes_per_s
        host.counts["sent"] += 1
        if self.random.random() < host.link.loss:
            host.counts["lost"] += 1
            return
        other = self.hosts[target].link
        delay = (host.link.delay_ms + other.delay_ms) / 1000
        jitter = (host.link.jitter_ms + other.jitter_ms) / 1000
        arrival = host.up_free + delay + (self.random.random() * jitter if jitter else 0.0)
        path = (source, target)
        arrival = max(arrival, self.last_arrival.get(path, 0.0))
        self.last_arrival[path] = arrival
        self._push(arrival, ARRIVE, target, packet)

    def _arrived(self, target: int, packet: bytes, now: float) -> None:
        host = self.hosts[target]
        start = max(now, host.down_free)
        if start - now > host.down_queue_s:
            host.counts["dropped"] += 1
            return
        host.down_free = start + len(packet) / host.down_bytes_per_s
        self._push(host.down_free, DELIVER, target, packet)

    def run(self) -> None:
        poller = select.epoll()
        for host in self.hosts:
            poller.register(host.fd, select.EPOLLIN)
        while not self.stopped:
            now = time.monotonic()
            while self.events and self.events[0][0] <= now:
                _, _, kind, index, packet = heapq.heappop(self.events)
                if kind == ARRIVE:
                    self._arrived(index, packet, now)
                else:
                    try:
                        os.write(self.hosts[index].fd, packet)
                    except BlockingIOError:
                        self.hosts[index].counts["dropped"] += 1
            wait = max(0.0, self.events[0][0] - now) if self.events else 1.0
            for fd, _ in poller.poll(wait):
                source = self.by_fd[fd]
                for _ in range(READS_PER_WAKE):
                    try:
                        packet = os.read(fd, 65536)
                    except BlockingIOError:
                        break
                    self._sent(source, packet, time.monotonic())

    def counts(self) -> dict[str, dict[str, int]]:
        return {host.link.namespace: host.counts for host in self.hosts}


SOURCE = Path(__file__).with_name("router.c")
BUILD = Path(__file__).resolve().parents[2] / "build"


def compiled_router() -> Path | None:
    """router.c built into build/ (once per version of its source), or None where there is no C
    compiler, the build fails, or P2PTRAIN_LAB_ROUTER=python asks for this module's router."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if os.environ.get("P2PTRAIN_LAB_ROUTER") == "python" or compiler is None:
        return None
    binary = BUILD / f"lab-router-{hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]}"
    if binary.exists():
        return binary
    BUILD.mkdir(exist_ok=True)
    partial = binary.with_name(f"{binary.name}.{os.getpid()}")
    built = subprocess.run([compiler, "-O2", "-o", str(partial), str(SOURCE)], capture_output=True, text=True)
    if built.returncode != 0:
        print(f"router.c did not build, running the Python router: {built.stderr[-500:]}", flush=True)
        return None
    partial.replace(binary)  # atomic: a concurrent build of the same source writes the same file
    return binary


def exec_compiled(binary: Path, links: list[Link], *, ready: Path, counts: str | None, seed: int) -> None:
    """Open every TUN device here (entering each namespace needs this process's setns), say ready
    (a device queues what arrives until the exec'd router reads it), then become the compiled
    router, which inherits them; never returns."""
    hosts = []
    for link in links:
        fd = open_tun(link.namespace)
        os.set_inheritable(fd, True)
        fields = (link.delay_ms, link.jitter_ms, link.loss, link.up_mbit, link.down_mbit, link.queue_ms)
        hosts.append(",".join([link.namespace, str(fd), link.address, *map(repr, fields)]))
    ready.write_text("ready\n")
    os.execv(binary, [str(binary), counts or "-", str(seed), *hosts])


def main() -> None:
    arguments = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    arguments.add_argument("--spec", required=True, help="JSON: a list of Link fields per host")
    arguments.add_argument("--ready", required=True, help="written once every TUN device is attached")
    arguments.add_argument(
        "--counts", help="where to write what each host sent, lost and dropped, and the CPU time used"
    )
    arguments.add_argument("--seed", type=int, default=0)
    args = arguments.parse_args()
    links = [Link(**fields) for fields in json.loads(Path(args.spec).read_text())]
    binary = compiled_router()
    if binary is not None:
        exec_compiled(binary, links, ready=Path(args.ready), counts=args.counts, seed=args.seed)
    router = Router(links, seed=args.seed)

    def stop(*_: object) -> None:
        router.stopped = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    Path(args.ready).write_text("ready\n")
    router.run()
    if args.counts:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        said = {"hosts": router.counts(), "cpu_s": round(usage.ru_utime + usage.ru_stime, 2)}
        Path(args.counts).write_text(json.dumps(said))
    sys.exit(0)


if __name__ == "__main__":
    main()
