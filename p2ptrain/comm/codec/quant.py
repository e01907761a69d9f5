"""Blockwise 8- or 4-bit codes for fp32 vectors: the compiled kernels, plus the NumPy reference (the oracle).

A vector of n values becomes n code bytes (8 bits; at 4 bits two codes a byte: byte k of a block
of m values holds value k in its low nibble and value ceil(m / 2) + k in its high one) plus one
(min, step) fp32 pair per block of `block` values: value ≈ min + code * step. Production code
calls the Cython kernels (p2ptrain._kernels); `reference_*` are the same arithmetic in NumPy,
kept for tests.

Why int4 with (min, step) and not FP4 (E2M1 or E3M0, one scale a block): measured relative L2
error at blocks of 256 (`benchmarks.quant`; docs/results/2026-12-kernels.md), int4 0.109 against E2M1
0.111 and E3M0 0.195 on Gaussian values, and 0.069 against 0.111 and 0.203 on a real pseudo-gradient
(AdamW's updates are spread evenly over their range, which suits evenly spaced levels); and the
int8 kernels' scan, rounding and fused hop serve both widths.
"""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

try:
    from p2ptrain import _kernels
except ImportError as exc:  # pragma: no cover - only without a build
    raise ImportError(
        "p2ptrain's compiled kernels (p2ptrain._kernels) are missing: install the package with "
        "'pip install -e .' (or 'make install'), which compiles cython_ext/ with a C compiler"
    ) from exc


@dataclass(kw_only=True)
class Encoded:
    """One encoded vector: codes (uint8, n) and per-block mins and steps (fp32)."""

    codes: np.ndarray
    mins: np.ndarray
    steps: np.ndarray
    block: int
    bits: int = 8
    count: int | None = None
    """How many values (at 4 bits an odd count leaves half a byte); None: one per code byte."""

    @property
    def size(self) -> int:
        return int(self.codes.shape[0]) if self.count is None else self.count

    @property
    def nbytes(self) -> int:
        return int(self.codes.nbytes + self.mins.nbytes + self.steps.nbytes)


def num_blocks(n: int, block: int) -> int:
    return (n + block - 1) // block


def code_bytes(n: int, bits: int) -> int:
    return n if bits == 8 else (n + 1) // 2


def empty(n: int, block: int, bits: int = 8) -> Encoded:
    blocks = num_blocks(n, block)
    codes = np.empty(code_bytes(n, bits), np.uint8)
    return Encoded(
        codes=codes,
        mins=np.empty(blocks, np.float32),
        steps=np.empty(blocks, np.float32),
        block=block,
        bits=bits,
        count=n,
    )


class NonFiniteError(ValueError):
    """The vector holds NaN or Inf: it must never be sent."""


def quantize(
    values: np.ndarray,
    block: int,
    *,
    out: Encoded | None = None,
    scale: float = 1.0,
    threads: int = 0,
    bits: int = 8,
) -> Encoded:
    """Encode a contiguous fp32 vector times `scale` (≥ 0) at `bits` (`out`'s, when given); raises
    NonFiniteError instead of encoding NaN/Inf. `threads` caps the kernel's OpenMP team (0: all)."""
    values = _as_f32(values)
    out = out or empty(values.shape[0], block, bits)
    bad = _kernels.quantize(values, out.codes, out.mins, out.steps, block, scale, threads, out.bits)
    _refuse_non_finite(bad)
    return out


def all_finite(values: np.ndarray) -> bool:
    """No NaN and no ±Inf in `values`: NaN propagates through min and max, and an infinity is one of
    them, so two passes without a mask do (isfinite().all() allocates one bool per value)."""
    return bool(values.size == 0 or (np.isfinite(values.min()) and np.isfinite(values.max())))


def _refuse_non_finite(bad: int) -> None:
    if bad:
        raise NonFiniteError(f"{bad} non-finite value(s) in the vector")


def dequantize(encoded: Encoded, out: np.ndarray | None = None, threads: int = 0) -> np.ndarray:
    out = np.empty(encoded.size, np.float32) if out is None else out
    _kernels.dequantize(encoded.codes, encoded.mins, encoded.steps, out, encoded.block, threads, encoded.bits)
    return out


def dequantize_chunks(chunks: Sequence[tuple[int, int, Encoded]], out: np.ndarray) -> None:
    """out[start:stop] = decode(encoded) for every chunk, spread over plain threads.

    One kernel thread per chunk: an OpenMP team per chunk pays a barrier per chunk, and where
    processes share cores (several nodes on one machine: tests, benchmarks) each barrier waits for a
    descheduled sibling — measured: 0.1–0.3 s stalls decoding 64 MiB with 3 nodes on 2 cores.
    """
    workers = max(1, min(os.cpu_count() or 1, len(chunks)))
    groups = [chunks[first::workers] for first in range(workers)]

    def decode(group: Sequence[tuple[int, int, Encoded]]) -> None:
        for start, stop, encoded in group:
            dequantize(encoded, out[start:stop], threads=1)

    if workers == 1:
        decode(chunks)
        return
    with concurrent.futures.ThreadPoolExecutor(workers - 1) as pool:
        helpers = [pool.submit(decode, group) for group in groups[1:]]
        decode(groups[0])
        for helper in helpers:
            helper.result()


def dequantize_add(encoded: Encoded, acc: np.ndarray, threads: int = 0) -> np.ndarray:
    """acc += decode(encoded), in place; returns acc."""
    _kernels.dequantize_add(
        encoded.codes, encoded.mins, encoded.steps, acc, encoded.block, threads, encoded.bits
    )
    return acc


def _as_f32(values: np.ndarray) -> np.ndarray:
    if values.dtype != np.float32 or not values.flags.c_contiguous or values.ndim != 1:
        raise TypeError("expected a contiguous 1-D float32 array")
    return values


# ---- NumPy reference: the same arithmetic, vectorised, for tests ---------------------------------


def reference_quantize(values: np.ndarray, block: int, bits: int = 8) -> Encoded:
    n = values.shape[0]
    blocks = num_blocks(n, block)
    padded = np.empty(blocks * block, np.float32)
    padded[:n] = values
    padded[n:] = values[-1] if n else 0  # padding repeats a real value: min/max unchanged
    grid = padded.reshape(blocks, block)
    lo = grid.min(axis=1)
    hi = grid.max(axis=1)
    top = np.float32(2**bits - 1)
    steps = ((hi - lo) / top).astype(np.float32)
    inv = np.where(steps > 0, np.float32(1.0) / np.where(steps > 0, steps, 1), 0).astype(np.float32)
    q = (grid - lo[:, None]) * inv[:, None] + np.float32(0.5)
    codes = np.clip(q, 0, top).astype(np.uint8).reshape(-1)[:n]
    if bits == 4:
        codes = np.concatenate([_pack_halves(part) for part in _blocks(codes, block)] or [codes])
    return Encoded(codes=codes, mins=lo.astype(np.float32), steps=steps, block=block, bits=bits, count=n)


def _blocks(codes: np.ndarray, block: int) -> list[np.ndarray]:
    """The whole blocks as one (blocks, block) grid, then the last partial block, if any."""
    whole = codes.shape[0] // block * block
    parts = [codes[:whole].reshape(-1, block)] if whole else []
    return parts + ([codes[whole:].reshape(1, -1)] if whole < codes.shape[0] else [])


def _pack_halves(grid: np.ndarray) -> np.ndarray:
    """Each row's 4-bit codes: its first ceil(m / 2) in the low nibbles, the rest in the high ones."""
    half = (grid.shape[1] + 1) // 2
    high = np.zeros((grid.shape[0], half), np.uint8)
    high[:, : grid.shape[1] - half] = grid[:, half:]
    return (grid[:, :half] | (high << 4)).reshape(-1)


def _unpack_halves(codes: np.ndarray, n: int, block: int) -> np.ndarray:
    """The n codes `_pack_halves` packed, block by block (a block's bytes: `block` / 2, the last
    block's fewer; the high nibbles past its end are 0 and cut off)."""
    rows = [np.concatenate([part & 15, part >> 4], axis=1).reshape(-1) for part in _blocks(codes, block // 2)]
    return np.concatenate(rows or [codes])[:n]


def reference_dequantize(encoded: Encoded) -> np.ndarray:
    codes = encoded.codes
    if encoded.bits == 4:
        codes = _unpack_halves(codes, encoded.size, encoded.block)
    index = np.arange(encoded.size) // encoded.block
    return (encoded.mins[index] + codes.astype(np.float32) * encoded.steps[index]).astype(np.float32)


# ---- one chunk on the wire: mins, then steps, then codes ------------------------------------------


class PayloadError(ValueError):
    """A received payload does not hold a valid encoding of the announced number of values."""


def payload_size(length: int, block: int, bits: int = 8) -> int:
    return code_bytes(length, bits) + 8 * num_blocks(length, block)


Buffer = bytes | bytearray | memoryview


def _payload_views(payload: Buffer, length: int, *, block: int, bits: int) -> Encoded:
    blocks = num_blocks(length, block)
    mins = np.frombuffer(payload, np.float32, blocks, 0)  # block parameters first: 4-byte aligned
    steps = np.frombuffer(payload, np.float32, blocks, 4 * blocks)
    codes = np.frombuffer(payload, np.uint8, code_bytes(length, bits), 8 * blocks)
    return Encoded(codes=codes, mins=mins, steps=steps, block=block, bits=bits, count=length)


def encode_payload(
    values: np.ndarray,
    block: int,
    *,
    scale: float = 1.0,
    threads: int = 0,
    out: Buffer | None = None,
    bits: int = 8,
) -> Buffer:
    """Encode `values` * `scale` straight into one wire payload (into `out` when given: a writable
    buffer of payload_size bytes); raises NonFiniteError for NaN/Inf."""
    payload = _output(out, values.shape[0], block=block, bits=bits)
    views = _payload_views(payload, values.shape[0], block=block, bits=bits)
    quantize(np.ascontiguousarray(values), block, out=views, scale=scale, threads=threads)
    return payload


def add_encode_payload(
    own: np.ndarray, scale: float, *, received: Encoded, threads: int = 0, out: Buffer | None = None
) -> Buffer:
    """Encode `own` * `scale` + decode(`received`) into one wire payload (one ring hop, one pass)."""
    own = _as_f32(own)
    payload = _output(out, own.shape[0], block=received.block, bits=received.bits)
    views = _payload_views(payload, own.shape[0], block=received.block, bits=received.bits)
    bad = _kernels.scaled_add_quantize(
        own,
        scale,
        received.codes,
        received.mins,
        received.steps,
        views.codes,
        views.mins,
        views.steps,
        views.block,
        threads,
        views.bits,
    )
    _refuse_non_finite(bad)
    return payload


def _output(out: Buffer | None, length: int, *, block: int, bits: int) -> Buffer:
    size = payload_size(length, block, bits)
    if out is None:
        return bytearray(size)
    if len(out) != size:
        raise ValueError(f"output of {len(out)} bytes for a payload of {size}")
    return out


def decode_payload(payload: Buffer, length: int, *, block: int, bits: int = 8) -> Encoded:
    """Views of a payload's codes and block parameters; sizes and values are checked, nothing copied."""
    if len(payload) != payload_size(length, block, bits):
        raise PayloadError(f"payload of {len(payload)} bytes for {length} values")
    encoded = _payload_views(payload, length, block=block, bits=bits)
    mins, steps = encoded.mins, encoded.steps
    if not (np.isfinite(mins).all() and np.isfinite(steps).all() and (steps >= 0).all()):
        raise PayloadError("non-finite or negative block parameters in a contribution")
    return encoded
