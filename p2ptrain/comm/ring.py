"""The int8 ring all-reduce of one outer step, over authenticated TCP between ring neighbours.

Every member of step N calls `ring_all_reduce` with the same ordered member list. The flat fp32
vector is cut into one segment per member, and each segment into chunks (`chunk_bytes`):

- reduce-scatter, n−1 rounds: a member receives a chunk from its predecessor, decodes it and adds
  its own weighted values in fp32, then encodes the partial sum for its successor; the member
  after the segment's last hop holds the segment's complete sum (it "owns" the segment);
- all-gather, n−1 rounds: each owner encodes its reduced segment once; those bytes travel around
  the ring unchanged and every member, the owner included, decodes the same bytes. So all members
  end with bit-identical vectors.

Rounds are pipelined per chunk: chunk k of round r goes out as soon as chunk k of round r−1 came
in, so the wire is busy while the kernels (which release the GIL, on a worker thread) decode and
encode. Weights (tokens processed) are part of the membership, hence of its digest: every member
scales its own vector by its share of the total before the ring, and the ring sums the shares.

Failure is all-or-nothing. Any error — a neighbour that dies, stalls past `failure_timeout`, sends
a malformed frame or a non-finite contribution — closes both of this member's connections, which
makes its neighbours fail at once too, and raises AllReduceError. The caller's buffer is written
only after the whole all-reduce succeeded.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import zstandard

from p2ptrain.comm import quant
from p2ptrain.comm.handshake import Admission, HandshakeError, accept_any, dial
from p2ptrain.comm.wire import FrameError, PeerClosed, WireError, read_frame, write_frame
from p2ptrain.identity import NodeIdentity, short_id

log = logging.getLogger(__name__)


class AllReduceError(WireError):
    """This member's all-reduce failed; its buffer is unchanged. Retry with the survivors."""


@dataclass(frozen=True)
class RingMember:
    key: bytes
    host: str
    port: int
    weight: float = 1.0


@dataclass(frozen=True)
class RingSettings:
    block: int = 256
    chunk_bytes: int = 4 << 20
    """fp32 bytes per pipelined chunk (about a quarter of that goes on the wire)."""
    failure_timeout: float = 5.0
    """Longest wait for the next frame (or for a neighbour to connect) before the step fails."""
    setup_timeout: float = 30.0
    """How long members may take to arrive at the step and connect."""
    zstd: bool = False


@dataclass
class RingStats:
    seconds: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    frames: int = 0
    extra: dict[str, float] = field(default_factory=dict)


def membership_digest(step: int, members: Sequence[RingMember]) -> bytes:
    """sha256 over the step and the ordered members (keys, addresses, weights)."""
    digest = hashlib.sha256(b"p2ptrain/ring/v1\0" + step.to_bytes(8, "big"))
    for member in members:
        digest.update(member.key + f"{member.host}:{member.port}:{member.weight!r}\0".encode())
    return digest.digest()


def shares(members: Sequence[RingMember]) -> list[float]:
    """Each member's share of the average: weight / total, or equal shares when all weights are 0."""
    weights = [float(member.weight) for member in members]
    if any(not np.isfinite(weight) or weight < 0 for weight in weights):
        raise ValueError("member weights must be finite and non-negative")
    total = sum(weights)
    return [weight / total for weight in weights] if total > 0 else [1.0 / len(weights)] * len(weights)


def segment_bounds(length: int, parts: int, align: int = 1) -> list[int]:
    """Start offsets of `parts` near-equal segments of `length`, plus the end.

    Boundaries fall on multiples of `align` (the code block), so every block of the vector is the
    same block on every member and in every chunk, whatever the member count.
    """
    units = -(-length // align)
    base, extra = divmod(units, parts)
    bounds = [0]
    for index in range(parts):
        bounds.append(min(length, bounds[-1] + (base + (1 if index < extra else 0)) * align))
    return bounds


def chunk_bounds(start: int, stop: int, chunk: int) -> list[tuple[int, int]]:
    return [(offset, min(offset + chunk, stop)) for offset in range(start, stop, chunk)] or [(start, start)]


class DataPlaneServer:
    """A node's listening socket; hands each incoming ring connection to the step that expects it."""

    def __init__(self, identity: NodeIdentity, settings: RingSettings):
        self.identity = identity
        self.settings = settings
        self._server: asyncio.Server | None = None
        self._expected: dict[int, tuple[Admission, asyncio.Future]] = {}
        self._changed = asyncio.Event()
        self.address: tuple[str, int] = ("", 0)

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> tuple[str, int]:
        self._server = await asyncio.start_server(self._on_connection, host, port)
        self.address = self._server.sockets[0].getsockname()[:2]
        return self.address

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for _, future in self._expected.values():
            if not future.done():
                future.cancel()

    def expect(self, step: int, predecessor: bytes, digest: bytes) -> asyncio.Future:
        """Register step `step`: the future resolves with the predecessor's authenticated connection."""
        future = asyncio.get_running_loop().create_future()
        self._expected[step] = (Admission({predecessor}, digest), future)
        self._changed.set()
        self._changed = asyncio.Event()
        return future

    def forget(self, step: int) -> None:
        self._expected.pop(step, None)

    async def _admission(self, step: int) -> Admission | None:
        """Wait (bounded) for the local node to reach `step`: a fast peer may dial before we get there."""
        deadline = time.monotonic() + self.settings.setup_timeout
        while step not in self._expected:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)
        admission, future = self._expected[step]
        return None if future.done() else admission

    async def _on_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            session = await accept_any(
                reader, writer, self.identity, self._admission, self.settings.failure_timeout
            )
        except WireError as exc:
            log.info("data-plane connection dropped: %s", exc)
            writer.close()
            return
        entry = self._expected.get(session.step)
        if entry is None or entry[1].done():
            writer.close()
            return
        entry[1].set_result((reader, writer))


async def _dial(
    identity: NodeIdentity, member: RingMember, step: int, digest: bytes, settings: RingSettings
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Connect and authenticate to the successor, retrying refused connections until the setup deadline."""
    deadline = time.monotonic() + settings.setup_timeout
    delay = 0.05
    while True:
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(member.host, member.port), settings.failure_timeout
            )
        except (OSError, asyncio.TimeoutError) as exc:
            if time.monotonic() + delay > deadline:
                raise AllReduceError(
                    f"cannot connect to {short_id(member.key)} at {member.host}:{member.port}: {exc}"
                ) from None
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)
            continue
        try:
            await dial(reader, writer, identity, member.key, step, digest, settings.setup_timeout)
        except BaseException:
            writer.close()
            raise
        return reader, writer


@dataclass
class _Encoded:
    """One encoded chunk as it travels: codes, then mins, then steps, in one payload."""

    payload: bytes
    length: int


def _encode(values: np.ndarray, block: int) -> _Encoded:
    encoded = quant.quantize(np.ascontiguousarray(values), block)
    return _Encoded(
        encoded.codes.tobytes() + encoded.mins.tobytes() + encoded.steps.tobytes(), values.shape[0]
    )


def _decode(payload: bytes, length: int, block: int) -> quant.Encoded:
    """Split a payload back into codes and block parameters; sizes and values are checked."""
    blocks = quant.num_blocks(length, block)
    if len(payload) != length + 8 * blocks:
        raise FrameError(f"payload of {len(payload)} bytes for {length} values")
    codes = np.frombuffer(payload, np.uint8, length)
    mins = np.frombuffer(payload, np.float32, blocks, length)
    steps = np.frombuffer(payload, np.float32, blocks, length + 4 * blocks)
    if not (np.isfinite(mins).all() and np.isfinite(steps).all() and (steps >= 0).all()):
        raise FrameError("non-finite or negative block parameters in a contribution")
    return quant.Encoded(codes, mins, steps, block)


class _Ring:
    """State of one member's all-reduce; see the module docstring for the schedule."""

    def __init__(
        self,
        index: int,
        members: Sequence[RingMember],
        own: np.ndarray,
        share: float,
        settings: RingSettings,
        step: int,
        progress: Callable[[str, int, int], None] | None,
        loop: asyncio.AbstractEventLoop,
    ):
        self._loop = loop
        self.n = len(members)
        self.index = index
        self.own = own  # the caller's buffer: read only, never written before success
        self.share = np.float32(share)
        self.finals: list[tuple[int, int, bytes]] = []
        """Encoded chunks of the result; decoded into the caller's buffer only once all succeeded."""
        self.settings = settings
        self.step = step
        self.progress = progress
        self.bounds = segment_bounds(own.shape[0], self.n, settings.block)
        chunk = max(settings.block, (settings.chunk_bytes // 4 // settings.block) * settings.block)
        self.chunks = [chunk_bounds(self.bounds[s], self.bounds[s + 1], chunk) for s in range(self.n)]
        self.stats = RingStats()
        self.frames_queued = 0
        self.frames_to_send = sum(
            len(self.chunks[self.segment(phase, rnd, sending=True)])
            for phase in ("rs", "ag")
            for rnd in range(self.n - 1)
        )
        # ready[(phase, round, chunk)] is set once that chunk may be sent
        self.outbox: dict[tuple[str, int, int], asyncio.Future] = {}
        self.compressor = zstandard.ZstdCompressor(level=1) if settings.zstd else None
        self.decompressor = zstandard.ZstdDecompressor() if settings.zstd else None

    def segment(self, phase: str, rnd: int, sending: bool) -> int:
        """Segment sent (or received) in round `rnd` of `phase` by this member."""
        shift = 0 if sending else 1
        if phase == "rs":
            return (self.index - rnd - shift) % self.n
        return (self.index + 1 - rnd - shift) % self.n

    def slot(self, key: tuple[str, int, int]) -> asyncio.Future:
        if key not in self.outbox:
            self.outbox[key] = asyncio.get_running_loop().create_future()
        return self.outbox[key]

    async def send_all(self, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        for phase in ("rs", "ag"):
            for rnd in range(self.n - 1):
                segment = self.segment(phase, rnd, sending=True)
                for chunk_index, (start, stop) in enumerate(self.chunks[segment]):
                    if phase == "rs" and rnd == 0:
                        encoded = await loop.run_in_executor(None, self._encode_own, start, stop)
                    else:
                        encoded = await self.slot((phase, rnd, chunk_index))
                    payload = encoded.payload
                    header = {
                        "kind": phase,
                        "step": self.step,
                        "round": rnd,
                        "chunk": chunk_index,
                        "n": encoded.length,
                    }
                    if self.compressor is not None:
                        payload = self.compressor.compress(payload)
                        header["zstd"] = True
                    # counted before the call: write_frame queues the bytes before its first await
                    self.frames_queued += 1
                    await write_frame(writer, header, payload, timeout=self.settings.failure_timeout)
                    self.stats.bytes_sent += len(payload)

    async def receive_all(self, reader: asyncio.StreamReader) -> None:
        loop = asyncio.get_running_loop()
        block = self.settings.block
        max_payload = max(stop - start for chunks in self.chunks for start, stop in chunks)
        max_payload += 8 * quant.num_blocks(max_payload, block) + 64
        for phase in ("rs", "ag"):
            for rnd in range(self.n - 1):
                segment = self.segment(phase, rnd, sending=False)
                for chunk_index, (start, stop) in enumerate(self.chunks[segment]):
                    frame = await read_frame(reader, self.settings.failure_timeout, max_payload)
                    expected = (phase, self.step, rnd, chunk_index, stop - start)
                    got = tuple(frame.header.get(key) for key in ("kind", "step", "round", "chunk", "n"))
                    if got != expected:
                        raise FrameError(f"expected frame {expected}, got {got}")
                    payload = frame.payload
                    self.stats.bytes_received += len(payload)
                    if frame.header.get("zstd"):
                        payload = self._decompress(payload, stop - start)
                    encoded = _decode(payload, stop - start, block)
                    await loop.run_in_executor(
                        None, self._absorb, phase, rnd, chunk_index, start, stop, encoded, payload
                    )
                    self.stats.frames += 1
                    if self.progress is not None:
                        self.progress(phase, rnd, chunk_index)

    def _decompress(self, payload: bytes, length: int) -> bytes:
        if self.decompressor is None:
            raise FrameError("zstd frame, but zstd is off for this ring")
        limit = length + 8 * quant.num_blocks(length, self.settings.block)
        try:
            return self.decompressor.decompress(payload, max_output_size=limit)
        except zstandard.ZstdError as exc:
            raise FrameError(f"bad zstd payload: {exc}") from None

    def _absorb(
        self, phase: str, rnd: int, chunk: int, start: int, stop: int, encoded: quant.Encoded, payload: bytes
    ) -> None:
        """Runs on a worker thread: decode one received chunk and prepare what goes out next."""
        loop_result: tuple[str, int, int, _Encoded] | None = None
        if phase == "rs":
            view = self._scaled_own(start, stop)
            quant.dequantize_add(encoded, view)
            if rnd < self.n - 2:
                loop_result = ("rs", rnd + 1, chunk, _encode(view, self.settings.block))
            else:  # this member now owns the fully reduced chunk: encode it once, like everyone decodes it
                final = _encode(view, self.settings.block)
                self.finals.append((start, stop, final.payload))
                loop_result = ("ag", 0, chunk, final)
        else:
            self.finals.append((start, stop, payload))
            if rnd < self.n - 2:
                loop_result = ("ag", rnd + 1, chunk, _Encoded(payload, stop - start))
        if loop_result is not None:
            self._post(loop_result)

    def _scaled_own(self, start: int, stop: int) -> np.ndarray:
        """This member's weighted contribution to one chunk, in a fresh chunk-sized buffer."""
        return np.multiply(self.own[start:stop], self.share)

    def _encode_own(self, start: int, stop: int) -> _Encoded:
        return _encode(self._scaled_own(start, stop), self.settings.block)

    def write_result(self, buffer: np.ndarray) -> None:
        """Decode every final chunk into `buffer`: the same bytes on every member, so the same floats."""
        for start, stop, payload in self.finals:
            quant.dequantize(_decode(payload, stop - start, self.settings.block), buffer[start:stop])

    def _post(self, item: tuple[str, int, int, _Encoded]) -> None:
        phase, rnd, chunk, encoded = item
        self._loop.call_soon_threadsafe(self._deliver, (phase, rnd, chunk), encoded)

    def _deliver(self, key: tuple[str, int, int], encoded: _Encoded) -> None:
        slot = self.slot(key)
        if not slot.done():
            slot.set_result(encoded)


async def _watch_successor(reader: asyncio.StreamReader, ring: _Ring) -> None:
    """The successor never writes after the handshake; it hangs up once it has every frame of ours.

    End of stream before we queued our last frame therefore means it failed.
    """
    with contextlib.suppress(ConnectionError, OSError):
        await reader.read(1)
    if ring.frames_queued < ring.frames_to_send:
        raise PeerClosed("the successor closed the connection")


async def ring_all_reduce(
    server: DataPlaneServer,
    step: int,
    members: Sequence[RingMember],
    buffer: np.ndarray,
    progress: Callable[[str, int, int], None] | None = None,
) -> RingStats:
    """Replace `buffer` (1-D fp32) with the weighted average over `members`, identical on all of them.

    Raises AllReduceError (buffer unchanged) when any member fails; see the module docstring.
    """
    identity, settings = server.identity, server.settings
    if buffer.dtype != np.float32 or buffer.ndim != 1 or not buffer.flags.c_contiguous:
        raise TypeError("the all-reduce buffer must be a contiguous 1-D float32 array")
    keys = [member.key for member in members]
    if identity.public_key not in keys or len(set(keys)) != len(keys):
        raise ValueError("members must be distinct and include this node")
    index = keys.index(identity.public_key)
    share = shares(members)[index]
    started = time.monotonic()
    if len(members) == 1:
        if not np.isfinite(buffer).all():
            raise AllReduceError(f"step {step}: this node's contribution holds NaN or Inf")
        return RingStats(seconds=time.monotonic() - started)
    # Partial sums live in chunk-sized buffers; NaN/Inf of ours are caught where a chunk is encoded,
    # before anything is sent, and the error then closes the connections so the others fail at once.
    ring = _Ring(index, members, buffer, share, settings, step, progress, asyncio.get_running_loop())
    digest = membership_digest(step, members)
    successor, predecessor = members[(index + 1) % len(members)], members[index - 1]
    incoming = server.expect(step, predecessor.key, digest)
    writers: list[asyncio.StreamWriter] = []
    tasks: list[asyncio.Task] = []
    try:
        try:
            out_reader, out_writer = await _dial(identity, successor, step, digest, settings)
            writers.append(out_writer)
            in_reader, in_writer = await asyncio.wait_for(incoming, settings.setup_timeout)
            writers.append(in_writer)
        except asyncio.TimeoutError:
            raise AllReduceError(
                f"{short_id(predecessor.key)} did not connect within {settings.setup_timeout:.0f} s"
            ) from None
        sender = asyncio.create_task(ring.send_all(out_writer))
        receiver = asyncio.create_task(ring.receive_all(in_reader))
        tasks = [sender, receiver, asyncio.create_task(_watch_successor(out_reader, ring))]
        pending = set(tasks)
        while not (sender.done() and receiver.done()):
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # the first failure propagates at once
    except AllReduceError:
        raise
    except quant.NonFiniteError as exc:
        raise AllReduceError(
            f"step {step}: NaN or Inf in this node's contribution ({exc}); not sent"
        ) from exc
    except (WireError, HandshakeError, OSError) as exc:
        raise AllReduceError(f"step {step}: {exc}") from exc
    finally:
        for task in tasks:
            task.cancel()
        for writer in writers:
            writer.close()
        server.forget(step)
    await asyncio.get_running_loop().run_in_executor(None, ring.write_result, buffer)
    ring.stats.seconds = time.monotonic() - started
    return ring.stats
