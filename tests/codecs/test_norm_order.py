"""The norm codecs' L2 norm has one summation order on every backend (``codecs.qsgd.tree_norm``).

The order: the squares of a row, zero-padded to a power-of-two width, summed pairwise (columns 2i and 2i + 1,
level by level), then the correctly rounded square root. The torch form, the C kernel (``qcomm::c_tree_norm``,
the fused CPU path) and the Triton kernel (tests/kernels/test_kernels.py) must give the same bits; here the first two
against a plain-Python statement of the order, at widths that are and are not powers of two, with NaN, Inf,
values whose squares overflow or underflow, and signed zeros.
"""

from __future__ import annotations

import math
import struct

import pytest
import torch

from lightning_qcomm.codecs import cpu_fused, native
from lightning_qcomm.codecs.qsgd import tree_norm

WIDTHS = (1, 2, 3, 4, 5, 7, 8, 37, 128, 300, 512, 1000)


def _f32(v: float) -> float:
    """v rounded to fp32 (round to nearest even), as a Python float; inf where it overflows."""
    try:
        return struct.unpack("f", struct.pack("f", v))[0]
    except OverflowError:
        return math.copysign(math.inf, v)


def _pairwise_norm(row: list[float]) -> float:
    """The order written out: fp32 squares, zero-padded to a power of two, pairwise fp32 sums, fp64 root to fp32."""
    sq = [_f32(x * x) for x in row]
    width = 1 << max(len(sq) - 1, 0).bit_length()
    sq += [0.0] * (width - len(sq))
    while len(sq) > 1:
        sq = [_f32(sq[2 * i] + sq[2 * i + 1]) for i in range(len(sq) // 2)]
    return _f32(math.sqrt(sq[0])) if sq[0] == sq[0] else math.nan


def _rows(width: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(width)
    x = torch.randn(8, width, generator=g) * torch.logspace(-3, 3, width)
    x[1, 0] = float("nan")
    x[2, -1] = float("inf")
    x[3] = 3e38  # squares overflow
    x[4] = 1e-30  # squares underflow to subnormals or zero
    x[5] = -0.0
    return x


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(((a.view(torch.int32) == b.view(torch.int32)) | (a.isnan() & b.isnan())).all())


@pytest.mark.parametrize("width", WIDTHS)
def test_torch_order_is_the_pairwise_tree(width, monkeypatch):
    monkeypatch.setenv(cpu_fused.ENV_SWITCH, "0")  # the torch ops, not the C kernel
    x = _rows(width)
    want = torch.tensor([_pairwise_norm(r) for r in x.tolist()], dtype=torch.float32)
    assert _same(tree_norm(x), want)


@pytest.mark.parametrize("width", WIDTHS + (8193, 20000))
def test_c_kernel_equals_torch_order(width, monkeypatch):
    if native.load() is None:
        pytest.skip(f"the C kernels are not available: {native.load_error()}")
    x = _rows(width)
    got = tree_norm(x)  # the C kernel (CPU, library loaded)
    monkeypatch.setenv(cpu_fused.ENV_SWITCH, "0")
    assert _same(got, tree_norm(x))
