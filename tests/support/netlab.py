"""Network namespaces for NAT tests: a public network and home networks behind masquerading routers.

    public (10.77.0.1 ... on veth)  ⇄  router A (10.77.0.2 | 192.168.1.1)  ⇄  home A (192.168.1.2)
                                    ⇄  router B (10.77.0.3 | 192.168.2.1)  ⇄  home B (192.168.2.2)

Every router masquerades what leaves its home network and drops whatever would enter it unasked
(nftables forward policy drop; established and related traffic only), as a home router does without
port forwarding. The public side has no route into any home network. Every namespace and link is
created by the test that uses the lab and deleted by it; names carry a per-lab tag.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass, field

PUBLIC_NET = "10.77.0"
NAMESPACE_PREFIX = "p2pt"
"""Every namespace of a lab is named this, its tag, then its role."""


def missing() -> str | None:
    """Why this machine cannot run the lab (None when it can): not root, no ip or nft, or a
    kernel or container that refuses network namespaces or nftables in them."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "nft"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (make test installs nftables where it can)"
    probe = f"p2ptprobe{os.getpid()}"
    try:
        run_checked("ip", "netns", "add", probe)
        run_checked("ip", "netns", "exec", probe, "nft", "list", "tables")
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        return f"network namespaces with nftables are not permitted here: {exc}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    return None


def run_checked(*argv: str) -> None:
    """Run a set-up command; RuntimeError with its stderr when it fails."""
    result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {result.stderr.strip()}")


ROUTER_RULES = """
table ip nat {{
    chain postrouting {{ type nat hook postrouting priority 100; oifname "{wan}" masquerade; }}
}}
table inet filter {{
    chain forward {{
        type filter hook forward priority 0; policy drop;
        ct state established,related accept
        iifname "{lan}" oifname "{wan}" accept
    }}
}}
"""


@dataclass
class NetLab:
    tag: str = field(default_factory=lambda: secrets.token_hex(3))
    namespaces: list[str] = field(default_factory=list)
    homes: list[str] = field(default_factory=list)

    @property
    def public(self) -> str:
        return f"{NAMESPACE_PREFIX}{self.tag}pub"

    @property
    def public_ip(self) -> str:
        return f"{PUBLIC_NET}.1"

    def start(self, homes: int) -> NetLab:
        """The public namespace (with a bridge, so several routers can hang off it) and `homes`
        home namespaces, each behind its own NAT router."""
        try:
            self._namespace(self.public)
            bridge = f"br{self.tag}"
            self._in(self.public, "ip", "link", "add", bridge, "type", "bridge")
            self._in(self.public, "ip", "addr", "add", f"{self.public_ip}/24", "dev", bridge)
            self._in(self.public, "ip", "link", "set", bridge, "up")
            for index in range(homes):
                self._home(index, bridge)
        except BaseException:
            self.stop()
            raise
        return self

    def _namespace(self, name: str) -> None:
        run_checked("ip", "netns", "add", name)
        self.namespaces.append(name)
        self._in(name, "ip", "link", "set", "lo", "up")

    def _in(self, namespace: str, *argv: str) -> None:
        run_checked("ip", "netns", "exec", namespace, *argv)

    def _veth(self, a: str, a_ns: str, *, b: str, b_ns: str) -> None:
        run_checked("ip", "link", "add", a, "type", "veth", "peer", "name", b)
        run_checked("ip", "link", "set", a, "netns", a_ns)
        run_checked("ip", "link", "set", b, "netns", b_ns)
        self._in(a_ns, "ip", "link", "set", a, "up")
        self._in(b_ns, "ip", "link", "set", b, "up")

    def _home(self, index: int, bridge: str) -> None:
        router, home = f"{NAMESPACE_PREFIX}{self.tag}r{index}", f"{NAMESPACE_PREFIX}{self.tag}h{index}"
        self._namespace(router)
        self._namespace(home)
        wan, uplink = f"w{self.tag}{index}", f"u{self.tag}{index}"
        self._veth(uplink, self.public, b=wan, b_ns=router)
        self._in(self.public, "ip", "link", "set", uplink, "master", bridge)
        self._in(router, "ip", "addr", "add", f"{PUBLIC_NET}.{index + 2}/24", "dev", wan)
        lan, inside = f"l{self.tag}{index}", f"i{self.tag}{index}"
        self._veth(lan, router, b=inside, b_ns=home)
        self._in(router, "ip", "addr", "add", f"192.168.{index + 1}.1/24", "dev", lan)
        self._in(home, "ip", "addr", "add", f"192.168.{index + 1}.2/24", "dev", inside)
        self._in(home, "ip", "route", "add", "default", "via", f"192.168.{index + 1}.1")
        self._in(router, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
        rules = ROUTER_RULES.format(wan=wan, lan=lan)
        result = subprocess.run(
            ["ip", "netns", "exec", router, "nft", "-f", "-"], input=rules, capture_output=True, text=True
        )
        if result.returncode != 0:
            raise RuntimeError(f"nft in {router}: {result.stderr.strip()}")
        self.homes.append(home)

    def run_in(self, namespace: str) -> tuple[str, ...]:
        """The prefix that runs a command inside `namespace` (ip netns exec execs it: same PID)."""
        return ("ip", "netns", "exec", namespace)

    def stop(self) -> None:
        """Delete every namespace (their links go with them)."""
        for name in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        self.namespaces.clear()
        self.homes.clear()


def leftover_namespaces(tag: str, *, prefix: str = NAMESPACE_PREFIX) -> list[str]:
    """The namespaces of the lab tagged `tag` (names `prefix` + tag + …) that still exist."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    return [line.split()[0] for line in listed.splitlines() if line.startswith(f"{prefix}{tag}")]
