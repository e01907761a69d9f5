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

cdef extern from *:
    """
    /* The min/max scan of a block, written with GCC/Clang vector extensions: a compare-and-select
       on 4-float vectors needs no fast-math (unlike a min/max reduction, which the compiler will
       not vectorize without it) and picks exactly the values the scalar loop would. */
    typedef float p2p_f4 __attribute__((vector_size(16)));
    typedef int p2p_i4 __attribute__((vector_size(16)));

    static inline p2p_f4 p2p_load(const float *p) { p2p_f4 v; __builtin_memcpy(&v, p, 16); return v; }
    static inline p2p_f4 p2p_pick(p2p_i4 take_a, p2p_f4 a, p2p_f4 b) {
        return (p2p_f4)(((p2p_i4)a & take_a) | ((p2p_i4)b & ~take_a));
    }

    /* n >= 1. poison becomes NaN iff some value is NaN or +-Inf (x * 0 is 0 for finite x). */
    static void p2p_scan(const float *x, Py_ssize_t n, float *lo_out, float *hi_out, float *poison_out) {
        const p2p_f4 zero = {0, 0, 0, 0};
        p2p_f4 lo0 = {x[0], x[0], x[0], x[0]}, hi0 = lo0, lo1 = lo0, hi1 = lo0, z0 = zero, z1 = zero;
        Py_ssize_t i = 0;
        for (; i + 8 <= n; i += 8) {
            p2p_f4 a = p2p_load(x + i), b = p2p_load(x + i + 4);
            lo0 = p2p_pick(a < lo0, a, lo0);
            hi0 = p2p_pick(a > hi0, a, hi0);
            lo1 = p2p_pick(b < lo1, b, lo1);
            hi1 = p2p_pick(b > hi1, b, hi1);
            z0 += a * zero;
            z1 += b * zero;
        }
        float lo = x[0], hi = x[0], poison = 0;
        for (int j = 0; j < 4; j++) {
            lo = lo0[j] < lo ? lo0[j] : lo;
            lo = lo1[j] < lo ? lo1[j] : lo;
            hi = hi0[j] > hi ? hi0[j] : hi;
            hi = hi1[j] > hi ? hi1[j] : hi;
            poison += z0[j] + z1[j];
        }
        for (; i < n; i++) {
            lo = x[i] < lo ? x[i] : lo;
            hi = x[i] > hi ? x[i] : hi;
            poison += x[i] * 0.0f;
        }
        *lo_out = lo;
        *hi_out = hi;
        *poison_out = poison;
    }
    """
    void p2p_scan(const float* x, Py_ssize_t n, float* lo_out, float* hi_out, float* poison_out) nogil


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


cdef Py_ssize_t _encode_block(const float* x, Py_ssize_t n, unsigned char* codes, float* min_out,
                              float* step_out) noexcept nogil:
    """Encode one block; returns its count of non-finite values (then the block is all zeros)."""
    cdef Py_ssize_t i, bad = 0
    cdef float low, high, nan_probe, step, inv, q
    cdef float half = 0.5, top = 255
    p2p_scan(x, n, &low, &high, &nan_probe)
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
