"""EDEN: a randomized Hadamard rotation, then the Lloyd-Max levels of N(0, 1) with an unbiased scale, 1..4 bits.

Per bucket x of B = 2^k elements (Vargaftik et al., ICML 2022; docs/design.md, "EDEN")::

    y = R x,  R = H_B D / sqrt(B)   (D random +-1 signs, H_B Walsh-Hadamard in a fixed butterfly order)
    z = y sqrt(B) / ||y||,  q_i = the Lloyd-Max level nearest z_i (deterministic),  S = ||y||^2 / <y, q>
    decode = R^T (S q)

Bias and variance: R is orthogonal, and EDEN's scale gives <S q, y> = ||y||^2; over a uniformly random rotation the
decode is unbiased, E_R[x_hat] = x, with NMSE D_b / (1 - D_b) = 0.571 / 0.133 / 0.0359 / 0.0096 at 1..4 bits
(``DISTORTION``), whatever the tails of x; the randomized Hadamard's residual bias is below 1e-5 of ||x||^2 at
B = 4096 (BENCHMARKS.md section 12). A short last bucket (L not a power of two) is rotated by D, then an
orthonormal Hadamard of h = 2^floor(log2 L) on its first h and on its last h elements (orthogonal, one scale).

Wire: bits per element plus two fp32 words per bucket, the scale S (NaN for a bucket with NaN / Inf, flagged as in
``codecs.scaling`` outside fp32's normal range) and the 23-bit rotation key (the ops' decode takes no seed): bits +
64 / B bits per element. The keys come from ``rng.hash_u32(seed, bucket)``: one seed, the same signs on every rank.
Buckets are pre-scaled by a power of two (subnormal and near-FLT_MAX buckets stay exact); a decode is clamped to the
input dtype's largest value (``_decode_rows``). The rotation is the op ``qcomm::hadamard_`` (C on CPU, Triton on
CUDA); the rest is torch ops on every device (``kernels=False``), no host work per bucket.

Example::

    x_hat = get_codec("eden", bits=2).roundtrip(x, seed=derive_seed(0, step, rank))   # B = 4096: 2.016 bits/elem
"""

from __future__ import annotations

import math
import struct

import torch

from lightning_qcomm.codecs import layout, rng, scaling
from lightning_qcomm.codecs.base import Codec
from lightning_qcomm.codecs.registry import register_codec

# Lloyd-Max levels of N(0, 1): the non-negative half (the set is symmetric), per width, to 12 digits; the
# thresholds are the midpoints of adjacent levels. tests/codecs/test_eden.py checks the centroid conditions.
LLOYD_MAX_HALF = {
    1: (0.797884560803,),
    2: (0.452780034636, 1.510417608499),
    3: (0.245094178944, 0.756005281206, 1.343909278505, 2.151945704537),
    4: (
        0.128395029851,
        0.388048299490,
        0.656759118532,
        0.942340456487,
        1.256231197347,
        1.618046386022,
        2.069017226531,
        2.732589570995,
    ),
}
# D_b = E (z - Q(z))^2 for z ~ N(0, 1): the min-MSE distortion; EDEN's NMSE is D_b / (1 - D_b).
DISTORTION = {1: 0.36338022763, 2: 0.11748184783, 3: 0.03454776079, 4: 0.00950100801}
_KEY_BITS = 23
_ONE_BITS = 0x3F800000  # fp32 1.0: a key k travels as the fp32 with these bits | k, in [1, 2) ...
# ... times 2^c, c the index of the input dtype's largest value here (fp32 / fp64, bf16, fp16): the decode's clamp
_OUT_MAXES = (scaling.FLT_MAX, torch.finfo(torch.bfloat16).max, torch.finfo(torch.float16).max)
_BUCKET_MAX = 1 << 24


def lloyd_max_levels(bits: int) -> torch.Tensor:
    """The 2^bits Lloyd-Max levels of N(0, 1), ascending, fp32."""
    half = torch.tensor(LLOYD_MAX_HALF[bits], dtype=torch.float64)
    return torch.cat([-half.flip(0), half]).to(torch.float32)


# ---------------------------------------------------------------------------------------------- the rotation
MAX_BLOCK = 1 << 16  # the largest block the op takes (the C kernel works in place; Triton holds a block per program)


def check_block(block: int, numel: int) -> None:
    """ValueError unless ``block`` is a power of two in [1, MAX_BLOCK] dividing ``numel``."""
    if not isinstance(block, int) or block < 1 or block & (block - 1) or block > MAX_BLOCK:
        raise ValueError(f"hadamard_: block must be a power of two in [1, {MAX_BLOCK}], got {block!r}")
    if numel % block:
        raise ValueError(f"hadamard_: the tensor's {numel} elements are not whole blocks of {block}")


def hadamard_scale(block: int) -> float:
    """fl(1 / sqrt(block)): the fp32 factor every backend multiplies by (a float that fp32 holds exactly; rounded on
    the host, no tensor made)."""
    return struct.unpack("f", struct.pack("f", 1.0 / math.sqrt(block)))[0]


def hadamard_reference_(x: torch.Tensor, block: int) -> None:
    """``qcomm::hadamard_``'s reference: H_B of each block of the flat fp32 ``x``, in place, in one fixed order.

    H_B is the orthonormal Walsh-Hadamard matrix (Sylvester order), applied as an in-place butterfly: for h = 1, 2,
    4, ..., B/2 every pair (i, i + h) with i mod 2h < h becomes (a + b, a - b), then every element is multiplied by
    ``hadamard_scale(B)``, fl(1 / sqrt(B)). Each output is the same sequence of fp32 additions on every backend
    (this reference, the C kernel, the Triton kernel), so all give the same bits. H_B is symmetric and H_B H_B = I
    (exact when k is even, else up to the rounding of fl(1 / sqrt(B))^2). A NaN or +-Inf reaches every output of
    its block (each is a signed sum of all its inputs) and no other block; the butterfly overflows where a block's
    l1 norm passes FLT_MAX (``sum |x_i|``), which the codec pre-scales (``codecs.scaling``)."""
    check_block(block, x.numel())
    v = x.view(-1, block)
    h = 1
    while h < block:
        pairs = v.view(-1, block // (2 * h), 2, h)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        s, d = a + b, a - b
        a.copy_(s)
        b.copy_(d)
        h *= 2
    x.mul_(hadamard_scale(block))


def fwht_rows(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal Walsh-Hadamard transform of each row of ``x`` (rows of h = 2^k), out of place: the op
    ``qcomm::hadamard_`` (``hadamard_reference_``: the butterfly in one fixed order, then fl(1 / sqrt(h)); the C kernel
    on CPU, Triton on CUDA, the same bits). The transform is its own inverse (H H = I, up to rounding)."""
    y = x.contiguous().clone()
    torch.ops.qcomm.hadamard_(y.view(-1), x.shape[1])
    return y


def signs(keys: torch.Tensor, length: int) -> torch.Tensor:
    """(len(keys), length) fp32 +-1: element i of a bucket with key k gets the top bit of
    mix32(mix32(i ^ k) ^ mix32(k ^ 0x85EBCA6B)) (``rng``'s lowbias32 hash): a function of the key alone."""
    k1 = keys.to(torch.int32)[:, None]
    k2 = k1 ^ rng._as_int32(0x85EBCA6B)
    rng._mix32_(k2, torch.empty_like(k2))
    h = torch.arange(length, dtype=torch.int32, device=keys.device)[None, :] ^ k1
    tmp = torch.empty_like(h)
    rng._mix32_(h, tmp)
    h ^= k2
    rng._mix32_(h, tmp)
    return torch.where(h < 0, -1.0, 1.0).to(torch.float32)


def _tail_halves(length: int) -> int | None:
    """h of a bucket of ``length`` elements that is not a power of two (module docstring), else None."""
    if length & (length - 1) == 0:
        return None
    return 1 << (length.bit_length() - 1)


def rotate(xb: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """R x of each row of ``xb`` (rows of one length L) with its row's key (module docstring)."""
    length = xb.shape[1]
    y = xb * signs(keys, length)
    h = _tail_halves(length)
    if h is None:
        return fwht_rows(y)
    y = torch.cat([fwht_rows(y[:, :h]), y[:, h:]], dim=1)
    return torch.cat([y[:, : length - h], fwht_rows(y[:, length - h :])], dim=1)


def unrotate(yb: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """R^T y of each row of ``yb``: ``rotate``'s steps inverted, in reverse order."""
    length = yb.shape[1]
    h = _tail_halves(length)
    if h is None:
        x = fwht_rows(yb)
    else:
        x = torch.cat([yb[:, : length - h], fwht_rows(yb[:, length - h :])], dim=1)
        x = torch.cat([fwht_rows(x[:, :h]), x[:, h:]], dim=1)
    return x * signs(keys, length)


def _pow2(e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two fp32 factors whose product is 2^e exactly, each a normal number (|e| <= 300)."""
    e1 = torch.div(e, 2, rounding_mode="floor")
    return torch.exp2(e1.to(torch.float32)), torch.exp2((e - e1).to(torch.float32))


@register_codec("eden", bits=range(1, 5), default_bits=2, bucket_size=4096, kernels=False)
class EdenCodec(Codec):
    """The ``eden`` codec (module docstring): ``bits`` 1..4, ``bucket_size`` a power of two (the rotation block).

    Example::

        >>> EdenCodec(2, 4096).nbytes(8192)      # 2 bits per element + (scale, key) per bucket
        4112
    """

    name = "eden"
    scales_per_bucket = 2
    stochastic = False
    tail_pads = False  # the last bucket is rotated at its own length
    rotation = True  # tests switch it off on an instance to show what the rotation buys

    def __init__(self, bits: int = 2, bucket_size: int | None = 4096) -> None:
        ok = isinstance(bucket_size, int) and 1 <= bucket_size <= _BUCKET_MAX and bucket_size & (bucket_size - 1) == 0
        if not ok and not isinstance(bucket_size, bool):
            raise ValueError(
                f"EdenCodec(bucket_size={bucket_size!r}) must be a power of two (the rotation block); "
                f"allowed: 1, 2, 4, ..., {_BUCKET_MAX}"
            )
        super().__init__(bits, bucket_size)
        self.levels = lloyd_max_levels(bits)
        self.thresholds = (self.levels[1:] + self.levels[:-1]) / 2

    # ------------------------------------------------------------------ the element-wise hooks (rotated domain)
    def _scales(self, xb: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("EdenCodec computes its scales after the rotation (encode_torch)")

    def _encode_params(self, scales: torch.Tensor, out_max: float = scaling.FLT_MAX) -> torch.Tensor:
        raise NotImplementedError("EdenCodec quantizes in the rotated domain (encode_torch)")

    def _decode_params(self, scales: torch.Tensor) -> torch.Tensor:
        """The wire scales themselves (scale, key) per bucket: ``decode_reference`` reads both."""
        return scales

    def _quantize(self, x: torch.Tensor, params: torch.Tensor, u: torch.Tensor | None) -> torch.Tensor:
        """Index of the nearest Lloyd-Max level of each normalized rotated value ``x`` (params unused)."""
        return torch.bucketize(torch.nan_to_num(x, nan=0.0), self.thresholds.to(x.device))

    def _dequantize(self, codes: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
        return self.levels.to(codes.device)[codes]

    # ------------------------------------------------------------------ encode
    def _keys(self, seed: int, nb: int, device: torch.device) -> torch.Tensor:
        """(nb,) int64 rotation keys of a tensor's buckets: 23 bits of ``rng.hash_u32(seed, bucket index)``."""
        return rng.hash_u32(seed, nb, device) >> (32 - _KEY_BITS)

    def _encode_rows(self, xb: torch.Tensor, keys: torch.Tensor, out_max: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(int64 codes (r, L), fp32 wire words (r, 2)) of buckets ``xb`` (r, L) of one length; ``out_max``, the
        input dtype's largest value (``scaling.output_max``), travels as the key word's exponent."""
        length = xb.shape[1]
        finite = self._finite_mask(xb)[:, 0]
        amax = xb.abs().amax(dim=1)
        _, e = torch.frexp(torch.where(finite & (amax > 0), amax, torch.ones_like(amax)))
        f1, f2 = _pow2(-e.to(torch.int64))
        xs = torch.where(finite[:, None], xb, torch.zeros_like(xb)) * f1[:, None] * f2[:, None]  # max |x| in [0.5, 1)
        y = rotate(xs, keys) if self.rotation else xs
        ss = (y * y).sum(dim=1)
        norm = ss.sqrt()
        z = y * (math.sqrt(length) / torch.where(norm > 0, norm, torch.ones_like(norm)))[:, None]
        codes = self._quantize(z, z, None)
        yq = (y * self._dequantize(codes, codes)).sum(dim=1)
        s = torch.where(ss > 0, ss / torch.where(ss > 0, yq, torch.ones_like(yq)), torch.zeros_like(ss))
        s64 = s.double() * torch.exp2(e.double())  # the scale in x's units: exact, fp64 has the range
        plain = s64.to(torch.float32)
        wide = s64 > 2.0**126
        tiny = (s64 > 0) & (s64 < scaling.FLT_MIN)
        wire = scaling.flagged(plain, s64, wide, tiny)
        wire = torch.where(finite, wire, torch.full_like(wire, float("nan")))
        key_word = (keys.to(torch.int32) | (_ONE_BITS + (_OUT_MAXES.index(out_max) << 23))).view(torch.float32)
        return codes.masked_fill_(~finite[:, None], 0), torch.stack([wire, key_word], dim=1)

    def _split(self, n: int) -> tuple[int, int, int]:
        """(bucket length B of the full buckets, their count, the last bucket's length or 0) of n elements."""
        blen = self.bucket_len(n)
        full = n // blen
        return blen, full, n - full * blen

    def encode_torch(self, xf: torch.Tensor, seed: int, out_max: float, elementwise=None):
        """(packed codes, (num_buckets, 2) wire words) of flat fp32 ``xf`` (``elementwise`` is not used: no
        kernels)."""
        n = xf.numel()
        blen, full, tail = self._split(n)
        keys = self._keys(seed, full + (tail > 0), xf.device)
        codes = torch.empty(n, dtype=torch.uint8, device=xf.device)
        words = []
        if full:
            c, w = self._encode_rows(xf[: full * blen].view(full, blen), keys[:full], out_max)
            codes[: full * blen].view(full, blen).copy_(c)
            words.append(w)
        if tail:
            c, w = self._encode_rows(xf[full * blen :].view(1, tail), keys[full:], out_max)
            codes[full * blen :].copy_(c.view(-1))
            words.append(w)
        codes = torch.nn.functional.pad(codes, (0, layout.packed_nbytes(n, 8) - n))
        return layout.pack_bits(codes, self.bits), torch.cat(words).contiguous()

    # ------------------------------------------------------------------ decode
    def _decode_rows(self, codes: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
        """fp32 values (r, L) of int64 codes (r, L) with their buckets' wire words (r, 2), clamped to the input
        dtype's largest value: a finite fp16 / bf16 bucket near its max would otherwise decode past it (R^T (S q)
        reaches ~2.7 sigma) and cast back to inf. Which dtype rides in the key word's exponent (no extra bytes)."""
        mag, _, m = scaling.unflag(words[:, 0].contiguous())
        key_bits = words[:, 1].contiguous().view(torch.int32)
        keys = key_bits & ((1 << _KEY_BITS) - 1)
        c = (key_bits >> 23)[:, None] - 127  # no host tensor: the caps are scalars of the expression
        cap = torch.where(c == 2, _OUT_MAXES[2], torch.where(c == 1, _OUT_MAXES[1], _OUT_MAXES[0]))
        q = self._dequantize(codes, codes)
        v = unrotate(q, keys) if self.rotation else q
        out = v * mag[:, None] * m[:, None]
        return torch.minimum(torch.maximum(out, -cap), cap)  # NaN stays NaN

    def decode_reference(self, codes: torch.Tensor, dec_params: torch.Tensor, numel: int) -> torch.Tensor:
        """Flat fp32 values of packed ``codes`` and the wire words ``dec_params`` (``_decode_params``)."""
        c_all = layout.unpack_bits(codes, self.bits, numel).to(torch.int64)
        blen, full, tail = self._split(numel)
        out = torch.empty(numel, dtype=torch.float32, device=codes.device)
        if full:
            rows = c_all[: full * blen].view(full, blen)
            out[: full * blen].view(full, blen).copy_(self._decode_rows(rows, dec_params[:full]))
        if tail:
            out[full * blen :].copy_(self._decode_rows(c_all[full * blen :].view(1, tail), dec_params[full:]).view(-1))
        return out

    def bucket_scales(self, xf: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("EdenCodec's scales depend on the rotation keys: use encode")
