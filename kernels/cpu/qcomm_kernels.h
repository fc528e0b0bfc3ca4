/* The C kernels of the fused CPU codec path: element-wise encode / decode of every codec kind, per-bucket
   statistics, the uniform codec's one-call encode, and the 1-bit sign path of comm.onebit_all_reduce.

   Each function redoes the torch reference's fp32 arithmetic (the codec classes of lightning_qcomm/codecs), in the
   reference's order: built with -ffp-contract=off and without fast-math (lightning_qcomm/codecs/native.py),
   there is no FMA contraction or reassociation, so the results are bit-identical (tests/codecs/test_cpu_fused.py).
   Single-threaded; it runs under the caller's floating-point environment (flush-denormal included).

   Plain C-compatible code, included by qcomm_ops.cpp (the torch op wrappers). The kernel kinds
   QC_KIND_UNIFORM .. QC_KIND_FP8 are defined by the build from lightning_qcomm.codecs.layout.KernelKind. */
#pragma once
#include <stdint.h>
#include <string.h>

#if !defined(QC_KIND_UNIFORM) || !defined(QC_KIND_QSGD) || !defined(QC_KIND_NUQSGD) || !defined(QC_KIND_SIGN) || \
    !defined(QC_KIND_FP8)
#error "build with the -DQC_KIND_* flags of lightning_qcomm.codecs.layout.c_kind_defines()"
#endif

#define CHUNK 4096  /* elements per packing chunk (multiple of 8) */
#define FLT_MAX_ 3.40282346638528859812e+38f

static inline uint32_t mix32(uint32_t x) {
    x ^= x >> 16; x *= 0x7FEB352Du; x ^= x >> 15; x *= 0x846CA68Bu; x ^= x >> 16; return x;
}
static inline float uniform_u(int64_t i, uint32_t k1, uint32_t k2) {
    uint32_t h = mix32(mix32((uint32_t)i ^ k1) ^ k2);
    return (float)(h >> 8) * (1.0f / 16777216.0f);
}
static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline int fexp(float r) { return (int)((f2u(r) >> 23) & 0xFF) - 127; }
static inline float exp2i(int e) { return u2f((uint32_t)(e + 127) << 23); }
static inline int isfin(float v) { return v - v == 0.0f; }
/* torch.nan_to_num(nan=0.0) of a value known to be >= 0 or NaN */
static inline float nan0(float r) { return r != r ? 0.0f : (r > FLT_MAX_ ? FLT_MAX_ : r); }

/* The kernel spec (lightning_qcomm.codecs.layout.KernelSpec) as the kernels read it. */
typedef struct {
    int kind, bits, stoch, P;
    int levels;        /* uniform: 2^b - 1; qsgd: s; nuqsgd: L - 1 */
    int sign_bit;      /* qsgd / nuqsgd */
    int emin;          /* nuqsgd: min exponent; fp8: 1 - bias */
    int mbits, bias;   /* fp8 */
    float fmax;        /* fp8: largest finite value; qsgd: clamp of the scaled magnitude (256) */
} cfg_t;

static inline __attribute__((always_inline)) void quantize_body(
        const cfg_t* c, const float* x, int64_t i0, int64_t i1, const float* p,
        uint32_t k1, uint32_t k2, int64_t off, uint8_t* out, const int stoch) {
    /* p: (sigma, lo, 1/unit) uniform; (sigma, k/n, level cap) qsgd, nuqsgd; (scale) sign1; (sigma, 1/s) fp8.
       Element j draws the random counter j + off. */
    const float p0 = p[0], p1 = c->P > 1 ? p[1] : p0, p2 = c->P > 2 ? p[2] : p1;
    const int levels = c->levels, sign_bit = c->sign_bit; /* locals: the uint8 stores may alias *c */
    switch (c->kind) {
    case QC_KIND_UNIFORM: {
        const float L = (float)levels;
        for (int64_t j = i0; j < i1; j++) {
            float xv = x[j];
            float t = (xv * p0 - p1) * p2;
            t = stoch ? t + uniform_u(j + off, k1, k2) : t + 0.5f;
            int code = !(t >= 0.0f) ? 0 : (t >= L ? levels : (int)t);
            out[j - i0] = isfin(xv) ? (uint8_t)code : 0;
        }
    } break;
    case QC_KIND_QSGD: { /* qsgd, qsgdinf */
        /* r >= cap = 256 > S + 1 (S <= 127) gives level S whatever the rounding, so clamping r there first
           changes no code and keeps the int conversion in range. cap comes from the config at run time:
           with a literal 256 gcc does not if-convert the clamp and the loop stays scalar (~4x slower). */
        const float cap = c->fmax;
        const int top = (int)p2; /* the bucket's level cap, <= S */
        for (int64_t j = i0; j < i1; j++) {
            float xv = x[j];
            float r = nan0(__builtin_fabsf(xv) * p0 * p1);
            r = r > cap ? cap : r;
            int li = (int32_t)r;
            float d = r - (float)li;
            int up = stoch ? (uniform_u(j + off, k1, k2) < d) : (d >= 0.5f);
            int level = li + up; /* small exact integers: the reference's min(lower + up, S, cap) */
            level = level > top ? top : level;
            int code = xv < 0.0f ? (level | sign_bit) : level;
            out[j - i0] = isfin(xv) ? (uint8_t)code : 0;
        }
    } break;
    case QC_KIND_NUQSGD: {
        const int emin = c->emin, top = (int)p2; /* top: the bucket's level cap, <= L - 1 */
        for (int64_t j = i0; j < i1; j++) {
            float xv = x[j];
            float r = nan0(__builtin_fabsf(xv) * p0 * p1);
            r = r > 1.0f ? 1.0f : r;
            int e = fexp(r);
            int below = e < emin;
            int ef = below ? emin : e;
            ef = ef > 0 ? 0 : ef;
            float m = r * exp2i(-ef);
            float pr = below ? m : m - 1.0f;
            int idx = below ? 0 : ef - emin + 1;
            int up = stoch ? (uniform_u(j + off, k1, k2) < pr) : (pr >= 0.5f);
            int level = idx + up;
            level = level < 0 ? 0 : (level > top ? top : level);
            int code = xv < 0.0f ? (level | sign_bit) : level;
            out[j - i0] = isfin(xv) ? (uint8_t)code : 0;
        }
    } break;
    case QC_KIND_SIGN:
        for (int64_t j = i0; j < i1; j++) {
            float xv = x[j];
            out[j - i0] = isfin(xv) ? (uint8_t)(xv < 0.0f) : 0;
        }
        break;
    case QC_KIND_FP8: {
        const int mb = c->mbits, emin = c->emin, bias = c->bias;
        const float fmax = c->fmax;
        for (int64_t j = i0; j < i1; j++) {
            float xv = x[j];
            float a = nan0(__builtin_fabsf(xv) * p0 * p1);
            a = a > fmax ? fmax : a;
            int e = fexp(a);
            e = e < emin ? emin : e;
            float t = a * exp2i(mb - e);
            int fi = (int)t; /* 0 <= t < 2^(mb+1): truncation == floor */
            float d = t - (float)fi;
            /* nearest, ties to even: up iff d > 1/2, or d == 1/2 and f odd; for fp32 d, d > 1/2 is
               d >= 1/2 + 2^-24 (the next float), written as one compare so the loop vectorizes */
            float half = (fi & 1) ? 0.5f : 0x1.000002p-1f;
            int up = stoch ? (uniform_u(j + off, k1, k2) < d) : (d >= half);
            int mm = fi + up;
            int carry = mm >> (mb + 1); /* 0 or 1 */
            mm = carry ? mm >> 1 : mm;
            e += carry;
            int normal = mm >= (1 << mb);
            int ef = normal ? e + bias : 0;
            int mant = normal ? mm - (1 << mb) : mm;
            int code = ((xv < 0.0f) << 7) | (ef << mb) | mant;
            out[j - i0] = isfin(xv) ? (uint8_t)code : 0;
        }
    } break;
    }
}

/* The random bits are only computed for stochastic codecs: two copies of the loops, stoch a constant. */
static void quantize_run(const cfg_t* c, const float* x, int64_t i0, int64_t i1, const float* p,
                         uint32_t k1, uint32_t k2, int64_t off, uint8_t* out) {
    if (c->stoch) quantize_body(c, x, i0, i1, p, k1, k2, off, out, 1);
    else quantize_body(c, x, i0, i1, p, k1, k2, off, out, 0);
}

/* bits 1, 2, 4: whole codes per byte, code k of byte i at bit bits * k (the layout of the generic loop
   below: group g's 8 codes little-endian in bits bytes), in loops the compiler vectorizes. */
#define PACK_PER_BYTE(BITS)                                                              \
    for (int64_t i = 0; i < groups * BITS; i++) {                                        \
        uint8_t v = 0;                                                                   \
        for (int k = 0; k < 8 / BITS; k++) v |= (uint8_t)(c[i * (8 / BITS) + k] << (BITS * k)); \
        out[i] = v;                                                                      \
    }

static void pack_chunk(const uint8_t* c, int64_t groups, int bits, uint8_t* out) {
    if (bits == 8) { memcpy(out, c, (size_t)groups * 8); return; }
    if (bits == 4) { PACK_PER_BYTE(4) return; }
    if (bits == 2) { PACK_PER_BYTE(2) return; }
    if (bits == 1) { PACK_PER_BYTE(1) return; }
    for (int64_t g = 0; g < groups; g++) {
        uint64_t v = 0;
        for (int k = 0; k < 8; k++) v |= (uint64_t)c[8 * g + k] << (bits * k);
        for (int b = 0; b < bits; b++) out[g * bits + b] = (uint8_t)(v >> (8 * b));
    }
}

/* Packed codes of x[0..n) into out (ceil(n/8)*bits bytes); params (nb, P) row-major, bucket length blen.
   Element j's random counter is off + j: x is elements off.. of a longer tensor whose counters run on (the
   rows of whole buckets that one flat encode of that tensor would code, coded one row at a time). */
static void qc_encode(const cfg_t* c, const float* x, int64_t n, const float* params, int64_t blen,
               uint32_t k1, uint32_t k2, int64_t off, uint8_t* out) {
    uint8_t buf[CHUNK];
    for (int64_t s = 0; s < n; s += CHUNK) {
        int64_t e = s + CHUNK < n ? s + CHUNK : n;
        for (int64_t i = s; i < e;) {
            int64_t b = i / blen;
            int64_t be = (b + 1) * blen;
            if (be > e) be = e;
            const float* p = params + b * c->P;
            int ok = 1;
            for (int k = 0; k < c->P; k++) ok &= isfin(p[k]);
            if (ok) quantize_run(c, x, i, be, p, k1, k2, off, buf + (i - s));
            else memset(buf + (i - s), 0, (size_t)(be - i));
            i = be;
        }
        int64_t m = e - s, groups = (m + 7) / 8;
        memset(buf + m, 0, (size_t)(groups * 8 - m));
        pack_chunk(buf, groups, c->bits, out + (s / 8) * c->bits);
    }
}

/* Per-bucket stats of x[0..n) over the real elements of each bucket: min, max, max |x| = max(|min|, |max|),
   and flags: bit 0 = all finite, bit 1 = both +0 and -0 occur (then which zero is the min/max depends on
   the reduction order, and the caller redoes the bucket). Min/max run on order-preserving int32 keys of
   the fp32 bits (integer reductions vectorize); they equal the fp32 min/max for finite buckets without
   mixed zeros, the only buckets whose stats are used. */
static inline int32_t fkey(uint32_t u) { return (int32_t)(u ^ ((uint32_t)((int32_t)u >> 31) & 0x7FFFFFFFu)); }
static inline float unkey(int32_t k) { return u2f((uint32_t)k ^ ((uint32_t)(k >> 31) & 0x7FFFFFFFu)); }

/* The Hadamard transform of each block of `block` = 2^k floats of x (n of them, whole blocks), in place, in the
   order of codecs.eden.hadamard_reference_: for h = 1, 2, ..., block / 2 every pair (i, i + h) with
   i mod 2h < h becomes (a + b, a - b); then every element times `scale`. Additions only until the product, and
   -ffp-contract=off, so each output is the reference's sequence of fp32 operations. */
static void qc_hadamard(float* x, int64_t n, int64_t block, float scale) {
    for (int64_t o = 0; o < n; o += block) {
        float* v = x + o;
        for (int64_t h = 1; h < block; h <<= 1)
            for (int64_t i = 0; i < block; i += 2 * h)
                for (int64_t j = i; j < i + h; j++) {
                    const float a = v[j], b = v[j + h];
                    v[j] = a + b;
                    v[j + h] = a - b;
                }
        for (int64_t j = 0; j < block; j++) v[j] *= scale;
    }
}

/* ||row||_2 of each of the `rows` rows of `width` floats at x, in the fixed order of codecs.qsgd.tree_norm: the
   squares summed pairwise as a binary tree over the row zero-padded to a power of two (a binary counter of
   partial sums: equal-sized subtrees merge left + right as soon as both exist; at the end the partials merge
   from the smallest up, which is what the zero subtrees of the padding leave), then the square root rounded
   once (in double, whose 53 bits make the rounding to float exact). */
static void qc_tree_norm(const float* x, int64_t rows, int64_t width, float* out) {
    int64_t pow2 = 1;
    while (pow2 < width) pow2 <<= 1;
    if (pow2 <= 8192) { /* the tree itself, level by level, in a zero-padded buffer that stays in L1 */
        float buf[8192];
        for (int64_t r = 0; r < rows; r++) {
            const float* row = x + r * width;
            if (pow2 == 1) {
                out[r] = (float)__builtin_sqrt((double)(row[0] * row[0]));
                continue;
            }
            /* the first level straight from the row: squares of columns 2i and 2i + 1 (zero past the row) */
            const int64_t pairs = width / 2;
            for (int64_t i = 0; i < pairs; i++) {
                const float a = row[2 * i], b = row[2 * i + 1];
                buf[i] = a * a + b * b;
            }
            int64_t i = pairs;
            if (width & 1) buf[i++] = row[width - 1] * row[width - 1] + 0.0f;
            for (; i < pow2 / 2; i++) buf[i] = 0.0f;
            for (int64_t w = pow2 / 2; w > 1; w >>= 1)
                for (int64_t k = 0; k < w / 2; k++) buf[k] = buf[2 * k] + buf[2 * k + 1];
            out[r] = (float)__builtin_sqrt((double)buf[0]);
        }
        return;
    }
    for (int64_t r = 0; r < rows; r++) {
        const float* row = x + r * width;
        float part[64];
        uint64_t has = 0;
        for (int64_t j = 0; j < width; j++) {
            float v = row[j] * row[j];
            int l = 0;
            while (has >> l & 1u) {
                v = part[l] + v;
                has &= ~(1ull << l);
                l++;
            }
            part[l] = v;
            has |= 1ull << l;
        }
        float acc = 0.0f;
        int any = 0;
        for (int l = 0; l < 64; l++) {
            if (has >> l & 1u) {
                acc = any ? part[l] + acc : part[l];
                any = 1;
            }
        }
        out[r] = (float)__builtin_sqrt((double)acc);
    }
}

/* One bucket x[i0..i1): min / max as keys, and whether a non-finite value, a +0 or a -0 occurs. */
typedef struct { int32_t mn, mx; uint32_t nonfin, pz, nz; } bstats_t;
static inline bstats_t bucket_stats(const uint32_t* xu, int64_t i0, int64_t i1) {
    int32_t mn = INT32_MAX, mx = INT32_MIN;
    uint32_t nonfin = 0, pz = 0, nz = 0;
    for (int64_t j = i0; j < i1; j++) {
        uint32_t u = xu[j];
        int32_t k = fkey(u);
        mn = k < mn ? k : mn;
        mx = k > mx ? k : mx;
        nonfin |= (u & 0x7F800000u) == 0x7F800000u;
        pz |= u == 0u;
        nz |= u == 0x80000000u;
    }
    bstats_t r = {mn, mx, nonfin, pz, nz};
    return r;
}

static void qc_stats(const float* x, int64_t n, int64_t blen, float* lo, float* hi, float* amax, uint8_t* flags) {
    const uint32_t* xu = (const uint32_t*)x;
    int64_t nb = (n + blen - 1) / blen;
    for (int64_t b = 0; b < nb; b++) {
        int64_t i0 = b * blen, i1 = i0 + blen < n ? i0 + blen : n;
        bstats_t st = bucket_stats(xu, i0, i1);
        float l = unkey(st.mn), h = unkey(st.mx), al = __builtin_fabsf(l), ah = __builtin_fabsf(h);
        lo[b] = l; hi[b] = h; amax[b] = al > ah ? al : ah;
        flags[b] = (uint8_t)((st.nonfin == 0) | ((st.pz & st.nz) << 1));
    }
}

/* Uniform codec, the whole of Codec.encode in one call: per-bucket lo/hi over the real elements (as in
   qc_stats), wire scales (lo, unit = (hi - lo) / L), NaN for a bucket with a non-finite element, encode
   params (1, lo, inv = unit > 0 ? 1/unit : 0), then the codes (random counters from off, as in qc_encode).
   A zero min or max is +0 (UniformCodec._wire_scales). Returns 1 before writing any code if a bucket is
   pre-scaled (UniformCodec._wire_scales: the same fp32 tests): the caller then takes the general path. */
static int qc_uniform_encode(const cfg_t* c, const float* x, int64_t n, int64_t blen, uint32_t k1, uint32_t k2,
                      int64_t off, float* scales, float* params, uint8_t* out) {
    const uint32_t* xu = (const uint32_t*)x;
    const int64_t nb = (n + blen - 1) / blen;
    const float L = (float)c->levels;
    const float qnan = u2f(0x7FC00000u);
    for (int64_t b = 0; b < nb; b++) {
        int64_t i0 = b * blen, i1 = i0 + blen < n ? i0 + blen : n;
        bstats_t st = bucket_stats(xu, i0, i1);
        float lo = unkey(st.mn) + 0.0f, hi = unkey(st.mx) + 0.0f; /* a zero min / max is +0 (_wire_scales) */
        if (st.nonfin) {
            scales[2 * b] = scales[2 * b + 1] = qnan;
            params[3 * b] = 1.0f;
            params[3 * b + 1] = params[3 * b + 2] = qnan;
            continue;
        }
        float unit = (hi - lo) / L;
        float top = lo + L * unit;
        if (!isfin(top) || unit > 0x1p126f || (hi > lo && unit < 0x1p-126f)) return 1;
        float inv = unit > 0.0f ? 1.0f / unit : 0.0f;
        scales[2 * b] = lo; scales[2 * b + 1] = unit;
        params[3 * b] = 1.0f; params[3 * b + 1] = lo; params[3 * b + 2] = inv;
    }
    qc_encode(c, x, n, params, blen, k1, k2, off, out);
    return 0;
}

/* fp32 values of the first n packed codes: (p0 + c * p1) * p2 (P = 3: uniform, whose lut[c] is c), else
   lut[c] * p0 * p1 (P = 2) or lut[c] * p0 (P = 1). */
/* The uniform codec's decode parameters of bucket b from its wire scales (lo, unit), as codecs.scaling.unflag and
   UniformCodec._decode_params make them: a negative unit flags a pre-scaled bucket (m = 2^-64 when |unit| < 1,
   else 2^64); once any bucket of the call is flagged every unit is taken by magnitude (unflag's abs). */
static inline void uniform_wire_params(const float* scales, int64_t b, int any_flagged, float* p) {
    const float w = scales[2 * b + 1];
    const float mag = u2f(f2u(w) & 0x7FFFFFFFu); /* torch.abs: the sign bit cleared (-0 and NaN included) */
    p[0] = scales[2 * b];
    p[1] = any_flagged ? mag : w;
    p[2] = w < 0.0f ? (mag < 1.0f ? exp2i(-64) : exp2i(64)) : 1.0f;
}

/* Decode of numel packed codes. params: (num_buckets, P) decode parameters; or, with uniform_wire, the uniform
   codec's (num_buckets, 2) wire scales (uniform_wire_params; P is then 3). */
static void qc_decode(const uint8_t* codes, int64_t n, int bits, const float* params, int P, int64_t blen,
               const float* lut, float* out, int uniform_wire) {
    uint8_t buf[CHUNK];
    int any_flagged = 0;
    if (uniform_wire) {
        const int64_t nb = (n + blen - 1) / blen;
        for (int64_t b = 0; b < nb; b++) any_flagged |= params[2 * b + 1] < 0.0f;
    }
    const uint32_t mask = (1u << bits) - 1u;
    for (int64_t s = 0; s < n; s += CHUNK) {
        int64_t e = s + CHUNK < n ? s + CHUNK : n;
        int64_t groups = (e - s + 7) / 8;
        const uint8_t* in = codes + (s / 8) * bits;
        const uint8_t* cb = buf;
        if (bits == 8) cb = in;
        else if (bits == 4 || bits == 2 || bits == 1) { /* whole codes per byte (see PACK_PER_BYTE) */
            const int per = 8 / bits;
            const int64_t nbytes = groups * bits;
            if (bits == 4) for (int64_t i = 0; i < nbytes; i++) { buf[2 * i] = in[i] & 15u; buf[2 * i + 1] = in[i] >> 4; }
            else for (int64_t i = 0; i < nbytes; i++)
                for (int k = 0; k < per; k++) buf[i * per + k] = (uint8_t)((in[i] >> (bits * k)) & mask);
        }
        else for (int64_t g = 0; g < groups; g++) {
            uint64_t v = 0;
            for (int b = 0; b < bits; b++) v |= (uint64_t)in[g * bits + b] << (8 * b);
            for (int k = 0; k < 8; k++) buf[8 * g + k] = (uint8_t)((v >> (bits * k)) & mask);
        }
        for (int64_t i = s; i < e;) {
            int64_t b = i / blen;
            int64_t be = (b + 1) * blen;
            if (be > e) be = e;
            float wp[3];
            if (uniform_wire) uniform_wire_params(params, b, any_flagged, wp);
            const float* p = uniform_wire ? wp : params + b * P;
            if (P == 3) { /* uniform: lut[c] == (float)c exactly, so no gather is needed */
                const float p0 = p[0], p1 = p[1], p2 = p[2];
                for (int64_t j = i; j < be; j++) out[j] = (p0 + (float)cb[j - s] * p1) * p2;
            } else if (P == 2) {
                const float p0 = p[0], p1 = p[1];
                for (int64_t j = i; j < be; j++) out[j] = lut[cb[j - s]] * p0 * p1;
            } else {
                const float p0 = p[0];
                for (int64_t j = i; j < be; j++) out[j] = lut[cb[j - s]] * p0;
            }
            i = be;
        }
    }
}

/* ---- 1-bit sign path of comm.onebit_all_reduce (sign1 codec, one bucket per chunk) ----------------
   Each is the composition of the sign1 reference ops the collective would otherwise run, fused. */

/* Packed sign bits of y[0..c) into codes (ceil(c/8) bytes, then s as fp32: one payload; bit k of byte g is y[8g+k] < 0) and, when s
   is finite, err[j] = y[j] - C(y)[j] = y[j] - (y[j] < 0 ? -s : s) for j < valid. A non-finite s (a
   non-finite element, or an overflowing norm) gives all-zero codes and leaves err[0..valid) as it was:
   the reference's residual is non-finite there and the error update keeps the old value. err[valid..
   err_len) is zeroed in every case (the padding of a server chunk). */
static void qc_sign_encode_err(const float* y, int64_t c, float s, uint8_t* codes, float* err, int64_t valid,
                        int64_t err_len) {
    const int64_t full = c / 8;
    if (!isfin(s)) {
        memset(codes, 0, (size_t)((c + 7) / 8));
    } else {
        for (int64_t g = 0; g < full; g++) {
            const float* v = y + 8 * g;
            codes[g] = (uint8_t)((v[0] < 0.0f) | ((v[1] < 0.0f) << 1) | ((v[2] < 0.0f) << 2) |
                                 ((v[3] < 0.0f) << 3) | ((v[4] < 0.0f) << 4) | ((v[5] < 0.0f) << 5) |
                                 ((v[6] < 0.0f) << 6) | ((v[7] < 0.0f) << 7));
        }
        if (full * 8 < c) {
            uint8_t b = 0;
            for (int64_t j = full * 8; j < c; j++) b |= (uint8_t)((y[j] < 0.0f) << (j - full * 8));
            codes[full] = b;
        }
        const float ns = -s;
        for (int64_t j = 0; j < valid; j++) err[j] = y[j] - (y[j] < 0.0f ? ns : s);
    }
    for (int64_t j = valid > 0 ? valid : 0; j < err_len; j++) err[j] = 0.0f;
    memcpy(codes + (c + 7) / 8, &s, 4);
}

static inline float payload_scale(const uint8_t* payload, int64_t c) {
    float s;
    memcpy(&s, payload + (c + 7) / 8, 4);
    return s;
}

/* The 8 decoded values of code byte b: (1 - 2 * bit_k) * s, i.e. s with its sign bit flipped where
   bit_k is set (-1 * s == -s exactly for every s; only a NaN's payload sign may differ). */
static inline void sign_values8(uint8_t b, uint32_t su, float* v) {
    for (int k = 0; k < 8; k++) v[k] = u2f(su ^ ((uint32_t)((b >> k) & 1u) << 31));
}

/* z[i] = (v_0[i] + v_1[i] + ... + v_{N-1}[i]) / N + es[i] for i < valid, 0 after (to c), where v_r is
   the decoded payload r of buf (N payloads of P bytes: ceil(c/8) code bytes, then the fp32 scale):
   v_r[i] = (1 - 2 * bit) * s_r. The sum runs in rank order. N <= 256. */
static void qc_sign_server_sum(const uint8_t* buf, int N, int64_t c, int64_t P, const float* es, int64_t valid,
                        float* z) {
    const int64_t n = valid < 0 ? 0 : (valid < c ? valid : c);
    const float fN = (float)N;
    uint32_t su[256];
    for (int r = 0; r < N; r++) su[r] = f2u(payload_scale(buf + (int64_t)r * P, c));
    const int64_t full = n / 8;
    float acc[8], v[8];
    for (int64_t g = 0; g < full; g++) {
        sign_values8(buf[g], su[0], acc);
        for (int r = 1; r < N; r++) {
            sign_values8(buf[(int64_t)r * P + g], su[r], v);
            for (int k = 0; k < 8; k++) acc[k] = acc[k] + v[k];
        }
        for (int k = 0; k < 8; k++) z[8 * g + k] = acc[k] / fN + es[8 * g + k];
    }
    if (full * 8 < n) {
        sign_values8(buf[full], su[0], acc);
        for (int r = 1; r < N; r++) {
            sign_values8(buf[(int64_t)r * P + full], su[r], v);
            for (int k = 0; k < 8; k++) acc[k] = acc[k] + v[k];
        }
        for (int64_t i = full * 8; i < n; i++) z[i] = acc[i - full * 8] / fN + es[i];
    }
    for (int64_t i = n; i < c; i++) z[i] = 0.0f;
}

/* out[i] = (1 - 2 * bit_i) * s for i < length: the first length values of one c-element payload. */
static void qc_sign_decode(const uint8_t* payload, int64_t c, int64_t length, float* out) {
    const uint32_t su = f2u(payload_scale(payload, c));
    const int64_t full = length / 8;
    for (int64_t g = 0; g < full; g++) sign_values8(payload[g], su, out + 8 * g);
    if (full * 8 < length) {
        float v[8];
        sign_values8(payload[full], su, v);
        for (int64_t i = full * 8; i < length; i++) out[i] = v[i - full * 8];
    }
}
