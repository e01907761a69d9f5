"""Robust aggregation inside one all-reduce: the owner's side (clip to the claimed limits, sign the
result) and every member's (check signatures as frames arrive, the bound once all are in).

The all-reduce (reduce/allreduce.py) holds one `RobustAggregator` under `comm.robust` and hands it
the frames that concern it; the aggregator hands back what it produces through a `ResultSink`.
claims.Ledger holds the signed state; clipping.py the arithmetic.
"""

from __future__ import annotations

import threading
from typing import Protocol

import numpy as np

from p2ptrain.comm.codec import quant
from p2ptrain.comm.codec.quant import Buffer
from p2ptrain.comm.net.attempt import AllReduceError
from p2ptrain.comm.robust import claims, clipping
from p2ptrain.comm.transport.wire import FrameError
from p2ptrain.config import CommConfig


class ResultSink(Protocol):
    """What the aggregator needs of the all-reduce it is part of."""

    def placed(self, start: int, stop: int) -> memoryview:
        """Where the encoded result of values [start, stop) goes."""

    def finish_chunk(self, chunk: int, start: int, stop: int, payload: Buffer) -> None:
        """A chunk of our segment is reduced: send it round the all-gather."""

    def send_bundle(self, bundle: bytes) -> None:
        """Every member's claims for our segment: send them ahead of its all-gather."""


class RobustAggregator:
    """One member's robust aggregation in one all-reduce (the butterfly under `comm.robust`).

    Its methods are called from the transfer's threads. A frame that proves a peer broke the
    protocol raises AllReduceError naming that peer."""

    def __init__(
        self,
        *,
        ledger: claims.Ledger,
        comm: CommConfig,
        threads: int,
        sink: ResultSink,
        reference: np.ndarray | None = None,
    ):
        """`ledger`: this member's signed claims and results of the step (it knows the members,
        their shares, the chunks and this member's vector); `threads`: OpenMP threads per kernel
        call; `reference`: the last result this member took (the whole vector), or None."""
        self.reference = reference
        self.ledger = ledger
        self.step = ledger.step
        self.keys = ledger.keys
        self.fractions = ledger.fractions
        self.index = ledger.index
        self.own = ledger.own
        self.block = comm.quant_block
        self.bits = comm.bits
        self.reweighted = comm.aggregation == "reweighted"
        self.threads = threads
        self.sink = sink
        self.lock = threading.Lock()  # guards limits, waiting, clipped and left_out
        self.chunk_locks = [threading.Lock() for _ in ledger.chunks[ledger.own_segment]]
        self.contributions: dict[int, dict[int, np.ndarray]] = {}
        """Chunk of our segment → the members' decoded shares of it so far."""
        self.limits: list[np.ndarray] | None = None
        """Per chunk of our segment, each member's limit, once every claim is in."""
        self.waiting: list[int] = []
        """Chunks of ours whose shares are all in, waiting for the last claims."""
        self.clipped: dict[bytes, int] = {}
        """Member → chunks of ours (we own them) in which its share was cut to under half its norm."""
        self.left_out: dict[bytes, int] = {}
        """Member → chunks of ours in which the reweighted mean counted it at under half its weight."""

    def _blame(self, peer: int, message: str) -> AllReduceError:
        """The attempt fails and names `peer`: what it sent proves it broke the protocol."""
        return AllReduceError(f"step {self.step}: {message}", unresponsive=self.keys[peer])

    def own_claims(self, segment: int) -> bytes:
        """Our signed norm claims for `segment`, sent to its owner ahead of our shares."""
        return self.ledger.own_claims(segment)

    def claims_arrived(self, peer: int, blob: bytes) -> None:
        """`peer`'s claims for our segment; once all are in, reduce the chunks that waited."""
        try:
            complete = self.ledger.claims_arrived(peer, blob)
        except FrameError as exc:
            raise self._blame(peer, str(exc)) from None
        if complete is None:
            return
        bundle, limits = complete
        with self.lock:
            self.limits = limits
            waiting, self.waiting = self.waiting, []
        self.sink.send_bundle(bundle)
        for chunk in waiting:
            self._reduce(chunk)

    def bundle_arrived(self, peer: int, segment: int, blob: bytes) -> None:
        """The claims `segment`'s owner used, forwarded by `peer`."""
        try:
            self.ledger.bundle_arrived(segment, blob)
        except FrameError as exc:
            raise self._blame(peer, str(exc)) from None

    def share_arrived(self, peer: int, chunk: int, encoded: quant.Encoded) -> None:
        """Keep `peer`'s share of our chunk; once all of them and all claims are in, clip and sum."""
        values = np.zeros(encoded.size, np.float32)
        quant.dequantize_add(encoded, values, self.threads)
        with self.chunk_locks[chunk]:
            arrived = self.contributions.setdefault(chunk, {})
            arrived[peer] = values
            if len(arrived) < len(self.keys) - 1:
                return
        with self.lock:
            if self.limits is None:
                self.waiting.append(chunk)
                return
        self._reduce(chunk)

    def _reduce(self, chunk: int) -> None:
        assert self.limits is not None
        start, stop = self.ledger.chunks[self.ledger.own_segment][chunk]
        with self.chunk_locks[chunk]:
            arrived = self.contributions.pop(chunk)
        arrived[self.index] = np.multiply(self.own[start:stop], np.float32(self.fractions[self.index]))
        summed = clipping.robust_sum(
            arrived,
            self.fractions,
            self.limits[chunk],
            reweighted=self.reweighted,
            reference=None if self.reference is None else self.reference[start:stop],
        )
        with self.lock:
            for counts, members in ((self.clipped, summed.clipped), (self.left_out, summed.left_out)):
                for key in (self.keys[member] for member in members):
                    counts[key] = counts.get(key, 0) + 1
        final = quant.encode_payload(
            summed.total,
            self.block,
            scale=1.0,
            threads=self.threads,
            out=self.sink.placed(start, stop),
            bits=self.bits,
        )
        self.ledger.sign_result(chunk, final)
        self.sink.finish_chunk(chunk, start, stop, final)

    def signature(self, segment: int, chunk: int) -> bytes:
        """The owner's signature of a chunk of the result, sent with it in the all-gather."""
        return self.ledger.signature(segment, chunk)

    def result_arrived(
        self,
        *,
        peer: int,
        segment: int,
        chunk: int,
        signature: object,
        payload: Buffer,
        encoded: quant.Encoded,
    ) -> None:
        """A chunk of the all-gather, forwarded by `peer`: it must carry its owner's signature."""
        values = np.zeros(encoded.size, np.float32)
        quant.dequantize_add(encoded, values, self.threads)
        try:
            self.ledger.result_arrived(segment, chunk, signature=signature, payload=payload, values=values)
        except FrameError as exc:
            raise self._blame(peer, str(exc)) from None

    def check_results(self) -> None:
        """Once every frame is in: a chunk above the clip rule's bound fails the attempt, naming its owner."""
        violation = self.ledger.violation()
        if violation is not None:
            raise self._blame(*violation)
