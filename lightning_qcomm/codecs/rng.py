"""Counter-based random bits shared by the torch reference and the Triton kernels.

A uniform ``u`` in [0, 1) for element ``i`` of a tensor is a pure function of ``(key, i)``::

    h = mix32(mix32(i XOR k1) XOR k2),    u = (h >> 8) * 2**-24

where ``mix32`` is the "lowbias32" integer finaliser (xor-shift / multiply, all arithmetic mod 2**32)
and ``(k1, k2)`` are two 32-bit words derived from the 64-bit ``seed`` passed to ``Codec.encode``.
Because the bits depend only on the counter, the CPU reference and the GPU kernel produce identical
codes, runs are reproducible, and a tensor quantized twice with one seed yields the same result.

``derive_seed`` builds that 64-bit seed from (user seed, step, rank, tensor id, ...) with SplitMix64.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
MASK64 = 0xFFFFFFFFFFFFFFFF
MIX_C1 = 0x7FEB352D
MIX_C2 = 0x846CA68B
GOLDEN32 = 0x9E3779B9
INV_2_24 = 1.0 / 16777216.0


def _mix32_int(x: int) -> int:
    x &= MASK32
    x ^= x >> 16
    x = (x * MIX_C1) & MASK32
    x ^= x >> 15
    x = (x * MIX_C2) & MASK32
    x ^= x >> 16
    return x


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def derive_seed(seed: int, *counters: int) -> int:
    """Fold integer counters (step, rank, tensor id, ...) into a 64-bit seed.

    Different counters give statistically independent streams; equal inputs give equal seeds.

    Example::

        seed = derive_seed(base_seed, step, tensor_id)   # one stream per (step, tensor)
    """
    h = _splitmix64(int(seed) & MASK64)
    for c in counters:
        h = _splitmix64(h ^ (int(c) & MASK64))
    return h


def signed_seed(seed: int) -> int:
    """``seed`` mod 2^64 as the int64 with the same bits: how the ops (an ``int`` argument) carry it;
    ``seed_to_key`` gives both forms the same key."""
    s = int(seed) & MASK64
    return s - (1 << 64) if s >= (1 << 63) else s


def seed_to_key(seed: int) -> tuple[int, int]:
    """The two 32-bit words (k1, k2) the per-element hash is keyed with."""
    seed = int(seed) & MASK64
    k1 = _mix32_int((seed & MASK32) ^ GOLDEN32)
    k2 = _mix32_int((((seed >> 32) & MASK32) ^ 0x85EBCA6B) + k1)
    return k1, k2


# The torch hash runs in int32 (the same 32 bits as uint32, which torch cannot shift or multiply):
# multiplication wraps mod 2**32 on every torch backend, and the logical right shift of uint32 is the
# arithmetic shift masked to the low 32-k bits. Work proceeds in chunks that stay in cache.
_CHUNK = 1 << 16


def _as_int32(word: int) -> int:
    """The int32 with the same 32 bits as the uint32 ``word``."""
    return word - (1 << 32) if word >= (1 << 31) else word


_C1_I32 = _as_int32(MIX_C1)
_C2_I32 = _as_int32(MIX_C2)


def _xorshift_(x: torch.Tensor, k: int, tmp: torch.Tensor) -> None:
    """x ^= x >>> k (logical shift of the uint32 bits) on int32 x, in place."""
    torch.bitwise_right_shift(x, k, out=tmp)
    tmp &= (1 << (32 - k)) - 1
    x ^= tmp


def _mix32_(x: torch.Tensor, tmp: torch.Tensor) -> None:
    """lowbias32 on the uint32 bits of int32 ``x``, in place."""
    _xorshift_(x, 16, tmp)
    x *= _C1_I32
    _xorshift_(x, 15, tmp)
    x *= _C2_I32
    _xorshift_(x, 16, tmp)


def _counters(start: int, numel: int, device: torch.device | str) -> torch.Tensor:
    """int32 tensor holding the uint32 bits of (start .. start+numel-1) mod 2**32."""
    if 0 <= start and start + numel <= (1 << 31):
        return torch.arange(start, start + numel, dtype=torch.int32, device=device)
    idx = torch.arange(start, start + numel, dtype=torch.int64, device=device) & MASK32
    return torch.where(idx >= (1 << 31), idx - (1 << 32), idx).to(torch.int32)


def _hash_into(out: torch.Tensor, seed: int, offset: int, finish) -> torch.Tensor:
    """Fill ``out`` chunk by chunk with ``finish(h, out_chunk)`` of the int32 hashes of its counters."""
    k1, k2 = (_as_int32(k) for k in seed_to_key(seed))
    numel = out.numel()
    for s in range(0, numel, _CHUNK):
        e = min(numel, s + _CHUNK)
        h = _counters(offset + s, e - s, out.device)
        tmp = torch.empty_like(h)
        h ^= k1
        _mix32_(h, tmp)
        h ^= k2
        _mix32_(h, tmp)
        finish(h, out[s:e])
    return out


def hash_u32(seed: int, numel: int, device: torch.device | str = "cpu", offset: int = 0) -> torch.Tensor:
    """32-bit hashes (as int64 in [0, 2**32)) of the counters offset .. offset+numel-1."""
    out = torch.empty(numel, dtype=torch.int64, device=device)
    return _hash_into(out, seed, offset, lambda h, o: torch.bitwise_and(h.to(torch.int64), MASK32, out=o))


def _to_uniform(h: torch.Tensor, out: torch.Tensor) -> None:
    h >>= 8
    h &= 0xFFFFFF  # (hash >>> 8) < 2**24: exact in fp32
    # cast first: int32 * python float computes in torch's *default* dtype (fp16 under Lightning's
    # "16-true", where 2**24 overflows), whatever ``out`` is
    out.copy_(h).mul_(INV_2_24)


def uniform(seed: int, numel: int, device: torch.device | str = "cpu", offset: int = 0) -> torch.Tensor:
    """float32 uniforms in [0, 1) on a 2**-24 grid: ``(hash >> 8) * 2**-24``."""
    return _hash_into(torch.empty(numel, dtype=torch.float32, device=device), seed, offset, _to_uniform)


def round_bf16_stochastic_(out: torch.Tensor, x: torch.Tensor, seed: int, offset: int = 0) -> torch.Tensor:
    """``out`` (bf16) <- ``x`` (fp32, clobbered) rounded stochastically: up with probability the fraction of the
    last bf16 place that x lies above the lower neighbour, so E[out] = x exactly (unbiased) and ``|out - x|`` < one
    bf16 place (``2^-7 |x|`` at most). The 16 bits bf16 drops get the low 16 bits of the hash of the counters
    offset .. offset+numel-1 added, then are cut (carries move the magnitude up one place); ±inf and NaN stay.

    Example::

        round_bf16_stochastic_(acc[s:e], acc[s:e].float().add_(g[s:e] ** 2), derive_seed(1, step), offset=s)
    """
    if x.dtype != torch.float32 or out.dtype != torch.bfloat16 or x.shape != out.shape:
        raise TypeError(
            f"round_bf16_stochastic_(out={out.dtype}{tuple(out.shape)}, x={x.dtype}{tuple(x.shape)}): allowed a "
            "bfloat16 out and a float32 x of the same shape"
        )
    bits = x.view(torch.int32)

    def finish(h: torch.Tensor, o: torch.Tensor) -> None:
        h &= 0xFFFF
        o += h

    _hash_into(bits.view(-1), seed, offset, finish)
    bits &= -65536  # keep the 16 bits bf16 holds: the cast below is exact
    return out.copy_(x)


def add_square_sr_reference_(acc: torch.Tensor, g: torch.Tensor, seed: int, chunk: int) -> None:
    """``qcomm::add_square_sr_``'s reference: acc (flat bf16) <- SR_bf16(acc + g²), g flat (any float dtype), formed
    in fp32 ``chunk`` elements at a time (``round_bf16_stochastic_``, counter i = the element's index in ``acc``)."""
    for s in range(0, acc.numel(), chunk):
        e = min(acc.numel(), s + chunk)
        gs = g[s:e]
        round_bf16_stochastic_(acc[s:e], acc[s:e].float().addcmul_(gs, gs), seed, offset=s)
