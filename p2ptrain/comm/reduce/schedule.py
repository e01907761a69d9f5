"""Who talks to whom in one all-reduce, and which frames travel on each connection (allreduce.py).

Member i owns segment i+1 mod n; every segment is cut into chunks on block boundaries. A stream is
what one member sends another, in order; its frames are the chunks of the stream's segments, and
with M lanes per pair of members the frames take the lanes in turn.
"""

from __future__ import annotations

from dataclasses import dataclass

from p2ptrain.comm.robust.clipping import MIN_MEMBERS
from p2ptrain.config import CommConfig

Stream = list[tuple[str, int, int]]
"""What travels from one member to another, in order: (phase, round, segment) for every chunk of
the segment. Phases: "rs" (reduce-scatter), "ag" (all-gather), "sg" (the sparse codec's gather:
each member's own share of the segment, round = segment)."""
FrameSpec = tuple[str, int, int, int, int]
"""One frame of a stream: (phase, round, chunk, start, stop)."""


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


AUTO_RING_MAX_MEMBERS = 3
MIN_ROBUST_MEMBERS = MIN_MEMBERS
"""Robust aggregation needs a majority to tell a poisoner from: with two members neither outvotes
the other, so their step is the plain mean (ring, no claims) whatever comm.robust says."""
GATHER = "sg"
SPARSE_FRAME_VALUES = 32
"""Under the sparse codec a frame holds this many times the values of a dense one (chunk_bytes / 4):
at 0.23 bits a value, about 1 MB on the wire for the default 4 MiB."""
CLAIMS, BUNDLE = "cl", "bd"
"""Robust aggregation's frames: a member's signed norm claims, an owner's bundle of them (claims.py)."""


def robust(comm: CommConfig, members: int) -> bool:
    """Whether a step of `members` aggregates robustly (the same answer on every member): with the
    sparse codec, where every member has every share, each computes the same robust sum alone."""
    return comm.aggregation != "off" and members >= MIN_ROBUST_MEMBERS


def choose_topology(comm: CommConfig, members: int, behind_nat: int = 0) -> str:
    """`behind_nat`: members nobody can dial. Two of them connect through a relay (relay.py), and
    the butterfly connects every pair: "auto" then takes the ring, whose order keeps them apart.
    The sparse codec's shares do not add up along a ring (their indices differ): they are gathered."""
    if comm.codec == "sparse":
        return "gather"
    if robust(comm, members):
        return "butterfly"  # the ring re-encodes partial sums: no member's share is seen alone
    if comm.topology != "auto":
        return comm.topology
    if behind_nat >= 2:
        return "ring"
    return "ring" if members <= AUTO_RING_MAX_MEMBERS else "butterfly"


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """One member's view of the all-reduce's traffic: the same function of (n, length, comm) on
    every member, so what one sends is exactly what its peer expects."""

    index: int
    n: int
    topology: str
    chunks: list[list[tuple[int, int]]]
    """Per segment, the (start, stop) of its chunks."""
    lanes: int
    robust: bool = False
    """Robust aggregation (comm.robust): each reduce-scatter stream starts with the sender's signed
    norm claims ("cl") and each segment of the all-gather with its owner's bundle of claims ("bd"),
    claims.py; in those frames `chunk` is the segment and (start, stop) is empty."""

    @classmethod
    def of(cls, *, index: int, n: int, length: int, comm: CommConfig, behind_nat: int = 0) -> Schedule:
        """Member `index` of `n` reducing `length` values; `behind_nat`: members nobody can dial."""
        topology = choose_topology(comm, n, behind_nat)
        block = comm.sparse_chunk if topology == "gather" else comm.quant_block
        values = comm.chunk_bytes // 4 * (SPARSE_FRAME_VALUES if topology == "gather" else 1)
        bounds = segment_bounds(length, n, block)
        chunk = max(block, (values // block) * block)
        chunks = [chunk_bounds(bounds[s], bounds[s + 1], chunk) for s in range(n)]
        return cls(
            index=index,
            n=n,
            topology=topology,
            chunks=chunks,
            lanes=comm.connections,
            robust=robust(comm, n) and topology != "gather",  # a gather's robust sum needs no frames
        )

    @property
    def successor(self) -> int:
        return (self.index + 1) % self.n

    @property
    def predecessor(self) -> int:
        return (self.index - 1) % self.n

    def others(self) -> list[int]:
        return [peer for peer in range(self.n) if peer != self.index]

    def out_peers(self) -> list[int]:
        return [self.successor] if self.topology == "ring" else self.others()

    def in_peers(self) -> list[int]:
        return [self.predecessor] if self.topology == "ring" else self.others()

    def send_stream(self, peer: int) -> Stream:
        n, i = self.n, self.index
        if self.topology == "gather":  # our whole share, to every other member
            return [(GATHER, segment, segment) for segment in range(n)]
        if self.topology == "ring":
            stream = [("rs", rnd, (i - rnd) % n) for rnd in range(n - 1)]
        else:
            stream = [("rs", 0, (peer + 1) % n)]
        if peer == self.successor:
            stream += [("ag", rnd, (i + 1 - rnd) % n) for rnd in range(n - 1)]
        return stream

    def receive_stream(self, peer: int) -> Stream:
        n, i = self.n, self.index
        if self.topology == "gather":
            return [(GATHER, segment, segment) for segment in range(n)]
        if self.topology == "ring":
            stream = [("rs", rnd, (i - rnd - 1) % n) for rnd in range(n - 1)]
        else:
            stream = [("rs", 0, (i + 1) % n)]
        if peer == self.predecessor:
            stream += [("ag", rnd, (i - rnd) % n) for rnd in range(n - 1)]
        return stream

    def frames(self, stream: Stream, lane: int | None = None) -> list[FrameSpec]:
        """The frames of a stream in order; with `lane`, only those that lane carries."""
        every: list[FrameSpec] = []
        for phase, rnd, segment in stream:
            if self.robust:
                every.append((CLAIMS if phase == "rs" else BUNDLE, rnd, segment, 0, 0))
            every.extend(
                (phase, rnd, chunk, start, stop) for chunk, (start, stop) in enumerate(self.chunks[segment])
            )
        return every if lane is None else every[lane :: self.lanes]

    def owner(self, segment: int) -> int:
        return (segment - 1) % self.n

    def sent_segment(self, rnd: int) -> int:
        """The segment whose chunks we send in all-gather round `rnd`."""
        return (self.index + 1 - rnd) % self.n

    def received_segment(self, rnd: int) -> int:
        """The segment whose chunks we receive in all-gather round `rnd`."""
        return (self.index - rnd) % self.n

    def send_frames(self, peer: int, lane: int | None = None) -> list[FrameSpec]:
        """The frames we send `peer` (on `lane`)."""
        return self.frames(self.send_stream(peer), lane)

    def receive_frames(self, peer: int, lane: int | None = None) -> list[FrameSpec]:
        """The frames `peer` sends us (on `lane`)."""
        return self.frames(self.receive_stream(peer), lane)

    def frames_in(self) -> int:
        """How many frames we receive in all."""
        return sum(len(self.receive_frames(peer)) for peer in self.in_peers())
