"""Parsing of bootstrap multiaddresses given with --peer, the PEER variable or the config."""

from __future__ import annotations

from collections.abc import Iterable

import multiaddr
from multiaddr.exceptions import Error as MultiaddrError

from p2ptrain.errors import UserError

_TRANSPORTS = {"ip4", "ip6", "dns", "dns4", "dns6"}


def parse_peer(text: str) -> str:
    """Validate one bootstrap multiaddress and return it normalised.

    A usable peer address names a host, a TCP port and the peer's ID:
    /ip4/203.0.113.7/tcp/31337/p2p/QmPeer...  (or /dns4/host/..., /ip6/...).
    """
    text = text.strip()
    if not text:
        raise UserError("empty peer address")
    try:
        parsed = multiaddr.Multiaddr(text)
    except (MultiaddrError, ValueError, TypeError) as exc:
        raise UserError(f"malformed peer multiaddress '{text}': {_reason(exc)}") from None
    names = [proto.name for proto in parsed.protocols()]
    if not names or names[0] not in _TRANSPORTS:
        raise UserError(f"peer multiaddress '{text}' must start with /ip4, /ip6 or /dns4 and a host")
    if "tcp" not in names:
        raise UserError(f"peer multiaddress '{text}' has no /tcp/PORT part")
    if names[-1] != "p2p":
        raise UserError(
            f"peer multiaddress '{text}' must end with /p2p/<peer id> "
            "(copy the line printed by the bootstrap peer)"
        )
    return str(parsed)


def parse_peers(values: Iterable[str]) -> list[str]:
    """Every comma- or space-separated address from `values`, validated, without duplicates."""
    peers: list[str] = []
    for value in values:
        for item in value.replace(",", " ").split():
            peer = parse_peer(item)
            if peer not in peers:
                peers.append(peer)
    return peers


def _reason(exc: Exception) -> str:
    message = str(exc)
    # multiaddr repeats the whole input after the reason: keep the reason only
    message = message.split(" (string:", 1)[0]
    return message.removeprefix("Invalid MultiAddr ").split(": ", 1)[-1] or type(exc).__name__
