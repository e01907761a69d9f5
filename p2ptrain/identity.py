"""Node identity: one Ed25519 key per machine, kept in a 0600 file and reused across restarts.

The public key is the node's name in every signed DHT record and every data-plane handshake.
The DHT's libp2p key (p2p.key) lives beside it, in the same private folder: see
p2ptrain/swarm/p2p_key.py (ranks import this module, so it imports nothing of hivemind).
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from p2ptrain.errors import IdentityError

NODE_KEY_FILE = "node.key"
PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64


@dataclass(frozen=True)
class NodeIdentity:
    """The node's Ed25519 key pair; `public_key` (32 raw bytes) is what other nodes know it by."""

    private_key: Ed25519PrivateKey
    path: Path

    @property
    def public_key(self) -> bytes:
        return self.private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )

    @property
    def node_id(self) -> str:
        return self.public_key.hex()

    @property
    def short_id(self) -> str:
        return short_id(self.public_key)

    def sign(self, message: bytes) -> bytes:
        return self.private_key.sign(message)


def short_id(public_key: bytes) -> str:
    """The first 12 hex digits: enough to tell nodes apart in a table."""
    return public_key.hex()[:12]


def verify(public_key: bytes, signature: bytes, message: bytes) -> bool:
    """True when `signature` is `public_key`'s Ed25519 signature of `message`; never raises."""
    if len(public_key) != PUBLIC_KEY_BYTES or len(signature) != SIGNATURE_BYTES:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, message)
    except (InvalidSignature, ValueError):
        return False
    return True


def check_private_file(path: Path) -> None:
    """Refuse key files that other users can read or write, as ssh does."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise IdentityError(f"{path}: no such key file") from None
    except PermissionError:
        raise IdentityError(f"{path}: key file is not accessible (permission denied)") from None
    if not stat.S_ISREG(mode):
        raise IdentityError(f"{path}: key file is not a regular file")
    if mode & 0o077:
        raise IdentityError(
            f"{path}: key file has permissions {stat.S_IMODE(mode):04o}, others may read it; "
            f"run 'chmod 600 {path}'"
        )


def write_private_file(path: Path, data: bytes) -> bool:
    """Create `path` with mode 0600 holding `data`; False if another process created it first."""
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    except OSError as exc:
        raise IdentityError(f"{path}: cannot create key file ({exc.strerror})") from None
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    return True


def load_or_create_identity(directory: str | os.PathLike[str]) -> NodeIdentity:
    """Load `directory`/node.key, creating a fresh Ed25519 key there on first use."""
    path = Path(directory).expanduser() / NODE_KEY_FILE
    if not path.exists():
        create_key_file(path)
    return load_key_file(path)


def create_key_file(path: Path) -> bool:
    """Write a fresh Ed25519 key (PEM, mode 0600) to `path`; False if the file exists already."""
    pem = Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return write_private_file(path, pem)


def load_key_file(path: Path) -> NodeIdentity:
    """The Ed25519 key in `path` (a node.key, or a run authority's key), refused if others may read it."""
    check_private_file(path)
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except PermissionError:
        raise IdentityError(f"{path}: key file is not readable (permission denied)") from None
    except (ValueError, TypeError):
        raise IdentityError(f"{path}: not a PEM private key (corrupted key file?)") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise IdentityError(f"{path}: holds a {type(key).__name__}, expected an Ed25519 key")
    return NodeIdentity(private_key=key, path=path)
