"""Robust aggregation that every member can check: signed norm claims and signed chunk results.

Under `comm.robust` (the butterfly, clipping.py) the owner of a segment clips the members' shares of
it before summing. An owner that does not clip, or writes anything it likes into its segment,
would otherwise change every member's params silently. So:

1. Each member claims, for every chunk, the L2 norm of its own values (before its weight and before
   quantization) and signs the claims of each segment for (step, membership digest, segment). It
   sends them to the segment's owner ahead of its shares (a "claims" frame) and keeps its own.
2. The owner clips every share to min(claim × slack, clip × median of the claims) (`clipping.limits`);
   a member's share larger than its own claim is cut to the claim, so a low claim buys nothing.
3. The owner sends the n signed claims it used (the "bundle") ahead of its segment in the all-gather,
   and signs every chunk of its result: sha256(payload) under (step, digest, segment, chunk). The
   bundle and the chunks travel around the ring unchanged; every member checks the signatures as
   the frames arrive (a forwarder that changed one is named: honest members check before they
   forward) and, once all frames are in, that each chunk's norm is within the clip rule's bound
   Σ fᵢ · limitᵢ × slack (the reweighted mean is scaled into it, clipping.py). A result
   outside it fails the attempt on every honest member alike (the same bytes, the same claims),
   naming the owner: its signature shows the result is its own.

One member cannot equivocate usefully: a claim about a chunk matters only to that chunk's owner and
to the check of that owner's result, which uses the very claims the owner used (signed by their
claimers). A member with weight 0 contributes nothing (its share is dropped).
"""

from __future__ import annotations

import hashlib
import statistics
import struct
import threading
from collections.abc import Sequence

import numpy as np

from p2ptrain.comm.codec.quant import Buffer
from p2ptrain.comm.robust import clipping
from p2ptrain.comm.transport.wire import FrameError
from p2ptrain.identity import SIGNATURE_BYTES, NodeIdentity, short_id, verify

CLAIMS_DOMAIN = b"p2ptrain/claims/v1\0"
RESULT_DOMAIN = b"p2ptrain/result/v1\0"
_HEAD = struct.Struct("<QII")  # step, segment, number of chunks
SLACK = {8: 1.05, 4: 1.25}
"""How much larger than the raw values' norm their decoded codes may be (quantization noise adds to
the norm; int8 adds ~0.01 %, int4 ~1 % on Gaussian values, more on spiky blocks): an honest share is
never clipped below its claim for it, and an honest owner's encoded sum stays within the bound."""


def claim_bytes(chunks: int) -> int:
    """Size of one member's signed claims for a segment of `chunks` chunks."""
    return _HEAD.size + 8 * chunks + SIGNATURE_BYTES


def chunk_norms(values: np.ndarray, bounds: Sequence[tuple[int, int]]) -> np.ndarray:
    """The L2 norm (float64) of `values[start:stop]` for each chunk."""
    return np.array([clipping.norm(values[start:stop]) for start, stop in bounds], np.float64)


def sign_claims(
    identity: NodeIdentity, step: int, *, digest: bytes, segment: int, norms: np.ndarray
) -> bytes:
    body = _HEAD.pack(step, segment, len(norms)) + np.asarray(norms, "<f8").tobytes()
    return body + identity.sign(CLAIMS_DOMAIN + digest + body)


def read_claims(
    blob: bytes, key: bytes, *, step: int, digest: bytes, segment: int, chunks: int
) -> np.ndarray:
    """The norms `key` signed for (step, digest, segment); FrameError for anything else."""
    who = short_id(key)
    if len(blob) != claim_bytes(chunks):
        raise FrameError(
            f"{who}'s claims for segment {segment}: {len(blob)} bytes, not {claim_bytes(chunks)}"
        )
    body, signature = blob[:-SIGNATURE_BYTES], blob[-SIGNATURE_BYTES:]
    if _HEAD.unpack_from(body) != (step, segment, chunks):
        raise FrameError(f"{who}'s claims are for another step, segment or chunk count")
    if not verify(key, signature, CLAIMS_DOMAIN + digest + body):
        raise FrameError(f"{who}'s claims for segment {segment} carry a bad signature")
    norms = np.frombuffer(body, "<f8", offset=_HEAD.size).astype(np.float64)
    if not (np.isfinite(norms).all() and (norms >= 0).all()):
        raise FrameError(f"{who} claims a negative or non-finite norm")
    return norms


def read_bundle(
    blob: bytes, keys: Sequence[bytes], *, step: int, digest: bytes, segment: int, chunks: int
) -> np.ndarray:
    """Every member's claims for a segment, as the owner forwards them: (members, chunks) norms."""
    size = claim_bytes(chunks)
    if len(blob) != size * len(keys):
        raise FrameError(f"claims bundle of segment {segment}: {len(blob)} bytes, not {size * len(keys)}")
    rows = [
        read_claims(
            blob[i * size : (i + 1) * size], key, step=step, digest=digest, segment=segment, chunks=chunks
        )
        for i, key in enumerate(keys)
    ]
    return np.stack(rows)


def limits(claims: np.ndarray, fractions: Sequence[float], *, clip: float, bits: int) -> np.ndarray:
    """Per member, the largest norm (per unit of weight) its share of one chunk may count with:
    min(claim × slack, clip × median of the weighted members' claims); 0 for weight 0."""
    weighted = [float(claim) for claim, fraction in zip(claims, fractions, strict=True) if fraction > 0]
    cap = clip * statistics.median(weighted) if weighted else 0.0
    per_member = [
        min(float(claim) * SLACK[bits], cap) if fraction > 0 else 0.0
        for claim, fraction in zip(claims, fractions, strict=True)
    ]
    return np.array(per_member)


def result_bound(claims: np.ndarray, fractions: Sequence[float], *, clip: float, bits: int) -> float:
    """The largest norm an owner's decoded sum of one chunk may have under the clip rule: the
    triangle inequality over the clipped shares, times the slack of encoding the sum."""
    return float(np.dot(np.asarray(fractions), limits(claims, fractions, clip=clip, bits=bits))) * SLACK[bits]


def result_message(digest: bytes, step: int, *, segment: int, chunk: int, payload: Buffer) -> bytes:
    """What the owner signs for one chunk of its result."""
    return RESULT_DOMAIN + digest + _HEAD.pack(step, segment, chunk) + hashlib.sha256(payload).digest()


class Ledger:
    """One member's claims, bundles and result signatures in one robust all-reduce (see above).

    Its methods are called from the transfer's threads; each raises FrameError for what a peer sent
    wrong, which the caller turns into a failed attempt naming that peer."""

    def __init__(
        self,
        *,
        identity: NodeIdentity,
        step: int,
        digest: bytes,
        keys: Sequence[bytes],
        fractions: Sequence[float],
        clip: float,
        bits: int,
        chunks: Sequence[Sequence[tuple[int, int]]],
        own: np.ndarray,
    ):
        """`keys`, `fractions`: the members in order and their shares of the average; `clip`,
        `bits`: comm.clip and comm.bits; `chunks`: per segment, its chunks' (start, stop); `own`:
        this member's vector (its claims are the norms of its chunks)."""
        self.identity = identity
        self.step = step
        self.digest = digest
        self.keys = list(keys)
        self.fractions = list(fractions)
        self.clip = clip
        self.bits = bits
        self.chunks = chunks
        self.own = own
        self.index = self.keys.index(identity.public_key)
        self.own_segment = (self.index + 1) % len(self.keys)
        self.lock = threading.Lock()
        self.claims: dict[int, bytes] = {}
        """Each member's signed claims for our segment, as they arrive (ours last)."""
        self.bundles: dict[int, np.ndarray] = {}
        """Segment → every member's claims for it, (members, chunks), as its owner sent them."""
        self.signatures: dict[tuple[int, int], bytes] = {}
        """(segment, chunk) → its owner's signature of that chunk of the result."""
        self.norms: dict[tuple[int, int], float] = {}
        """(segment, chunk) → the norm of the decoded result chunk we received."""

    def owner(self, segment: int) -> int:
        return (segment - 1) % len(self.keys)

    def own_claims(self, segment: int) -> bytes:
        """Our signed norm claims for `segment`."""
        norms = chunk_norms(self.own, self.chunks[segment])
        return sign_claims(self.identity, self.step, digest=self.digest, segment=segment, norms=norms)

    def claims_arrived(self, peer: int, blob: bytes) -> tuple[bytes, list[np.ndarray]] | None:
        """`peer`'s claims for our segment; once every peer's are in, the bundle to send ahead of our
        segment and, per chunk of it, each member's limit (`limits`)."""
        count = len(self.chunks[self.own_segment])
        read_claims(
            blob, self.keys[peer], step=self.step, digest=self.digest, segment=self.own_segment, chunks=count
        )
        with self.lock:
            self.claims[peer] = blob
            if len(self.claims) < len(self.keys) - 1:
                return None
        self.claims[self.index] = self.own_claims(self.own_segment)
        bundle = b"".join(self.claims[member] for member in range(len(self.keys)))
        norms = read_bundle(
            bundle, self.keys, step=self.step, digest=self.digest, segment=self.own_segment, chunks=count
        )
        return bundle, [
            limits(norms[:, chunk], self.fractions, clip=self.clip, bits=self.bits) for chunk in range(count)
        ]

    def bundle_arrived(self, segment: int, blob: bytes) -> None:
        count = len(self.chunks[segment])
        self.bundles[segment] = read_bundle(
            blob, self.keys, step=self.step, digest=self.digest, segment=segment, chunks=count
        )

    def sign_result(self, chunk: int, payload: Buffer) -> None:
        message = result_message(
            self.digest, self.step, segment=self.own_segment, chunk=chunk, payload=payload
        )
        self.signatures[(self.own_segment, chunk)] = self.identity.sign(message)

    def signature(self, segment: int, chunk: int) -> bytes:
        return self.signatures[(segment, chunk)]

    def result_arrived(
        self, segment: int, chunk: int, *, signature: object, payload: Buffer, values: np.ndarray
    ) -> None:
        """A chunk of the all-gather (`values` decoded) must carry its owner's signature of exactly
        these bytes; keep the signature to send on, and the norm for `violation`."""
        message = result_message(self.digest, self.step, segment=segment, chunk=chunk, payload=payload)
        owner_key = self.keys[self.owner(segment)]
        if not isinstance(signature, bytes) or not verify(owner_key, signature, message):
            raise FrameError(f"chunk {chunk} of segment {segment} does not carry its owner's signature")
        self.signatures[(segment, chunk)] = signature
        self.norms[(segment, chunk)] = clipping.norm(values)

    def violation(self) -> tuple[int, str] | None:
        """Once every frame is in: the owner of the first chunk we received above the clip rule's
        bound (from the claims that owner used), and why; None when every chunk is within it."""
        for (segment, chunk), size in sorted(self.norms.items()):
            bound = result_bound(
                self.bundles[segment][:, chunk], self.fractions, clip=self.clip, bits=self.bits
            )
            if not size <= bound * (1 + 1e-6):
                owner = self.owner(segment)
                return owner, (
                    f"{short_id(self.keys[owner])}'s result for chunk {chunk} of segment {segment} has norm "
                    f"{size:.4g}, above the clip rule's bound {bound:.4g} from the members' claims: "
                    "not applied"
                )
        return None
