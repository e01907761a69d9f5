"""Robust aggregation inside one all-reduce: the owner's side (clip to the claimed limits, sign the
result) and every member's (check signatures as frames arrive, the bound once all are in).

Mixed into ring._AllReduce, whose threads call these methods; claims.Ledger holds the signed state.
"""

from __future__ import annotations

import threading

import numpy as np

from p2ptrain.comm import claims, quant, robust
from p2ptrain.comm.attempt import AllReduceError
from p2ptrain.comm.members import RingStats
from p2ptrain.comm.quant import Buffer
from p2ptrain.comm.schedule import BUNDLE, Schedule
from p2ptrain.comm.transfer import Slots
from p2ptrain.comm.wire import FrameError


class RobustReduce:
    """The robust-aggregation part of ring._AllReduce (`clip` > 0)."""

    # what it uses of the all-reduce
    n: int
    index: int
    step: int
    keys: list[bytes]
    fractions: list[float]
    share: float
    own: np.ndarray
    block: int
    bits: int
    threads: int
    schedule: Schedule
    slots: Slots
    lock: threading.Lock
    chunk_locks: list[threading.Lock]
    contributions: dict[int, dict[int, np.ndarray]]
    stats: RingStats
    ledger: claims.Ledger | None
    limits: list[np.ndarray] | None
    waiting: list[int]

    def placed(self, start: int, stop: int) -> memoryview:
        raise NotImplementedError

    def _finish_chunk(self, chunk: int, start: int, stop: int, payload: Buffer) -> None:
        raise NotImplementedError

    def _blame(self, peer: int, message: str) -> AllReduceError:
        """The attempt fails and names `peer`: what it sent proves it broke the protocol."""
        return AllReduceError(f"step {self.step}: {message}", unresponsive=self.keys[peer])

    def _absorb_claims(self, peer: int, phase: str, rnd: int, segment: int, blob: bytes) -> None:
        assert self.ledger is not None
        try:
            if phase == BUNDLE:
                self.ledger.bundle_arrived(segment, blob)
                if rnd < self.n - 2:
                    self.slots.put((BUNDLE, rnd + 1, segment), blob)
                return
            complete = self.ledger.claims_arrived(peer, blob)
        except FrameError as exc:
            raise self._blame(peer, str(exc)) from None
        if complete is not None:  # every claim for our segment is in: reduce what waited for it
            bundle, limits = complete
            with self.lock:
                self.limits = limits
                waiting, self.waiting = self.waiting, []
            self.slots.put((BUNDLE, 0, self.ledger.own_segment), bundle)
            for chunk in waiting:
                self._reduce_clipped(chunk)

    def _absorb_clipped(self, peer: int, chunk: int, start: int, stop: int, encoded: quant.Encoded) -> None:
        """Keep each share of the chunk; once all of them and all claims are in, clip and sum them."""
        values = np.zeros(stop - start, np.float32)
        quant.dequantize_add(encoded, values, self.threads)
        with self.chunk_locks[chunk]:
            arrived = self.contributions.setdefault(chunk, {})
            arrived[peer] = values
            if len(arrived) < self.n - 1:
                return
        with self.lock:
            if self.limits is None:
                self.waiting.append(chunk)
                return
        self._reduce_clipped(chunk)

    def _reduce_clipped(self, chunk: int) -> None:
        assert self.ledger is not None and self.limits is not None
        start, stop = self.schedule.chunks[self.ledger.own_segment][chunk]
        with self.chunk_locks[chunk]:
            arrived = self.contributions.pop(chunk)
        arrived[self.index] = np.multiply(self.own[start:stop], np.float32(self.share))
        total, clipped = robust.clipped_sum(arrived, self.fractions, self.limits[chunk])
        with self.lock:
            for key in (self.keys[member] for member in clipped):
                self.stats.clipped[key] = self.stats.clipped.get(key, 0) + 1
        final = quant.encode_payload(
            total, self.block, 1.0, self.threads, self.placed(start, stop), self.bits
        )
        self.ledger.sign_result(chunk, final)
        self._finish_chunk(chunk, start, stop, final)

    def _check_signed(
        self, peer: int, rnd: int, chunk: int, signature: object, payload: Buffer, encoded: quant.Encoded
    ) -> None:
        assert self.ledger is not None
        values = np.zeros(encoded.size, np.float32)
        quant.dequantize_add(encoded, values, self.threads)
        try:
            self.ledger.result_arrived(self.schedule.received_segment(rnd), chunk, signature, payload, values)
        except FrameError as exc:
            raise self._blame(peer, str(exc)) from None

    def check_results(self) -> None:
        """Once every frame is in: a chunk above the clip rule's bound fails the attempt, naming its owner."""
        violation = self.ledger.violation() if self.ledger is not None else None
        if violation is not None:
            raise self._blame(*violation)
