from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from p2ptrain.errors import IdentityError
from p2ptrain.identity import NODE_KEY_FILE, load_or_create_identity, verify
from p2ptrain.swarm.p2p_key import ensure_p2p_identity, peer_id_of
from tests.support.helpers import assert_one_line_error, cli


def test_key_is_created_private_and_reused(tmp_path: Path) -> None:
    first = load_or_create_identity(tmp_path / "id")
    mode = stat.S_IMODE((tmp_path / "id" / NODE_KEY_FILE).stat().st_mode)
    assert mode == 0o600
    second = load_or_create_identity(tmp_path / "id")
    assert first.public_key == second.public_key and len(first.public_key) == 32


def test_signatures_verify_and_detect_tampering(tmp_path: Path) -> None:
    identity = load_or_create_identity(tmp_path)
    signature = identity.sign(b"message")
    assert verify(identity.public_key, signature, b"message")
    assert not verify(identity.public_key, signature, b"messagf")
    assert not verify(identity.public_key, signature[:-1] + bytes([signature[-1] ^ 1]), b"message")
    assert not verify(b"short", signature, b"message")


def test_world_readable_key_is_refused(tmp_path: Path) -> None:
    load_or_create_identity(tmp_path)
    os.chmod(tmp_path / NODE_KEY_FILE, 0o644)
    with pytest.raises(IdentityError, match="chmod 600"):
        load_or_create_identity(tmp_path)


def test_corrupted_key_is_refused(tmp_path: Path) -> None:
    path = tmp_path / NODE_KEY_FILE
    path.write_bytes(b"not a key")
    path.chmod(0o600)
    with pytest.raises(IdentityError, match="not a PEM private key"):
        load_or_create_identity(tmp_path)


def test_key_path_that_is_a_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / NODE_KEY_FILE).mkdir(mode=0o700)
    with pytest.raises(IdentityError, match="not a regular file"):
        load_or_create_identity(tmp_path)


def test_p2p_identity_persists(tmp_path: Path) -> None:
    path = ensure_p2p_identity(tmp_path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert peer_id_of(path) == peer_id_of(ensure_p2p_identity(tmp_path))


@pytest.mark.procs
def test_identity_command_prints_stable_ids(tmp_path: Path) -> None:
    first = cli("identity", "--identity", str(tmp_path))
    second = cli("identity", "--identity", str(tmp_path))
    assert first.returncode == 0, first.stderr
    assert first.stdout == second.stdout and "node key" in first.stdout


@pytest.mark.procs
def test_identity_command_without_a_flag_prints_the_key_join_would_use(tmp_path: Path) -> None:
    """No --identity: the node's own folder (node.work_dir, ~/.local/share/p2ptrain/node), or the
    one --work-dir, --config or --set choose, as for join."""
    home = {"HOME": str(tmp_path)}
    default = tmp_path / ".local" / "share" / "p2ptrain" / "node"
    chosen = {
        default: [],
        tmp_path / "w": ["--work-dir", str(tmp_path / "w")],
        tmp_path / "s": ["--set", f"node.work_dir={tmp_path / 's'}"],
        tmp_path / "k": ["--config", "debug", "--set", f"node.identity={tmp_path / 'k'}"],
    }
    for folder, flags in chosen.items():
        shown = cli("identity", *flags, env=home)
        assert shown.returncode == 0, shown.stderr
        node_id = load_or_create_identity(folder).node_id  # the key the command created there
        assert f"node key   {node_id}  ({folder / NODE_KEY_FILE})" in shown.stdout, shown.stdout


@pytest.mark.procs
def test_identity_command_reports_bad_permissions(tmp_path: Path) -> None:
    load_or_create_identity(tmp_path)
    os.chmod(tmp_path / NODE_KEY_FILE, 0o640)
    assert_one_line_error(cli("identity", "--identity", str(tmp_path)), "permissions 0640")
