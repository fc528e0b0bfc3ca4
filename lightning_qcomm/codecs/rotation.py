"""The randomized Hadamard rotation R = H_B D of blocks of B = 2^k elements (docs/design.md, "Rotation").

D is a diagonal of random +-1 signs drawn from the codecs' counter-based keys (``rng``: sign_i = -1 where the
hash of element i has its top bit set), so every rank that knows the seed rotates alike and no sign is sent.
H_B is the orthonormal Walsh-Hadamard matrix (Sylvester order), applied by ``qcomm::hadamard_``: an in-place
butterfly in one fixed order, for h = 1, 2, 4, ..., B/2 every pair (i, i + h) with i mod 2h < h becoming
(a + b, a - b), then every element multiplied by ``hadamard_scale(B)``, fl(1 / sqrt(B)). Each output is the
same sequence of fp32 additions on every backend (this reference, the C kernel, the Triton kernel), so all
give the same bits. H_B is symmetric and H_B H_B = I, so R^-1 = D H_B (exact when k is even, else up to the
rounding of fl(1 / sqrt(B))^2).

Invariants: ||R x|| = ||x|| up to rounding; a NaN or +-Inf reaches every output of its block (each is a signed
sum of all its inputs) and no other block; the butterfly overflows where a block's l1 norm passes FLT_MAX
(``sum |x_i|``), which a codec pre-scales (``codecs.scaling``).

Example::

    y = rotate(x, 4096, seed=3)                      # x.numel() a multiple of 4096
    torch.allclose(unrotate(y, 4096, seed=3), x, atol=1e-5)
"""

from __future__ import annotations

import math
import struct

import torch

from lightning_qcomm.codecs import rng

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
    """``qcomm::hadamard_``'s reference: H_B of each block of the flat fp32 ``x``, in place, in the fixed order."""
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


def signs(seed: int, numel: int, device: torch.device | str = "cpu", offset: int = 0) -> torch.Tensor:
    """fp32 +-1 of elements offset .. offset + numel - 1: -1 where their hash (``rng.hash_u32``) is >= 2^31."""
    h = rng.hash_u32(seed, numel, device, offset)
    return torch.where(h >= (1 << 31), -1.0, 1.0).to(torch.float32)


def rotate(x: torch.Tensor, block: int, seed: int) -> torch.Tensor:
    """R x of the flat fp32 copy of ``x`` (numel a multiple of ``block``): signs, then ``qcomm::hadamard_``."""
    y = x.reshape(-1).to(torch.float32) * signs(seed, x.numel(), x.device)
    torch.ops.qcomm.hadamard_(y, block)
    return y


def unrotate(y: torch.Tensor, block: int, seed: int) -> torch.Tensor:
    """R^-1 y = D H_B y, flat fp32 (``rotate``'s inverse)."""
    x = y.reshape(-1).to(torch.float32).clone()
    torch.ops.qcomm.hadamard_(x, block)
    return x.mul_(signs(seed, x.numel(), x.device))
