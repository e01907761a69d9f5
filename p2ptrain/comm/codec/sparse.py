"""Sparse error-feedback codes (comm.codec = "sparse"): what each member sends, and what it keeps.

SparseLoCo (Sarfi et al., arXiv 2508.15706): each node keeps an error-feedback accumulator e of
the model's size and, every outer step, with Δ its pseudo-gradient,

    e ← β·e + Δ;   c ← C(e);   e ← e − decode(c)

and sends c alone. C keeps the top k of every chunk of `chunk` values by magnitude at 2 bits
each (sign, and which half of the kept magnitudes; each half decodes to its mean), with packed
indices: at 4096 and 64, 120 bytes per 4096 values, 0.234 bits per parameter (the record layout is
cython_ext/sparse.pyx's docstring). What is not sent stays in e and goes out in a later step: e
stands in for the outer momentum, which is why a sparse run's outer step defaults to plain SGD at
lr 1 (config.py). Members then apply the weighted mean of the decoded shares, which every member
computes from the same bytes in the same order (comm/reduce/gather.py).

`encode`, `check` and `decode_add` call the compiled kernels (p2ptrain._sparse); `reference_*`
are the same arithmetic in NumPy, the oracle the kernels are tested against.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from p2ptrain.comm.codec.quant import Buffer, NonFiniteError, PayloadError, all_finite

try:
    from p2ptrain import _sparse
except ImportError as exc:  # pragma: no cover - only without a build
    raise ImportError(
        "p2ptrain's compiled kernels (p2ptrain._sparse) are missing: install the package with "
        "'pip install -e .' (or 'make install'), which compiles cython_ext/ with a C compiler"
    ) from exc


@dataclass(frozen=True, kw_only=True)
class SparseCode:
    """The code's two settings (comm.sparse_chunk, comm.sparse_k)."""

    chunk: int = 4096
    """Values per chunk: a power of two (an index takes log2(chunk) bits)."""
    k: int = 64
    """Values kept per chunk (the last, shorter chunk keeps min(k, its length))."""

    @property
    def index_bits(self) -> int:
        return self.chunk.bit_length() - 1

    def payload_size(self, n: int) -> int:
        return int(_sparse.payload_size(n, self.chunk, self.k))

    def offset(self, start: int) -> int:
        """Where the record of the chunk that starts at value `start` (a multiple of chunk) begins."""
        return self.payload_size(start)

    def bits_per_value(self, n: int) -> float:
        return 8 * self.payload_size(n) / n if n else 0.0


def _bytes(payload: Buffer) -> np.ndarray:
    return np.frombuffer(payload, np.uint8)


def encode(values: np.ndarray, code: SparseCode, *, threads: int = 0) -> bytearray:
    """The payload of a contiguous fp32 vector; NonFiniteError instead of encoding NaN/Inf."""
    out = bytearray(code.payload_size(values.shape[0]))
    bad = _sparse.encode(values, _bytes(out), code.chunk, code.k, threads)
    if bad:
        raise NonFiniteError(f"{bad} non-finite value(s) in the vector")
    return out


def squared_norm(payload: Buffer, n: int, code: SparseCode) -> float:
    """The squared L2 norm of the decoded values of a received payload (double); PayloadError when
    it is not a valid payload of n values: wrong size, a magnitude negative or not finite, indices
    not strictly ascending inside their chunk."""
    if len(payload) != code.payload_size(n):
        raise PayloadError(f"a sparse payload of {len(payload)} bytes for {n} values")
    bad, total = _sparse.check(_bytes(payload), n, code.chunk, code.k)
    if bad:
        raise PayloadError(f"{bad} malformed chunk(s) in a sparse payload")
    return float(total)


def decode_add(
    payload: Buffer, acc: np.ndarray, code: SparseCode, *, weight: float = 1.0, threads: int = 0
) -> None:
    """acc += weight · decode(payload), in fp32, in place (the payload passed `squared_norm`)."""
    _sparse.decode_add(_bytes(payload), acc, code.chunk, code.k, weight, threads)


def weighted_sum(
    shares: Sequence[Buffer], weights: Sequence[float], out: np.ndarray, code: SparseCode, *, threads: int = 0
) -> None:
    """out = Σ weightᵢ · decode(shareᵢ), from zeros, in the order given, shares of weight 0 skipped:
    the one sum every member of a sparse step computes and a replay repeats, so both give the same
    floats. Every share with a weight has passed `squared_norm`."""
    out.fill(0)
    for share, weight in zip(shares, weights, strict=True):
        if weight:
            decode_add(share, out, code, weight=weight, threads=threads)


def gram(shares: Sequence[Buffer], n: int, code: SparseCode) -> list[list[float]]:
    """The decoded shares' Gram matrix, G[a][b] = ⟨decode(a), decode(b)⟩: what the gather's
    direction rule weighs shares by. In double, in one fixed order, so the same shares give the
    same floats on every member. Every share has passed `squared_norm`."""
    return _sparse.gram([_bytes(share) for share in shares], n, code.chunk, code.k)


class ErrorFeedback:
    """One node's accumulator e (comm.error_feedback of it decays each step) and the share it
    sends for one outer step. Per node, not part of the shared state S: a joiner starts from zeros.

    `share(step, delta)` folds delta in once per step (an attempt that is retried sends the same
    share again; a second caller while the first computes it waits for that one); `sent(step)`
    takes what went out from e, once, when the step's sync completed. A step given up leaves its
    delta in e, sent later."""

    def __init__(self, *, code: SparseCode, decay: float, threads: int = 0):
        self.code = code
        self.decay = decay
        self.threads = threads
        self.error: np.ndarray | None = None
        self._lock = threading.Lock()
        self._step: int | None = None
        self._share: bytearray | None = None
        self._sent = False

    def share(self, step: int, delta: np.ndarray) -> bytearray:
        with self._lock:
            return self._share_once(step, delta)

    def _share_once(self, step: int, delta: np.ndarray) -> bytearray:
        if self._step == step and self._share is not None:
            return self._share
        if not all_finite(delta):
            raise NonFiniteError("NaN or Inf in this node's pseudo-gradient")  # e stays as it was
        if self.error is None or self.error.shape != delta.shape:
            self.error = np.zeros_like(delta)
        np.multiply(self.error, np.float32(self.decay), out=self.error)
        np.add(self.error, delta, out=self.error)
        try:
            self._share = encode(self.error, self.code, threads=self.threads)
        except NonFiniteError:
            self.error.fill(0)  # finite parts that overflowed: start again from nothing
            raise
        self._step, self._sent = step, False
        return self._share

    def save(self, path: Path) -> None:
        """Write the accumulator (written beside, then renamed: a reader never sees half of it)."""
        if self.error is None:
            return
        partial = path.with_name(path.name + ".partial")
        with partial.open("wb") as handle:
            np.save(handle, self.error, allow_pickle=False)
        partial.replace(path)

    def load(self, path: Path, size: int) -> str | None:
        """Take the accumulator `save` wrote, for a vector of `size` values; why not, or None."""
        try:
            error = np.load(path, allow_pickle=False, mmap_mode="r")
        except (OSError, ValueError) as exc:
            return f"unreadable ({exc})"
        if error.dtype != np.float32 or error.shape != (size,):
            return f"{error.dtype} {error.shape}, wanted float32 ({size},)"
        if not all_finite(error):
            return "not finite"
        self.error = np.array(error)
        self._step, self._share = None, None
        return None

    def sent(self, step: int) -> None:
        with self._lock:
            if self._step != step or self._share is None or self._sent:
                return
            assert self.error is not None
            decode_add(self._share, self.error, self.code, weight=-1.0, threads=self.threads)
            self._sent = True


# ---- NumPy reference: the same arithmetic, for tests ----------------------------------------------


def reference_encode(values: np.ndarray, code: SparseCode) -> bytes:
    bits, records = code.index_bits, []
    for start in range(0, values.shape[0], code.chunk):
        x = values[start : start + code.chunk]
        kept = min(code.k, x.shape[0])
        half = kept // 2
        magnitude = np.abs(x)
        order = np.argsort(-magnitude, kind="stable")  # largest first, ties: lower index first
        picked = np.sort(order[:kept])
        big = np.zeros(x.shape[0], bool)
        big[order[:half]] = True
        lo_values = magnitude[picked][~big[picked]].astype(np.float64)
        hi_values = magnitude[picked][big[picked]].astype(np.float64)
        lo = np.float32(np.cumsum(lo_values)[-1] / lo_values.size) if lo_values.size else np.float32(0)
        hi = np.float32(np.cumsum(hi_values)[-1] / hi_values.size) if hi_values.size else np.float32(0)
        index_bits = np.array([(int(i) >> b) & 1 for i in picked for b in range(bits)], np.uint8)
        codes = (x[picked] < 0).astype(np.uint8) | (big[picked].astype(np.uint8) << 1)
        code_bits = np.array([(int(c) >> b) & 1 for c in codes for b in range(2)], np.uint8)
        records.append(
            np.array([lo, hi], np.float32).tobytes()
            + np.packbits(index_bits, bitorder="little").tobytes()
            + np.packbits(code_bits, bitorder="little").tobytes()
        )
    return b"".join(records)


def reference_decode(payload: Buffer, n: int, code: SparseCode) -> np.ndarray:
    """The decoded fp32 vector (the oracle of decode_add into zeros at weight 1)."""
    out = np.zeros(n, np.float32)
    bits, data, offset = code.index_bits, bytes(payload), 0
    for start in range(0, n, code.chunk):
        kept = min(code.k, n - start)
        lo, hi = np.frombuffer(data, np.float32, 2, offset)
        index_bytes, code_bytes = (kept * bits + 7) // 8, (kept + 3) // 4
        index_stream = np.unpackbits(
            np.frombuffer(data, np.uint8, index_bytes, offset + 8), bitorder="little"
        )
        code_stream = np.unpackbits(
            np.frombuffer(data, np.uint8, code_bytes, offset + 8 + index_bytes), bitorder="little"
        )
        weights = 1 << np.arange(bits)
        indices = (index_stream[: kept * bits].reshape(kept, bits) * weights).sum(axis=1)
        codes = code_stream[: 2 * kept].reshape(kept, 2)
        values = np.where(codes[:, 1] == 1, hi, lo).astype(np.float32)
        out[start + indices] += np.where(codes[:, 0] == 1, -values, values)
        offset += 8 + index_bytes + code_bytes
    return out


def reference_gram(shares: Sequence[Buffer], n: int, code: SparseCode) -> list[list[float]]:
    """The oracle of `gram` (equal up to the order of the sums)."""
    decoded = np.stack([reference_decode(share, n, code).astype(np.float64) for share in shares])
    return (decoded @ decoded.T).tolist()
