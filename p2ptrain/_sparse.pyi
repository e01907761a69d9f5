"""Types of the compiled sparse kernels (cython_ext/sparse.pyx); buffers are 1-D C-contiguous arrays.

Every function checks the payload's length against (n, chunk, k) (ValueError); `chunk` is a power
of two from 2 to 65536 and 1 <= k <= chunk.
"""

import numpy as np
import numpy.typing as npt

_F32 = npt.NDArray[np.float32]
_U8 = npt.NDArray[np.uint8]

def payload_size(n: int, chunk: int, k: int) -> int: ...
def encode(values: _F32, out: _U8, chunk: int, k: int, threads: int = 0) -> int:
    """Encode values into out; returns the count of non-finite values (then never send out)."""

def check(payload: _U8, n: int, chunk: int, k: int) -> tuple[int, float]:
    """(invalid chunks, squared norm of the decoded values)."""

def decode_add(payload: _U8, acc: _F32, chunk: int, k: int, weight: float = 1, threads: int = 0) -> None:
    """acc += weight * decode(payload), chunk by chunk."""

def gram(payloads: list[_U8], n: int, chunk: int, k: int) -> list[list[float]]:
    """G[a][b] = Σ value_a · value_b over the coordinates both payloads keep (double, one order)."""
