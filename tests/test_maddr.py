from __future__ import annotations

import pytest

from p2ptrain.errors import UserError
from p2ptrain.swarm.maddr import parse_peer, parse_peers

PEER_ID = "QmTaMjzayTqNDpDJQSfyoqzzgJuHkbGj1oNzxzXC34MxPA"
GOOD = f"/ip4/203.0.113.7/tcp/31337/p2p/{PEER_ID}"


def test_good_addresses_pass() -> None:
    assert parse_peer(GOOD) == GOOD
    assert parse_peer(f"/dns4/boot.example.org/tcp/31337/p2p/{PEER_ID}").startswith("/dns4/")
    assert parse_peers([f"{GOOD}, {GOOD}", f"/ip6/::1/tcp/1/p2p/{PEER_ID}"]) == [
        GOOD,
        f"/ip6/::1/tcp/1/p2p/{PEER_ID}",
    ]


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("hello", "malformed"),
        ("/ip4/1.2.3/tcp/1/p2p/" + PEER_ID, "malformed"),
        ("/ip4/1.2.3.4/tcp/99999/p2p/" + PEER_ID, "malformed"),
        ("/ip4/1.2.3.4/tcp/5/p2p/notapeerid", "malformed"),
        ("/ip4/1.2.3.4/tcp/5", "must end with /p2p/"),
        ("/ip4/1.2.3.4/udp/5/p2p/" + PEER_ID, "no /tcp/PORT"),
        ("/p2p/" + PEER_ID, "must start with"),
        ("   ", "empty"),
    ],
)
def test_bad_addresses_are_named(text: str, reason: str) -> None:
    with pytest.raises(UserError, match=reason):
        parse_peer(text)
