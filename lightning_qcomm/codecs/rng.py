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
    """
    h = _splitmix64(int(seed) & MASK64)
    for c in counters:
        h = _splitmix64(h ^ (int(c) & MASK64))
    return h


def seed_to_key(seed: int) -> tuple[int, int]:
    """The two 32-bit words (k1, k2) the per-element hash is keyed with."""
    seed = int(seed) & MASK64
    k1 = _mix32_int((seed & MASK32) ^ GOLDEN32)
    k2 = _mix32_int((((seed >> 32) & MASK32) ^ 0x85EBCA6B) + k1)
    return k1, k2


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 x in [0, 2**32), without ever overflowing int64."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, MIX_C1)
    x = x ^ (x >> 15)
    x = _mul32(x, MIX_C2)
    return x ^ (x >> 16)


def hash_u32(seed: int, numel: int, device: torch.device | str = "cpu", offset: int = 0) -> torch.Tensor:
    """32-bit hashes (as int64 in [0, 2**32)) of the counters offset .. offset+numel-1."""
    k1, k2 = seed_to_key(seed)
    idx = torch.arange(offset, offset + numel, dtype=torch.int64, device=device) & MASK32
    return _mix32(_mix32(idx ^ k1) ^ k2)


def uniform(seed: int, numel: int, device: torch.device | str = "cpu", offset: int = 0) -> torch.Tensor:
    """float32 uniforms in [0, 1) on a 2**-24 grid: ``(hash >> 8) * 2**-24``."""
    return (hash_u32(seed, numel, device, offset) >> 8).to(torch.float32) * INV_2_24
