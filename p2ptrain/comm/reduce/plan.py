"""One member's part in one all-reduce (allreduce.py): the frames it sends and what it does with
those it receives, on the transfer threads (transfer.py), for the ring and the butterfly;
gather.py's subclass for the sparse codec's gather.

The first error wins (`fail`): it shuts every connection of this member, which makes its peers fail
at once too. The caller's buffer is untouched until `write_result`, once every member holds the
result (barrier.py).
"""

from __future__ import annotations

import functools
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import zstandard

from p2ptrain.comm.codec import quant
from p2ptrain.comm.codec.quant import Buffer
from p2ptrain.comm.net.members import Member, shares
from p2ptrain.comm.reduce.barrier import (
    ALIVE,
    BEATS_PER_TIMEOUT,
    Testimony,
    ToSuccessor,
)
from p2ptrain.comm.reduce.schedule import BUNDLE, CLAIMS, GATHER, FrameSpec, Schedule
from p2ptrain.comm.reduce.transfer import SlotKey, Slots
from p2ptrain.comm.robust import claims
from p2ptrain.comm.robust.aggregator import RobustAggregator
from p2ptrain.comm.transport import lanes
from p2ptrain.comm.transport.wire import FrameError, PeerClosed, PeerTimeout
from p2ptrain.config import CommConfig
from p2ptrain.identity import NodeIdentity, short_id

log = logging.getLogger(__name__)

Progress = Callable[[str, int, int], None]
"""Called with (phase, round, chunk) after each frame is received, on the receiving thread."""
HELD_UP_S = 0.002
"""A frame whose send waited this long waited for the link: its time and bytes measure the link.
Frames that go out at once only show that the link kept up (the socket buffers absorb bursts)."""
MIN_MEASURED_BYTES = 1 << 20
"""Fewer bytes held up by a link than this say too little to measure its rate."""


def link_rates(held_up: dict[bytes, list[float]]) -> dict[bytes, float]:
    """Bytes/s to each peer, from the [bytes, seconds] of the sends to it that waited for its link;
    inf where too few waited to tell (the link kept up)."""
    return {
        key: sent / seconds if sent >= MIN_MEASURED_BYTES and seconds > 0 else math.inf
        for key, (sent, seconds) in held_up.items()
    }


@dataclass(kw_only=True)
class ReduceStats:
    """What one member's part in one all-reduce yields besides the result in its buffer."""

    seconds: float = 0.0
    connect_s: float = 0.0
    """Of `seconds`: dialing and authenticating every lane (and waiting for the peers' dials)."""
    transfer_s: float = 0.0
    """Of `seconds`: the frames, from every lane up to the last frame in."""
    barrier_s: float = 0.0
    """Of `seconds`: the completion barrier (barrier.py), from the last frame in to the result's."""
    bytes_sent: int = 0
    bytes_received: int = 0
    frames: int = 0
    result: list[tuple[int, int, Buffer]] = field(default_factory=list)
    """The encoded chunks (start, stop, payload) every member decoded: an exact record of the step."""
    link_rates: dict[bytes, float] = field(default_factory=dict)
    """Bytes/s to each peer we sent to, measured over the frames whose send it held up; inf for a
    peer that took our frames as fast as we produced them (its link was not our bottleneck)."""
    round_trips: dict[bytes, float] = field(default_factory=dict)
    """Seconds, the kernel's smoothed round trip to each peer we sent to (the slowest of its lanes)."""
    failure_timeout: float = 0.0
    """The attempt's deadline for a frame or an answer: comm.failure_timeout, or longer where a
    member's path measured long in an earlier step (net/paths.py)."""
    clipped: dict[bytes, int] = field(default_factory=dict)
    """Robust aggregation: member → chunks of ours (we own them) in which its share was cut to under
    half its norm (clipping.CUT_FAR)."""
    shares: list[Buffer] = field(default_factory=list)
    """The sparse codec's record of the step instead of `result`: every member's share, in member
    order, and the weight each counted with (gather.py)."""
    weights: list[float] = field(default_factory=list)
    left_out: dict[bytes, int] = field(default_factory=dict)
    """The reweighted mean: member → chunks of ours in which its share pointed so far from the
    others' that it counted at under half its weight (clipping.LEFT_OUT)."""


class ReducePlan:
    """One member's part in one all-reduce; see the module docstring for the schedule."""

    def __init__(
        self,
        *,
        index: int,
        members: Sequence[Member],
        own: np.ndarray,
        comm: CommConfig,
        step: int,
        progress: Progress | None,
        identity: NodeIdentity,
        digest: bytes,
        reference: np.ndarray | None = None,
    ):
        """Member `index` of `members` reduces `own` (read only, never written before success) in
        attempt `digest` of `step`; `reference`: all_reduce's."""
        self.n = len(members)
        self.index = index
        self.keys = [member.key for member in members]
        self.own = own
        self.fractions = [float(np.float32(share)) for share in shares(members)]
        self.share = self.fractions[index]
        self.comm = comm
        self.block = comm.quant_block
        self.bits = comm.bits
        self.step = step
        self.progress = progress
        behind_nat = sum(not member.reachable for member in members)
        self.schedule = Schedule.of(
            index=index, n=self.n, length=own.shape[0], comm=comm, behind_nat=behind_nat
        )
        largest = max(stop - start for chunks in self.schedule.chunks for start, stop in chunks)
        self.largest_payload = self._size(largest)
        self.max_payload = self.largest_payload + 64  # zstd may grow a payload a little
        workers = (len(self.schedule.out_peers()) + len(self.schedule.in_peers())) * comm.connections
        self.threads = max(1, (os.cpu_count() or 1) // workers)
        """OpenMP threads per kernel call: the transfer threads already run kernels side by side,
        and more threads than cores make OpenMP spin (measured: twice the CPU time on 2 cores)."""
        self.aggregator: RobustAggregator | None = None
        """Robust aggregation (`comm.robust`): aggregates and signs our segment, checks the others'."""
        if self.schedule.robust:
            most = max(len(chunks) for chunks in self.schedule.chunks)
            self.max_payload = max(self.max_payload, self.n * claims.claim_bytes(most))
            ledger = claims.Ledger(
                identity=identity,
                step=step,
                digest=digest,
                keys=self.keys,
                fractions=self.fractions,
                clip=comm.clip,
                bits=comm.bits,
                chunks=self.schedule.chunks,
                own=own,
            )
            self.aggregator = RobustAggregator(
                ledger=ledger, comm=comm, threads=self.threads, sink=self, reference=reference
            )
        self.min_rate = comm.slowest_link_mbit * 1e6 / 8
        """Bytes/s a frame in transit must keep up to extend its deadline (lanes.Deadline)."""
        self.working: dict[tuple[int, int], float] = {}
        """(peer, lane) → since when that receiving thread works on a frame it received."""
        segment = max(sum(stop - start for start, stop in chunks) for chunks in self.schedule.chunks)
        self.alive_hold = comm.failure_timeout * self.n + (
            self._size(segment) / self.min_rate if self.min_rate > 0 else 0.0
        )
        """How long a peer's keepalives may stand in for its next frame: a hop's failure_timeout
        for each member it may wait behind, and a whole segment's bytes at the floor rate (what a
        slow member's reduce-scatter frames take). A member that withholds a frame and sends
        keepalives holds the step that long, as one trickling it at the floor rate could."""
        self.data_deadline = math.inf
        """When the data phase may legitimately take no longer (`data_phase_bound`, set once the
        lanes are up): keepalives do not hold a receiver past it."""
        self.to_successor = ToSuccessor(step, comm.failure_timeout)
        """Keepalives and the barrier's sets, from our last data frame to the successor on."""
        self.result = np.empty(self._size(own.shape[0]), np.uint8)
        """The encoded result, each chunk at its place: received or encoded straight into it, so
        the bulk of the data is never copied and lands in one allocation (huge pages where the
        system has them) instead of fresh pages for every frame."""
        self.finals: list[tuple[int, int, Buffer]] = []
        """Encoded chunks of the result; decoded into the caller's buffer only once all succeeded."""
        self.spares: list[bytearray] = []
        """Buffers of ring partial sums already sent, for the next ones."""
        self.slots = Slots()
        self.lock = threading.Lock()  # guards the counters and lists below, and `failure`
        owned = len(self.schedule.chunks[self.schedule.successor])
        self.chunk_locks = [threading.Lock() for _ in range(owned)]
        self.partial: dict[int, np.ndarray] = {}  # butterfly: chunk index -> fp32 sum so far
        self.arrived: dict[int, int] = {}
        self.frames_queued = dict.fromkeys(self.schedule.out_peers(), 0)
        self.arrivals: dict[int, dict[int, float]] = {peer: {} for peer in self.schedule.in_peers()}
        """peer → position in its stream to us → when that frame had arrived (lanes.Deadline)."""
        self.held_up = {peer: [0, 0.0] for peer in self.schedule.out_peers()}
        """peer → [bytes, seconds] of the frames whose send waited for the peer's link."""
        self.stats = ReduceStats()
        self.failure: BaseException | None = None
        self.sockets: list[socket.socket] = []

    # ---- failure: the first error wins and stops everything ----------------------------------

    def fail(self, exc: BaseException) -> None:
        with self.lock:
            if self.failure is not None:
                return
            self.failure = exc
        self.slots.abort()
        for sock in self.sockets:
            lanes.shut(sock)

    # ---- sending (one thread per outgoing lane) -----------------------------------------------

    def send_lane(self, peer: int, lane: int, channel: lanes.Channel) -> None:
        compressor = zstandard.ZstdCompressor(level=1) if self.comm.zstd else None
        scratch = bytearray(self.largest_payload)  # our own encoded chunks, one at a time
        for phase, rnd, chunk, start, stop in self.schedule.send_frames(peer, lane):
            payload, spare = self._outgoing((phase, rnd, chunk, start, stop), scratch, channel)
            header = {"kind": phase, "step": self.step, "round": rnd, "chunk": chunk, "n": stop - start}
            signature = self._signature((phase, rnd, chunk, start, stop))
            if signature is not None:
                header["sig"] = signature
            if compressor is not None and phase not in (CLAIMS, BUNDLE, GATHER):
                payload = compressor.compress(payload)
                header["zstd"] = True
            with self.lock:  # counted before the send: the peer may hang up as soon as it has all
                self.frames_queued[peer] += 1
            sent_at = time.monotonic()
            lanes.send_frame(
                channel, header, payload=payload, timeout=self.comm.failure_timeout, min_rate=self.min_rate
            )
            waited = time.monotonic() - sent_at
            with self.lock:
                if spare is not None:  # in the kernel now: the buffer can take the next partial sum
                    self.spares.append(spare)
                if waited >= HELD_UP_S:  # the link (or the peer) was slower than we produce frames
                    self.held_up[peer][0] += len(payload)
                    self.held_up[peer][1] += waited
                self.stats.bytes_sent += len(payload)
        if (rtt := lanes.round_trip_s(channel.sock)) is not None:
            with self.lock:
                key = self.keys[peer]
                self.stats.round_trips[key] = max(rtt, self.stats.round_trips.get(key, 0.0))
        if (peer, lane) == (self.schedule.successor, 0):  # until our barrier ends: we are alive
            self.to_successor.start(channel)

    def _outgoing(
        self, spec: FrameSpec, scratch: bytearray, channel: lanes.Channel
    ) -> tuple[Buffer, bytearray | None]:
        """The payload of frame `spec` and the spare buffer it lies in (returned to `spares` once
        sent), or None: our own values encoded into `scratch`, or what other frames produced."""
        phase, rnd, chunk, start, stop = spec
        if phase == CLAIMS:  # `chunk` is the segment
            assert self.aggregator is not None
            return self.aggregator.own_claims(chunk), None
        if phase == "rs" and (rnd == 0 or self.schedule.topology == "butterfly"):
            out = memoryview(scratch)[: self._size(stop - start)]
            own = self.own[start:stop]
            payload = quant.encode_payload(
                own, self.block, scale=self.share, threads=self.threads, out=out, bits=self.bits
            )
            return payload, None
        return self._take_saying_alive(channel, (phase, rnd, chunk))

    def _signature(self, spec: FrameSpec) -> bytes | None:
        """What frame `spec`'s header carries as "sig": robust aggregation's signature of each chunk
        of a segment we own, in the all-gather."""
        phase, rnd, chunk, _, _ = spec
        if phase == "ag" and self.aggregator is not None:
            return self.aggregator.signature(self.schedule.sent_segment(rnd), chunk)
        return None

    def _take_saying_alive(self, channel: lanes.Channel, key: SlotKey) -> tuple[Buffer, bytearray | None]:
        """The payload of a frame that waits for other members' frames (a partial sum, a chunk to
        pass on), telling the peer we are alive while it waits: behind a slow member that wait
        legitimately outlasts failure_timeout (a 5 Mbit/s uplink among 50 Mbit/s ones failed every
        attempt), and the peer, which cannot see why, takes only a silent sender for a dead one.
        Only while the wait is on the network: no keepalive while bytes of ours are unacknowledged
        (the peer is receiving them), none once one of our own receiving threads is stuck in its
        work on a frame (a hung member must look dead, as it did before keepalives)."""
        beat = self.comm.failure_timeout / BEATS_PER_TIMEOUT
        while (taken := self.slots.take(key, beat)) is None:
            if not lanes.unacknowledged(channel.sock) and not self._stuck(beat):
                alive = {"kind": ALIVE, "step": self.step}
                lanes.send_frame(channel, alive, payload=b"", timeout=self.comm.failure_timeout)
        return taken

    def _stuck(self, limit: float) -> bool:
        """Whether one of our receiving threads has worked on a frame it received for over `limit`
        seconds (decoding and adding take milliseconds)."""
        now = time.monotonic()
        with self.lock:
            return any(now - since > limit for since in self.working.values())

    def hung_up(self, peer: int, state: str) -> None:
        """A peer we only send to made its connection readable: it never writes after the handshake
        and hangs up once it has all our frames, so anything else means it failed."""
        if state == "data":
            self.fail(FrameError(f"{short_id(self.keys[peer])} wrote on a connection it must only read"))
        elif self.frames_queued[peer] < len(self.schedule.send_frames(peer)):
            self.fail(PeerClosed(f"{short_id(self.keys[peer])} closed the connection"))

    # ---- receiving (one thread per incoming lane) ---------------------------------------------

    def receive_lane(self, peer: int, lane: int, channel: lanes.Channel) -> None:
        decompressor = zstandard.ZstdDecompressor() if self.comm.zstd else None
        scratch = memoryview(bytearray(self.largest_payload))  # reduce-scatter frames, used at once
        arrivals = self.arrivals[peer]
        lanes_of_peer = self.schedule.lanes
        for number, spec in enumerate(self.schedule.receive_frames(peer, lane)):
            phase, rnd, chunk, start, stop = spec
            place = functools.partial(self._place, peer, spec, scratch)
            position = lane + number * lanes_of_peer  # in the peer's stream to us
            # the frame before it came on another lane: this one is due only after that one
            after = (
                None if lanes_of_peer == 1 or position == 0 else functools.partial(arrivals.get, position - 1)
            )
            with self.lock:
                self.working.pop((peer, lane), None)
            alive_since = None
            while True:
                frame = lanes.recv_frame(
                    channel,
                    self.comm.failure_timeout,
                    max_payload=self.max_payload,
                    place=place,
                    min_rate=self.min_rate,
                    after=after,
                )
                if frame.header != {"kind": ALIVE, "step": self.step} or len(frame.payload):
                    break
                # the peer waits for others' frames: as long as a chain of them may take, no longer
                now = time.monotonic()
                alive_since = now if alive_since is None else alive_since
                if now - alive_since > self.alive_hold or now > self.data_deadline:
                    raise PeerTimeout(
                        f"{short_id(self.keys[peer])} said only that it was alive for "
                        f"{now - alive_since:.0f} s"
                    )
            arrivals[position] = time.monotonic()
            with self.lock:
                self.working[(peer, lane)] = arrivals[position]
            expected, got = self._expected(spec), _identity(frame.header)
            if got != expected:
                raise FrameError(f"expected frame {expected}, got {got}")
            payload: Buffer = frame.payload
            with self.lock:
                self.stats.bytes_received += len(payload)
            if phase in (CLAIMS, BUNDLE):
                self._absorb_claims(peer, phase, rnd=rnd, segment=chunk, blob=bytes(payload))
                continue
            if frame.header.get("zstd"):
                payload = self._decompress(decompressor, payload, stop - start)
            self._incoming(peer, spec, frame.header, payload)
            with self.lock:
                self.stats.frames += 1
            if self.progress is not None:
                self.progress(phase, rnd, chunk)
        with self.lock:
            self.working.pop((peer, lane), None)

    def _incoming(self, peer: int, spec: FrameSpec, header: dict, payload: Buffer) -> None:
        """A data frame from `peer` that arrived whole and as expected: decoded and taken in."""
        phase, rnd, chunk, start, stop = spec
        try:
            encoded = quant.decode_payload(payload, stop - start, block=self.block, bits=self.bits)
        except quant.PayloadError as exc:
            raise FrameError(str(exc)) from None
        if phase == "ag" and self.aggregator is not None:
            self.aggregator.result_arrived(
                peer=peer,
                segment=self.schedule.received_segment(rnd),
                chunk=chunk,
                signature=header.get("sig"),
                payload=payload,
                encoded=encoded,
            )
        self._absorb(peer=peer, spec=spec, encoded=encoded, payload=payload)

    def _expected(self, spec: FrameSpec) -> tuple:
        """The identity (see `_identity`) the frame `spec` must arrive with."""
        phase, rnd, chunk, start, stop = spec
        return (phase, self.step, rnd, chunk, stop - start)

    def _place(
        self, peer: int, spec: FrameSpec, scratch: memoryview, header: dict, length: int
    ) -> memoryview | None:
        """The buffer an expected frame's payload from `peer` is received into: its place in the
        result for the all-gather, `scratch` for the reduce-scatter (used up before the next frame)."""
        phase, _, _, start, stop = spec
        size = self._size(stop - start)
        if _identity(header) != self._expected(spec) or length != size or header.get("zstd"):
            return None  # a fresh buffer; the checks after the read refuse what is wrong
        return self.placed(start, stop) if phase == "ag" else scratch[:size]

    def _absorb_claims(self, peer: int, phase: str, *, rnd: int, segment: int, blob: bytes) -> None:
        """Robust aggregation's frames: a member's claims for our segment, or an owner's bundle
        passed on round the all-gather ahead of its segment."""
        assert self.aggregator is not None
        if phase == CLAIMS:
            self.aggregator.claims_arrived(peer, blob)
            return
        self.aggregator.bundle_arrived(peer, segment, blob)
        if rnd < self.n - 2:
            self.slots.put((BUNDLE, rnd + 1, segment), blob)

    def send_bundle(self, bundle: bytes) -> None:
        assert self.aggregator is not None
        self.slots.put((BUNDLE, 0, self.aggregator.ledger.own_segment), bundle)

    def _absorb(self, *, peer: int, spec: FrameSpec, encoded: quant.Encoded, payload: Buffer) -> None:
        """A data frame from `peer`, decoded (`encoded`) and raw (`payload`)."""
        phase, rnd, chunk, start, stop = spec
        if phase == "ag":
            with self.lock:
                self.finals.append((start, stop, payload))
            if rnd < self.n - 2:
                self.slots.put(("ag", rnd + 1, chunk), payload)
        elif self.schedule.topology == "ring":
            own = self.own[start:stop]
            if rnd < self.n - 2:
                spare = self._spare()
                out = memoryview(spare)[: self._size(stop - start)]
                partial = quant.add_encode_payload(
                    own, self.share, received=encoded, threads=self.threads, out=out
                )
                self.slots.put(("rs", rnd + 1, chunk), partial, spare)
            else:  # the last hop: this member owns the reduced chunk, encoded once for everyone
                final = quant.add_encode_payload(
                    own, self.share, received=encoded, threads=self.threads, out=self.placed(start, stop)
                )
                self.finish_chunk(chunk, start, stop, final)
        elif self.aggregator is not None:
            self.aggregator.share_arrived(peer, chunk, encoded)
        else:
            with self.chunk_locks[chunk]:  # contributions to one chunk arrive from every peer at once
                if chunk not in self.partial:
                    self.partial[chunk] = np.multiply(self.own[start:stop], np.float32(self.share))
                quant.dequantize_add(encoded, self.partial[chunk], self.threads)
                self.arrived[chunk] = self.arrived.get(chunk, 0) + 1
                if self.arrived[chunk] == self.n - 1:
                    summed, placed = self.partial.pop(chunk), self.placed(start, stop)
                    final = quant.encode_payload(
                        summed, self.block, scale=1.0, threads=self.threads, out=placed, bits=self.bits
                    )
                    self.finish_chunk(chunk, start, stop, final)

    def data_phase_bound(self) -> float:
        """Seconds the data phase may legitimately take: every frame we receive its own deadline
        (lanes.Deadline: failure_timeout plus its bytes at the floor rate), and one more per hop."""
        frames_in = self.schedule.frames_in()
        bound = self.comm.failure_timeout * (frames_in + self.n)
        if self.min_rate > 0:
            bound += frames_in * self.largest_payload / self.min_rate
        return bound

    def placed(self, start: int, stop: int) -> memoryview:
        """Where the encoded chunk [start, stop) lies in `result` (chunks start on a block boundary)."""
        offset = quant.code_bytes(start, self.bits) + 8 * (start // self.block)
        return self.result.data[offset : offset + self._size(stop - start)]

    def _spare(self) -> bytearray:
        with self.lock:
            if self.spares:
                return self.spares.pop()
        return bytearray(self.largest_payload)

    def _size(self, length: int) -> int:
        return quant.payload_size(length, self.block, self.bits)

    def finish_chunk(self, chunk: int, start: int, stop: int, payload: Buffer) -> None:
        with self.lock:
            self.finals.append((start, stop, payload))
        self.slots.put(("ag", 0, chunk), payload)

    def _decompress(
        self, decompressor: zstandard.ZstdDecompressor | None, payload: Buffer, length: int
    ) -> bytes:
        if decompressor is None:
            raise FrameError("zstd frame, but zstd is off for this all-reduce")
        try:
            return decompressor.decompress(payload, max_output_size=self._size(length))
        except zstandard.ZstdError as exc:
            raise FrameError(f"bad zstd payload: {exc}") from None

    def check_results(self) -> None:
        """Once every frame is in: robust aggregation's bound on every owner's result."""
        if self.aggregator is not None:
            self.aggregator.check_results()

    def holding_digest(self) -> bytes:
        """What the barrier's signature covers beside the attempt: nothing here, where every member
        decodes the same bytes that owners signed or passed on (gather.py's differs)."""
        return b""

    def testimony(self) -> bytes:
        """What this member's first barrier frame carries (barrier.py): nothing here."""
        return b""

    def testimony_check(self) -> Testimony | None:
        """What checks the predecessor's testimony (gather.py's); None where there is none."""
        return None

    def write_result(self, buffer: np.ndarray) -> None:
        """Decode every final chunk into `buffer`: the same bytes on every member, so the same floats."""
        chunks = [
            (start, stop, quant.decode_payload(payload, stop - start, block=self.block, bits=self.bits))
            for start, stop, payload in self.finals
        ]
        quant.dequantize_chunks(chunks, buffer)


def _identity(header: dict) -> tuple:
    """What a data frame's header says it is: (kind, step, round, chunk, value count)."""
    return tuple(header.get(key) for key in ("kind", "step", "round", "chunk", "n"))
