"""Fused CPU path of ``Codec.encode`` / ``decode``: a few compiled passes instead of ~40 eager ops.

The torch reference (``Codec._scales`` + ``encode_reference`` / ``decode_reference``) stays the spec.
This module redoes the same arithmetic in C on CPU tensors, in two passes for encode and one for decode:

    encode: per-bucket stats (min, max, max |x|, finiteness) -> wire scales and per-bucket params (torch,
            on nb-element tensors) -> counter hash, uniform u, quantize, finiteness mask, pack b-bit codes
    decode: unpack -> LUT[code] -> (lo + LUT[code] * unit) * m (uniform), LUT[code] * scale * m (the others)

(m, and the sigma x is multiplied by before quantizing, are 1 except in the pre-scaled buckets at the ends
of fp32's range, ``codecs.scaling``.)

and is bit-identical to the reference (tests/test_cpu_fused.py). Every fp32 operation is the
reference's, in the reference's order, compiled with ``-ffp-contract=off`` and without fast-math, so
there is no FMA contraction or reassociation. floor() of a value known to lie in [0, 2^23) is a
truncating int conversion (exact); the decode LUT is filled by calling the codec's own ``_dequantize``
on the 2^bits codes with unit params (``LUT[c] * 1 == LUT[c]`` exactly). Scales come from the codec's
own ``_scales`` applied to the exact per-bucket stats (see ``_scales``); L2-norm scales (qsgd, nuqsgd,
sign1) are still computed by torch, because their rounding depends on torch's summation order.

The C source is compiled once per machine with the system C compiler (``$CC``, else ``cc``/``gcc``)
into a shared library cached under torch's extensions dir (``$TORCH_EXTENSIONS_DIR``, default
``~/.cache/torch_extensions``); a cache directory or library that another user could have written (not
owned by this user or root, group/world-writable, a symlink) is refused with a warning, as ssh refuses a
writable ``~/.ssh``, and the library is then built into a private temporary directory. It is keyed by a
hash of the source, flags and CPU (it is built with
``-march=native`` when the compiler accepts it, else for the baseline ISA), and loaded with ctypes (the
GIL is released during the calls). Single-threaded, no OpenMP: it runs in the calling thread, under
the caller's floating-point environment (e.g. ``torch.set_flush_denormal``), like the reference with
one torch thread.

Dispatch (``codecs.dispatch.use_cpu_fused``): CPU tensors with ``numel >= FUSED_MIN_NUMEL`` (2^14) of the
codec classes in ``_KINDS``; ``LIGHTNING_QCOMM_CPU_FUSED=0`` disables it. If the library cannot be
built or loaded, one warning is logged and the reference is used.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import threading

import torch

from lightning_qcomm.codecs import packing, rng
from lightning_qcomm.codecs.fp8 import FP8Codec
from lightning_qcomm.codecs.qsgd import NUQSGDCodec, QSGDCodec, QSGDInfCodec
from lightning_qcomm.codecs.sign import SignCodec
from lightning_qcomm.codecs.uniform import UniformCodec

log = logging.getLogger(__name__)
FLT_MAX = torch.finfo(torch.float32).max

# Smallest tensor (elements) that goes to the fused path. Below it the eager reference's fixed costs are
# small anyway, and keeping small tensors on the reference keeps the spec path exercised by the tests.
# 2^14 puts QSDP's per-parameter shards and DDP buckets of real models on the fused path.
FUSED_MIN_NUMEL = 1 << 14
ENV_SWITCH = "LIGHTNING_QCOMM_CPU_FUSED"  # "0" disables the fused path

# No fast-math, no FMA contraction: every fp32 op is the reference's. -fno-trapping-math only lets the
# compiler if-convert (and so vectorize) branches on float compares; it changes no result.
CFLAGS = (
    "-O3",
    "-std=c11",
    "-fPIC",
    "-shared",
    "-fno-fast-math",
    "-ffp-contract=off",
    "-fno-trapping-math",
    "-fno-strict-aliasing",
)

# Tried first: vectorize for this machine's ISA (~1.5x on AVX2/AVX-512 over baseline x86-64). The cached
# library's key includes a fingerprint of the CPU, so a build for one CPU is never loaded on another; if
# the compiler rejects the flag, the build is redone with CFLAGS alone.
NATIVE_FLAGS = ("-march=native",)

# Exact codec classes with a fused kernel (a subclass may override the math, so it keeps the reference).
_KINDS = {UniformCodec: 0, QSGDCodec: 1, QSGDInfCodec: 1, NUQSGDCodec: 2, SignCodec: 3, FP8Codec: 4}
_ENC_P = (3, 3, 3, 1, 2)  # per kind: per-bucket encode parameters (the codec's _encode_params)
_DEC_P = (3, 2, 2, 1, 2)  # per kind: per-bucket decode parameters (the codec's _decode_params)

_SOURCE = r"""
#include <stdint.h>
#include <string.h>

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
        uint32_t k1, uint32_t k2, uint8_t* out, const int stoch) {
    /* p: (sigma, lo, 1/unit) uniform; (sigma, k/n, level cap) qsgd, nuqsgd; (scale) sign1; (sigma, 1/s) fp8 */
    const float p0 = p[0], p1 = c->P > 1 ? p[1] : p0, p2 = c->P > 2 ? p[2] : p1;
    const int levels = c->levels, sign_bit = c->sign_bit; /* locals: the uint8 stores may alias *c */
    switch (c->kind) {
    case 0: { /* uniform */
        const float L = (float)levels;
        for (int64_t j = i0; j < i1; j++) {
            float xv = x[j];
            float t = (xv * p0 - p1) * p2;
            t = stoch ? t + uniform_u(j, k1, k2) : t + 0.5f;
            int code = !(t >= 0.0f) ? 0 : (t >= L ? levels : (int)t);
            out[j - i0] = isfin(xv) ? (uint8_t)code : 0;
        }
    } break;
    case 1: { /* qsgd, qsgdinf */
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
            int up = stoch ? (uniform_u(j, k1, k2) < d) : (d >= 0.5f);
            int level = li + up; /* small exact integers: the reference's min(lower + up, S, cap) */
            level = level > top ? top : level;
            int code = xv < 0.0f ? (level | sign_bit) : level;
            out[j - i0] = isfin(xv) ? (uint8_t)code : 0;
        }
    } break;
    case 2: { /* nuqsgd */
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
            int up = stoch ? (uniform_u(j, k1, k2) < pr) : (pr >= 0.5f);
            int level = idx + up;
            level = level < 0 ? 0 : (level > top ? top : level);
            int code = xv < 0.0f ? (level | sign_bit) : level;
            out[j - i0] = isfin(xv) ? (uint8_t)code : 0;
        }
    } break;
    case 3: /* sign1 */
        for (int64_t j = i0; j < i1; j++) {
            float xv = x[j];
            out[j - i0] = isfin(xv) ? (uint8_t)(xv < 0.0f) : 0;
        }
        break;
    case 4: { /* fp8 */
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
            int up = stoch ? (uniform_u(j, k1, k2) < d) : (d >= half);
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
                         uint32_t k1, uint32_t k2, uint8_t* out) {
    if (c->stoch) quantize_body(c, x, i0, i1, p, k1, k2, out, 1);
    else quantize_body(c, x, i0, i1, p, k1, k2, out, 0);
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

/* Packed codes of x[0..n) into out (ceil(n/8)*bits bytes); params (nb, P) row-major, bucket length blen. */
void qc_encode(const cfg_t* c, const float* x, int64_t n, const float* params, int64_t blen,
               uint32_t k1, uint32_t k2, uint8_t* out) {
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
            if (ok) quantize_run(c, x, i, be, p, k1, k2, buf + (i - s));
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

void qc_stats(const float* x, int64_t n, int64_t blen, float* lo, float* hi, float* amax, uint8_t* flags) {
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
   params (1, lo, inv = unit > 0 ? 1/unit : 0), then the codes.
   Returns 1 before writing any code if a bucket holds both +0 and -0 and its min or max is a zero (torch's
   sign of that zero depends on its reduction order), or if a bucket is pre-scaled (UniformCodec._wire_scales:
   the same fp32 tests): the caller then takes the general path. */
int qc_uniform_encode(const cfg_t* c, const float* x, int64_t n, int64_t blen, uint32_t k1, uint32_t k2,
                      float* scales, float* params, uint8_t* out) {
    const uint32_t* xu = (const uint32_t*)x;
    const int64_t nb = (n + blen - 1) / blen;
    const float L = (float)c->levels;
    const float qnan = u2f(0x7FC00000u);
    for (int64_t b = 0; b < nb; b++) {
        int64_t i0 = b * blen, i1 = i0 + blen < n ? i0 + blen : n;
        bstats_t st = bucket_stats(xu, i0, i1);
        float lo = unkey(st.mn), hi = unkey(st.mx);
        if (st.nonfin) {
            scales[2 * b] = scales[2 * b + 1] = qnan;
            params[3 * b] = 1.0f;
            params[3 * b + 1] = params[3 * b + 2] = qnan;
            continue;
        }
        if ((st.pz & st.nz) && (lo == 0.0f || hi == 0.0f)) return 1;
        float unit = (hi - lo) / L;
        float top = lo + L * unit;
        if (!isfin(top) || unit > 0x1p126f || (hi > lo && unit < 0x1p-126f)) return 1;
        float inv = unit > 0.0f ? 1.0f / unit : 0.0f;
        scales[2 * b] = lo; scales[2 * b + 1] = unit;
        params[3 * b] = 1.0f; params[3 * b + 1] = lo; params[3 * b + 2] = inv;
    }
    qc_encode(c, x, n, params, blen, k1, k2, out);
    return 0;
}

/* fp32 values of the first n packed codes: (p0 + c * p1) * p2 (P = 3: uniform, whose lut[c] is c), else
   lut[c] * p0 * p1 (P = 2) or lut[c] * p0 (P = 1). */
void qc_decode(const uint8_t* codes, int64_t n, int bits, const float* params, int P, int64_t blen,
               const float* lut, float* out) {
    uint8_t buf[CHUNK];
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
            const float* p = params + b * P;
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
void qc_sign_encode_err(const float* y, int64_t c, float s, uint8_t* codes, float* err, int64_t valid,
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
void qc_sign_server_sum(const uint8_t* buf, int N, int64_t c, int64_t P, const float* es, int64_t valid,
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
void qc_sign_decode(const uint8_t* payload, int64_t c, int64_t length, float* out) {
    const uint32_t su = f2u(payload_scale(payload, c));
    const int64_t full = length / 8;
    for (int64_t g = 0; g < full; g++) sign_values8(payload[g], su, out + 8 * g);
    if (full * 8 < length) {
        float v[8];
        sign_values8(payload[full], su, v);
        for (int64_t i = full * 8; i < length; i++) out[i] = v[i - full * 8];
    }
}
"""


class _Cfg(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_int),
        ("bits", ctypes.c_int),
        ("stoch", ctypes.c_int),
        ("P", ctypes.c_int),
        ("levels", ctypes.c_int),
        ("sign_bit", ctypes.c_int),
        ("emin", ctypes.c_int),
        ("mbits", ctypes.c_int),
        ("bias", ctypes.c_int),
        ("fmax", ctypes.c_float),
    ]


_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_load_error: str | None = None


def _compiler() -> str | None:
    for cand in (os.environ.get("CC"), "cc", "gcc"):
        if cand and shutil.which(cand):
            return shutil.which(cand)
    return None


def _build_dir() -> str:
    from torch.utils.cpp_extension import get_default_build_root

    return os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()


def _cpu_fingerprint() -> str:
    """What ``-march=native`` depends on: the CPU model and ISA flags (Linux), else the platform's words."""
    try:
        with open("/proc/cpuinfo") as f:
            return "".join(sorted({ln for ln in f if ln.startswith(("model name", "flags", "Features", "CPU part"))}))
    except OSError:
        return f"{platform.machine()} {platform.processor()} {platform.platform()}"


def _build() -> ctypes.CDLL:
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found ($CC, cc, gcc)")
    try:
        return _build_with(cc, (*CFLAGS, *NATIVE_FLAGS), _cpu_fingerprint())
    except RuntimeError as e:
        log.info("lightning_qcomm: native build of the fused CPU codecs failed (%s); building for the baseline ISA", e)
        return _build_with(cc, CFLAGS, "")


def library_path(build_dir: str, cc: str, flags: tuple[str, ...], machine: str) -> str:
    """Where the library built from this source with ``cc``, ``flags`` for ``machine`` is cached."""
    key = hashlib.sha256("\0".join([_SOURCE, cc, *flags, machine]).encode()).hexdigest()[:16]
    return os.path.join(build_dir, "lightning_qcomm_cpu_fused", f"codec_{key}.so")


def _unsafe(path: str, ancestor: bool = False) -> str | None:
    """Why code loaded from ``path`` could have been written by someone else, or None (ssh's StrictModes rule).

    ``path`` must be owned by this user or root and not writable by group or others, and must not be a
    symbolic link. An ``ancestor`` directory may be group/world-writable only with the sticky bit (``/tmp``).
    """
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) and not ancestor:
        return f"{path} is a symbolic link"
    if st.st_uid not in (os.geteuid(), 0):
        return f"{path} is owned by uid {st.st_uid}, not by this user ({os.geteuid()}) or root"
    writable = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if writable and not (ancestor and st.st_mode & stat.S_ISVTX):
        return (
            f"{path} is writable by {'group' if st.st_mode & stat.S_IWGRP else 'others'} (mode {st.st_mode & 0o7777:o})"
        )
    return None


def _unsafe_cache_dir(d: str) -> str | None:
    """``_unsafe`` for the cache directory and its build root, and the sticky rule for every ancestor."""
    d = os.path.abspath(d)
    for path in (d, os.path.dirname(d)):
        if os.path.lexists(path) and (reason := _unsafe(path)):
            return reason
    parent = os.path.dirname(os.path.dirname(d))
    while True:
        if os.path.lexists(parent) and (reason := _unsafe(os.path.realpath(parent), ancestor=True)):
            return reason
        if parent == os.path.dirname(parent):
            return None
        parent = os.path.dirname(parent)


def _compile_into(d: str, cc: str, flags: tuple[str, ...], so: str) -> None:
    """Compile into a private temporary directory inside ``d``, then rename onto ``so`` (atomic: concurrent
    builders each publish a complete file; nobody sees a half-written library)."""
    with tempfile.TemporaryDirectory(dir=d) as tmp:  # mode 0700
        src = os.path.join(tmp, "codec.c")
        with open(src, "w") as f:
            f.write(_SOURCE)
        out = os.path.join(tmp, "codec.so")
        res = subprocess.run([cc, *flags, src, "-o", out], capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"{cc} failed: {res.stderr.strip()[-2000:]}")
        os.chmod(out, 0o755)  # whatever the umask: never group/world-writable
        os.replace(out, so)


def _build_with(cc: str, flags: tuple[str, ...], machine: str) -> ctypes.CDLL:
    so = library_path(_build_dir(), cc, flags, machine)
    d = os.path.dirname(so)
    os.makedirs(d, mode=0o700, exist_ok=True)
    reason = _unsafe_cache_dir(d)
    if reason is not None:  # a shared or writable cache: build privately, cache nothing
        log.warning(
            "lightning_qcomm: refusing the compiled-codec cache %s (%s); building into a private temporary "
            "directory instead (not cached)",
            d,
            reason,
        )
        private = tempfile.mkdtemp(prefix="lightning_qcomm_cpu_fused_")
        try:
            so = os.path.join(private, "codec.so")
            _compile_into(private, cc, flags, so)
            return _bind(ctypes.CDLL(so))
        finally:
            shutil.rmtree(private, ignore_errors=True)  # the loaded library stays mapped
    if os.path.lexists(so) and (reason := _unsafe(so)):
        log.warning("lightning_qcomm: refusing the cached library %s (%s); rebuilding it", so, reason)
        os.remove(so)
    if not os.path.exists(so):
        _compile_into(d, cc, flags, so)
    if reason := _unsafe(so):  # re-checked right before loading
        raise RuntimeError(f"refusing to load {so}: {reason}")
    return _bind(ctypes.CDLL(so))


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the C signatures on a freshly loaded library."""
    vp, i64, u32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint32
    lib.qc_encode.argtypes = [ctypes.POINTER(_Cfg), vp, i64, vp, i64, u32, u32, vp]
    lib.qc_encode.restype = None
    lib.qc_decode.argtypes = [vp, i64, ctypes.c_int, vp, ctypes.c_int, i64, vp, vp]
    lib.qc_decode.restype = None
    lib.qc_stats.argtypes = [vp, i64, i64, vp, vp, vp, vp]
    lib.qc_stats.restype = None
    lib.qc_uniform_encode.argtypes = [ctypes.POINTER(_Cfg), vp, i64, i64, u32, u32, vp, vp, vp]
    lib.qc_uniform_encode.restype = ctypes.c_int
    lib.qc_sign_encode_err.argtypes = [vp, i64, ctypes.c_float, vp, vp, i64, i64]
    lib.qc_sign_encode_err.restype = None
    lib.qc_sign_server_sum.argtypes = [vp, ctypes.c_int, i64, i64, vp, i64, vp]
    lib.qc_sign_server_sum.restype = None
    lib.qc_sign_decode.argtypes = [vp, i64, i64, vp]
    lib.qc_sign_decode.restype = None
    return lib


def load() -> ctypes.CDLL | None:
    """The compiled library (built on first use), or None if it cannot be built; the reason is in
    ``load_error()`` and the caller logs it once."""
    global _lib, _load_error
    if _lib is None and _load_error is None:
        with _lock:
            if _lib is None and _load_error is None:
                try:
                    _lib = _build()
                except Exception as e:  # any build/load failure -> reference path, reported by the caller
                    _load_error = f"{type(e).__name__}: {e}"
    return _lib


def load_error() -> str | None:
    return _load_error


def supports(codec) -> bool:
    """True when ``codec`` is one of the exact codec classes with a fused kernel."""
    return type(codec) in _KINDS


def _cfg(codec) -> _Cfg:
    kind = _KINDS[type(codec)]
    c = _Cfg(kind=kind, bits=codec.bits, stoch=int(bool(codec.stochastic)), P=_ENC_P[kind])
    if kind == 0:
        c.levels = codec.levels
    elif kind == 1:
        c.levels, c.sign_bit, c.fmax = codec.s, codec.sign_bit, 256.0  # fmax: qsgd's clamp of |x| * s / norm
    elif kind == 2:
        c.levels, c.sign_bit, c.emin = codec.num_levels - 1, codec.sign_bit, codec.min_exponent
    elif kind == 4:
        c.mbits, c.bias, c.emin, c.fmax = codec.mbits, codec.bias, codec.emin, codec.fmax
    return c


def encode(codec, xf: torch.Tensor, enc_params: torch.Tensor, seed: int) -> torch.Tensor:
    """Fused ``codec.encode_reference(xf, enc_params, seed)``: packed uint8 codes of flat fp32 ``xf``."""
    lib = load()
    if lib is None:
        raise RuntimeError(f"lightning_qcomm fused CPU codecs unavailable: {_load_error}")
    x = xf.reshape(-1).to(torch.float32).contiguous()
    n = x.numel()
    params = enc_params.to(torch.float32).contiguous()
    out = torch.empty(packing.packed_nbytes(n, codec.bits), dtype=torch.uint8)
    k1, k2 = rng.seed_to_key(seed)
    cfg = _cfg(codec)
    if params.shape != (codec.num_buckets(n), cfg.P):
        raise ValueError(f"enc_params of shape {tuple(params.shape)} do not match codec {codec!r} on {n} elements")
    lib.qc_encode(ctypes.byref(cfg), x.data_ptr(), n, params.data_ptr(), codec.bucket_len(n), k1, k2, out.data_ptr())
    return out


_LUTS: dict[tuple, torch.Tensor] = {}


def _cfg_key(cfg: _Cfg) -> tuple:
    return tuple(getattr(cfg, name) for name, _ in _Cfg._fields_)


def decode_lut(codec) -> torch.Tensor:
    """fp32 value of every code with unit params, from the codec's own ``_dequantize``: uniform
    ``(0 + c * 1) * 1``; the others ``v(c) * 1 * 1``. The fused decode computes ``(p0 + LUT[c] * p1) * p2``
    or ``LUT[c] * p0 * p1``, which is the reference's expression term by term. Cached per codec configuration
    (every field ``_dequantize`` reads is in the kernel config)."""
    key = (type(codec), _cfg_key(_cfg(codec)))
    lut = _LUTS.get(key)
    if lut is None:
        lut = _LUTS[key] = _decode_lut(codec)
    return lut


def _decode_lut(codec) -> torch.Tensor:
    codes = torch.arange(256, dtype=torch.int64).remainder_(1 << codec.bits).view(1, 256)
    if type(codec) is UniformCodec:
        unit = torch.tensor([[[0.0], [1.0], [1.0]]])
    else:
        unit = torch.ones(1, _DEC_P[_KINDS[type(codec)]], 1)
    return codec._dequantize(codes, unit).reshape(256).to(torch.float32).contiguous()


def decode(
    codec, codes: torch.Tensor, dec_params: torch.Tensor, numel: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Fused ``codec.decode_reference(codes, dec_params, numel)``: flat fp32 values, written into ``out``
    (a contiguous CPU fp32 tensor of ``numel`` elements) when given."""
    lib = load()
    if lib is None:
        raise RuntimeError(f"lightning_qcomm fused CPU codecs unavailable: {_load_error}")
    need = packing.packed_nbytes(numel, codec.bits)
    c = codes.reshape(-1)
    if c.numel() < need:
        raise ValueError(f"codes has {c.numel()} bytes, {numel} codes of {codec.bits} bits need {need}")
    c = c.contiguous()
    params = dec_params.to(torch.float32).contiguous()
    if params.shape[1] != _DEC_P[_KINDS[type(codec)]]:
        raise ValueError(f"dec_params of shape {tuple(params.shape)} do not match codec {codec!r}")
    lut = decode_lut(codec)
    if out is None:
        out = torch.empty(numel, dtype=torch.float32)
    else:
        _check_f32("out", out, numel)
    lib.qc_decode(
        c.data_ptr(),
        numel,
        codec.bits,
        params.data_ptr(),
        params.shape[1],
        codec.bucket_len(numel),
        lut.data_ptr(),
        out.data_ptr(),
    )
    return out


def _scales(codec, x: torch.Tensor) -> torch.Tensor:
    """The reference's wire scales (``Codec._scales`` then the non-finite-bucket NaN mask), bit for bit,
    from one C pass of per-bucket stats where the codec's scales are exact functions of them:

    - min/max (uniform) and max |x| (qsgdinf, fp8) do not depend on the reduction order, so the codec's
      own ``_scales`` applied to the stats ((lo, hi) rows, or (amax,) rows) gives the reference's bits;
      a bucket holding both +0 and -0 where min or max is zero is redone by ``_scales`` on its elements,
      together with the last bucket (which ``_scales`` treats specially);
    - L2-norm codecs (qsgd, nuqsgd, sign1): the norm's rounding depends on torch's summation order, so
      ``_scales`` runs on the bucketed tensor as in the reference; only the finiteness pass is fused.
    """
    n = x.numel()
    blen = codec.bucket_len(n)
    nb = -(-n // blen)
    lo, hi, amax = (torch.empty(nb, dtype=torch.float32) for _ in range(3))
    flags = torch.empty(nb, dtype=torch.uint8)
    _lib.qc_stats(x.data_ptr(), n, blen, lo.data_ptr(), hi.data_ptr(), amax.data_ptr(), flags.data_ptr())
    counts = torch.full((nb,), blen, dtype=torch.float32)
    counts[-1] = n - (nb - 1) * blen
    kind = _KINDS[type(codec)]
    if kind == 0:
        stat_counts = counts.clone()
        stat_counts[-1] = 2
        scales = codec._scales(torch.stack([lo, hi], dim=1), stat_counts)
        redo = (((flags & 2) != 0) & ((lo == 0) | (hi == 0))).nonzero().reshape(-1)
        if redo.numel():
            redo = redo[redo != nb - 1]
            full = x[: (nb - 1) * blen].view(nb - 1, blen)
            last = torch.nn.functional.pad(x[(nb - 1) * blen :], (0, nb * blen - n)).view(1, blen)
            sub = torch.cat([full[redo], last])
            rows = torch.cat([redo, torch.tensor([nb - 1])])
            scales[rows] = codec._scales(sub, counts[rows])
    elif kind == 4 or type(codec) is QSGDInfCodec:
        scales = codec._scales(amax[:, None], counts)
    elif nb * blen == n:
        scales = codec._scales(x.view(nb, blen), counts)
    else:
        # the full buckets straight from x, only the short last one padded (the reference pads a copy of
        # all of x); a two-row block keeps the row reduction on the same (multi-row) kernel as the rest
        full = nb - 1
        tail = torch.zeros(2, blen, dtype=x.dtype)
        tail[0, : n - full * blen] = x[full * blen :]
        last = codec._scales(tail, torch.stack([counts[-1], counts[-1]]))[:1]
        scales = torch.cat([codec._scales(x[: full * blen].view(full, blen), counts[:full]), last]) if full else last
    finite = (flags & 1).bool()[:, None]
    return torch.where(finite, scales, torch.full_like(scales, float("nan")))


def encode_packed(codec, xf: torch.Tensor, seed: int, out_max: float = FLT_MAX) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused ``Codec.encode`` body: (packed codes, wire scales) of flat fp32 ``xf``, bit-identical to
    the reference's (``out_max``: see ``Codec._encode_params``)."""
    if load() is None:
        raise RuntimeError(f"lightning_qcomm fused CPU codecs unavailable: {_load_error}")
    x = xf.reshape(-1).to(torch.float32).contiguous()
    if type(codec) is UniformCodec:  # stats, scales, params and codes in one call
        n = x.numel()
        blen = codec.bucket_len(n)
        nb = -(-n // blen)
        scales = torch.empty(nb, 2, dtype=torch.float32)
        params = torch.empty(nb, 3, dtype=torch.float32)
        out = torch.empty(packing.packed_nbytes(n, codec.bits), dtype=torch.uint8)
        k1, k2 = rng.seed_to_key(seed)
        cfg = _cfg(codec)
        args = (x.data_ptr(), n, blen, k1, k2, scales.data_ptr(), params.data_ptr(), out.data_ptr())
        if _lib.qc_uniform_encode(ctypes.byref(cfg), *args) == 0:
            return out, scales
        # a signed zero whose sign torch's reduction order decides, or a pre-scaled bucket: general path
    scales = _scales(codec, x)
    return encode(codec, x, codec._encode_params(scales, out_max), seed), scales.contiguous()


# ------------------------------------------------------------------ 1-bit sign path (comm.onebit_all_reduce)
def _require_lib() -> ctypes.CDLL:
    lib = load()
    if lib is None:
        raise RuntimeError(f"lightning_qcomm fused CPU codecs unavailable: {_load_error}")
    return lib


def _check_f32(name: str, t: torch.Tensor, numel: int) -> None:
    if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous() or t.numel() < numel:
        raise ValueError(
            f"{name} must be a contiguous CPU fp32 tensor of >= {numel} elements, got "
            f"{t.dtype} {t.device.type} {tuple(t.shape)} contiguous={t.is_contiguous()}"
        )


def _check_u8(name: str, t: torch.Tensor, numel: int) -> None:
    if t.dtype != torch.uint8 or t.device.type != "cpu" or not t.is_contiguous() or t.numel() < numel:
        raise ValueError(f"{name} must be a contiguous CPU uint8 tensor of >= {numel} bytes, got {tuple(t.shape)}")


def sign_scale(y: torch.Tensor) -> float:
    """The sign1 codec's wire scale of ``y`` as one bucket: ||y||_2 / sqrt(len y), NaN if any element
    is non-finite (``Codec.encode``'s scale, bit for bit)."""
    return float(_scales(SignCodec(), y.reshape(-1))[0, 0])


def sign_encode_err(
    y: torch.Tensor, scale: float, payload: torch.Tensor, err: torch.Tensor, valid: int, err_len: int
) -> None:
    """One sign1 payload of ``y`` (c elements, one bucket) into ``payload`` (``SignCodec().nbytes(c)``
    bytes: packed codes, then ``scale`` as fp32), and the residual y - C(y) into ``err``.

    ``scale`` must be ``sign_scale(y)``. err[:valid] <- y - C(y) if the scale is finite, else unchanged
    (the reference keeps the previous residual where the new one is non-finite); err[valid:err_len] <- 0.
    Equals ``encode(y).to_bytes()`` and ``_update_error(err, y - decode(...))`` of the reference.
    """
    c = y.numel()
    nb = (c + 7) // 8
    _check_f32("y", y, c)
    _check_u8("payload", payload, nb + 4)
    if not 0 <= valid <= err_len <= c:
        raise ValueError(f"need 0 <= valid ({valid}) <= err_len ({err_len}) <= len(y) ({c})")
    _check_f32("err", err, err_len)
    lib = _require_lib()
    lib.qc_sign_encode_err(y.data_ptr(), c, scale, payload.data_ptr(), err.data_ptr(), valid, err_len)


def sign_server_sum(
    buf: torch.Tensor, world: int, c: int, server_error: torch.Tensor, valid: int, z: torch.Tensor
) -> None:
    """z <- (sum over the ``world`` sign1 payloads of ``buf``, decoded, in rank order) / world
    + server_error, for the first ``valid`` elements, 0 for the rest of the c (1-bit Adam's server
    step). Equals ``decode_rows(buf).sum(dim=0).div_(world) + server_error`` with the padding zeroed."""
    if not 1 <= world <= 256:
        raise ValueError(f"world must be in [1, 256], got {world}")
    p = SignCodec().nbytes(c)
    n = max(min(valid, c), 0)
    _check_u8("buf", buf, world * p)
    _check_f32("server_error", server_error, n)
    _check_f32("z", z, c)
    _require_lib().qc_sign_server_sum(buf.data_ptr(), world, c, p, server_error.data_ptr(), valid, z.data_ptr())


def sign_decode(payload: torch.Tensor, c: int, out: torch.Tensor) -> None:
    """The first ``out.numel()`` values of one sign1 payload of c elements, written into ``out``."""
    length = out.numel()
    if length > c:
        raise ValueError(f"out has {length} elements, more than the payload's {c}")
    _check_u8("payload", payload, (c + 7) // 8 + 4)
    _check_f32("out", out, length)
    _require_lib().qc_sign_decode(payload.data_ptr(), c, length, out.data_ptr())
