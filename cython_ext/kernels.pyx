# cython: language_level=3
"""int8 and int4 (uint8 / packed 4-bit code) kernels for the pseudo-gradient all-reduce.

Scheme: the flat fp32 vector is cut into blocks of `block` values; each block keeps its own
minimum and step (fp32), and each value becomes round((x - min) / step): with `bits` = 8 a byte in
[0, 255], with `bits` = 4 a nibble in [0, 15], two per byte. At 4 bits a block of m values takes
h = ceil(m / 2) bytes: byte k holds value k in its low nibble and value h + k in its high one (an
odd m leaves the last high nibble 0), so each half of the block is one contiguous stream and the
loops vectorize as the 8-bit ones do; blocks hold an even number of values, so each starts on a
byte. Per-block parameters keep a rare outlier from wrecking more than its own block.

All loops release the GIL and run over blocks in parallel (OpenMP prange where the extension was
built with OpenMP, serially otherwise); `threads` caps the team of one call (0: all), for callers
that already run several kernels at once on their own threads. They work in place on caller-owned buffers: NumPy arrays,
torch CPU tensors (via .numpy()) or anything else exposing a contiguous buffer.
Rounding is plain round-half-up in fp32 without FMA contraction, so every machine produces the
same bytes for the same input.
"""

from cython.parallel cimport parallel, prange, threadid
from libc.math cimport fabsf, INFINITY

import numpy as np

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
    /* The element loops, in C so that each can be compiled for several ISAs, picked once at load
       time (target_clones on x86-64 with glibc): AVX-512 (x86-64-v4, GCC 12 or later), AVX2 and
       the baseline. Every clone does the same IEEE operations in the same order (no FMA: the build
       turns contraction off), so every CPU produces the same bytes; a wider clone only does 16 or
       8 floats per instruction instead of 4. */
    #if defined(__x86_64__) && defined(__GLIBC__) && defined(__has_attribute)
    #  if __has_attribute(target_clones) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
    #    define P2P_CLONES __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
    #  elif __has_attribute(target_clones)
    #    define P2P_CLONES __attribute__((target_clones("avx2", "default")))
    #  endif
    #endif
    #ifndef P2P_CLONES
    #  define P2P_CLONES
    #endif

    /* The min/max scan of a block, written with GCC/Clang vector extensions: a compare-and-select
       on float vectors needs no fast-math (unlike a min/max reduction, which the compiler will
       not vectorize without it) and picks exactly the values the scalar loop would. */
    typedef float p2p_f8 __attribute__((vector_size(32)));
    typedef int p2p_i8 __attribute__((vector_size(32)));

    static inline p2p_f8 p2p_load(const float *p) { p2p_f8 v; __builtin_memcpy(&v, p, 32); return v; }
    static inline p2p_f8 p2p_pick(p2p_i8 take_a, p2p_f8 a, p2p_f8 b) {
        return (p2p_f8)(((p2p_i8)a & take_a) | ((p2p_i8)b & ~take_a));
    }

    /* n >= 1. poison becomes NaN iff some value is NaN or +-Inf (x * 0 is 0 for finite x). */
    P2P_CLONES
    static void p2p_scan(const float *x, Py_ssize_t n, float *lo_out, float *hi_out, float *poison_out) {
        const p2p_f8 zero = {0};
        p2p_f8 lo0 = zero + x[0], hi0 = lo0, lo1 = lo0, hi1 = lo0, z0 = zero, z1 = zero;
        Py_ssize_t i = 0;
        for (; i + 16 <= n; i += 16) {
            p2p_f8 a = p2p_load(x + i), b = p2p_load(x + i + 8);
            lo0 = p2p_pick(a < lo0, a, lo0);
            hi0 = p2p_pick(a > hi0, a, hi0);
            lo1 = p2p_pick(b < lo1, b, lo1);
            hi1 = p2p_pick(b > hi1, b, hi1);
            z0 += a * zero;
            z1 += b * zero;
        }
        float lo = x[0], hi = x[0], poison = 0;
        for (int j = 0; j < 8; j++) {
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

    /* codes[i] = round-half-up((x[i] * scale - low) * inv), at most 255. */
    P2P_CLONES
    static void p2p_quantize(const float *x, Py_ssize_t n, float scale, float low, float inv,
                             unsigned char *codes) {
        for (Py_ssize_t i = 0; i < n; i++) {
            float q = (x[i] * scale - low) * inv + 0.5f;  /* >= 0.5 since x >= low */
            q = q < 255.0f ? q : 255.0f;
            codes[i] = (unsigned char)(int)q;
        }
    }

    /* The 4-bit codes of a block x[0..n): round-half-up((x[i] * scale - low) * inv), at most 15;
       byte k holds value k (low nibble) and value h + k (high nibble), h = ceil(n / 2). */
    static inline unsigned char p2p_code4(float x, float scale, float low, float inv) {
        float q = (x * scale - low) * inv + 0.5f;
        q = q < 15.0f ? q : 15.0f;
        return (unsigned char)(int)q;
    }

    P2P_CLONES
    static void p2p_quantize4(const float *x, Py_ssize_t n, float scale, float low, float inv,
                              unsigned char *codes) {
        Py_ssize_t pairs = n / 2;
        const float *second = x + (n + 1) / 2;
        for (Py_ssize_t k = 0; k < pairs; k++) {
            unsigned char first_half = p2p_code4(x[k], scale, low, inv);
            unsigned char second_half = p2p_code4(second[k], scale, low, inv);
            codes[k] = (unsigned char)(first_half | (second_half << 4));
        }
        if (n & 1) codes[pairs] = p2p_code4(x[pairs], scale, low, inv);
    }

    /* out[i] = low + nibble(i) * step, or out[i] += that, for a block of n values: a byte at a
       time, its value in each half of the block. */
    P2P_CLONES
    static void p2p_decode4(const unsigned char *codes, Py_ssize_t n, float low, float step, float *out,
                            int accumulate) {
        Py_ssize_t pairs = n / 2, h = (n + 1) / 2;
        /* one loop per half: a loop writing both halves vectorized badly (the halves might overlap,
           for all the compiler knows), and the block's codes are in cache for the second pass */
        if (accumulate) {
            for (Py_ssize_t k = 0; k < h; k++) out[k] = out[k] + (low + (codes[k] & 15) * step);
            for (Py_ssize_t k = 0; k < pairs; k++) out[h + k] = out[h + k] + (low + (codes[k] >> 4) * step);
        } else {
            for (Py_ssize_t k = 0; k < h; k++) out[k] = low + (codes[k] & 15) * step;
            for (Py_ssize_t k = 0; k < pairs; k++) out[h + k] = low + (codes[k] >> 4) * step;
        }
    }

    /* out[i] = low + codes[i] * step, or out[i] += that. */
    P2P_CLONES
    static void p2p_decode(const unsigned char *codes, Py_ssize_t n, float low, float step, float *out,
                           int accumulate) {
        if (accumulate) {
            for (Py_ssize_t i = 0; i < n; i++) {
                float decoded = low + codes[i] * step;
                out[i] = out[i] + decoded;
            }
        } else {
            for (Py_ssize_t i = 0; i < n; i++) out[i] = low + codes[i] * step;
        }
    }

    /* out[i] = own[i] * scale + (low + codes[i] * step): a ring hop's fp32 partial sum. */
    P2P_CLONES
    static void p2p_scaled_add(const float *own, float scale, const unsigned char *codes, float low,
                               float step, float *out, Py_ssize_t n) {
        for (Py_ssize_t i = 0; i < n; i++) {
            float decoded = low + codes[i] * step;
            float mine = own[i] * scale;
            out[i] = mine + decoded;
        }
    }

    /* The same for a block of 4-bit codes: out[i] = own[i] * scale + (low + nibble(i) * step),
       each value in the 8-bit hop's order of operations. */
    P2P_CLONES
    static void p2p_scaled_add4(const float *own, float scale, const unsigned char *codes, float low,
                                float step, float *out, Py_ssize_t n) {
        Py_ssize_t pairs = n / 2, h = (n + 1) / 2;
        for (Py_ssize_t k = 0; k < h; k++) {
            float first_half = low + (codes[k] & 15) * step, mine = own[k] * scale;
            out[k] = mine + first_half;
        }
        for (Py_ssize_t k = 0; k < pairs; k++) {
            float second_half = low + (codes[k] >> 4) * step, mine = own[h + k] * scale;
            out[h + k] = mine + second_half;
        }
    }
    """
    void p2p_scan(const float* x, Py_ssize_t n, float* lo_out, float* hi_out, float* poison_out) nogil
    void p2p_quantize(const float* x, Py_ssize_t n, float scale, float low, float inv,
                      unsigned char* codes) nogil
    void p2p_decode(const unsigned char* codes, Py_ssize_t n, float low, float step, float* out,
                    int accumulate) nogil
    void p2p_scaled_add(const float* own, float scale, const unsigned char* codes, float low, float step,
                        float* out, Py_ssize_t n) nogil
    void p2p_quantize4(const float* x, Py_ssize_t n, float scale, float low, float inv,
                       unsigned char* codes) nogil
    void p2p_decode4(const unsigned char* codes, Py_ssize_t n, float low, float step, float* out,
                     int accumulate) nogil
    void p2p_scaled_add4(const float* own, float scale, const unsigned char* codes, float low, float step,
                         float* out, Py_ssize_t n) nogil


def max_threads() -> int:
    """Threads the kernels use (1 when built without OpenMP)."""
    return p2p_max_threads()


cdef enum:
    _LINE_FLOATS = 16  # floats in a 64-byte cache line


cdef inline Py_ssize_t _num_blocks(Py_ssize_t n, Py_ssize_t block) noexcept nogil:
    return (n + block - 1) // block


def code_bytes(Py_ssize_t n, int bits):
    """Bytes of the codes of n values: n at 8 bits, ceil(n / 2) at 4."""
    return n if bits == 8 else (n + 1) // 2


def _check(Py_ssize_t n, Py_ssize_t codes, Py_ssize_t params, Py_ssize_t block, int bits=8):
    if block <= 0:
        raise ValueError(f"block must be positive, got {block}")
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    if bits == 4 and block % 2:
        raise ValueError(f"4-bit blocks must hold an even number of values, got {block}")
    if codes != code_bytes(n, bits):
        raise ValueError(f"codes hold {codes} bytes for {n} values of {bits} bits")
    if params < _num_blocks(n, block):
        raise ValueError(f"{params} block parameters for {_num_blocks(n, block)} blocks")


cdef Py_ssize_t _encode_block(const float* x, Py_ssize_t n, float scale, unsigned char* codes,
                              float* min_out, float* step_out, int bits) noexcept nogil:
    """Encode one block of x * scale (scale >= 0); returns its count of non-finite values (then the
    block is all zeros).

    Rounding is monotone, so the extremes of x * scale are the scaled extremes of x: the scan runs
    on x, and the bytes equal those of encoding the multiplied vector.
    """
    cdef Py_ssize_t i, bad = 0
    cdef float low, high, nan_probe, step, inv
    cdef float top = 255 if bits == 8 else 15
    p2p_scan(x, n, &low, &high, &nan_probe)
    if nan_probe != 0:  # rare: count exactly, and emit a harmless all-zero block
        for i in range(n):
            if not (fabsf(x[i]) < INFINITY):
                bad += 1
        for i in range(n if bits == 8 else (n + 1) // 2):
            codes[i] = 0
        min_out[0] = 0
        step_out[0] = 0
        return bad
    low = low * scale
    high = high * scale
    step = (high - low) / top
    inv = 0
    if step > 0:
        inv = 1 / step
    min_out[0] = low
    step_out[0] = step
    if bits == 8:
        p2p_quantize(x, n, scale, low, inv, codes)
    else:
        p2p_quantize4(x, n, scale, low, inv, codes)
    return 0


def quantize(const float[::1] values, unsigned char[::1] codes, float[::1] mins, float[::1] steps,
             Py_ssize_t block, float scale=1, int threads=0, int bits=8):
    """Encode `values` * `scale` (scale >= 0) into `codes` with one (min, step) pair per block.

    Returns the number of non-finite inputs; when it is not 0 the output must not be sent.
    """
    cdef Py_ssize_t n = values.shape[0]
    _check(n, codes.shape[0], min(mins.shape[0], steps.shape[0]), block, bits)
    if not scale >= 0:
        raise ValueError(f"scale must be >= 0, got {scale}")
    cdef Py_ssize_t b, start, length
    cdef Py_ssize_t bad = 0
    if n == 0:
        return 0
    cdef const float* source = &values[0]
    cdef unsigned char* target = &codes[0]
    cdef float* min_out = &mins[0]
    cdef float* step_out = &steps[0]
    cdef int team = _team(threads)
    for b in prange(_num_blocks(n, block), nogil=True, schedule="static", num_threads=team):
        start = b * block
        length = block if start + block <= n else n - start
        bad += _encode_block(source + start, length, scale, target + _code_at(start, bits), min_out + b,
                             step_out + b, bits)
    return bad


cdef inline Py_ssize_t _code_at(Py_ssize_t value, int bits) noexcept nogil:
    """The byte where the code of value number `value` (the first of a block) starts."""
    return value if bits == 8 else value // 2


def scaled_add_quantize(const float[::1] own, float scale, const unsigned char[::1] in_codes,
                        const float[::1] in_mins, const float[::1] in_steps, unsigned char[::1] codes,
                        float[::1] mins, float[::1] steps, Py_ssize_t block, int threads=0, int bits=8):
    """Encode own * scale + decode(in) block by block: one ring hop in one pass over memory.

    The sum of a block is formed in a small per-thread scratch buffer (in cache) and encoded at once;
    the bytes equal those of multiply, dequantize_add and quantize run one after the other.
    Returns the number of non-finite sums (then the output must not be sent).
    """
    cdef Py_ssize_t n = own.shape[0]
    _check(n, codes.shape[0], min(mins.shape[0], steps.shape[0]), block, bits)
    _check(n, in_codes.shape[0], min(in_mins.shape[0], in_steps.shape[0]), block, bits)
    if not scale >= 0:
        raise ValueError(f"scale must be >= 0, got {scale}")
    if n == 0:
        return 0
    cdef int team = _team(threads)
    # each thread's row starts on a cache line of its own: rows sharing a line made every block's
    # first and last values bounce between the cores (the hop ran at a third of its speed, or not,
    # as the allocation happened to fall)
    cdef Py_ssize_t width = (min(block, n) + 2 * _LINE_FLOATS - 1) // _LINE_FLOATS * _LINE_FLOATS
    cdef float[::1] scratch = np.empty(team * width + _LINE_FLOATS, np.float32)
    cdef float* scratch_at = &scratch[0]
    scratch_at += (_LINE_FLOATS - (<size_t>scratch_at // 4) % _LINE_FLOATS) % _LINE_FLOATS
    cdef const float* mine = &own[0]
    cdef const unsigned char* received = &in_codes[0]
    cdef const float* received_min = &in_mins[0]
    cdef const float* received_step = &in_steps[0]
    cdef unsigned char* target = &codes[0]
    cdef float* min_out = &mins[0]
    cdef float* step_out = &steps[0]
    cdef Py_ssize_t b, start, length
    cdef Py_ssize_t bad = 0
    cdef float* local
    with nogil, parallel(num_threads=team):
        local = scratch_at + threadid() * width
        for b in prange(_num_blocks(n, block), schedule="static"):
            start = b * block
            length = block if start + block <= n else n - start
            if bits == 8:
                p2p_scaled_add(mine + start, scale, received + start, received_min[b], received_step[b],
                               local, length)
            else:
                p2p_scaled_add4(mine + start, scale, received + start // 2, received_min[b],
                                received_step[b], local, length)
            bad += _encode_block(local, length, 1, target + _code_at(start, bits), min_out + b,
                                 step_out + b, bits)
    return bad


cdef inline int _team(int threads) noexcept nogil:
    """OpenMP threads for one call: `threads`, or all of them when 0."""
    return threads if threads > 0 else p2p_max_threads()


cdef void _decode(const unsigned char[::1] codes, const float[::1] mins, const float[::1] steps,
                  float[::1] out, Py_ssize_t block, bint accumulate, int threads, int bits) noexcept nogil:
    cdef Py_ssize_t n = out.shape[0], b, start
    if n == 0:
        return
    cdef const unsigned char* source = &codes[0]
    cdef float* target = &out[0]
    cdef int team = _team(threads)
    for b in prange(_num_blocks(n, block), schedule="static", num_threads=team):
        start = b * block
        if bits == 8:
            p2p_decode(source + start, block if start + block <= n else n - start, mins[b], steps[b],
                       target + start, accumulate)
        else:
            p2p_decode4(source + start // 2, block if start + block <= n else n - start, mins[b], steps[b],
                        target + start, accumulate)


def dequantize(const unsigned char[::1] codes, const float[::1] mins, const float[::1] steps,
               float[::1] out, Py_ssize_t block, int threads=0, int bits=8):
    """out[i] = min[b] + code[i] * step[b]."""
    _check(out.shape[0], codes.shape[0], min(mins.shape[0], steps.shape[0]), block, bits)
    with nogil:
        _decode(codes, mins, steps, out, block, False, threads, bits)


def dequantize_add(const unsigned char[::1] codes, const float[::1] mins, const float[::1] steps,
                   float[::1] acc, Py_ssize_t block, int threads=0, int bits=8):
    """acc[i] += min[b] + code[i] * step[b]: the fp32 accumulation of one ring hop."""
    _check(acc.shape[0], codes.shape[0], min(mins.shape[0], steps.shape[0]), block, bits)
    with nogil:
        _decode(codes, mins, steps, acc, block, True, threads, bits)
