"""The Hadamard transform of whole blocks in Triton (``qcomm::hadamard_`` on CUDA; ``codecs.eden``): one program
per block of B = 2^LOG2 elements, held in registers, the butterfly of the reference in its order (stride h = 1, 2,
..., B/2: the pair (i, i + h) becomes (a + b, a - b)), then the product with the fp32 factor fl(1 / sqrt(B)).

Each stage views the block as (B / 2h, 2, h), moves the pair axis last and splits it: the same additions as the
reference, so the same bits.

Example::

    hadamard_(x, 4096, eden.hadamard_scale(4096))   # x: contiguous fp32 on the device, whole blocks
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCK = 1 << 13  # a block per program in registers: 8192 fp32 over 8 warps is 32 per thread


@triton.jit
def _hadamard_kernel(x_ptr, scale, BLOCK: tl.constexpr, LOG2: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)
    for i in tl.static_range(LOG2):
        v = tl.permute(tl.reshape(x, [BLOCK >> (i + 1), 2, 1 << i]), (0, 2, 1))
        a, b = tl.split(v)
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 2, 1)), [BLOCK])
    tl.store(x_ptr + offs, x * scale)


def hadamard_(x: torch.Tensor, block: int, scale: float) -> None:
    """H_B of each block of the contiguous fp32 ``x`` in place (``block`` a power of two <= MAX_BLOCK dividing its
    size), ``scale`` = ``eden.hadamard_scale(block)``: one launch."""
    if x.numel():
        warps = max(1, min(8, block // 256))
        _hadamard_kernel[(x.numel() // block,)](x, scale, BLOCK=block, LOG2=block.bit_length() - 1, num_warps=warps)
