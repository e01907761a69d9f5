"""A small switched network of network namespaces with tc-limited links, for bandwidth benchmarks.

Needs root (or CAP_NET_ADMIN) and iproute2. Every member gets its own namespace with one veth into
a hub namespace's bridge; each member's egress is shaped with a token bucket (tbf) to MBIT, so a
member can send at most MBIT whatever the destination — like a home or cloud uplink. Members in
`behind_nat` sit behind a router namespace of their own on that bridge (nftables masquerade, and a
forward policy that drops what enters unasked, as a home router without port forwarding).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Collection, Iterator
from dataclasses import dataclass

SUBNET = "10.213.7"


class NamespacesUnavailable(RuntimeError):
    """Network namespaces or tc cannot be used here (no permission, no iproute2)."""


@dataclass(frozen=True)
class Network:
    namespaces: list[str]
    addresses: list[str]

    def prefix(self, index: int) -> list[str]:
        """What puts a command inside member `index`'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[index]]

    def command(self, index: int, argv: list[str]) -> list[str]:
        """`argv` run inside member `index`'s namespace (gloo told to use its one interface)."""
        return [*self.prefix(index), "env", "GLOO_SOCKET_IFNAME=eth0", *argv]


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise NamespacesUnavailable(f"ip {' '.join(args)}: {result.stderr.strip() or 'failed'}")


ROUTER_RULES = """
table ip nat {
    chain postrouting { type nat hook postrouting priority 100; oifname "wan" masquerade; }
}
table inet filter {
    chain forward {
        type filter hook forward priority 0; policy drop;
        ct state established,related accept
        iifname "lan" oifname "wan" accept
    }
}
"""


def _router(prefix: str, hub: str, *, index: int, member: str, created: list[str]) -> str:
    """A NAT router between the hub's bridge and `member`'s namespace; the member's address."""
    router = f"{prefix}r{index}"
    _ip("netns", "add", router)
    created.append(router)
    _ip("link", "add", "wan", "netns", router, "type", "veth", "peer", "name", f"r{index}", "netns", hub)
    _ip("-n", router, "addr", "add", f"{SUBNET}.{index + 1}/24", "dev", "wan")
    _ip("link", "add", "lan", "netns", router, "type", "veth", "peer", "name", "eth0", "netns", member)
    _ip("-n", router, "addr", "add", f"192.168.{index + 1}.1/24", "dev", "lan")
    for link in ("wan", "lan", "lo"):
        _ip("-n", router, "link", "set", link, "up")
    _ip("-n", hub, "link", "set", f"r{index}", "master", "br0")
    _ip("-n", hub, "link", "set", f"r{index}", "up")
    address = f"192.168.{index + 1}.2"
    _ip("-n", member, "addr", "add", f"{address}/24", "dev", "eth0")
    _ip("-n", member, "link", "set", "eth0", "up")
    _ip("-n", member, "route", "add", "default", "via", f"192.168.{index + 1}.1")
    for argv in (["sysctl", "-q", "-w", "net.ipv4.ip_forward=1"], ["nft", "-f", "-"]):
        done = subprocess.run(
            ["ip", "netns", "exec", router, *argv],
            input=ROUTER_RULES if argv[0] == "nft" else None,
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise NamespacesUnavailable(f"{argv[0]} in the NAT router: {done.stderr.strip()}")
    return address


@contextlib.contextmanager
def limited_network(members: int, mbit: float, behind_nat: Collection[int] = ()) -> Iterator[Network]:
    """Create the namespaces, yield them, and always delete them again."""
    prefix = f"p2pb{os.getpid() % 100000}"
    hub = f"{prefix}h"
    created: list[str] = []
    try:
        _ip("netns", "add", hub)
        created.append(hub)
        _ip("-n", hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", hub, "link", "set", "br0", "up")
        names, addresses = [], []
        burst = max(64 * 1024, int(mbit * 1e6 / 8 / 100))  # at least 10 ms of traffic
        for index in range(members):
            name = f"{prefix}m{index}"
            _ip("netns", "add", name)
            created.append(name)
            _ip("-n", name, "link", "set", "lo", "up")
            if index in behind_nat:
                address = _router(prefix, hub, index=index, member=name, created=created)
            else:
                _ip(
                    "link",
                    "add",
                    "eth0",
                    "netns",
                    name,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    f"m{index}",
                    "netns",
                    hub,
                )
                address = f"{SUBNET}.{index + 1}"
                _ip("-n", name, "addr", "add", f"{address}/24", "dev", "eth0")
                _ip("-n", name, "link", "set", "eth0", "up")
                _ip("-n", hub, "link", "set", f"m{index}", "master", "br0")
                _ip("-n", hub, "link", "set", f"m{index}", "up")
            shaped = subprocess.run(
                [
                    "ip",
                    "netns",
                    "exec",
                    name,
                    "tc",
                    "qdisc",
                    "add",
                    "dev",
                    "eth0",
                    "root",
                    "tbf",
                    "rate",
                    f"{mbit}mbit",
                    "burst",
                    str(burst),
                    "latency",
                    "100ms",
                ],
                capture_output=True,
                text=True,
                check=False,
            )
            if shaped.returncode != 0:
                raise NamespacesUnavailable(f"tc: {shaped.stderr.strip()}")
            names.append(name)
            addresses.append(address)
        yield Network(names, addresses)
    except FileNotFoundError as exc:
        raise NamespacesUnavailable(f"{exc.filename} not found (iproute2 missing)") from None
    finally:
        for name in reversed(created):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
