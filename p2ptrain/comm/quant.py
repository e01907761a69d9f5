"""Blockwise uint8 codes for fp32 vectors: the compiled kernels, plus the NumPy reference (the oracle).

A vector of n values becomes n code bytes plus one (min, step) fp32 pair per block of `block`
values: value ≈ min + code * step. Production code calls the Cython kernels (p2ptrain._kernels);
`reference_*` are the same arithmetic in NumPy, kept for tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

try:
    from p2ptrain import _kernels
except ImportError as exc:  # pragma: no cover - only without a build
    raise ImportError(
        "p2ptrain's compiled kernels (p2ptrain._kernels) are missing: install the package with "
        "'pip install -e .' (or 'make install'), which compiles cython_ext/ with a C compiler"
    ) from exc


@dataclass
class Encoded:
    """One encoded vector: codes (uint8, n) and per-block mins and steps (fp32)."""

    codes: np.ndarray
    mins: np.ndarray
    steps: np.ndarray
    block: int

    @property
    def size(self) -> int:
        return int(self.codes.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self.codes.nbytes + self.mins.nbytes + self.steps.nbytes)


def num_blocks(n: int, block: int) -> int:
    return (n + block - 1) // block


def empty(n: int, block: int) -> Encoded:
    blocks = num_blocks(n, block)
    return Encoded(np.empty(n, np.uint8), np.empty(blocks, np.float32), np.empty(blocks, np.float32), block)


class NonFiniteError(ValueError):
    """The vector holds NaN or Inf: it must never be sent."""


def quantize(values: np.ndarray, block: int, out: Encoded | None = None) -> Encoded:
    """Encode a contiguous fp32 vector; raises NonFiniteError instead of encoding NaN/Inf."""
    values = _as_f32(values)
    out = out or empty(values.shape[0], block)
    bad = _kernels.quantize(values, out.codes, out.mins, out.steps, block)
    if bad:
        raise NonFiniteError(f"{bad} non-finite value(s) in the vector")
    return out


def dequantize(encoded: Encoded, out: np.ndarray | None = None) -> np.ndarray:
    out = np.empty(encoded.size, np.float32) if out is None else out
    _kernels.dequantize(encoded.codes, encoded.mins, encoded.steps, out, encoded.block)
    return out


def dequantize_add(encoded: Encoded, acc: np.ndarray) -> np.ndarray:
    """acc += decode(encoded), in place; returns acc."""
    _kernels.dequantize_add(encoded.codes, encoded.mins, encoded.steps, acc, encoded.block)
    return acc


def _as_f32(values: np.ndarray) -> np.ndarray:
    if values.dtype != np.float32 or not values.flags.c_contiguous or values.ndim != 1:
        raise TypeError("expected a contiguous 1-D float32 array")
    return values


# ---- NumPy reference: the same arithmetic, vectorised, for tests ---------------------------------


def reference_quantize(values: np.ndarray, block: int) -> Encoded:
    n = values.shape[0]
    blocks = num_blocks(n, block)
    padded = np.empty(blocks * block, np.float32)
    padded[:n] = values
    padded[n:] = values[-1] if n else 0  # padding repeats a real value: min/max unchanged
    grid = padded.reshape(blocks, block)
    lo = grid.min(axis=1)
    hi = grid.max(axis=1)
    steps = ((hi - lo) / np.float32(255.0)).astype(np.float32)
    inv = np.where(steps > 0, np.float32(1.0) / np.where(steps > 0, steps, 1), 0).astype(np.float32)
    q = (grid - lo[:, None]) * inv[:, None] + np.float32(0.5)
    codes = np.clip(q, 0, 255).astype(np.uint8).reshape(-1)[:n]
    return Encoded(codes, lo.astype(np.float32), steps, block)


def reference_dequantize(encoded: Encoded) -> np.ndarray:
    index = np.arange(encoded.size) // encoded.block
    return (encoded.mins[index] + encoded.codes.astype(np.float32) * encoded.steps[index]).astype(np.float32)


# ---- one chunk on the wire: codes, then mins, then steps -----------------------------------------


class PayloadError(ValueError):
    """A received payload does not hold a valid encoding of the announced number of values."""


def payload_size(length: int, block: int) -> int:
    return length + 8 * num_blocks(length, block)


def encode_payload(values: np.ndarray, block: int) -> bytes:
    """Encode `values` as one wire payload; raises NonFiniteError for NaN/Inf."""
    encoded = quantize(np.ascontiguousarray(values), block)
    return encoded.codes.tobytes() + encoded.mins.tobytes() + encoded.steps.tobytes()


def decode_payload(payload: bytes, length: int, block: int) -> Encoded:
    """Views of a payload's codes and block parameters; sizes and values are checked, nothing copied."""
    blocks = num_blocks(length, block)
    if len(payload) != payload_size(length, block):
        raise PayloadError(f"payload of {len(payload)} bytes for {length} values")
    codes = np.frombuffer(payload, np.uint8, length)
    mins = np.frombuffer(payload, np.float32, blocks, length)
    steps = np.frombuffer(payload, np.float32, blocks, length + 4 * blocks)
    if not (np.isfinite(mins).all() and np.isfinite(steps).all() and (steps >= 0).all()):
        raise PayloadError("non-finite or negative block parameters in a contribution")
    return Encoded(codes, mins, steps, block)
