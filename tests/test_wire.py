"""Data-plane framing and the authenticated handshake, over real TCP on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict, TypeVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2ptrain.comm.net.attempt import close_connection
from p2ptrain.comm.net.members import Member
from p2ptrain.comm.net.server import DataPlaneServer
from p2ptrain.comm.reduce.connect import dial_member
from p2ptrain.comm.transport.handshake import (
    AttemptBehind,
    HandshakeError,
    Session,
    ViewsDiffer,
    accept,
    dial,
)
from p2ptrain.comm.transport.wire import (
    MAGIC,
    PREFIX,
    VERSION,
    ClosedBetweenFrames,
    Frame,
    FrameError,
    PeerClosed,
    PeerTimeout,
    WireError,
    encode_frame,
    read_frame,
    write_frame,
)
from p2ptrain.config import CommConfig
from p2ptrain.identity import NodeIdentity, load_or_create_identity

T = TypeVar("T")
S = TypeVar("S")
C = TypeVar("C")
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[T]]


async def with_server(handler: Handler[S], client: Handler[C]) -> tuple[S | Exception, C | Exception]:
    """Run `handler` for one connection on 127.0.0.1 and `client` against it; return both results
    (or what each raised)."""
    result: asyncio.Future[S | Exception] = asyncio.get_running_loop().create_future()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            result.set_result(await handler(reader, writer))
        except Exception as exc:
            result.set_result(exc)
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        client_result: C | Exception
        try:
            client_result = await client(reader, writer)
        except Exception as exc:
            client_result = exc
        finally:
            writer.close()
        return await asyncio.wait_for(result, 10), client_result
    finally:
        server.close()
        await server.wait_closed()


def raw_reader(data: bytes, eof: bool = True) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    if eof:
        reader.feed_eof()
    return reader


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def test_frame_round_trip_over_tcp() -> None:
    payload = bytes(range(256)) * 4096

    async def server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Frame:
        return await read_frame(reader, timeout=5)

    async def client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await write_frame(writer, {"kind": "chunk", "step": 3, "index": 7}, payload=memoryview(payload))

    frame, _ = run(with_server(server, client))
    assert isinstance(frame, Frame), frame
    assert frame.header == {"kind": "chunk", "step": 3, "index": 7} and frame.payload == payload


def test_a_frame_without_payload_is_sent_and_its_connection_closes() -> None:
    """No empty buffer reaches writelines: Python 3.12's transport would keep it queued and spin on
    it, and the connection would never close (a node that finished hung at 100 % CPU)."""
    assert all(len(part) for part in encode_frame({"kind": "bye"}))

    async def server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> tuple[Frame, bytes]:
        frame = await read_frame(reader, timeout=5)
        return frame, await asyncio.wait_for(reader.read(), 5)

    async def client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await write_frame(writer, {"kind": "bye"})
        writer.close()
        await asyncio.wait_for(writer.wait_closed(), 5)

    served, _ = run(with_server(server, client))
    assert not isinstance(served, Exception), served
    frame, rest = served
    assert frame.header == {"kind": "bye"} and frame.payload == b"" and rest == b""


def frame_bytes(header: dict, payload: bytes = b"") -> bytes:
    return b"".join(bytes(part) for part in encode_frame(header, payload))


@pytest.mark.parametrize(
    ("data", "error", "reason"),
    [
        (b"XXXX" + frame_bytes({"kind": "x"})[4:], FrameError, "bad magic"),
        (PREFIX.pack(MAGIC, 9, 1, 0) + b"\x80", FrameError, "version"),
        (PREFIX.pack(MAGIC, VERSION, 0, 0), FrameError, "header length"),
        (PREFIX.pack(MAGIC, VERSION, 60000, 0), FrameError, "header length"),
        (PREFIX.pack(MAGIC, VERSION, 1, 1 << 31), FrameError, "exceeds the limit"),
        (PREFIX.pack(MAGIC, VERSION, 3, 0) + b"\xc1\xc1\xc1", FrameError, "not msgpack"),
        (PREFIX.pack(MAGIC, VERSION, 2, 0) + b"\x91\x01", FrameError, "not a map"),
        (frame_bytes({"kind": "x"}, b"12345678")[:-3], PeerClosed, "closed after"),
        (frame_bytes({"kind": "x"})[:5], PeerClosed, "closed after"),
    ],
)
def test_bad_frames_raise_typed_errors(data: bytes, error: type[WireError], reason: str) -> None:
    async def go() -> Frame:
        return await read_frame(raw_reader(data), timeout=2, max_payload=1 << 20)

    with pytest.raises(error, match=reason):
        run(go())


def test_a_connection_closed_before_any_byte_is_told_from_a_broken_frame() -> None:
    """Port probes (connect, close) are not broken handshakes: the server logs them quietly."""

    async def go(data: bytes) -> WireError:
        with pytest.raises(PeerClosed) as closed:
            await read_frame(raw_reader(data), timeout=2)
        return closed.value

    assert isinstance(run(go(b"")), ClosedBetweenFrames)
    for broken in (frame_bytes({"kind": "x"})[:5], frame_bytes({"kind": "x"})[: PREFIX.size]):
        assert not isinstance(run(go(broken)), ClosedBetweenFrames)


def test_a_stalled_peer_times_out() -> None:
    async def go() -> float:
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(PeerTimeout):
            await read_frame(raw_reader(frame_bytes({"kind": "x"}, b"abc")[:-1], eof=False), timeout=0.3)
        return loop.time() - started

    assert run(go()) < 1.0


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=2048))
def test_parser_fuzz_only_raises_wire_errors(data: bytes) -> None:
    async def go() -> None:
        try:
            frame = await read_frame(raw_reader(data), timeout=1, max_payload=4096)
        except WireError:
            return
        assert len(frame.payload) <= 4096

    run(go())


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 255), st.integers(0, 65535), st.integers(0, 2**32 - 1), st.binary(max_size=64))
def test_parser_fuzz_on_valid_magic(version: int, header_len: int, payload_len: int, rest: bytes) -> None:
    async def go() -> None:
        with contextlib.suppress(WireError):
            await read_frame(
                raw_reader(struct.pack("!4sBHI", MAGIC, version, header_len, payload_len) + rest),
                timeout=1,
                max_payload=1 << 16,
            )

    run(go())


# ---- handshake --------------------------------------------------------------------------------


@dataclass
class Nodes:
    a: NodeIdentity
    b: NodeIdentity
    c: NodeIdentity


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Nodes:
    root: Path = tmp_path_factory.mktemp("keys")
    return Nodes(*(load_or_create_identity(root / name) for name in "abc"))


DIGEST = b"d" * 32


def handshake(
    listener: NodeIdentity,
    dialer: NodeIdentity,
    members: set[bytes],
    *,
    expected: bytes | None = None,
    step: int = 5,
    digest: bytes = DIGEST,
    dial_step: int = 5,
    dial_digest: bytes = DIGEST,
    lane: int = 0,
) -> tuple[Session | Exception, Session | Exception]:
    """(what the listener's accept, what the dialer's dial gave or raised)"""

    async def server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Session:
        return await accept(
            reader, writer, identity=listener, members=members, step=step, digest=digest, timeout=5
        )

    async def client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Session:
        return await dial(
            reader,
            writer,
            identity=dialer,
            expected_peer=expected or listener.public_key,
            step=dial_step,
            digest=dial_digest,
            timeout=5,
            lane=lane,
        )

    return run(with_server(server, client))


def test_handshake_between_members(nodes: Nodes) -> None:
    accepted, dialed = handshake(nodes.a, nodes.b, {nodes.a.public_key, nodes.b.public_key})
    assert isinstance(accepted, Session) and isinstance(dialed, Session), (accepted, dialed)
    assert accepted.keys is not None and dialed.keys is not None
    assert accepted.peer_key == nodes.b.public_key and dialed.peer_key == nodes.a.public_key
    assert accepted.step == dialed.step == 5
    # one key per direction, the same at both ends, fresh for every handshake
    assert dialed.keys.sending == accepted.keys.receiving != dialed.keys.receiving == accepted.keys.sending
    again, _ = handshake(nodes.a, nodes.b, {nodes.a.public_key, nodes.b.public_key})
    assert isinstance(again, Session) and again.keys is not None, again
    assert again.keys.sending != accepted.keys.sending


def test_a_sealed_frame_opens_only_once_in_order_on_its_own_direction() -> None:
    """What a tampering proxy could do to sealed frames: flip a bit (payload, header or prefix),
    drop, replay, reorder, reflect. Each is refused by the tag."""
    from p2ptrain.comm.transport.seal import TAG_BYTES, FrameSeal

    key, other = b"k" * 32, b"o" * 32

    def sealed(seal: FrameSeal, header: bytes, payload: bytes) -> bytearray:
        out = bytearray(len(payload) + TAG_BYTES)
        seal.seal_into(header, memoryview(payload), memoryview(out))
        return out

    def opens(seal: FrameSeal, header: bytes, frame: bytes | bytearray) -> bool:
        try:
            seal.open_into(header, memoryview(frame), memoryview(bytearray(len(frame) - TAG_BYTES)))
        except FrameError:
            return False
        return True

    sender = FrameSeal(key)
    frames = [sealed(sender, b"head%d" % i, b"payload %d" % i) for i in range(3)]
    assert opens(FrameSeal(key), b"head0", frames[0])
    flipped = bytearray(frames[0])
    flipped[3] ^= 1
    assert not opens(FrameSeal(key), b"head0", flipped)
    assert not opens(FrameSeal(key), b"heaD0", frames[0])  # the header is authenticated
    assert not opens(FrameSeal(key), b"head1", frames[1])  # frame 0 dropped: a gap
    receiver = FrameSeal(key)
    assert opens(receiver, b"head0", frames[0])
    assert not opens(receiver, b"head0", frames[0])  # replayed
    receiver = FrameSeal(key)
    assert not opens(receiver, b"head1", frames[1])  # reordered
    assert not opens(FrameSeal(other), b"head0", frames[0])  # reflected: the other direction's key


class DialerOptions(TypedDict, total=False):
    """What a refused dialer does differently from the listener (`handshake`'s keywords)."""

    dial_step: int
    dial_digest: bytes
    lane: int


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("non-member", "is not a member"),
        ("step", "step 6"),
        ("digest", "membership digest differs"),
        ("non-member of another election", "membership digest differs"),
        ("lane", "differ in comm.connections"),
    ],
)
def test_handshake_refusals_are_logged_on_both_sides(
    nodes: Nodes, caplog: pytest.LogCaptureFixture, case: str, reason: str
) -> None:
    """Only a refusal for another digest says the views differ (the dialer elects again without
    counting a failed attempt), also where the dialer is not among the listener's members."""
    members = {nodes.a.public_key, nodes.b.public_key}
    options: dict[str, DialerOptions] = {
        "step": {"dial_step": 6},
        "digest": {"dial_digest": b"x" * 32},
        "non-member of another election": {"dial_digest": b"x" * 32},
        "lane": {"lane": 1},  # the listener expects one connection per peer
    }
    kwargs = options.get(case, {})
    dialer = nodes.c if case.startswith("non-member") else nodes.b
    with caplog.at_level(logging.WARNING, logger="p2ptrain.comm.transport.handshake"):
        accepted, dialed = handshake(nodes.a, dialer, members, **kwargs)
    assert isinstance(accepted, HandshakeError) and reason in str(accepted)
    assert isinstance(dialed, HandshakeError) and reason in str(dialed)
    assert isinstance(dialed, ViewsDiffer) == (reason == "membership digest differs")
    assert any(reason in record.getMessage() for record in caplog.records)


def test_impostor_claiming_a_members_key_is_refused(nodes: Nodes) -> None:
    """c says it is b but cannot sign as b."""
    impostor = NodeIdentity(private_key=nodes.c.private_key, path=nodes.c.path)

    class Claims(NodeIdentity):
        @property
        def public_key(self) -> bytes:  # claims b's key, signs with c's private key
            return nodes.b.public_key

    liar = Claims(private_key=impostor.private_key, path=impostor.path)
    accepted, dialed = handshake(nodes.a, liar, {nodes.a.public_key, nodes.b.public_key})
    assert isinstance(accepted, HandshakeError) and "failed to prove" in str(accepted)
    assert isinstance(dialed, WireError)


def test_dialer_detects_the_wrong_listener(nodes: Nodes) -> None:
    accepted, dialed = handshake(
        nodes.c, nodes.b, {nodes.b.public_key, nodes.c.public_key}, expected=nodes.a.public_key
    )
    assert isinstance(dialed, HandshakeError) and "instead of" in str(dialed)
    assert isinstance(accepted, WireError)  # the dialer hung up without its proof


def test_attempts_of_one_step_never_mix(nodes: Nodes) -> None:
    """A dialer behind the listener's attempt learns the listener's number; one ahead abandons the
    listener's attempt and gets into its next one (same step, same members, same digest)."""

    async def main() -> None:
        server = DataPlaneServer(identity=nodes.a, comm=CommConfig(failure_timeout=5.0), setup_timeout=10.0)
        host, port = await server.start()
        member = Member(key=nodes.a.public_key, host=host, port=port)
        try:
            server.expect(5, [nodes.b.public_key], digest=DIGEST)
            server.forget(5)  # attempt 0 failed here
            current = server.expect(5, [nodes.b.public_key], digest=DIGEST)
            assert current.attempt == 1
            with pytest.raises(AttemptBehind) as behind:
                await dial_member(
                    nodes.b, member, step=5, digest=DIGEST, attempt=0, setup_timeout=10.0, failure_timeout=5.0
                )
            assert behind.value.attempt == 1 and not current.abandoned.is_set()

            ahead = asyncio.create_task(
                dial_member(
                    nodes.b, member, step=5, digest=DIGEST, attempt=3, setup_timeout=10.0, failure_timeout=5.0
                )
            )
            await current.abandoned.wait()  # the dialer moved on: this attempt cannot succeed
            assert "attempt 3" in current.reason and not ahead.done()
            server.forget(5)
            following = server.expect(5, [nodes.b.public_key], digest=DIGEST)
            assert following.attempt == 3
            _, writer, _ = await asyncio.wait_for(ahead, 10)
            accepted = await asyncio.wait_for(following.incoming[(nodes.b.public_key, 0)], 10)
            writer.close()
            close_connection(accepted)
        finally:
            await server.close()

    run(main())


def test_garbage_instead_of_a_handshake(nodes: Nodes) -> None:
    async def server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Session:
        return await accept(
            reader, writer, identity=nodes.a, members={nodes.a.public_key}, step=1, digest=DIGEST, timeout=2
        )

    async def client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        return await reader.read()

    accepted, _ = run(with_server(server, client))
    assert isinstance(accepted, FrameError) and "bad magic" in str(accepted)
