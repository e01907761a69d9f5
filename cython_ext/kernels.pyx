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


cdef enum:
    LANES = 8  # independent min/max lanes: lets the compiler vectorize the scan without fast-math


cdef Py_ssize_t _encode_block(const float* x, Py_ssize_t n, unsigned char* codes, float* min_out,
                              float* step_out) noexcept nogil:
    """Encode one block; returns its count of non-finite values (then the block is all zeros)."""
    cdef float lo[LANES]
    cdef float hi[LANES]
    cdef float poison[LANES]  # x * 0 is 0 for finite x and NaN for NaN/Inf: a branch-free check
    cdef Py_ssize_t g, i, j, full = n - n % LANES, bad = 0
    cdef float v, low, high, nan_probe = 0, step, inv, q
    cdef float zero = 0, half = 0.5, top = 255
    for j in range(LANES):
        lo[j] = x[0]
        hi[j] = x[0]
        poison[j] = 0
    for g in range(full // LANES):
        i = g * LANES
        for j in range(LANES):
            v = x[i + j]
            lo[j] = v if v < lo[j] else lo[j]
            hi[j] = v if v > hi[j] else hi[j]
            poison[j] = poison[j] + v * zero
    for i in range(full, n):
        v = x[i]
        lo[0] = v if v < lo[0] else lo[0]
        hi[0] = v if v > hi[0] else hi[0]
        poison[0] = poison[0] + v * zero
    low = lo[0]
    high = hi[0]
    for j in range(LANES):
        low = lo[j] if lo[j] < low else low
        high = hi[j] if hi[j] > high else high
        nan_probe = nan_probe + poison[j]
    if nan_probe != 0:  # rare: count exactly, and emit a harmless all-zero block
        for i in range(n):
            if not (fabsf(x[i]) < INFINITY):
                bad += 1
            codes[i] = 0
        min_out[0] = 0
        step_out[0] = 0
        return bad
    step = (high - low) / top
    inv = 0
    if step > 0:
        inv = 1 / step
    min_out[0] = low
    step_out[0] = step
    for i in range(n):
        q = (x[i] - low) * inv + half  # >= 0.5 since x >= low; at most 255.5 give or take an ulp
        q = q if q < top else top
        codes[i] = <unsigned char> (<int> q)
    return 0


def quantize(const float[::1] values, unsigned char[::1] codes, float[::1] mins, float[::1] steps,
             Py_ssize_t block):
    """Encode `values` into `codes` with one (min, step) pair per block.

    Returns the number of non-finite inputs; when it is not 0 the output must not be sent.
    """
    cdef Py_ssize_t n = values.shape[0]
    _check(n, codes.shape[0], min(mins.shape[0], steps.shape[0]), block)
    cdef Py_ssize_t b, start, length
    cdef Py_ssize_t bad = 0
    if n == 0:
        return 0
    cdef const float* source = &values[0]
    cdef unsigned char* target = &codes[0]
    cdef float* min_out = &mins[0]
    cdef float* step_out = &steps[0]
    for b in prange(_num_blocks(n, block), nogil=True, schedule="static"):
        start = b * block
        length = block if start + block <= n else n - start
        bad += _encode_block(source + start, length, target + start, min_out + b, step_out + b)
    return bad


cdef void _decode_block(const unsigned char* codes, Py_ssize_t n, float low, float step, float* out,
                       bint accumulate) noexcept nogil:
    cdef Py_ssize_t i
    cdef float decoded
    if accumulate:
        for i in range(n):
            decoded = low + codes[i] * step
            out[i] = out[i] + decoded
    else:
        for i in range(n):
            out[i] = low + codes[i] * step


cdef void _decode(const unsigned char[::1] codes, const float[::1] mins, const float[::1] steps,
                  float[::1] out, Py_ssize_t block, bint accumulate) noexcept nogil:
    cdef Py_ssize_t n = out.shape[0], b, start
    if n == 0:
        return
    cdef const unsigned char* source = &codes[0]
    cdef float* target = &out[0]
    for b in prange(_num_blocks(n, block), schedule="static"):
        start = b * block
        _decode_block(source + start, block if start + block <= n else n - start, mins[b], steps[b],
                      target + start, accumulate)


def dequantize(const unsigned char[::1] codes, const float[::1] mins, const float[::1] steps,
               float[::1] out, Py_ssize_t block):
    """out[i] = min[b] + code[i] * step[b]."""
    _check(out.shape[0], codes.shape[0], min(mins.shape[0], steps.shape[0]), block)
    with nogil:
        _decode(codes, mins, steps, out, block, False)


def dequantize_add(const unsigned char[::1] codes, const float[::1] mins, const float[::1] steps,
                   float[::1] acc, Py_ssize_t block):
    """acc[i] += min[b] + code[i] * step[b]: the fp32 accumulation of one ring hop."""
    _check(acc.shape[0], codes.shape[0], min(mins.shape[0], steps.shape[0]), block)
    with nogil:
        _decode(codes, mins, steps, acc, block, True)
