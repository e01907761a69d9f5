"""Bad input on the command line: one line, non-zero exit, no traceback, nothing left behind."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from p2ptrain.identity import NODE_KEY_FILE, load_or_create_identity
from p2ptrain.procs import free_port
from p2ptrain.swarm.p2p_key import ensure_p2p_identity, peer_id_of
from tests.support.helpers import assert_one_line_error, cli, socket_files, stale_sockets

pytestmark = pytest.mark.procs
"""Every test here starts processes."""

PEER_ID = "QmTaMjzayTqNDpDJQSfyoqzzgJuHkbGj1oNzxzXC34MxPA"


@pytest.fixture
def no_leftovers() -> Iterator[None]:
    before = socket_files()
    yield
    assert stale_sockets(before) == set(), "stale p2pd sockets left in /tmp"


@pytest.mark.parametrize(
    "peer",
    [
        "/ip4/1.2.3/tcp/1/p2p/" + PEER_ID,
        "banana",
        "/ip4/127.0.0.1/tcp/4001",
        "/ip4/127.0.0.1/tcp/4001/p2p/xyz",
    ],
)
def test_malformed_peer_address(tmp_path: Path, peer: str) -> None:
    result = cli("join", "--peer", peer, "--work-dir", str(tmp_path))
    assert_one_line_error(result, peer)


def test_malformed_peer_in_environment(tmp_path: Path) -> None:
    result = cli("join", "--work-dir", str(tmp_path), env={"PEER": "/ip4/nothing"})
    assert_one_line_error(result, "/ip4/nothing")


@pytest.mark.procs
def test_unreachable_bootstrap_peer_gives_up_after_bounded_retries(
    tmp_path: Path, no_leftovers: None
) -> None:
    # a real peer ID at a port where nobody listens
    key = ensure_p2p_identity(tmp_path / "ghost")
    address = f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{peer_id_of(key)}"
    started = time.monotonic()
    result = cli(
        "join",
        "--peer",
        address,
        "--work-dir",
        str(tmp_path / "node"),
        "--listen",
        "/ip4/127.0.0.1/tcp/0",
        "--set",
        "swarm.connect_retries=3",
        "--set",
        "swarm.connect_backoff=0.2",
    )
    assert_one_line_error(result, address, "after 3 attempts")
    assert result.returncode == 3
    assert result.stderr.count("retrying") == 2
    assert time.monotonic() - started < 60


def test_port_in_use(tmp_path: Path, no_leftovers: None) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = cli("bootstrap", "--listen", f"/ip4/127.0.0.1/tcp/{port}", "--identity", str(tmp_path))
    assert_one_line_error(result, "in use", str(port))


def test_key_readable_by_others(tmp_path: Path) -> None:
    load_or_create_identity(tmp_path)
    os.chmod(tmp_path / NODE_KEY_FILE, 0o644)
    result = cli("join", "--work-dir", str(tmp_path))
    assert_one_line_error(result, str(tmp_path / NODE_KEY_FILE), "chmod 600")


@pytest.mark.procs
def test_unreadable_key_file(tmp_path: Path) -> None:
    (tmp_path / NODE_KEY_FILE).write_text("garbage")
    os.chmod(tmp_path / NODE_KEY_FILE, 0o600)
    assert_one_line_error(cli("join", "--work-dir", str(tmp_path)), "not a PEM private key")


def test_bad_listen_address(tmp_path: Path) -> None:
    assert_one_line_error(
        cli("bootstrap", "--listen", "/ip4/300.0.0.1/tcp/1", "--identity", str(tmp_path)), "300.0.0.1"
    )


def test_config_error_in_join(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[swarm]\nheartbeat_interval = 'often'\n")
    assert_one_line_error(
        cli("join", "--config", str(bad), "--work-dir", str(tmp_path)), str(bad), "swarm.heartbeat_interval"
    )


def test_status_needs_a_peer() -> None:
    assert_one_line_error(cli("status", "--json"), "--peer")


def test_unknown_command_exits_non_zero() -> None:
    result = cli("frobnicate")
    assert result.returncode == 2 and "Traceback" not in result.stderr
