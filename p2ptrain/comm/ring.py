"""The int8 all-reduce of one outer step, over authenticated TCP between members.

Every member of step N calls `ring_all_reduce` with the same ordered member list. The flat fp32
vector is cut into one segment per member (member i owns segment i+1 mod n) and each segment into
chunks (`chunk_bytes`). Two reduce-scatter topologies share one all-gather:

- ring: n−1 rounds; a member receives a chunk from its predecessor, decodes it, adds its own
  weighted values in fp32, re-encodes the partial sum and sends it to its successor. Only ring
  neighbours talk, so slow links can be avoided by the ring order; but each hop re-encodes a
  growing partial sum, so the error grows with n (0.9 % at 3 members, 1.4 % at 8).
- butterfly: every member sends its own encoded chunks of segment j straight to j's owner, which
  sums them in fp32. The same bytes leave each member as in the ring, every contribution is encoded
  once, and the error stays near 0.9 % at any n; but every pair of members must connect.
- all-gather (both): each owner encodes its reduced segment once; the bytes travel around the ring
  unchanged, and every member, the owner included, decodes the same bytes: bit-identical results.

`RingSettings.topology = "auto"` takes the ring up to 3 members (where it meets the 1 % error
budget) and the butterfly above. Chunks are pipelined: a chunk goes out as soon as what it depends
on came in, and the kernels (which release the GIL) run on worker threads while the event loop
keeps the sockets busy. Weights are part of the membership, hence of its digest: each member scales
its own values by its share of the total.

Failure is all-or-nothing. Any error — a member that dies, stalls past `failure_timeout`, sends a
malformed frame or non-finite block parameters, or our own NaN/Inf — closes all of this member's
connections, which makes its peers fail at once too, and raises AllReduceError. The caller's buffer
is read, never written, until every frame arrived; then the encoded result is decoded into it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Sequence

import numpy as np
import zstandard

from p2ptrain.comm import quant
from p2ptrain.comm.dataplane import (
    AllReduceError,
    Connection,
    DataPlaneServer,
    RingMember,
    RingSettings,
    RingStats,
    chunk_bounds,
    dial_member,
    membership_digest,
    segment_bounds,
    shares,
)
from p2ptrain.comm.handshake import HandshakeError
from p2ptrain.comm.wire import FrameError, PeerClosed, PeerTimeout, WireError, read_frame, write_frame
from p2ptrain.identity import short_id

log = logging.getLogger(__name__)

Progress = Callable[[str, int, int], None]
Stream = list[tuple[str, int, int]]
"""What travels on one connection, in order: (phase, round, segment) for every chunk of the segment."""

AUTO_RING_MAX_MEMBERS = 3
HELD_UP_S = 0.002
"""A frame whose send waited this long waited for the link: its time and bytes measure the link.
Frames that go out at once only show that the link kept up (the socket buffers absorb bursts)."""
MIN_MEASURED_BYTES = 1 << 20

__all__ = [
    "AllReduceError",
    "DataPlaneServer",
    "RingMember",
    "RingSettings",
    "RingStats",
    "choose_topology",
    "ring_all_reduce",
    "segment_bounds",
    "shares",
]


def choose_topology(settings: RingSettings, members: int) -> str:
    if settings.topology != "auto":
        return settings.topology
    return "ring" if members <= AUTO_RING_MAX_MEMBERS else "butterfly"


class _AllReduce:
    """One member's part in one all-reduce; see the module docstring for the schedule."""

    def __init__(
        self,
        index: int,
        members: Sequence[RingMember],
        own: np.ndarray,
        settings: RingSettings,
        step: int,
        progress: Progress | None,
    ):
        self.n = len(members)
        self.index = index
        self.keys = [member.key for member in members]
        self.own = own  # the caller's buffer: read only, never written before success
        self.share = np.float32(shares(members)[index])
        self.settings = settings
        self.block = settings.block
        self.step = step
        self.progress = progress
        self.topology = choose_topology(settings, self.n)
        self.successor = (index + 1) % self.n
        self.predecessor = (index - 1) % self.n
        bounds = segment_bounds(own.shape[0], self.n, self.block)
        chunk = max(self.block, (settings.chunk_bytes // 4 // self.block) * self.block)
        self.chunks = [chunk_bounds(bounds[s], bounds[s + 1], chunk) for s in range(self.n)]
        self.finals: list[tuple[int, int, bytes]] = []
        """Encoded chunks of the result; decoded into the caller's buffer only once all succeeded."""
        self.outbox: dict[tuple[str, int, int], asyncio.Future[bytes]] = {}
        self.partial: dict[int, np.ndarray] = {}  # butterfly: chunk index -> fp32 sum so far
        self.arrived: dict[int, int] = {}
        self.locks: dict[int, asyncio.Lock] = {}
        self.frames_queued = dict.fromkeys(self.out_peers(), 0)
        self.held_up = {peer: [0, 0.0] for peer in self.out_peers()}
        """peer → [bytes, seconds] of the frames whose send waited for the peer's link."""
        self.stats = RingStats()
        self.compressor = zstandard.ZstdCompressor(level=1) if settings.zstd else None
        self.decompressor = zstandard.ZstdDecompressor() if settings.zstd else None

    # ---- who talks to whom, and what goes on each connection ----------------------------------

    def others(self) -> list[int]:
        return [peer for peer in range(self.n) if peer != self.index]

    def out_peers(self) -> list[int]:
        return self.others() if self.topology == "butterfly" else [self.successor]

    def in_peers(self) -> list[int]:
        return self.others() if self.topology == "butterfly" else [self.predecessor]

    def send_stream(self, peer: int) -> Stream:
        n, i = self.n, self.index
        if self.topology == "ring":
            stream = [("rs", rnd, (i - rnd) % n) for rnd in range(n - 1)]
        else:
            stream = [("rs", 0, (peer + 1) % n)]
        if peer == self.successor:
            stream += [("ag", rnd, (i + 1 - rnd) % n) for rnd in range(n - 1)]
        return stream

    def receive_stream(self, peer: int) -> Stream:
        n, i = self.n, self.index
        if self.topology == "ring":
            stream = [("rs", rnd, (i - rnd - 1) % n) for rnd in range(n - 1)]
        else:
            stream = [("rs", 0, (i + 1) % n)]
        if peer == self.predecessor:
            stream += [("ag", rnd, (i - rnd) % n) for rnd in range(n - 1)]
        return stream

    def frames_in(self, stream: Stream) -> int:
        return sum(len(self.chunks[segment]) for _, _, segment in stream)

    # ---- sending ----------------------------------------------------------------------------

    def slot(self, key: tuple[str, int, int]) -> asyncio.Future[bytes]:
        if key not in self.outbox:
            self.outbox[key] = asyncio.get_running_loop().create_future()
        return self.outbox[key]

    def deliver(self, key: tuple[str, int, int], payload: bytes) -> None:
        slot = self.slot(key)
        if not slot.done():
            slot.set_result(payload)

    async def send_to(self, peer: int, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        for phase, rnd, segment in self.send_stream(peer):
            for chunk, (start, stop) in enumerate(self.chunks[segment]):
                if phase == "rs" and (rnd == 0 or self.topology == "butterfly"):
                    payload = await loop.run_in_executor(None, self._encode_own, start, stop)
                else:
                    payload = await self.slot((phase, rnd, chunk))
                header = {"kind": phase, "step": self.step, "round": rnd, "chunk": chunk, "n": stop - start}
                if self.compressor is not None:
                    payload = self.compressor.compress(payload)
                    header["zstd"] = True
                # counted before the call: write_frame queues the bytes before its first await
                self.frames_queued[peer] += 1
                sent_at = loop.time()
                await write_frame(writer, header, payload, timeout=self.settings.failure_timeout)
                waited = loop.time() - sent_at
                if waited >= HELD_UP_S:  # the link (or the peer) was slower than we produce frames
                    self.held_up[peer][0] += len(payload)
                    self.held_up[peer][1] += waited
                self.stats.bytes_sent += len(payload)

    def link_rates(self) -> dict[bytes, float]:
        """Bytes/s to each peer we sent to; inf where it never held our sends up long enough to tell."""
        return {
            self.keys[peer]: sent / seconds if sent >= MIN_MEASURED_BYTES and seconds > 0 else math.inf
            for peer, (sent, seconds) in self.held_up.items()
        }

    async def watch(self, peer: int, reader: asyncio.StreamReader) -> None:
        """A peer we dial never writes after the handshake and hangs up once it has all our frames.

        End of stream before we queued our last frame to it therefore means it failed.
        """
        with contextlib.suppress(ConnectionError, OSError):
            await reader.read(1)
        if self.frames_queued[peer] < self.frames_in(self.send_stream(peer)):
            raise PeerClosed(f"{short_id(self.keys[peer])} closed the connection")

    # ---- receiving --------------------------------------------------------------------------

    async def receive_from(self, peer: int, reader: asyncio.StreamReader) -> None:
        largest = max(stop - start for chunks in self.chunks for start, stop in chunks)
        max_payload = quant.payload_size(largest, self.block) + 64
        for phase, rnd, segment in self.receive_stream(peer):
            for chunk, (start, stop) in enumerate(self.chunks[segment]):
                frame = await read_frame(reader, self.settings.failure_timeout, max_payload)
                expected = (phase, self.step, rnd, chunk, stop - start)
                got = tuple(frame.header.get(key) for key in ("kind", "step", "round", "chunk", "n"))
                if got != expected:
                    raise FrameError(f"expected frame {expected}, got {got}")
                payload = frame.payload
                self.stats.bytes_received += len(payload)
                if frame.header.get("zstd"):
                    payload = self._decompress(payload, stop - start)
                try:
                    encoded = quant.decode_payload(payload, stop - start, self.block)
                except quant.PayloadError as exc:
                    raise FrameError(str(exc)) from None
                await self._absorb(phase, rnd, chunk, start, stop, encoded, payload)
                self.stats.frames += 1
                if self.progress is not None:
                    self.progress(phase, rnd, chunk)

    async def _absorb(
        self, phase: str, rnd: int, chunk: int, start: int, stop: int, encoded: quant.Encoded, payload: bytes
    ) -> None:
        loop = asyncio.get_running_loop()
        if phase == "ag":
            self.finals.append((start, stop, payload))
            if rnd < self.n - 2:
                self.deliver(("ag", rnd + 1, chunk), payload)
        elif self.topology == "ring":
            partial = await loop.run_in_executor(None, self._add_own_and_encode, encoded, start, stop)
            if rnd < self.n - 2:
                self.deliver(("rs", rnd + 1, chunk), partial)
            else:  # the last hop: this member owns the reduced chunk, encoded once for everyone
                self._finish_chunk(chunk, start, stop, partial)
        else:
            lock = self.locks.setdefault(chunk, asyncio.Lock())
            async with lock:  # contributions to one chunk arrive from every peer at once
                await loop.run_in_executor(None, self._accumulate, encoded, chunk, start, stop)
                self.arrived[chunk] = self.arrived.get(chunk, 0) + 1
                if self.arrived[chunk] == self.n - 1:
                    final = await loop.run_in_executor(
                        None, quant.encode_payload, self.partial.pop(chunk), self.block
                    )
                    self._finish_chunk(chunk, start, stop, final)

    def _finish_chunk(self, chunk: int, start: int, stop: int, payload: bytes) -> None:
        self.finals.append((start, stop, payload))
        self.deliver(("ag", 0, chunk), payload)

    def _decompress(self, payload: bytes, length: int) -> bytes:
        if self.decompressor is None:
            raise FrameError("zstd frame, but zstd is off for this all-reduce")
        try:
            return self.decompressor.decompress(
                payload, max_output_size=quant.payload_size(length, self.block)
            )
        except zstandard.ZstdError as exc:
            raise FrameError(f"bad zstd payload: {exc}") from None

    # ---- kernels, on worker threads ------------------------------------------------------------

    def _scaled_own(self, start: int, stop: int) -> np.ndarray:
        """This member's weighted contribution to one chunk, in a fresh chunk-sized buffer."""
        return np.multiply(self.own[start:stop], self.share)

    def _encode_own(self, start: int, stop: int) -> bytes:
        return quant.encode_payload(self._scaled_own(start, stop), self.block)

    def _add_own_and_encode(self, encoded: quant.Encoded, start: int, stop: int) -> bytes:
        partial = self._scaled_own(start, stop)
        quant.dequantize_add(encoded, partial)
        return quant.encode_payload(partial, self.block)

    def _accumulate(self, encoded: quant.Encoded, chunk: int, start: int, stop: int) -> None:
        if chunk not in self.partial:
            self.partial[chunk] = self._scaled_own(start, stop)
        quant.dequantize_add(encoded, self.partial[chunk])

    def write_result(self, buffer: np.ndarray) -> None:
        """Decode every final chunk into `buffer`: the same bytes on every member, so the same floats."""
        for start, stop, payload in self.finals:
            quant.dequantize(quant.decode_payload(payload, stop - start, self.block), buffer[start:stop])


async def ring_all_reduce(
    server: DataPlaneServer,
    step: int,
    members: Sequence[RingMember],
    buffer: np.ndarray,
    progress: Progress | None = None,
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
    started = time.monotonic()
    if len(members) == 1:
        if not np.isfinite(buffer).all():
            raise AllReduceError(f"step {step}: this node's contribution holds NaN or Inf")
        return RingStats(seconds=time.monotonic() - started)
    # NaN/Inf of ours are caught where a chunk is encoded, before anything is sent; the error then
    # closes every connection, so the others fail at once instead of waiting for a timeout.
    plan = _AllReduce(keys.index(identity.public_key), members, buffer, settings, step, progress)
    digest = membership_digest(step, members)
    incoming = server.expect(step, [keys[peer] for peer in plan.in_peers()], digest)
    connections: list[Connection] = []
    tasks: list[asyncio.Task[None]] = []
    try:
        outgoing = await _connect(plan, members, incoming, server, step, digest, connections)
        workers = [asyncio.create_task(plan.send_to(peer, writer)) for peer, (_, writer) in outgoing.items()]
        workers += [
            asyncio.create_task(plan.receive_from(peer, incoming[keys[peer]].result()[0]))
            for peer in plan.in_peers()
        ]
        tasks = workers + [
            asyncio.create_task(plan.watch(peer, reader)) for peer, (reader, _) in outgoing.items()
        ]
        pending: set[asyncio.Task[None]] = set(tasks)
        while not all(worker.done() for worker in workers):
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # the first failure propagates at once
        await _flush([writer for _, writer in outgoing.values()], settings.failure_timeout)
        server.completed(step)
    except AllReduceError as exc:
        log.warning("all-reduce of step %d failed: %s", step, exc)
        raise
    except quant.NonFiniteError as exc:
        log.warning("all-reduce of step %d failed: NaN or Inf in this node's contribution", step)
        raise AllReduceError(
            f"step {step}: NaN or Inf in this node's contribution ({exc}); not sent"
        ) from exc
    except (WireError, HandshakeError, OSError) as exc:
        log.warning("all-reduce of step %d failed, connections dropped: %s", step, exc)
        raise AllReduceError(f"step {step}: {exc}") from exc
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()
            elif not task.cancelled():
                task.exception()  # a second failure after the first is expected, not news
        for _, writer in connections:
            writer.close()
        server.forget(step)
    await asyncio.get_running_loop().run_in_executor(None, plan.write_result, buffer)
    plan.stats.result = plan.finals
    plan.stats.link_rates = plan.link_rates()
    plan.stats.seconds = time.monotonic() - started
    return plan.stats


async def _flush(writers: list[asyncio.StreamWriter], timeout: float) -> None:
    """Wait until every byte we queued has reached the kernel, so closing the socket loses nothing
    even if the caller's event loop is busy right after we return."""
    for writer in writers:
        writer.transport.set_write_buffer_limits(high=0)
    try:
        await asyncio.wait_for(asyncio.gather(*(writer.drain() for writer in writers)), timeout)
    except asyncio.TimeoutError:
        raise PeerTimeout("peers did not take our last frames within the deadline") from None
    except (ConnectionError, OSError) as exc:
        raise PeerClosed(f"connection lost while flushing: {exc}") from None


async def _connect(
    plan: _AllReduce,
    members: Sequence[RingMember],
    incoming: dict[bytes, asyncio.Future[Connection]],
    server: DataPlaneServer,
    step: int,
    digest: bytes,
    connections: list[Connection],
) -> dict[int, Connection]:
    """Dial every out-peer and wait for every in-peer; all connections land in `connections`."""
    settings = server.settings

    async def dial_one(peer: int) -> tuple[int, Connection]:
        connection = await dial_member(server.identity, members[peer], step, digest, settings)
        connections.append(connection)
        return peer, connection

    dials = [asyncio.create_task(dial_one(peer)) for peer in plan.out_peers()]
    try:
        outgoing = dict(await asyncio.gather(*dials))
        for key, future in incoming.items():
            try:
                connections.append(await asyncio.wait_for(asyncio.shield(future), settings.setup_timeout))
            except asyncio.TimeoutError:
                raise AllReduceError(
                    f"{short_id(key)} did not connect within {settings.setup_timeout:.0f} s"
                ) from None
    except BaseException:
        for task in dials:
            task.cancel()
        raise
    return outgoing
