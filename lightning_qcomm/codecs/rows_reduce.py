"""The server step and the error-feedback tail of a compressed all-reduce as torch ops of the codec layer, one
launch each on CUDA (docs/design.md, "Collectives"):

    decode_rows_sum(Tensor wire, int n, <codec>, bool avg) -> Tensor                                  ((n,) fp32)
    feedback_update(Tensor y, Tensor dec, Tensor reduced, Tensor held, int start, float k,
                    ScalarType held_dtype, Tensor(a!) err) -> ()

**decode_rows_sum**: S = sum_r D(wire[r]) over the R payloads of n elements in ``wire`` (``avg``: S / R), exactly
the eager ``decode_rows(codec, wire, n).sum(dim=0)`` (then ``/= R``) on the device it runs on. CPU (and any device
but CUDA): those very ops (torch's CPU ``sum(dim=0)`` adds a column's rows in rank order from +0.0 for R <= 4;
for more rows its order depends on the column's place in its vectorized blocks, so the ops are kept, not
rewritten). CUDA: one Triton launch (``kernels.cuda.reduce_kernels``) reproducing torch's CUDA sum for
R <= ``MAX_SUM_ROWS`` and n >= 2 (one thread per column: four running sums, row r into sum r % 4, then
((s0 + s1) + s2) + s3) and its ``/=`` by a Python number (times fl(1/R)); more rows, rows of one element (then
torch reduces R contiguous values across threads, in another order), or rows the Triton rows kernels do not take
run the eager ops.

**feedback_update**: the residual of one piece and its write where finite, as ``collectives.quantized`` computed it
in eager ops: with ``new = y - dec`` (n values) and c = ``reduced.numel()``,

    new[start:start+c] += (reduced - held[start:start+c] rounded through held_dtype) * k      (clipped to n)
    err <- new where new is finite (new - new == 0), else err unchanged

(``held_dtype`` bf16 / fp16: the fp32 values rounded to that dtype and back, as x finally holds them). CUDA: one
Triton launch for fp32 ``err`` (all operands contiguous fp32), else the eager ops.

Example::

    >>> acc = decode_rows_sum(codec, recv, c, avg=True)                      # (c,) fp32
    >>> feedback_update(y, dec, acc, out_piece, rank * c, 4.0, torch.float32, err_piece)
"""

from __future__ import annotations

import os

import torch

from lightning_qcomm.codecs import registry
from lightning_qcomm.codecs.base import Codec
from lightning_qcomm.codecs.rows import _check_wire, decode_rows_body
from lightning_qcomm.codecs.rows_encode import _INT32_COUNTERS

MAX_SUM_ROWS = 8  # the Triton sum reproduces torch's CUDA sum(dim=0) order up to this many rows


# ---------------------------------------------------------------------------------------------- decode_rows_sum
def decode_rows_sum_body(codec: Codec, wire: torch.Tensor, n: int, avg: bool, triton: bool) -> torch.Tensor:
    """(n,) fp32 sum (``avg``: mean) of the decoded payloads in ``wire`` (module docstring)."""
    p = _check_wire(codec, wire, n)
    rows = wire.reshape(-1, p)
    r = rows.shape[0]
    if triton and r <= MAX_SUM_ROWS and 2 <= n < _INT32_COUNTERS:  # n = 1: torch sums R contiguous values
        from lightning_qcomm.codecs import ops

        if ops.rows_kernel(codec, rows, encode=False):
            return ops.decode_rows_sum_kernel(codec, rows, n, avg)
    acc = decode_rows_body(codec, rows, n, triton=triton).sum(dim=0)
    if avg:
        acc /= r
    return acc


def decode_rows_sum_reference(wire, n: int, codec: str, bits: int, bucket_size, stochastic: bool, avg: bool):
    """``qcomm::decode_rows_sum`` on any device but CUDA: the eager decode and sum."""
    c = registry.codec_for_op(codec, bits, bucket_size, stochastic)
    return decode_rows_sum_body(c, wire, n, avg, triton=False)


def decode_rows_sum_cuda(wire, n: int, codec: str, bits: int, bucket_size, stochastic: bool, avg: bool):
    """``qcomm::decode_rows_sum`` on CUDA: one Triton launch where the kernel takes the rows."""
    c = registry.codec_for_op(codec, bits, bucket_size, stochastic)
    return decode_rows_sum_body(c, wire, n, avg, triton=True)


def decode_rows_sum_fake(wire, n: int, codec: str, bits: int, bucket_size, stochastic: bool, avg: bool):
    """The shape of ``qcomm::decode_rows_sum``: (n,) fp32."""
    _check_wire(registry.codec_for_op(codec, bits, bucket_size, stochastic), wire, n)
    return wire.new_empty((n,), dtype=torch.float32)


# ---------------------------------------------------------------------------------------------- feedback_update
def _check_feedback(y, dec, reduced, held, err) -> None:
    n = y.numel()
    for name, t in (("dec", dec), ("held", held), ("err", err)):
        if t.numel() != n:
            raise ValueError(f"feedback_update: {name} must have y.numel() = {n} elements, got {t.numel()}")
    if reduced.dim() != 1:
        raise ValueError(f"feedback_update: reduced must be 1-D, got shape {tuple(reduced.shape)}")


def feedback_update_reference(y, dec, reduced, held, start: int, k: float, held_dtype, err) -> None:
    """``qcomm::feedback_update`` on any device but CUDA (and CUDA's fallback): the eager ops."""
    _check_feedback(y, dec, reduced, held, err)
    new = y.reshape(-1) - dec.reshape(-1)
    a, b = max(start, 0), min(start + reduced.numel(), new.numel())
    if b > a:
        h = held.reshape(-1)[a:b]
        if held_dtype != torch.float32:
            h = h.to(held_dtype).to(torch.float32)
        mine = new[a:b]
        mine += (reduced[a - start : b - start] - h).mul_(k)
    new = new.reshape(err.shape)
    finite = new - new == 0  # x - x == 0 iff x is finite
    if err.dtype == new.dtype:
        torch.where(finite, new, err, out=err)
    else:
        err.copy_(torch.where(finite, new, err.to(new.dtype)))


def _feedback_triton(tensors, device: torch.device) -> bool:
    from lightning_qcomm import kernels
    from lightning_qcomm.codecs import triton_probe

    if not kernels.HAS_TRITON or os.environ.get("LIGHTNING_QCOMM_DISABLE_TRITON") == "1":
        return False
    if not (device.type == "cuda" or kernels.codec_kernels._is_interpreted()):
        return False
    if not all(t.dtype == torch.float32 and t.is_contiguous() and t.dim() == 1 for t in tensors):
        return False
    return triton_probe.triton_works(registry.codec_for_op("uniform", 8, 512, True), device)


def feedback_update_cuda(y, dec, reduced, held, start: int, k: float, held_dtype, err) -> None:
    """``qcomm::feedback_update`` on CUDA: one Triton launch for contiguous fp32 operands, else the eager ops."""
    _check_feedback(y, dec, reduced, held, err)
    from lightning_qcomm.kernels.cuda import reduce_kernels

    if held_dtype in reduce_kernels.HELD_DTYPES and _feedback_triton((y, dec, reduced, held, err), y.device):
        from lightning_qcomm.codecs import triton_probe

        with triton_probe.on_device(y.device):
            reduce_kernels.feedback_update(y, dec, reduced, held, start, k, held_dtype, err)
        return
    feedback_update_reference(y, dec, reduced, held, start, k, held_dtype, err)


def feedback_update_fake(y, dec, reduced, held, start: int, k: float, held_dtype, err) -> None:
    return None


# ---------------------------------------------------------------------------------------------- the door
def decode_rows_sum(codec: Codec, wire: torch.Tensor, n: int, avg: bool = False) -> torch.Tensor:
    """(n,) fp32: ``decode_rows(codec, wire, n).sum(dim=0)`` (``avg``: then ``/= R``) as the eager ops compute it
    on ``wire``'s device, one launch on CUDA (module docstring). ValueError unless ``wire`` holds whole payloads.

    Example::

        >>> s = decode_rows_sum(codec, recv, c, avg=True)     # the server step of a quantized all-reduce
    """
    if registry.is_registered(codec):
        return torch.ops.qcomm.decode_rows_sum(wire, n, *codec.op_args(), avg)
    return decode_rows_sum_body(codec, wire, n, avg, triton=False)


def feedback_update(
    y: torch.Tensor,
    dec: torch.Tensor,
    reduced: torch.Tensor,
    held: torch.Tensor,
    start: int,
    k: float,
    held_dtype: torch.dtype,
    err: torch.Tensor,
) -> torch.Tensor:
    """``err`` <- the residual ``y - dec`` plus, on ``[start, start + reduced.numel())``, ``(reduced - held) * k``
    (``held`` rounded through ``held_dtype``), where that is finite (module docstring); returns ``err``.

    Example::

        >>> feedback_update(y, dec, s, out_piece, rank * c, float(world), torch.float32, err_piece)
    """
    torch.ops.qcomm.feedback_update(y, dec, reduced, held, int(start), float(k), held_dtype, err)
    return err


__all__ = ["MAX_SUM_ROWS", "decode_rows_sum", "feedback_update"]
