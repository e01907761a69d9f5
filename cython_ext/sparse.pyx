# cython: language_level=3
"""Sparse codes for error-feedback syncs: chunk-wise top-k, 2-bit values, packed indices.

A vector is cut into chunks of `chunk` values (a power of two, at most 65536). Of each chunk of
length m, the kk = min(k, m) values of largest magnitude are kept (ties: the lower index first);
each kept value becomes 2 bits, its sign (bit 0: negative) and whether it is among the kk // 2
largest of them (bit 1), and decodes to ±hi or ±lo, the mean magnitude of its half (the rest to 0).
A chunk's record, contiguous so that any chunk-aligned range of a payload is a payload:

    lo (fp32) · hi (fp32) · kk indices of log2(chunk) bits, ascending, packed LSB first
    (ceil(kk · bits / 8) bytes) · kk 2-bit codes, four a byte, LSB first (ceil(kk / 4) bytes)

At chunk 4096 and k 64: 120 bytes per 4096 values, 0.234 bits per value.

Encoding is the sender's alone (its bytes need not match anyone's, but they match the NumPy oracle
in comm/codec/sparse.py: the same selection, the same sums in the same order in double).
Decoding is what must be bit-identical on every member: `decode_add` adds weight * value in fp32
(no FMA: the build turns contraction off) at each kept index, chunk by chunk; chunks are disjoint,
so a parallel loop over them gives the same bytes as a serial one. `check` validates a received
payload before anything decodes it: finite non-negative magnitudes, indices strictly ascending
inside their chunk.
"""

from cython.parallel cimport parallel, prange
from libc.stdint cimport uint32_t, int32_t
from libc.stdlib cimport malloc, calloc, free
from libc.string cimport memcpy, memset
from libc.math cimport fabsf, INFINITY

cdef extern from *:
    """
    #include <stdint.h>
    #include <string.h>

    static inline Py_ssize_t sp_kept(Py_ssize_t length, Py_ssize_t k) { return length < k ? length : k; }

    static inline Py_ssize_t sp_index_bytes(Py_ssize_t kept, int bits) { return (kept * bits + 7) / 8; }

    static inline Py_ssize_t sp_record(Py_ssize_t length, Py_ssize_t k, int bits) {
        Py_ssize_t kept = sp_kept(length, k);
        return 8 + sp_index_bytes(kept, bits) + (kept + 3) / 4;
    }

    static inline uint32_t sp_key(float x) {  /* |x| as bits: for non-negative floats, the same order */
        float a = x < 0 ? -x : x;
        uint32_t u;
        memcpy(&u, &a, 4);
        return u & 0x7fffffffu;  /* -0.0 is 0 */
    }

    /* The value of rank r (0: the largest) among keys[0..m), which it reorders. */
    static uint32_t sp_select(uint32_t *keys, Py_ssize_t m, Py_ssize_t r) {
        Py_ssize_t lo = 0, hi = m - 1;
        while (hi > lo) {
            Py_ssize_t mid = lo + (hi - lo) / 2;
            uint32_t a = keys[lo], b = keys[mid], c = keys[hi], pivot;
            pivot = (a > b) ? ((b > c) ? b : (a > c ? c : a)) : ((a > c) ? a : (b > c ? c : b));
            Py_ssize_t i = lo, j = hi;
            while (i <= j) {  /* descending: the larger to the left */
                while (keys[i] > pivot) i++;
                while (keys[j] < pivot) j--;
                if (i <= j) { uint32_t t = keys[i]; keys[i] = keys[j]; keys[j] = t; i++; j--; }
            }
            if (r <= j) hi = j;
            else if (r >= i) lo = i;
            else return keys[r];
        }
        return keys[r];
    }

    static inline void sp_put(unsigned char *p, Py_ssize_t nbytes, Py_ssize_t bitpos, uint32_t value) {
        Py_ssize_t b = bitpos >> 3;
        uint32_t w = value << (bitpos & 7);
        for (int i = 0; i < 3 && b + i < nbytes; i++) p[b + i] |= (unsigned char)(w >> (8 * i));
    }

    static inline uint32_t sp_get(const unsigned char *p, Py_ssize_t nbytes, Py_ssize_t bitpos, int bits) {
        Py_ssize_t b = bitpos >> 3;
        uint32_t w = 0;
        for (int i = 0; i < 3 && b + i < nbytes; i++) w |= (uint32_t)p[b + i] << (8 * i);
        return (w >> (bitpos & 7)) & ((1u << bits) - 1u);
    }

    /* Encode one chunk x[0..m) into `out` (its record). keys: 2m scratch, picked: k scratch.
       Returns the count of non-finite values (then the record is all zeros and must not be sent). */
    static Py_ssize_t sp_encode_chunk(const float *x, Py_ssize_t m, Py_ssize_t k, int bits,
                                      unsigned char *out, uint32_t *keys, int32_t *picked) {
        Py_ssize_t kept = sp_kept(m, k), half = kept / 2, bad = 0, taken = 0;
        Py_ssize_t index_bytes = sp_index_bytes(kept, bits);
        memset(out, 0, (size_t)sp_record(m, k, bits));
        for (Py_ssize_t i = 0; i < m; i++) {
            if (!(fabsf(x[i]) < INFINITY)) bad++;
            keys[i] = keys[m + i] = sp_key(x[i]);
        }
        if (bad || kept == 0) return bad;
        uint32_t t = sp_select(keys + m, m, kept - 1);
        Py_ssize_t above = 0;
        for (Py_ssize_t i = 0; i < m; i++) above += keys[i] > t;
        Py_ssize_t ties = kept - above;
        for (Py_ssize_t i = 0; i < m && taken < kept; i++) {
            if (keys[i] > t || (keys[i] == t && ties-- > 0)) picked[taken++] = (int32_t)i;
        }
        uint32_t t2 = 0;
        Py_ssize_t ties2 = 0;
        if (half > 0) {
            for (Py_ssize_t j = 0; j < kept; j++) keys[m + j] = keys[picked[j]];
            t2 = sp_select(keys + m, kept, half - 1);
            Py_ssize_t above2 = 0;
            for (Py_ssize_t j = 0; j < kept; j++) above2 += keys[picked[j]] > t2;
            ties2 = half - above2;
        }
        double lo_sum = 0, hi_sum = 0;
        unsigned char *indices = out + 8, *codes = out + 8 + index_bytes;
        for (Py_ssize_t j = 0; j < kept; j++) {
            Py_ssize_t i = picked[j];
            uint32_t key = keys[i];
            int big = half > 0 && (key > t2 || (key == t2 && ties2-- > 0));
            double magnitude = (double)fabsf(x[i]);
            if (big) hi_sum += magnitude; else lo_sum += magnitude;
            sp_put(indices, index_bytes, j * bits, (uint32_t)i);
            codes[j >> 2] |= (unsigned char)(((x[i] < 0) | (big << 1)) << ((j & 3) * 2));
        }
        float lo = kept - half > 0 ? (float)(lo_sum / (double)(kept - half)) : 0.0f;
        float hi = half > 0 ? (float)(hi_sum / (double)half) : 0.0f;
        memcpy(out, &lo, 4);
        memcpy(out + 4, &hi, 4);
        return 0;
    }

    /* 0 when the record of a chunk of m values is valid, adding its squared norm to *sumsq. */
    static int sp_check_chunk(const unsigned char *rec, Py_ssize_t m, Py_ssize_t k, int bits, double *sumsq) {
        Py_ssize_t kept = sp_kept(m, k), index_bytes = sp_index_bytes(kept, bits);
        float lo, hi;
        memcpy(&lo, rec, 4);
        memcpy(&hi, rec + 4, 4);
        if (!(lo >= 0 && lo < INFINITY && hi >= 0 && hi < INFINITY)) return 1;
        const unsigned char *indices = rec + 8, *codes = rec + 8 + index_bytes;
        int64_t previous = -1;
        double sum = 0;
        for (Py_ssize_t j = 0; j < kept; j++) {
            int64_t i = sp_get(indices, index_bytes, j * bits, bits);
            if (i <= previous || i >= m) return 1;
            previous = i;
            double v = (codes[j >> 2] >> ((j & 3) * 2)) & 2 ? hi : lo;
            sum += v * v;
        }
        *sumsq += sum;
        return 0;
    }

    /* A checked record of a chunk of m values, read entry by entry (sp_entry). */
    typedef struct {
        float lo, hi;
        const unsigned char *indices, *codes;
        Py_ssize_t kept, index_bytes;
        int bits;
    } sp_record_reader;

    static inline sp_record_reader sp_reader(const unsigned char *rec, Py_ssize_t m, Py_ssize_t k, int bits) {
        sp_record_reader r;
        r.kept = sp_kept(m, k);
        r.index_bytes = sp_index_bytes(r.kept, bits);
        r.bits = bits;
        memcpy(&r.lo, rec, 4);
        memcpy(&r.hi, rec + 4, 4);
        r.indices = rec + 8;
        r.codes = rec + 8 + r.index_bytes;
        return r;
    }

    /* Entry j (< r->kept): its index into *i, its decoded value returned. */
    static inline float sp_entry(const sp_record_reader *r, Py_ssize_t j, uint32_t *i) {
        *i = sp_get(r->indices, r->index_bytes, j * r->bits, r->bits);
        unsigned code = (r->codes[j >> 2] >> ((j & 3) * 2)) & 3u;
        float v = code & 2u ? r->hi : r->lo;
        return code & 1u ? -v : v;
    }

    static void sp_decode_add_chunk(const unsigned char *rec, Py_ssize_t m, Py_ssize_t k, int bits,
                                    float weight, float *acc) {
        sp_record_reader r = sp_reader(rec, m, k, bits);
        for (Py_ssize_t j = 0; j < r.kept; j++) {
            uint32_t i;
            float v = sp_entry(&r, j, &i);
            if (i < (uint32_t)m) acc[i] += weight * v;  /* checked before; never out of the chunk */
        }
    }
    /* One chunk's part of `gram`: g[a·q + b] += value_a · value_b (a ≤ b) at every coordinate where
       both members a and b keep a value. vals (q·m, all zero), seen (m, all zero), uni (q·k) and
       who (q) are scratch; vals and seen are left zero. */
    static void sp_gram_chunk(const unsigned char *const *recs, Py_ssize_t q, Py_ssize_t m, Py_ssize_t k,
                              int bits, double *vals, unsigned char *seen, int32_t *uni, int32_t *who,
                              double *g) {
        Py_ssize_t u = 0;
        for (Py_ssize_t p = 0; p < q; p++) {
            sp_record_reader r = sp_reader(recs[p], m, k, bits);
            for (Py_ssize_t j = 0; j < r.kept; j++) {
                uint32_t i;
                float v = sp_entry(&r, j, &i);
                if (i >= (uint32_t)m) continue;  /* checked before; never out of the chunk */
                vals[p * m + i] = (double)v;
                if (!seen[i]) { seen[i] = 1; uni[u++] = (int32_t)i; }
            }
        }
        for (Py_ssize_t t = 0; t < u; t++) {
            Py_ssize_t i = uni[t], c = 0;
            for (Py_ssize_t p = 0; p < q; p++) if (vals[p * m + i] != 0) who[c++] = (int32_t)p;
            for (Py_ssize_t x = 0; x < c; x++) {
                double va = vals[who[x] * m + i];
                for (Py_ssize_t y = x; y < c; y++) g[who[x] * q + who[y]] += va * vals[who[y] * m + i];
            }
            seen[i] = 0;
            for (Py_ssize_t x = 0; x < c; x++) vals[who[x] * m + i] = 0;
        }
    }
    """
    Py_ssize_t sp_record(Py_ssize_t length, Py_ssize_t k, int bits) nogil
    Py_ssize_t sp_encode_chunk(const float *x, Py_ssize_t m, Py_ssize_t k, int bits, unsigned char *out,
                               uint32_t *keys, int32_t *picked) nogil
    int sp_check_chunk(const unsigned char *rec, Py_ssize_t m, Py_ssize_t k, int bits, double *sumsq) nogil
    void sp_decode_add_chunk(const unsigned char *rec, Py_ssize_t m, Py_ssize_t k, int bits, float weight,
                             float *acc) nogil
    void sp_gram_chunk(const unsigned char *const *recs, Py_ssize_t q, Py_ssize_t m, Py_ssize_t k, int bits,
                       double *vals, unsigned char *seen, int32_t *uni, int32_t *who, double *g) nogil

cdef extern from *:
    """
    #ifdef _OPENMP
    #include <omp.h>
    static int sp_max_threads(void) { return omp_get_max_threads(); }
    #else
    static int sp_max_threads(void) { return 1; }
    #endif
    """
    int sp_max_threads() nogil


cdef int _index_bits(Py_ssize_t chunk) except -1:
    if chunk < 2 or chunk > 65536 or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two from 2 to 65536, got {chunk}")
    return (<unsigned long>chunk).bit_length() - 1


def payload_size(Py_ssize_t n, Py_ssize_t chunk, Py_ssize_t k):
    """Bytes of the payload of n values: a record per chunk, the last one of the chunk that is left."""
    cdef int bits = _index_bits(chunk)
    if k < 1 or k > chunk:
        raise ValueError(f"k must be 1 to chunk ({chunk}), got {k}")
    return (n // chunk) * sp_record(chunk, k, bits) + (sp_record(n % chunk, k, bits) if n % chunk else 0)


def _checked(Py_ssize_t n, Py_ssize_t size, Py_ssize_t chunk, Py_ssize_t k):
    cdef Py_ssize_t wanted = payload_size(n, chunk, k)
    if size != wanted:
        raise ValueError(f"a payload of {size} bytes for {n} values (wanted {wanted})")


cdef inline int _team(int threads) noexcept nogil:
    return threads if threads > 0 else sp_max_threads()


def encode(const float[::1] values, unsigned char[::1] out, Py_ssize_t chunk, Py_ssize_t k, int threads=0):
    """Encode `values` into `out` (payload_size bytes). Returns the count of non-finite values; when
    it is not 0 the payload must not be sent."""
    cdef Py_ssize_t n = values.shape[0]
    _checked(n, out.shape[0], chunk, k)
    if n == 0:
        return 0
    cdef int bits = _index_bits(chunk)
    cdef Py_ssize_t chunks = (n + chunk - 1) // chunk, c, start, m, bad = 0
    cdef Py_ssize_t record = sp_record(chunk, k, bits)
    cdef const float* source = &values[0]
    cdef unsigned char* target = &out[0]
    cdef uint32_t* keys
    cdef int32_t* picked
    cdef int team = _team(threads)
    if team > chunks:
        team = <int>chunks
    with nogil, parallel(num_threads=team):
        keys = <uint32_t*>malloc(2 * chunk * sizeof(uint32_t))  # one scratch per thread
        picked = <int32_t*>malloc(k * sizeof(int32_t))
        for c in prange(chunks, schedule="static"):
            if keys == NULL or picked == NULL:
                bad += n  # no memory: refuse to send rather than send garbage
            else:
                start = c * chunk
                m = chunk if start + chunk <= n else n - start
                bad += sp_encode_chunk(source + start, m, k, bits, target + c * record, keys, picked)
        free(keys)
        free(picked)
    return bad


def check(const unsigned char[::1] payload, Py_ssize_t n, Py_ssize_t chunk, Py_ssize_t k):
    """(bad chunks, squared norm of the decoded values in double): 0 bad chunks for a valid payload."""
    _checked(n, payload.shape[0], chunk, k)
    cdef int bits = _index_bits(chunk)
    cdef Py_ssize_t chunks = (n + chunk - 1) // chunk, c, start, m, bad = 0
    cdef Py_ssize_t record = sp_record(chunk, k, bits)
    cdef double sumsq = 0
    if n == 0:
        return 0, 0.0
    cdef const unsigned char* source = &payload[0]
    with nogil:
        for c in range(chunks):
            start = c * chunk
            m = chunk if start + chunk <= n else n - start
            bad += sp_check_chunk(source + c * record, m, k, bits, &sumsq)
    return bad, sumsq


def decode_add(const unsigned char[::1] payload, float[::1] acc, Py_ssize_t chunk, Py_ssize_t k,
               float weight=1, int threads=0):
    """acc[i] += weight * value[i] at every kept index (the payload passed `check`)."""
    cdef Py_ssize_t n = acc.shape[0]
    _checked(n, payload.shape[0], chunk, k)
    if n == 0:
        return
    cdef int bits = _index_bits(chunk)
    cdef Py_ssize_t chunks = (n + chunk - 1) // chunk, c, start, m
    cdef Py_ssize_t record = sp_record(chunk, k, bits)
    cdef const unsigned char* source = &payload[0]
    cdef float* target = &acc[0]
    cdef int team = _team(threads)
    if team > chunks:
        team = <int>chunks
    with nogil:
        for c in prange(chunks, schedule="static", num_threads=team):
            start = c * chunk
            m = chunk if start + chunk <= n else n - start
            sp_decode_add_chunk(source + c * record, m, k, bits, weight, target + start)


def gram(list payloads, Py_ssize_t n, Py_ssize_t chunk, Py_ssize_t k):
    """The payloads' Gram matrix: G[a][b] = Σ value_a · value_b over the coordinates both keep, as a
    list of q lists. Every payload passed `check`. In double, one thread, chunk by chunk in order
    and inside a chunk in one fixed order: the same bytes in give the same floats out on every
    machine (about 2 ms per million values at 8 payloads on one core, 10 at 16)."""
    cdef Py_ssize_t q = len(payloads), p, c, start, m, r
    cdef int bits = _index_bits(chunk)
    cdef Py_ssize_t chunks = (n + chunk - 1) // chunk
    cdef Py_ssize_t record = sp_record(chunk, k, bits)
    cdef const unsigned char[::1] view
    views = []
    for payload in payloads:
        view = payload
        _checked(n, view.shape[0], chunk, k)
        views.append(view)  # keeps each buffer exported while the kernel reads it
    if n == 0 or q == 0:
        return [[0.0] * q for _ in range(q)]
    cdef const unsigned char** bases = <const unsigned char**>malloc(q * sizeof(void*))
    cdef const unsigned char** recs = <const unsigned char**>malloc(q * sizeof(void*))
    cdef double* g = <double*>calloc(q * q, sizeof(double))
    cdef double* vals = <double*>calloc(q * chunk, sizeof(double))
    cdef unsigned char* seen = <unsigned char*>calloc(chunk, 1)
    cdef int32_t* uni = <int32_t*>malloc(q * k * sizeof(int32_t))
    cdef int32_t* who = <int32_t*>malloc(q * sizeof(int32_t))
    try:
        if not (bases and recs and g and vals and seen and uni and who):
            raise MemoryError()
        for p in range(q):
            view = views[p]
            bases[p] = &view[0]
        with nogil:
            for c in range(chunks):
                start = c * chunk
                m = chunk if start + chunk <= n else n - start
                for r in range(q):
                    recs[r] = bases[r] + c * record
                sp_gram_chunk(recs, q, m, k, bits, vals, seen, uni, who, g)
        return [[g[min(a, b) * q + max(a, b)] for b in range(q)] for a in range(q)]
    finally:
        free(bases)
        free(recs)
        free(g)
        free(vals)
        free(seen)
        free(uni)
        free(who)
