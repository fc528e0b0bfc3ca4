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
    # Code i occupies bits [b*i, b*i + b) of the group: its low part goes to byte j = b*i // 8 at bit
    # s = b*i % 8, the rest (if s + b > 8) to byte j + 1. uint8 shifts drop the bits above 7.
    c = codes.reshape(groups, 8)
    out = torch.zeros(groups, bits, dtype=torch.uint8, device=codes.device)
    for i in range(8):
        j, s = divmod(bits * i, 8)
        out[:, j] |= c[:, i] << s
        if s + bits > 8:
            out[:, j + 1] |= c[:, i] >> (8 - s)
    return out.reshape(-1)


def unpack_bits(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``numel`` codes as uint8."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    if bits == 8:
        return packed.reshape(-1)[:numel]
    groups = packed.numel() // bits
    b = packed.reshape(groups, bits)
    codes = torch.empty(groups, 8, dtype=torch.uint8, device=packed.device)
    for i in range(8):
        j, s = divmod(bits * i, 8)
        v = b[:, j] >> s
        if s + bits > 8:
            v |= b[:, j + 1] << (8 - s)  # uint8: only the low bits survive, the mask keeps b of them
        torch.bitwise_and(v, (1 << bits) - 1, out=codes[:, i])
    return codes.reshape(-1)[:numel]
