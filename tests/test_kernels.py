"""The compiled int8 and int4 kernels against the NumPy reference implementation."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from p2ptrain import _kernels
from p2ptrain.comm.codec.quant import (
    NonFiniteError,
    add_encode_payload,
    decode_payload,
    dequantize,
    dequantize_add,
    dequantize_chunks,
    empty,
    encode_payload,
    quantize,
    reference_dequantize,
    reference_quantize,
)

BITS = pytest.mark.parametrize("bits", [8, 4])


@BITS
@pytest.mark.parametrize("n", [1, 255, 256, 257, 10_007, 1 << 16])
@pytest.mark.parametrize("block", [16, 256, 1000])
def test_kernels_match_the_reference_bit_for_bit(n: int, block: int, bits: int) -> None:
    values = np.random.default_rng(n + block).standard_normal(n).astype(np.float32)
    encoded, expected = quantize(values, block, bits=bits), reference_quantize(values, block, bits)
    assert np.array_equal(encoded.codes, expected.codes)
    assert np.array_equal(encoded.mins, expected.mins) and np.array_equal(encoded.steps, expected.steps)
    assert np.array_equal(dequantize(encoded), reference_dequantize(expected))


def test_a_4_bit_block_keeps_its_first_half_in_the_low_nibbles_and_its_second_half_in_the_high_ones() -> None:
    # a block of 4 values, then one of 3 (the last high nibble 0); steps of exactly 1
    values = np.array([0, 15, 5, 10, 4, 4, 19], np.float32)
    wire = bytes([0x50, 0xAF, 0xF0, 0x00])
    assert bytes(quantize(values, 4, bits=4).codes) == wire == bytes(reference_quantize(values, 4, 4).codes)
    assert np.array_equal(dequantize(quantize(values, 4, bits=4)), values)


@BITS
@pytest.mark.parametrize("n", [1, 257, 10_007])
@pytest.mark.parametrize("scale", [0.0, 1 / 3, 0.7, 1.0])
def test_scaled_encoding_equals_encoding_the_multiplied_vector(n: int, scale: float, bits: int) -> None:
    """The ring encodes weight × values in one pass; the bytes must be those of the two steps."""
    values = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    expected = reference_quantize(np.multiply(values, np.float32(scale)), 256, bits)
    encoded = quantize(values, 256, scale=scale, bits=bits)
    assert np.array_equal(encoded.codes, expected.codes)
    assert np.array_equal(encoded.mins, expected.mins) and np.array_equal(encoded.steps, expected.steps)


@BITS
@pytest.mark.parametrize("n", [1, 300, 10_007])
@pytest.mark.parametrize("block", [16, 256])
def test_a_fused_ring_hop_equals_its_three_steps(n: int, block: int, bits: int) -> None:
    """add_encode_payload = multiply, dequantize_add, quantize — byte for byte, with the wire layout."""
    rng = np.random.default_rng(n)
    own, other = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    received = decode_payload(encode_payload(other, block, bits=bits), n, block=block, bits=bits)
    partial = np.multiply(own, np.float32(0.25))
    partial += reference_dequantize(received)
    expected = reference_quantize(partial, block, bits)
    out = memoryview(bytearray(len(encode_payload(own, block, bits=bits))))
    fused = decode_payload(
        add_encode_payload(own, 0.25, received=received, threads=1, out=out), n, block=block, bits=bits
    )
    assert np.array_equal(fused.codes, expected.codes)
    assert np.array_equal(fused.mins, expected.mins) and np.array_equal(fused.steps, expected.steps)
    with pytest.raises(ValueError, match="output of"):
        add_encode_payload(own, 0.25, received=received, out=bytearray(3))
    own[n // 2] = np.inf
    with pytest.raises(NonFiniteError):
        add_encode_payload(own, 0.25, received=received)


@pytest.mark.parametrize(("bits", "relative"), [(8, 0.01), (4, 0.12)])
def test_error_is_within_half_a_step(bits: int, relative: float) -> None:
    values = np.random.default_rng(0).standard_normal(100_000).astype(np.float32)
    encoded = quantize(values, 256, bits=bits)
    error = np.abs(dequantize(encoded) - values)
    step = np.repeat(encoded.steps, 256)[: values.size]
    assert np.all(error <= step * 0.5 + 1e-6)
    assert np.linalg.norm(dequantize(encoded) - values) / np.linalg.norm(values) < relative


@BITS
def test_dequantize_add_accumulates_in_place(bits: int) -> None:
    rng = np.random.default_rng(1)
    values, acc = rng.standard_normal(5001).astype(np.float32), rng.standard_normal(5001).astype(np.float32)
    expected = acc + reference_dequantize(reference_quantize(values, 256, bits))
    result = dequantize_add(quantize(values, 256, bits=bits), acc)
    assert result is acc and np.array_equal(acc, expected)


@pytest.mark.parametrize("sizes", [[1000], [256, 512, 7], [300] * 9 + [1]])
def test_chunks_decoded_over_threads_land_in_their_places(sizes: list[int]) -> None:
    rng = np.random.default_rng(len(sizes))
    bounds = np.cumsum([0, *sizes])
    values = rng.standard_normal(int(bounds[-1])).astype(np.float32)
    chunks = [(int(a), int(b), quantize(values[a:b], 256)) for a, b in itertools.pairwise(bounds)]
    out = np.full_like(values, np.nan)
    dequantize_chunks(chunks, out)
    expected = np.concatenate(
        [reference_dequantize(reference_quantize(values[a:b], 256)) for a, b, _ in chunks]
    )
    assert np.array_equal(out, expected)


def test_an_outlier_only_costs_its_own_block() -> None:
    values = np.random.default_rng(2).standard_normal(4096).astype(np.float32)
    values[10] = 100.0
    error = np.abs(dequantize(quantize(values, 256)) - values)
    assert error[256:].max() < 0.02  # every other block keeps its resolution


def test_constant_blocks_are_exact() -> None:
    values = np.full(1000, 3.25, np.float32)
    assert np.array_equal(dequantize(quantize(values, 256)), values)


@BITS
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("position", [0, 256, 500, 997, 999])  # block starts, vector body, scalar tail
def test_non_finite_values_are_refused(bad: float, position: int, bits: int) -> None:
    values = np.zeros(1000, np.float32)
    values[position] = bad
    with pytest.raises(NonFiniteError, match="1 non-finite"):
        quantize(values, 256, bits=bits)


def test_shape_errors_are_caught() -> None:
    values = np.zeros(100, np.float32)
    out = empty(99, 16)
    with pytest.raises(ValueError):
        _kernels.quantize(values, out.codes, out.mins, out.steps, 16)
    with pytest.raises(ValueError):
        _kernels.quantize(
            values, np.empty(100, np.uint8), np.empty(1, np.float32), np.empty(1, np.float32), 16
        )
    with pytest.raises(TypeError):
        quantize(values.astype(np.float64), 16)
    with pytest.raises(ValueError, match="even number"):
        quantize(values, 15, bits=4)  # a 4-bit block must start on a byte
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        quantize(values, 16, bits=2)
    with pytest.raises(ValueError, match="of 4 bits"):
        _kernels.quantize(values, np.empty(100, np.uint8), out.mins, out.steps, 16, 1, 0, 4)


def test_works_on_torch_tensors_without_copies() -> None:
    torch = pytest.importorskip("torch")
    tensor = torch.randn(3000)
    encoded = quantize(tensor.numpy(), 256)
    acc = torch.zeros(3000)
    dequantize_add(encoded, acc.numpy())
    assert torch.allclose(acc, tensor, atol=0.05)


def test_threads_reported() -> None:
    assert _kernels.max_threads() >= 1
