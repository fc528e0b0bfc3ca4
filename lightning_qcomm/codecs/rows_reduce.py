"""The server step and the error-feedback tail of a compressed all-reduce as torch ops of the codec layer, one
launch each on CUDA (docs/design.md, "Launches per bucket and host syncs")::

    decode_rows_sum(Tensor wire, int n, <codec>, bool avg, bool rank_order=False) -> Tensor           ((n,) fp32)
    feedback_update(Tensor y, Tensor dec, Tensor reduced, Tensor held, int start, float k,
                    ScalarType held_dtype, Tensor(a!) err) -> ()

``decode_rows_sum``: the sum of the R payloads' decodes (``avg``: over R), exactly the eager
``decode_rows(...).sum(dim=0)`` (then ``/= R``) on the device it runs on; ``rank_order``: row 0, + row 1, ..., one
rounding each. ``feedback_update``: new = y - dec plus the requantization term on this rank's chunk, written to
``err`` where finite. CPU (and any device but CUDA): the eager ops themselves. CUDA: one Triton launch
(``kernels.cuda.reduce_kernels``) that reproduces torch's CUDA sum order and ``/=`` where it applies, else the
eager ops. The orders and limits: docs/design.md, "Module notes".

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
FEEDBACK_BLOCK = 1024  # the feedback kernel's elements per program; its indices are int32
HELD_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)  # what the feedback kernel rounds
_EAGER = "the eager ops run there"


# ---------------------------------------------------------------------------------------------- decode_rows_sum
def decode_rows_sum_body(
    codec: Codec, wire: torch.Tensor, n: int, avg: bool, triton: bool, rank_order: bool = False
) -> torch.Tensor:
    """(n,) fp32 sum (``avg``: mean) of the decoded payloads in ``wire`` (module docstring)."""
    p = _check_wire(codec, wire, n)
    rows = wire.reshape(-1, p)
    r = rows.shape[0]
    # torch's order: at most MAX_SUM_ROWS rows, n >= 2 (n = 1: torch sums R contiguous values); rank order: any
    # R and n. The kernel's row offsets r * p are int32.
    fits = rank_order or (r <= MAX_SUM_ROWS and n >= 2)
    if triton and fits and n < _INT32_COUNTERS and rows.numel() < _INT32_COUNTERS:
        from lightning_qcomm.codecs import ops

        if ops.rows_kernel(codec, rows, encode=False) and _sum_kernel_works(codec, r, rows.device, rank_order):
            return ops.decode_rows_sum_kernel(codec, rows, n, avg, rank_order)
    return _eager_sum(codec, rows, n, avg, triton, rank_order)


def _eager_sum(codec: Codec, rows: torch.Tensor, n: int, avg: bool, triton: bool, rank_order: bool) -> torch.Tensor:
    values = decode_rows_body(codec, rows, n, triton=triton)
    if rank_order:  # values[0] + values[1] + ..., one addition at a time
        acc = values[0].clone()
        for r in range(1, values.shape[0]):
            acc += values[r]
    else:
        acc = values.sum(dim=0)
    if avg:
        acc /= rows.shape[0]
    return acc


def _sum_kernel_works(codec: Codec, r: int, device: torch.device, rank_order: bool = False) -> bool:
    """The sum kernel of R rows on ``device`` equals the eager decode-and-sum it replaces (bit for bit, any NaN
    equal to any NaN) on a probe of R rows of 1061 elements with NaN and infinities, sum and mean: checked once
    per (codec, R, device), its host syncs then; else the eager ops, with one warning. So the sum order the
    kernel assumes of torch's CUDA reduction is verified on the GPU it runs on. Not on CPU tensors (Triton's
    interpreter): the eager sum there is the CPU's, in another order for R > 4."""
    from lightning_qcomm.codecs import ops, rows_encode, triton_probe

    if device.type != "cuda":
        return True

    def check() -> None:
        g = torch.Generator().manual_seed(r)
        x = torch.randn(r, 1061, generator=g) * 3
        x[0, 3], x[r - 1, 7], x[r - 1, 8] = float("nan"), float("inf"), float("-inf")
        wire = rows_encode.encode_rows_body(codec, x.to(device), list(range(r)), triton=False)
        for avg in (False, True):
            want = _eager_sum(codec, wire, 1061, avg, True, rank_order)
            got = ops.decode_rows_sum_kernel(codec, wire.view(r, -1), 1061, avg, rank_order)
            difference = triton_probe._difference("sums", want, got)
            if difference:
                raise RuntimeError(f"the Triton decode-and-sum differs from the eager ops: {difference}")

    key = ("sum", tuple(sorted(codec.config().items())), r, rank_order, str(device))
    what = f"the decode-and-sum kernel of {r} rows{' in rank order' if rank_order else ''} of {codec.config()}"
    return triton_probe.first_use(key, what, device, check, _EAGER)


def decode_rows_sum_reference(
    wire, n: int, codec: str, bits: int, bucket_size, stochastic: bool, avg: bool, rank_order=False
):
    """``qcomm::decode_rows_sum`` on any device but CUDA: the eager decode and sum."""
    c = registry.codec_for_op(codec, bits, bucket_size, stochastic)
    return decode_rows_sum_body(c, wire, n, avg, False, rank_order)


def decode_rows_sum_cuda(
    wire, n: int, codec: str, bits: int, bucket_size, stochastic: bool, avg: bool, rank_order=False
):
    """``qcomm::decode_rows_sum`` on CUDA: one Triton launch where the kernel takes the rows."""
    c = registry.codec_for_op(codec, bits, bucket_size, stochastic)
    return decode_rows_sum_body(c, wire, n, avg, True, rank_order)


def decode_rows_sum_fake(
    wire, n: int, codec: str, bits: int, bucket_size, stochastic: bool, avg: bool, rank_order=False
):
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

    if not kernels.HAS_TRITON or os.environ.get("LIGHTNING_QCOMM_DISABLE_TRITON") == "1":
        return False
    if not (device.type == "cuda" or kernels.codec_kernels._is_interpreted()):
        return False
    if not all(t.dtype == torch.float32 and t.is_contiguous() and t.dim() == 1 for t in tensors):
        return False
    if tensors[0].numel() >= _INT32_COUNTERS - FEEDBACK_BLOCK:  # the kernel's indices are int32
        return False
    return _feedback_kernel_works(device)


def _feedback_kernel_works(device: torch.device) -> bool:
    """The feedback kernel on ``device`` equals the eager ops (bit for bit) on a probe with NaN, infinities and
    subnormals, this rank's chunk inside and clipped, every held dtype: checked once per device, else the eager
    ops, with one warning."""
    from lightning_qcomm.codecs import triton_probe

    def check() -> None:
        from lightning_qcomm.kernels.cuda import reduce_kernels

        g = torch.Generator().manual_seed(0)
        y, dec, held, err = (torch.randn(1037, generator=g) * 5 for _ in range(4))
        y[2], dec[5], held[300], y[3] = float("nan"), float("inf"), float("-inf"), 1e-41
        red = torch.randn(260, generator=g) * 5
        red[1] = float("inf")
        for start in (0, 780, 1040):
            for held_dtype in HELD_DTYPES:
                want = err.clone()
                feedback_update_reference(y, dec, red, held, start, 4.0, held_dtype, want)
                ops = [t.to(device) for t in (y, dec, red, held, err)]
                with triton_probe.on_device(device):
                    reduce_kernels.feedback_update(*ops[:4], start, 4.0, held_dtype, ops[4])
                difference = triton_probe._difference("errors", want, ops[4].cpu())
                if difference:
                    raise RuntimeError(f"the Triton error-feedback tail differs from the eager ops: {difference}")

    return triton_probe.first_use(("feedback", str(device)), "the error-feedback kernel", device, check, _EAGER)


def feedback_update_cuda(y, dec, reduced, held, start: int, k: float, held_dtype, err) -> None:
    """``qcomm::feedback_update`` on CUDA: one Triton launch for contiguous fp32 operands, else the eager ops."""
    _check_feedback(y, dec, reduced, held, err)
    if held_dtype in HELD_DTYPES and _feedback_triton((y, dec, reduced, held, err), y.device):
        from lightning_qcomm.codecs import triton_probe
        from lightning_qcomm.kernels.cuda import reduce_kernels

        with triton_probe.on_device(y.device):
            reduce_kernels.feedback_update(y, dec, reduced, held, start, k, held_dtype, err)
        return
    feedback_update_reference(y, dec, reduced, held, start, k, held_dtype, err)


def feedback_update_fake(y, dec, reduced, held, start: int, k: float, held_dtype, err) -> None:
    return None


# ---------------------------------------------------------------------------------------------- the door
def decode_rows_sum(
    codec: Codec, wire: torch.Tensor, n: int, avg: bool = False, rank_order: bool = False
) -> torch.Tensor:
    """(n,) fp32: ``decode_rows(codec, wire, n).sum(dim=0)`` (``avg``: then ``/= R``) as the eager ops compute it
    on ``wire``'s device, one launch on CUDA (module docstring). ``rank_order``: the sum is
    ``rows[0] + rows[1] + ... + rows[R-1]``, one addition at a time, instead (any R; one launch on CUDA). ValueError
    unless ``wire`` holds whole payloads.

    Example::

        >>> s = decode_rows_sum(codec, recv, c, avg=True)     # the server step of a quantized all-reduce
    """
    if registry.is_registered(codec):
        return torch.ops.qcomm.decode_rows_sum(wire, n, *codec.op_args(), avg, rank_order)
    return decode_rows_sum_body(codec, wire, n, avg, False, rank_order)


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
