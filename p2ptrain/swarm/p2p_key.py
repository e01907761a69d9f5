"""The DHT's libp2p key (p2p.key), kept beside node.key in the node's private folder.

With it a node, and above all a bootstrap peer, keeps the same peer ID, and therefore the same
multiaddress, when it restarts. It lives in swarm/ because only the DHT's processes need it: this
package installs hivemind's bare packages first, so loading the key costs no torch import.
"""

from __future__ import annotations

import os
from pathlib import Path

from p2ptrain.errors import IdentityError
from p2ptrain.identity import check_private_file, write_private_file

P2P_KEY_FILE = "p2p.key"


def ensure_p2p_identity(directory: str | os.PathLike[str]) -> Path:
    """Path of the libp2p key file in `directory`, created (0600) on first use.

    hivemind's own generator writes the file with the default umask before narrowing it;
    we create it private from the start, in the same format (an RSA key in libp2p's protobuf).
    """
    from hivemind.proto import crypto_pb2
    from hivemind.utils.crypto import RSAPrivateKey

    path = Path(directory).expanduser() / P2P_KEY_FILE
    if not path.exists():
        blob = crypto_pb2.PrivateKey(
            key_type=crypto_pb2.KeyType.RSA, data=RSAPrivateKey().to_bytes()
        ).SerializeToString()
        write_private_file(path, blob)
    check_private_file(path)
    peer_id_of(path)  # refuse a corrupted file here, with a clear message, not deep inside p2pd
    return path


def peer_id_of(p2p_key_path: Path) -> str:
    """The libp2p peer ID (base58) that a p2p.key file gives the DHT."""
    from hivemind.p2p import PeerID

    try:
        return PeerID.from_identity(p2p_key_path.read_bytes()).to_base58()
    except PermissionError:
        raise IdentityError(f"{p2p_key_path}: key file is not readable (permission denied)") from None
    except Exception:
        raise IdentityError(f"{p2p_key_path}: not a libp2p private key (corrupted key file?)") from None
