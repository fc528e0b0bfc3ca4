"""The norm codecs' per-bucket helpers in Triton (``wire_params``' scales kernel calls them): QSGD's fixed-order
L2 norm with its redo below ``redo_floor``, and the largest level whose decode stays finite (``_level_cap``), each
operation for operation the torch reference's (``codecs.qsgd``).

Example::

    n, n64 = _l2_norm64(x, valid, ROWS, BLOCK, LOG2, REDO_FLOOR)   # inside a kernel: each row's norm
"""

from __future__ import annotations

import triton
import triton.language as tl

from lightning_qcomm.codecs.layout import KernelKind

from .elementwise import is_finite

_QSGD: tl.constexpr = tl.constexpr(int(KernelKind.QSGD))


@triton.jit
def _tree_norm(v, ROWS: tl.constexpr, BLOCK: tl.constexpr, LOG2: tl.constexpr):
    """``qsgd.tree_norm`` of each row of the (ROWS, BLOCK) tile (BLOCK = 2^LOG2, zeros past a row's end): the
    squares summed pairwise, columns 2i and 2i + 1 level by level, then the correctly rounded square root."""
    v = v * v
    for i in tl.static_range(LOG2):
        v = tl.sum(tl.reshape(v, [ROWS, BLOCK >> (i + 1), 2]), axis=2)
    return tl.sqrt(tl.reshape(v, [ROWS]).to(tl.float64)).to(tl.float32)  # fp64: sqrt.rn.f64


@triton.jit
def _l2_norm64(x, valid, ROWS: tl.constexpr, BLOCK: tl.constexpr, LOG2: tl.constexpr, REDO_FLOOR: tl.constexpr):
    """``qsgd.l2_norm_rows64`` of each row of the tile: (fp32, fp64) norms, a norm below ``REDO_FLOOR`` or not
    finite redone as ``amax ||x / amax||_2`` (the last product exact in fp64)."""
    n = _tree_norm(x, ROWS, BLOCK, LOG2)
    redo = ~(is_finite(n) & (n >= REDO_FLOOR))
    amax = tl.max(tl.where(valid, tl.abs(x), 0.0), axis=1)
    amax = tl.where(amax > 0, amax, 1.0)
    unit = _tree_norm(tl.math.div_rn(x, tl.broadcast_to(amax[:, None], x.shape)), ROWS, BLOCK, LOG2)
    n64 = tl.where(redo, unit.to(tl.float64) * amax.to(tl.float64), n.to(tl.float64))
    return tl.where(redo, unit * amax, n), n64


@triton.jit
def _finite64(v):
    return (v - v) == 0


@triton.jit
def _pow2(j):
    """2^j as fp64, exactly, for integer-valued fp64 j in [-1022, 1023]."""
    return ((j.to(tl.int64) + 1023) << 52).to(tl.float64, bitcast=True)


@triton.jit
def _level_cap(p0, m, KIND: tl.constexpr, TOP: tl.constexpr, OUT_MAX: tl.constexpr):
    """The norm codecs' ``_level_cap``: the largest level whose decode (factor p0, multiplier m) is <= OUT_MAX,
    exact in fp64 (QSGD: level l decodes to l p0 m; NUQSGD: index i to 2^(i - TOP) p0 m)."""
    pm = p0.to(tl.float64) * m.to(tl.float64)
    if KIND == _QSGD:
        q = tl.floor(OUT_MAX / pm)
        q = tl.where(q > TOP, TOP * 1.0, tl.where(q < 0, 0.0, q))  # a clamp that keeps NaN
        q = tl.where((q < TOP) & ((q + 1) * pm <= OUT_MAX), q + 1, q)
        q = tl.where(q * pm > OUT_MAX, q - 1, q)
    else:  # floor(log2(y)) from y's exponent bits and 2^j from j's: exact, unlike a library log2 / exp2
        y = OUT_MAX / pm
        j = (((y.to(tl.int64, bitcast=True) >> 52) & 0x7FF) - 1023).to(tl.float64)
        j = tl.where(y == y, j, y)  # NaN stays NaN
        j = tl.where(j > 0, 0.0, tl.where(j < -TOP, -TOP * 1.0, j))
        j = tl.where(_pow2(j) * pm > OUT_MAX, j - 1, j)
        j = tl.where((j < 0) & (_pow2(j + 1) * pm <= OUT_MAX), j + 1, j)
        q = j + TOP
        q = tl.where(q < 0, 0.0, q)
    return q.to(tl.float32)
