# cython: language_level=3
"""int8 (uint8 code) kernels for the pseudo-gradient all-reduce.

Scheme: the flat fp32 vector is cut into blocks of `block` values; each block keeps its own
minimum and step (fp32), and each value becomes round((x - min) / step), a byte in [0, 255].
Per-block parameters keep a rare outlier from wrecking more than its own block.

All loops release the GIL and run over blocks in parallel (OpenMP prange where the extension was
built with OpenMP, serially otherwise). They work in place on caller-owned buffers: NumPy arrays,
torch CPU tensors (via .numpy()) or anything else exposing a contiguous buffer.
Rounding is plain round-half-up in fp32 without FMA contraction, so every machine produces the
same bytes for the same input.
"""

from cython.parallel cimport prange
from libc.math cimport fabsf, INFINITY

cdef extern from *:
    """
    #ifdef _OPENMP
    #include <omp.h>
    static int p2p_max_threads(void) { return omp_get_max_threads(); }
    #else
    static int p2p_max_threads(void) { return 1; }
    #endif
    """
    int p2p_max_threads() nogil


def max_threads() -> int:
    """Threads the kernels use (1 when built without OpenMP)."""
    return p2p_max_threads()


cdef inline Py_ssize_t _num_blocks(Py_ssize_t n, Py_ssize_t block) noexcept nogil:
    return (n + block - 1) // block


def _check(Py_ssize_t n, Py_ssize_t codes, Py_ssize_t params, Py_ssize_t block):
    if block <= 0:
        raise ValueError(f"block must be positive, got {block}")
    if codes != n:
        raise ValueError(f"codes hold {codes} bytes for {n} values")
    if params < _num_blocks(n, block):
        raise ValueError(f"{params} block parameters for {_num_blocks(n, block)} blocks")


def quantize(const float[::1] values, unsigned char[::1] codes, float[::1] mins, float[::1] steps,
             Py_ssize_t block):
    """Encode `values` into `codes` with one (min, step) pair per block.

    Returns the number of non-finite inputs; when it is not 0 the output must not be sent.
    """
    cdef Py_ssize_t n = values.shape[0]
    _check(n, codes.shape[0], min(mins.shape[0], steps.shape[0]), block)
    cdef Py_ssize_t nblocks = _num_blocks(n, block)
    cdef Py_ssize_t b, i, start, stop
    cdef float lo, hi, x, step, inv, q
    cdef Py_ssize_t bad = 0
    for b in prange(nblocks, nogil=True, schedule="static"):
        start = b * block
        stop = start + block
        if stop > n:
            stop = n
        lo = INFINITY
        hi = -INFINITY
        for i in range(start, stop):
            x = values[i]
            if not (fabsf(x) < INFINITY):  # NaN or +-Inf
                bad += 1
            if x < lo:
                lo = x
            if x > hi:
                hi = x
        if not (fabsf(lo) < INFINITY and fabsf(hi) < INFINITY):
            lo = 0
            hi = 0
        step = (hi - lo) / 255.0
        mins[b] = lo
        steps[b] = step
        inv = 0.0
        if step > 0:
            inv = 1.0 / step
        for i in range(start, stop):
            q = (values[i] - lo) * inv + 0.5
            if not (q >= 0):  # also catches NaN
                q = 0
            if q > 255:
                q = 255
            codes[i] = <unsigned char> q
    return bad


def dequantize(const unsigned char[::1] codes, const float[::1] mins, const float[::1] steps,
               float[::1] out, Py_ssize_t block):
    """out[i] = min[b] + code[i] * step[b]."""
    cdef Py_ssize_t n = out.shape[0]
    _check(n, codes.shape[0], min(mins.shape[0], steps.shape[0]), block)
    cdef Py_ssize_t b, i, start, stop
    cdef float lo, step
    for b in prange(_num_blocks(n, block), nogil=True, schedule="static"):
        start = b * block
        stop = start + block
        if stop > n:
            stop = n
        lo = mins[b]
        step = steps[b]
        for i in range(start, stop):
            out[i] = lo + codes[i] * step


def dequantize_add(const unsigned char[::1] codes, const float[::1] mins, const float[::1] steps,
                   float[::1] acc, Py_ssize_t block):
    """acc[i] += min[b] + code[i] * step[b]: the fp32 accumulation of one ring hop."""
    cdef Py_ssize_t n = acc.shape[0]
    _check(n, codes.shape[0], min(mins.shape[0], steps.shape[0]), block)
    cdef Py_ssize_t b, i, start, stop
    cdef float lo, step, decoded
    for b in prange(_num_blocks(n, block), nogil=True, schedule="static"):
        start = b * block
        stop = start + block
        if stop > n:
            stop = n
        lo = mins[b]
        step = steps[b]
        for i in range(start, stop):
            decoded = lo + codes[i] * step
            acc[i] = acc[i] + decoded
