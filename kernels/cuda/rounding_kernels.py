"""1-bit Adam's bf16 variance window in Triton (``qcomm::add_square_sr_`` on CUDA; ``codecs.rng``): acc <- acc + g²
formed in fp32 and rounded to bf16 stochastically, in one pass over the tensor. The 16 bits bf16 drops get the low
16 bits of the counter-based hash of the element's index added, then are cut, as ``rng.round_bf16_stochastic_``
does; each operation rounded as the eager ops (no FMA contraction), so the same bits.

Example::

    add_square_sr_(acc, g, rng.signed_seed(seed))   # acc: flat contiguous bf16; g: contiguous float, same size
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightning_qcomm.codecs import rng

from .elementwise import _mix32

BLOCK = 1024


@triton.jit(do_not_specialize=["n", "k1", "k2"])
def _add_square_sr_kernel(acc_ptr, g_ptr, n, k1, k2, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = i < n
    a = tl.load(acc_ptr + i, mask=inb, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + i, mask=inb, other=0.0).to(tl.float32)
    s = a + g * g
    h = _mix32(_mix32(i.to(tl.uint32) ^ k1.to(tl.uint32, bitcast=True)) ^ k2.to(tl.uint32, bitcast=True))
    bits = (s.to(tl.int32, bitcast=True) + (h & 0xFFFF).to(tl.int32)) & -65536
    tl.store(acc_ptr + i, bits.to(tl.float32, bitcast=True).to(tl.bfloat16), mask=inb)


def add_square_sr_(acc: torch.Tensor, g: torch.Tensor, seed: int) -> None:
    """acc (flat contiguous bf16) <- SR_bf16(acc + g²) in one launch, keyed by ``seed`` (``rng.seed_to_key``)."""
    n = acc.numel()
    if n:
        k1, k2 = (rng._as_int32(k) for k in rng.seed_to_key(seed))  # int32 arguments with the key's bits
        grid = (triton.cdiv(n, BLOCK),)
        _add_square_sr_kernel[grid](acc, g, n, k1, k2, BLOCK=BLOCK, enable_fp_fusion=False)
