"""Framing of the data plane: a fixed prefix, a small msgpack header, then a raw payload.

    prefix   11 bytes   magic b"P2PT" · version (u8) · header length (u16) · payload length (u32)
    header   ≤ 4 KiB    msgpack map with str keys (kind, step, chunk, …)
    payload  ≤ limit    raw bytes (int8 codes, block parameters, …), never copied into the header;
                        after the handshake, sealed: AES-256-GCM ciphertext + 16-byte tag (seal.py)

Every length is checked against a limit before anything is allocated, and every read has a
deadline, so a peer that sends garbage, lies about sizes or stalls costs bounded memory and time.
Problems raise a subclass of WireError; none escapes as another exception type.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgpack

from p2ptrain.deadline import within
from p2ptrain.untrusted import UndecodableError, unpack_untrusted

MAGIC = b"P2PT"
VERSION = 4
PREFIX = struct.Struct("!4sBHI")
MAX_HEADER_BYTES = 4096
DEFAULT_MAX_PAYLOAD = 256 << 20


class WireError(Exception):
    """Base of every data-plane failure; callers catch this one type."""


class FrameError(WireError):
    """The peer sent bytes that are not a valid frame (the connection must be dropped)."""


class PeerClosed(WireError):
    """The connection ended, possibly in the middle of a frame."""


class ClosedBetweenFrames(PeerClosed):
    """The connection ended cleanly before the next frame's first byte: on a fresh connection, a
    port probe (connect, then close), not a broken handshake."""


class PeerTimeout(WireError):
    """The peer sent nothing (or not enough) before the deadline."""


@dataclass(frozen=True)
class Frame:
    header: dict[str, Any]
    payload: bytes | memoryview = b""

    @property
    def kind(self) -> str:
        return str(self.header.get("kind", ""))


def encode_head(header: Mapping[str, Any], payload_bytes: int) -> bytes:
    """Prefix and header of a frame whose payload takes `payload_bytes` on the wire."""
    head = msgpack.packb(dict(header), use_bin_type=True)
    if len(head) > MAX_HEADER_BYTES:
        raise ValueError(f"frame header of {len(head)} bytes exceeds {MAX_HEADER_BYTES}")
    if payload_bytes >= 1 << 32:
        raise ValueError("payload too large for one frame")
    return PREFIX.pack(MAGIC, VERSION, len(head), payload_bytes) + head


def encode_frame(
    header: Mapping[str, Any], payload: bytes | bytearray | memoryview = b""
) -> list[bytes | memoryview]:
    """The frame as buffers for `writer.writelines`; the payload is passed through without a copy.

    Never an empty buffer: Python 3.12's selector transport keeps an empty one queued after
    sendmsg, so the writer spins on a writable socket and the connection never closes."""
    body = memoryview(payload).cast("B")
    head = encode_head(header, body.nbytes)
    return [head, body] if body.nbytes else [head]


def parse_prefix(data: bytes, max_payload: int) -> tuple[int, int]:
    """(header length, payload length) from the 11-byte prefix, validated against the limits."""
    magic, version, header_len, payload_len = PREFIX.unpack(data)
    if magic != MAGIC:
        raise FrameError(f"bad magic {magic!r}")
    if version != VERSION:
        raise FrameError(f"unsupported frame version {version}")
    if header_len == 0 or header_len > MAX_HEADER_BYTES:
        raise FrameError(f"header length {header_len} outside 1..{MAX_HEADER_BYTES}")
    if payload_len > max_payload:
        raise FrameError(f"payload length {payload_len} exceeds the limit of {max_payload}")
    return header_len, payload_len


def decode_header(data: bytes) -> dict[str, Any]:
    try:
        header = unpack_untrusted(data, MAX_HEADER_BYTES, max_items=256)
    except UndecodableError as exc:
        raise FrameError(f"header is {exc}") from None
    if not isinstance(header, dict) or not all(isinstance(key, str) for key in header):
        raise FrameError("header is not a map with string keys")
    return header


async def _read_exactly(
    reader: asyncio.StreamReader, count: int, *, deadline: float, frame_start: bool = False
) -> bytes:
    remaining = deadline - asyncio.get_running_loop().time()
    if remaining <= 0:
        raise PeerTimeout("deadline passed before the frame arrived")
    try:
        return await within(reader.readexactly(count), remaining)
    except asyncio.IncompleteReadError as exc:
        closed = ClosedBetweenFrames if frame_start and not exc.partial else PeerClosed
        raise closed(f"connection closed after {len(exc.partial)} of {count} bytes") from None
    except asyncio.TimeoutError:
        raise PeerTimeout(f"no complete frame within the deadline ({count} bytes pending)") from None
    except (ConnectionError, OSError) as exc:
        raise PeerClosed(f"connection lost: {exc}") from None


async def read_frame(
    reader: asyncio.StreamReader, timeout: float, max_payload: int = DEFAULT_MAX_PAYLOAD
) -> Frame:
    """Read one whole frame within `timeout` seconds, or raise a WireError."""
    deadline = asyncio.get_running_loop().time() + timeout
    prefix = await _read_exactly(reader, PREFIX.size, deadline=deadline, frame_start=True)
    header_len, payload_len = parse_prefix(prefix, max_payload)
    header = decode_header(await _read_exactly(reader, header_len, deadline=deadline))
    payload = await _read_exactly(reader, payload_len, deadline=deadline) if payload_len else b""
    return Frame(header, payload)


async def write_frame(
    writer: asyncio.StreamWriter,
    header: Mapping[str, Any],
    *,
    payload: bytes | bytearray | memoryview = b"",
    timeout: float = 30.0,
) -> None:
    """Send one frame and wait (bounded) until the transport's buffer drains."""
    writer.writelines(encode_frame(header, payload))
    try:
        await within(writer.drain(), timeout)
    except asyncio.TimeoutError:
        raise PeerTimeout("peer did not take the frame within the deadline") from None
    except (ConnectionError, OSError) as exc:
        raise PeerClosed(f"connection lost: {exc}") from None


def stream_transport(writer: asyncio.StreamWriter) -> asyncio.Transport:
    """The TCP transport under a stream (to pause or resume its reading around the raw-socket phase)."""
    transport = writer.transport
    assert isinstance(transport, asyncio.Transport), "a stream's transport reads and writes"
    return transport


def expect(frame: Frame, kind: str) -> Frame:
    """`frame` if it is of `kind`; a refusal from the peer or any other kind is an error."""
    if frame.kind == kind:
        return frame
    if frame.kind == "refuse":
        raise FrameError(f"peer refused: {frame.header.get('reason', 'no reason given')}")
    raise FrameError(f"expected a {kind!r} frame, got {frame.kind!r}")
