"""Sealed frames: every data-plane frame after the handshake is encrypted and authenticated.

The handshake (handshake.py) exchanges ephemeral X25519 keys inside its signed transcript, so both
ends derive the same secret and know it is shared with the member they authenticated. From it,
HKDF-SHA256 derives one AES-256-GCM key per direction; the salt is a hash of the whole transcript
(step, attempt, lane, membership digest, both node keys, both nonces, both ephemeral keys), so
every connection of every lane, attempt and step has keys of its own.

Each frame's payload is encrypted with the direction's key; the nonce is the frame's number on
that connection (never sent: both ends count), and the 11-byte prefix plus the msgpack header are
the associated data. The 16-byte tag follows the payload (the prefix's payload length includes
it). So a flipped bit anywhere, a dropped, replayed or reordered frame, a frame reflected back to
its sender, or one carried over from another lane, attempt or step fails the tag: the connection
is dropped and the attempt fails for every member. Nothing changed on the path is ever averaged.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from p2ptrain.comm.transport.wire import FrameError

TAG_BYTES = 16
EPHEMERAL_BYTES = 32
_INFO = b"p2ptrain/data-plane/v1"


class Ephemeral:
    """This end's X25519 key for one handshake; used once."""

    def __init__(self) -> None:
        self._private = X25519PrivateKey.generate()
        self.public = self._private.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )

    def shared(self, peer_public: bytes) -> bytes:
        """The X25519 secret with the peer's ephemeral key; FrameError if that key is degenerate."""
        try:
            return self._private.exchange(X25519PublicKey.from_public_bytes(peer_public))
        except ValueError:  # a low-order point gives the all-zero secret, which cryptography refuses
            raise FrameError("the peer's ephemeral key is not usable") from None


@dataclass(frozen=True)
class SessionKeys:
    """The two AES-256-GCM keys of one connection, as seen from one end, and the secret a kept
    connection's next step derives its own keys from (transport/resume.py)."""

    sending: bytes
    receiving: bytes
    resume: bytes = b""


def derive_keys(secret: bytes, transcript: bytes, dialer: bool) -> SessionKeys:
    """Both directions' keys, and the resumption secret, from `secret` (the X25519 secret of a
    handshake, or a kept connection's resumption secret), bound to `transcript`."""
    material = HKDF(
        algorithm=hashes.SHA256(), length=96, salt=hashlib.sha256(transcript).digest(), info=_INFO
    ).derive(secret)
    to_listener, to_dialer, resume = material[:32], material[32:64], material[64:]
    if dialer:
        return SessionKeys(to_listener, to_dialer, resume)
    return SessionKeys(to_dialer, to_listener, resume)


class FrameSeal:
    """One direction of one connection: its key and its frame counter (the nonce)."""

    def __init__(self, key: bytes):
        self._aead = AESGCM(key)
        self._counter = 0

    def _nonce(self) -> bytes:
        nonce = self._counter.to_bytes(12, "big")
        self._counter += 1
        return nonce

    def seal_into(self, associated: bytes, payload: memoryview, out: memoryview) -> None:
        """Encrypt `payload` into `out` (exactly len(payload) + TAG_BYTES long)."""
        self._aead.encrypt_into(self._nonce(), payload, associated, out)

    def open_into(self, associated: bytes, sealed: memoryview, out: memoryview) -> None:
        """Decrypt and check `sealed` into `out` (exactly TAG_BYTES shorter); FrameError if the frame
        was changed, dropped, replayed, reordered or comes from another connection."""
        try:
            self._aead.decrypt_into(self._nonce(), sealed, associated, out)
        except InvalidTag:
            raise FrameError("a frame failed authentication (changed on the path, or out of order)") from None
