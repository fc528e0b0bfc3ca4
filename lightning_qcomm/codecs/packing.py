"""Dense bit packing of b-bit codes (1 <= b <= 8) into bytes.

Codes are packed in groups of 8: the group's value ``v = sum_i code_i << (b*i)`` occupies exactly
``b`` bytes, written little-endian. A tensor of n codes therefore takes ``ceil(n/8) * b`` bytes; the
last group is padded with zero codes. The layout is the same in the Triton kernels.
"""

from __future__ import annotations

import torch


def packed_nbytes(numel: int, bits: int) -> int:
    """Bytes that ``numel`` codes of ``bits`` bits occupy once packed (padding included)."""
    return -(-numel // 8) * bits


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack a flat uint8 tensor of codes (< 2**bits) into ``packed_nbytes(len, bits)`` bytes."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    n = codes.numel()
    groups = -(-n // 8)
    if groups * 8 != n:
        codes = torch.nn.functional.pad(codes.reshape(-1), (0, groups * 8 - n))
    if bits == 8:
        return codes.reshape(-1).contiguous()
    c = codes.reshape(groups, 8).to(torch.int64)
    shifts = torch.arange(8, device=codes.device, dtype=torch.int64) * bits
    v = (c << shifts).sum(dim=1, keepdim=True)  # disjoint bit fields: sum == bitwise or
    byte_shifts = torch.arange(bits, device=codes.device, dtype=torch.int64) * 8
    return ((v >> byte_shifts) & 0xFF).to(torch.uint8).reshape(-1)


def unpack_bits(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``numel`` codes as uint8."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    if bits == 8:
        return packed.reshape(-1)[:numel]
    groups = packed.numel() // bits
    b = packed.reshape(groups, bits).to(torch.int64)
    byte_shifts = torch.arange(bits, device=packed.device, dtype=torch.int64) * 8
    v = (b << byte_shifts).sum(dim=1, keepdim=True)
    shifts = torch.arange(8, device=packed.device, dtype=torch.int64) * bits
    codes = (v >> shifts) & ((1 << bits) - 1)
    return codes.to(torch.uint8).reshape(-1)[:numel]
