"""Types of the compiled int8/int4 kernels (cython_ext/kernels.pyx); buffers are 1-D C-contiguous arrays.

Every function checks its buffers' lengths against `block` and `bits` (ValueError) and works in place;
`bits` is 8 (a byte per code) or 4 (two codes per byte: a block's first half in the low nibbles,
its second half in the high ones; even blocks only).
"""

import numpy as np
import numpy.typing as npt

_F32 = npt.NDArray[np.float32]
_U8 = npt.NDArray[np.uint8]

def max_threads() -> int: ...
def code_bytes(n: int, bits: int) -> int: ...
def quantize(
    values: _F32,
    codes: _U8,
    mins: _F32,
    steps: _F32,
    block: int,
    scale: float = 1,
    threads: int = 0,
    bits: int = 8,
) -> int:
    """Encode values * scale into codes, one (min, step) per block; returns non-finite inputs."""

def scaled_add_quantize(
    own: _F32,
    scale: float,
    in_codes: _U8,
    in_mins: _F32,
    in_steps: _F32,
    codes: _U8,
    mins: _F32,
    steps: _F32,
    block: int,
    threads: int = 0,
    bits: int = 8,
) -> int:
    """Encode own * scale + decode(in) block by block; returns non-finite sums."""

def dequantize(
    codes: _U8, mins: _F32, steps: _F32, out: _F32, block: int, threads: int = 0, bits: int = 8
) -> None: ...
def dequantize_add(
    codes: _U8, mins: _F32, steps: _F32, acc: _F32, block: int, threads: int = 0, bits: int = 8
) -> None: ...
