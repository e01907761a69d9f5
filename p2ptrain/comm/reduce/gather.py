"""The sparse codec's sync: every member sends its share to every other member, and each computes
the same weighted, robust mean of all of them alone.

Shares of different members keep different indices, so partial sums along a ring would grow
denser at every hop; instead each member uploads its share (codec/sparse.py) n − 1 times and
downloads the n − 1 others. Against the dense int8 ring's 2(n − 1)/n bytes per value, that is
(n − 1) × s/8 at s bits per value: at 0.234 bits, 1/68 of the ring's upload at 2 members, 1/8 at 9
(docs/results/2026-12-allreduce.md has the measured crossover). The frames are the share's chunk-aligned
ranges (schedule.py's "sg" frames, the same lanes, handshake, relays, keepalives and warm lanes as
the dense topologies); each lands straight at its place in that member's copy.

Once every share is in, each member computes, from the same bytes in the same order:
- each share's validity and norm (`sparse.squared_norm`): a malformed one counts 0, on every
  member alike, and is reported (left_out);
- under robust aggregation (comm.robust, from 3 members), each share's factor min(1, clip × the
  median norm / its norm): no member counts for more than `clip` typical members in size;
- under "reweighted" (an open run's default), each share's weight by its direction: its score
  is how well it agrees with the other shares (`agreement_scores`: the (f + 1)-th largest of its
  cosines with them, f = (n − 1) // 3), whole from half the members' median score up, nothing at
  0 or below, its weight handed to the others (`_kept_by_direction`): a member sending the
  opposite of what it learned, a random direction or zeros counts for about nothing. It needs no
  reference of anyone's own: it comes from the shares every member holds alike;
- the result, 0 plus weight_i × decode(share_i) for i in member order, in fp32: the same floats on
  every member.
So nothing needs an owner to trust or claims to check. What could still differ is the shares
themselves: a member that sends one share to some and another to others. So each member signs its
share (sha256, under the attempt's membership digest: the header of its first frame to each peer),
a share whose bytes are not the ones signed fails the attempt naming its sender, the barrier
(barrier.py) signs the sha256 of all n shares as each member holds them, and each member's first
barrier frame carries every share's hash and signature as it holds them (its testimony): a member
whose predecessor holds another share of X, signed by X too, fails the attempt naming X, with
both signatures as proof; its successors fail with it, and nobody takes a result that differs.
"""

from __future__ import annotations

import hashlib
import math
import statistics
from collections.abc import Sequence

import numpy as np

from p2ptrain.comm.codec import sparse
from p2ptrain.comm.codec.quant import Buffer, PayloadError
from p2ptrain.comm.net.attempt import AllReduceError
from p2ptrain.comm.net.members import Member
from p2ptrain.comm.reduce.barrier import Proven, Testimony
from p2ptrain.comm.reduce.plan import Progress, ReducePlan
from p2ptrain.comm.reduce.schedule import GATHER, FrameSpec, robust
from p2ptrain.comm.robust.clipping import CUT_FAR, LEFT_OUT, MIN_MEMBERS, kept_by_cosine
from p2ptrain.comm.transport import lanes
from p2ptrain.comm.transport.wire import FrameError
from p2ptrain.config import CommConfig
from p2ptrain.identity import SIGNATURE_BYTES, NodeIdentity, short_id, verify

SHARE_DOMAIN = b"p2ptrain/share/v1\0"
SMALL = 2.0
"""Under the direction rule, a share of under 1/SMALL of the median share's norm keeps that much of
its weight in proportion (the rest goes to the others): a member that sends next to nothing with
its full token count (zeros, or what is left of its accumulator once it stops adding to it)
otherwise shrinks every step by its weight."""
HASH_BYTES = 32
WITNESS_BYTES = HASH_BYTES + SIGNATURE_BYTES
"""One member's entry in a testimony: its share's sha256, and its signature of it."""


def sparse_code(comm: CommConfig) -> sparse.SparseCode:
    return sparse.SparseCode(chunk=comm.sparse_chunk, k=comm.sparse_k)


def share_statement(digest: bytes, share_hash: bytes) -> bytes:
    """What a member signs of its share: the attempt's membership digest (it covers the step and the
    members) and the share's sha256."""
    return SHARE_DOMAIN + digest + share_hash


def kept_by_size(kept: list[float], norms: list[float | None], typical: float) -> list[float]:
    """`kept` with each share of under 1/SMALL of the `typical` (median) norm keeping that much of
    it in proportion: a share far smaller than the others' counts as what it holds."""
    return [
        fraction if norm is None else fraction * min(1.0, SMALL * norm / typical)
        for fraction, norm in zip(kept, norms, strict=True)
    ]


def agreement_scores(gram: list[list[float]]) -> list[float]:
    """Per share, how well it agrees with the others': of its cosines with every other share
    (from their Gram matrix; 0 with a share of zeros), the (f + 1)-th largest, f = (q − 1) // 3 of
    the q shares. A poisoner's share agrees with no honest one (opposite, random, zero: cosine ≤ 0
    or about 0), and up to f poisoners that agree with each other cannot vouch for one another;
    an honest share agrees with the other honest ones a little (pseudo-gradients of one run).
    Measured on synthetic shares, this kept a random share's weight under a fifth where a cosine
    with the shares' coordinate-wise median kept up to nine tenths of it: at a coordinate only a
    few members keep, the median is theirs, so each share partly agrees with itself."""
    count = len(gram)
    sizes = [math.sqrt(gram[a][a]) for a in range(count)]
    tolerated = (count - 1) // 3
    scores = []
    for a in range(count):
        cosines = sorted(
            (
                gram[a][b] / (sizes[a] * sizes[b]) if sizes[a] > 0 and sizes[b] > 0 else 0.0
                for b in range(count)
                if b != a
            ),
            reverse=True,
        )
        scores.append(cosines[tolerated])
    return scores


class GatherPlan(ReducePlan):
    """One member's part in a sparse gather: sends `own_share`, collects every other member's."""

    def __init__(
        self,
        *,
        index: int,
        members: Sequence[Member],
        own: np.ndarray,
        own_share: bytearray,
        comm: CommConfig,
        step: int,
        progress: Progress | None,
        identity: NodeIdentity,
        digest: bytes,
    ):
        self.code = sparse_code(comm)  # before the base class sizes its buffers with _size
        super().__init__(
            index=index,
            members=members,
            own=own,
            comm=comm,
            step=step,
            progress=progress,
            identity=identity,
            digest=digest,
        )
        assert self.schedule.topology == "gather"
        size = self.code.payload_size(own.shape[0])
        if len(own_share) != size:
            raise ValueError(f"a share of {len(own_share)} bytes for {own.shape[0]} values")
        self.shares: list[bytearray] = [
            own_share if member == index else bytearray(size) for member in range(self.n)
        ]
        self.weights: list[float] = []
        """Each member's weight in the result, settled by `check_results`."""
        self.identity, self.digest = identity, digest
        self.hashes: list[bytes] = [b""] * self.n
        """Each member's share's sha256, as this member holds them (once every frame is in)."""
        self.signatures: list[bytes] = [b""] * self.n
        """Each member's signature of its share, from the header of its first frame to us."""
        self.hashes[index] = hashlib.sha256(own_share).digest()
        self.signatures[index] = identity.sign(share_statement(digest, self.hashes[index]))

    def _size(self, length: int) -> int:
        return self.code.payload_size(length)

    def _range(self, start: int, stop: int) -> slice:
        return slice(self.code.offset(start), self.code.offset(start) + self._size(stop - start))

    def _outgoing(
        self, spec: FrameSpec, scratch: bytearray, channel: lanes.Channel
    ) -> tuple[Buffer, bytearray | None]:
        phase, _, _, start, stop = spec
        assert phase == GATHER
        return memoryview(self.shares[self.index])[self._range(start, stop)], None

    def _signature(self, spec: FrameSpec) -> bytes | None:
        """Our share's signature, with the first frame of our stream to each peer."""
        _, segment, chunk, _, _ = spec
        return self.signatures[self.index] if (segment, chunk) == (0, 0) else None

    def _place(
        self, peer: int, spec: FrameSpec, scratch: memoryview, header: dict, length: int
    ) -> memoryview | None:
        _, _, _, start, stop = spec
        if header.get("zstd") or length != self._size(stop - start):
            return None  # a fresh buffer; the checks after the read refuse what is wrong
        return memoryview(self.shares[peer])[self._range(start, stop)]

    def _incoming(self, peer: int, spec: FrameSpec, header: dict, payload: Buffer) -> None:
        _, segment, chunk, start, stop = spec
        if (segment, chunk) == (0, 0):
            signature = header.get("sig")
            if not isinstance(signature, bytes) or len(signature) != SIGNATURE_BYTES:
                raise self._blame(peer, "its first sparse frame does not carry the signature of its share")
            self.signatures[peer] = signature
        place = self._range(start, stop)
        if len(payload) != place.stop - place.start:
            raise FrameError(f"a sparse frame of {len(payload)} bytes for {stop - start} values")
        if not (isinstance(payload, memoryview) and payload.obj is self.shares[peer]):
            self.shares[peer][place] = payload  # not received in place (zstd): copied there

    def _blame(self, peer: int, message: str) -> AllReduceError:
        """The attempt fails and names `peer`: what it sent proves it broke the protocol."""
        return AllReduceError(f"step {self.step}: {message}", unresponsive=self.keys[peer])

    def check_results(self) -> None:
        """Every share is in: each is the one its sender signed (else the attempt fails naming it),
        then each member's weight by the rule every member applies alike."""
        for member in self.schedule.others():
            self.hashes[member] = hashlib.sha256(self.shares[member]).digest()
            statement = share_statement(self.digest, self.hashes[member])
            if not verify(self.keys[member], self.signatures[member], statement):
                raise self._blame(member, "its sparse share is not the one it signed")
        length = self.own.shape[0]
        norms: list[float | None] = []
        for share in self.shares:
            try:
                norms.append(math.sqrt(sparse.squared_norm(share, length, self.code)))
            except PayloadError:
                norms.append(None)
        factors = [0.0 if norm is None else 1.0 for norm in norms]
        kept = [1.0] * self.n
        if robust(self.comm, self.n):
            counted = [
                norm for norm, fraction in zip(norms, self.fractions, strict=True) if norm and fraction > 0
            ]
            # the median of fewer than 3 sizes is no typical size (with two neither outvotes the other)
            typical = statistics.median(counted) if len(counted) >= MIN_MEMBERS else None
            limit = self.comm.clip * typical if typical is not None else math.inf
            factors = [
                factor if norm is None or norm <= limit else limit / norm
                for factor, norm in zip(factors, norms, strict=True)
            ]
            if self.comm.aggregation == "reweighted":
                kept = self._kept_by_direction(norms, factors)
                if typical is not None:
                    kept = kept_by_size(kept, norms, typical)
        self.weights = self._settled(factors, kept)
        self.stats.shares, self.stats.weights = list(self.shares), self.weights
        for member, (norm, factor) in enumerate(zip(norms, factors, strict=True)):
            if norm is None or kept[member] < LEFT_OUT:
                self.stats.left_out[self.keys[member]] = 1
            elif factor < CUT_FAR:
                self.stats.clipped[self.keys[member]] = 1

    def _kept_by_direction(self, norms: list[float | None], factors: list[float]) -> list[float]:
        """Per member, the fraction of its weight it keeps by how its share agrees with the others'
        (`agreement_scores`, weighed against their median by clipping.kept_by_cosine); 1 for all
        where the scores say nothing. Computed from the shares alone, which every member holds
        alike, in double and in one order (sparse.gram): every member weighs alike, with no
        reference of its own."""
        counted = [  # a share of zeros too: it agrees with nobody, so it keeps nothing of its claim
            member
            for member in range(self.n)
            if norms[member] is not None and factors[member] > 0 and self.fractions[member] > 0
        ]
        kept = [1.0] * self.n
        if len(counted) < MIN_MEMBERS:
            return kept
        gram = sparse.gram([self.shares[member] for member in counted], self.own.shape[0], self.code)
        by_direction = kept_by_cosine(agreement_scores(gram))
        if by_direction is not None:
            for member, fraction in zip(counted, by_direction, strict=True):
                kept[member] = fraction
        return kept

    def _settled(self, factors: list[float], kept: list[float]) -> list[float]:
        """Each member's weight in the result, fraction × norm factor × kept, the kept ones' scaled
        so that the valid shares' fractions still sum as they did (a share left out for its
        direction hands its weight to the others, as the dense rule's weighted mean does). fp32,
        from double arithmetic in member order: the same floats on every member."""
        valid = [member for member in range(self.n) if factors[member] > 0]
        whole = sum(self.fractions[member] for member in valid)
        keeping = sum(self.fractions[member] * kept[member] for member in valid)
        scale = whole / keeping if keeping > 0 else 1.0
        return [
            float(np.float32(fraction * factor * fraction_kept * scale))
            for fraction, factor, fraction_kept in zip(self.fractions, factors, kept, strict=True)
        ]

    def holding_digest(self) -> bytes:
        """sha256 over every member's share's sha256, in member order: what the barrier signs."""
        return hashlib.sha256(b"".join(self.hashes)).digest()

    def testimony(self) -> bytes:
        """Every member's share hash and signature, in member order (WITNESS_BYTES each)."""
        return b"".join(h + s for h, s in zip(self.hashes, self.signatures, strict=True))

    def testimony_check(self) -> Testimony | None:
        return self._check_testimony

    def _check_testimony(self, theirs: bytes) -> None:
        """The predecessor's testimony against ours: Proven naming a member that signed another
        share than the one we hold, or naming the predecessor where its testimony does not hold up
        (it came on the predecessor's authenticated lane: nobody else could have written it)."""
        predecessor = self.keys[self.schedule.predecessor]
        if len(theirs) != WITNESS_BYTES * self.n:
            raise Proven(f"a testimony of {len(theirs)} bytes for {self.n} members", predecessor)
        for member in range(self.n):
            entry = theirs[member * WITNESS_BYTES : (member + 1) * WITNESS_BYTES]
            share_hash, signature = entry[:HASH_BYTES], entry[HASH_BYTES:]
            if share_hash == self.hashes[member]:
                continue
            if not verify(self.keys[member], signature, share_statement(self.digest, share_hash)):
                raise Proven(f"a testimony with a share member {member} did not sign", predecessor)
            raise Proven(
                f"{short_id(self.keys[member])} signed two different shares of step {self.step} "
                "(one sent to this member, another to its predecessor)",
                self.keys[member],
            )

    def write_result(self, buffer: np.ndarray) -> None:
        sparse.weighted_sum(self.shares, self.weights, buffer, self.code, threads=self.threads)
