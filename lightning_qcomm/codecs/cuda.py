"""The CUDA backend of the codec ops: each ``qcomm`` op's kernel on CUDA tensors (registered by ``codecs.ops``), the
Triton kernels of ``lightning_qcomm.kernels`` where they take the input, else the torch reference (docs/design.md,
"Launches per bucket and host syncs"; the segment ops: ``codecs.cuda_segments``).

Where: Triton installed and not switched off (``LIGHTNING_QCOMM_DISABLE_TRITON=1``), a registered codec with
kernels, and its first-use check passed on that device (``codecs.triton_probe``: the kernel run once next to the
reference, bit for bit; else the reference there, with one warning). Each kernel then is: ``encode`` two launches
(scales, codes), ``decode`` one; ``encode_rows`` two whatever R, keys through pinned memory; ``decode_rows`` /
``decode_rows_into`` one; ``decode_rows_sum`` one, in torch's CUDA ``sum(dim=0)`` order up to
``reduce_kernels.MAX_SUM_ROWS`` rows or in rank order; ``feedback_update`` one; ``feedback_rows`` one, each element
decoded in registers; ``hadamard_`` one. No host sync on any of them after the first-use checks.

Invariant: every kernel gives the reference's bits (any NaN equal to any NaN); with ``TRITON_INTERPRET=1`` the same
kernels run on CPU tensors (``benchmarks/launch_counts.cuda_path_on_cpu`` registers ``KERNELS`` for CPU).

Example::

    >>> torch.ops.qcomm.encode_rows(rows.cuda(), seeds, *codec.op_args())   # dispatched to encode_rows below
"""

from __future__ import annotations

import logging
import os

import torch

from lightning_qcomm._log import log_once
from lightning_qcomm.codecs import eden, registry, rng, rows_reduce, scaling, triton_probe
from lightning_qcomm.codecs.base import Codec
from lightning_qcomm.codecs.rows import (
    INT32_COUNTERS,
    check_wire,
    decode_rows_body,
    decode_rows_into_body,
    encode_rows_body,
    row_keys,
    rows_out,
)

log = logging.getLogger(__name__)
FEEDBACK_BLOCK = 1024  # the feedback kernel's elements per program; its indices are int32
_EAGER = "the eager ops run there"


triton_kernels = triton_probe.triton_kernels  # lightning_qcomm.kernels, imported at first use (it imports Triton)


# ---------------------------------------------------------------------------------------------- where
def triton_for(c: Codec, device: torch.device) -> bool:
    """Whether the Triton kernels do the element-wise work of ``c`` on ``device``: a codec with kernels, Triton
    installed and not disabled, and its first-use check passed there."""
    if not registry.has_kernels(c) or os.environ.get("LIGHTNING_QCOMM_DISABLE_TRITON") == "1":
        return False
    if not triton_kernels().HAS_TRITON:
        log_once(
            log, "no-triton", "lightning_qcomm: Triton is not available; CUDA tensors use the torch reference codecs"
        )
        return False
    return triton_probe.triton_works(c, device)


def kernels_for(c: Codec, device: torch.device, n: int, encode: bool = True) -> bool:
    """Whether the rows kernels code rows of n elements of ``c`` on ``device`` (a CUDA device, or any with the
    kernels interpreted): a registered codec with kernels and Triton working for it; to encode also buckets the
    scales kernel reduces (``kernels.fused_scales``: up to ``MAX_BUCKET``)."""
    k = triton_kernels()
    if not k.HAS_TRITON or not registry.is_registered(c) or not registry.has_kernels(c):
        return False
    if not (device.type == "cuda" or k.codec_kernels._is_interpreted()):
        return False
    return (not encode or k.fused_scales(c, n)) and triton_for(c, device)


def rows_kernel(c: Codec, rows: torch.Tensor, encode: bool = True) -> bool:
    """``kernels_for`` the (R, n) ``rows`` (or, ``encode=False``, payloads of that many rows)."""
    return kernels_for(c, rows.device, rows.shape[1], encode)


# ---------------------------------------------------------------------------------------------- encode, decode
def encode(x: torch.Tensor, c: Codec, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``qcomm::encode``: the scales and codes kernels (two launches)."""
    out_max = scaling.output_max(x.dtype)
    if not triton_for(c, x.device):
        return c.encode_torch(x.reshape(-1).to(torch.float32), seed, out_max)
    with triton_probe.on_device(x.device):
        return triton_kernels().encode_codec(c, x.reshape(-1).to(torch.float32), seed, out_max)


def decode(codes: torch.Tensor, scales: torch.Tensor, numel: int, c: Codec) -> torch.Tensor:
    """``qcomm::decode``: one launch (the decode parameters are made in the kernel)."""
    if not triton_for(c, codes.device):
        return c.decode_reference(codes, c._decode_params(scales), numel)
    with triton_probe.on_device(codes.device):
        return triton_kernels().decode_codec(c, codes, scales, numel)


# ---------------------------------------------------------------------------------------------- the rows ops
def encode_rows(rows: torch.Tensor, seeds, c: Codec) -> torch.Tensor:
    """``qcomm::encode_rows``: every row (one too) in two launches, straight into the payloads."""
    if rows.shape[1] < INT32_COUNTERS and rows_kernel(c, rows):
        keys = row_keys(seeds, rows.device) if c.stochastic else None
        with triton_probe.on_device(rows.device):
            return triton_kernels().encode_rows_codec(c, rows, keys)
    return encode_rows_body(c, rows, seeds)


def _decode_rows_kernel(c: Codec, wire: torch.Tensor, n: int, out: torch.Tensor | None = None) -> torch.Tensor:
    with triton_probe.on_device(wire.device):
        return triton_kernels().decode_rows(c, wire, n, out)


def decode_rows(wire: torch.Tensor, n: int, c: Codec) -> torch.Tensor:
    """``qcomm::decode_rows``: all rows in one launch (one row: the codec's ``decode``)."""
    wire2 = wire.reshape(-1, check_wire(c, wire, n))
    if wire2.shape[0] > 1 and n < INT32_COUNTERS and rows_kernel(c, wire2, encode=False):
        return _decode_rows_kernel(c, wire2, n)
    return decode_rows_body(c, wire, n)


def decode_rows_into(wire: torch.Tensor, n: int, c: Codec, out: torch.Tensor) -> None:
    """``qcomm::decode_rows_into``: one launch straight into a contiguous fp32 ``out``."""
    wire2, _ = rows_out(c, wire, n, out)
    direct = out.dtype == torch.float32 and out.is_contiguous()
    if direct and n < INT32_COUNTERS and rows_kernel(c, wire2, encode=False):
        _decode_rows_kernel(c, wire2, n, out=out.view(-1))
        return
    decode_rows_into_body(c, wire, n, out)


# ---------------------------------------------------------------------------------------------- sum, feedback
def decode_rows_sum(wire: torch.Tensor, n: int, c: Codec, avg: bool, rank_order: bool = False) -> torch.Tensor:
    """``qcomm::decode_rows_sum``: one launch where the sum kernel reproduces the eager order (at most
    ``MAX_SUM_ROWS`` rows and n >= 2, or ``rank_order``; int32 offsets); else the rows decode and torch's sum."""
    rows = wire.reshape(-1, check_wire(c, wire, n))
    r = rows.shape[0]
    small = n < INT32_COUNTERS and rows.numel() < INT32_COUNTERS  # the kernel's row offsets r * p are int32
    if small and rows_kernel(c, rows, encode=False):
        fits = rank_order or (r <= triton_kernels().reduce_kernels.MAX_SUM_ROWS and n >= 2)
        if fits and _sum_kernel_works(c, r, rows.device, rank_order):
            return _sum_kernel(c, rows, n, avg, rank_order)
    return rows_reduce.decode_rows_sum_body(c, rows, n, avg, rank_order)


def _sum_kernel(c: Codec, rows: torch.Tensor, n: int, avg: bool, rank_order: bool) -> torch.Tensor:
    with triton_probe.on_device(rows.device):
        return triton_kernels().reduce_kernels.decode_rows_sum(c, rows, n, avg, rank_order)


def _sum_kernel_works(c: Codec, r: int, device: torch.device, rank_order: bool = False) -> bool:
    """The sum kernel of R rows equals the rows decode kernel then torch's sum (bit for bit) on a probe of R rows of
    1061 elements with NaN and infinities, sum and mean: checked once per (codec, R, device). So the order the
    kernel assumes of torch's CUDA reduction is verified on the GPU it runs on. Not on CPU tensors (the
    interpreter's eager sum is the CPU's, in another order for R > 4)."""
    if device.type != "cuda":
        return True

    def check() -> None:
        g = torch.Generator().manual_seed(r)
        x = torch.randn(r, 1061, generator=g) * 3
        x[0, 3], x[r - 1, 7], x[r - 1, 8] = float("nan"), float("inf"), float("-inf")
        wire = encode_rows_body(c, x.to(device), list(range(r)))
        for avg in (False, True):
            want = rows_reduce.decode_rows_sum_body(c, wire, 1061, avg, rank_order)
            got = _sum_kernel(c, wire.view(r, -1), 1061, avg, rank_order)
            difference = triton_probe._difference("sums", want, got)
            if difference:
                raise RuntimeError(f"the Triton decode-and-sum differs from the eager ops: {difference}")

    key = ("sum", tuple(sorted(c.config().items())), r, rank_order, str(device))
    what = f"the decode-and-sum kernel of {r} rows{' in rank order' if rank_order else ''} of {c.config()}"
    return triton_probe.first_use(key, what, device, check, _EAGER)


def feedback_update(y, dec, reduced, held, start: int, k: float, held_dtype, err) -> None:
    """``qcomm::feedback_update``: one launch for contiguous 1-D fp32 operands, else the eager ops."""
    rows_reduce.check_feedback(y, dec, reduced, held, err)
    if _feedback_triton((y, dec, reduced, held, err), held_dtype, y.device):
        with triton_probe.on_device(y.device):
            triton_kernels().reduce_kernels.feedback_update(y, dec, reduced, held, start, k, held_dtype, err)
        return
    rows_reduce.feedback_update_body(y, dec, reduced, held, start, k, held_dtype, err)


def _triton_on(device: torch.device) -> bool:
    """Triton installed, not switched off, and ``device`` CUDA (or the kernels interpreted on CPU tensors)."""
    k = triton_kernels()
    if not k.HAS_TRITON or os.environ.get("LIGHTNING_QCOMM_DISABLE_TRITON") == "1":
        return False
    return device.type == "cuda" or k.codec_kernels._is_interpreted()


def _feedback_triton(tensors, held_dtype, device: torch.device) -> bool:
    if not _triton_on(device) or held_dtype not in triton_kernels().reduce_kernels.HELD_DTYPES:
        return False
    if not all(t.dtype == torch.float32 and t.is_contiguous() and t.dim() == 1 for t in tensors):
        return False
    if tensors[0].numel() >= INT32_COUNTERS - FEEDBACK_BLOCK:  # the kernel's indices are int32
        return False
    return _feedback_kernel_works(device)


def _feedback_kernel_works(device: torch.device) -> bool:
    """The feedback kernel equals the eager ops (bit for bit) on a probe with NaN, infinities and subnormals, this
    rank's chunk inside and clipped, every held dtype: checked once per device."""

    def check() -> None:
        g = torch.Generator().manual_seed(0)
        y, dec, held, err = (torch.randn(1037, generator=g) * 5 for _ in range(4))
        y[2], dec[5], held[300], y[3] = float("nan"), float("inf"), float("-inf"), 1e-41
        red = torch.randn(260, generator=g) * 5
        red[1] = float("inf")
        for start in (0, 780, 1040):
            for held_dtype in triton_kernels().reduce_kernels.HELD_DTYPES:
                want = err.clone()
                rows_reduce.feedback_update_body(y, dec, red, held, start, 4.0, held_dtype, want)
                ops = [t.to(device) for t in (y, dec, red, held, err)]
                with triton_probe.on_device(device):
                    triton_kernels().reduce_kernels.feedback_update(*ops[:4], start, 4.0, held_dtype, ops[4])
                difference = triton_probe._difference("errors", want, ops[4].cpu())
                if difference:
                    raise RuntimeError(f"the Triton error-feedback tail differs from the eager ops: {difference}")

    return triton_probe.first_use(("feedback", str(device)), "the error-feedback kernel", device, check, _EAGER)


def feedback_rows(y, wire, n: int, c: Codec, reduced, held, start: int, k: float, held_dtype, err) -> None:
    """``qcomm::feedback_rows``: one launch where the rows decode and feedback kernels both apply, else the
    ``decode_rows`` and ``feedback_update`` ops (two launches)."""
    rows = rows_reduce.feedback_rows_prefix(c, wire, n, y)
    if y.numel() + n + FEEDBACK_BLOCK < INT32_COUNTERS and rows_kernel(c, rows, encode=False):
        if _feedback_triton((y, reduced, held, err), held_dtype, y.device) and _feedback_rows_works(c, y.device):
            with triton_probe.on_device(y.device):
                triton_kernels().reduce_kernels.feedback_rows(c, y, rows, n, reduced, held, start, k, held_dtype, err)
            return
    rows_reduce.feedback_rows_body(c, y, wire, n, reduced, held, start, k, held_dtype, err)


def _feedback_rows_works(c: Codec, device: torch.device) -> bool:
    """The wire-reading feedback kernel equals the reference decode then ``feedback_update`` (bit for bit) on a
    probe of three rows of 347 elements with NaN, infinities and subnormals, the last row cut short, this rank's
    chunk inside: checked once per (codec, device)."""

    def check() -> None:
        g = torch.Generator().manual_seed(1)
        x = torch.randn(3, 347, generator=g) * 3
        x[0, 3], x[2, 7], x[1, 8] = float("nan"), float("inf"), -1e-41
        wire = encode_rows_body(c, x, [0, 1, 2])
        y, held, err = (torch.randn(3 * 347 - 5, generator=g) * 3 for _ in range(3))
        y[9], y[400], held[500] = float("nan"), 1e-41, float("-inf")
        red = torch.randn(200, generator=g)
        for held_dtype in (torch.float32, torch.bfloat16):
            want = err.clone()
            rows_reduce.feedback_rows_body(c, y, wire, 347, red, held, 380, 3.0, held_dtype, want, eager=True)
            ops = [t.to(device) for t in (y, wire, red, held, err)]
            with triton_probe.on_device(device):
                triton_kernels().reduce_kernels.feedback_rows(
                    c, ops[0], ops[1], 347, *ops[2:4], 380, 3.0, held_dtype, ops[4]
                )
            difference = triton_probe._difference("errors", want, ops[4].cpu())
            if difference:
                raise RuntimeError(f"the wire-reading error-feedback kernel differs from the eager ops: {difference}")

    key = ("feedback_rows", tuple(sorted(c.config().items())), str(device))
    what = f"the wire-reading error-feedback kernel of {c.config()}"
    return triton_probe.first_use(key, what, device, check, _EAGER)


# ---------------------------------------------------------------------------------------------- rotation
def hadamard_(x: torch.Tensor, block: int) -> None:
    """``qcomm::hadamard_``: one launch (a program per block, ``rotation_kernels``) for a contiguous fp32 ``x`` with
    blocks up to ``MAX_BLOCK`` once its first-use check passed on the device; else ``eden.hadamard_reference_``."""
    eden.check_block(block, x.numel())
    if _triton_on(x.device):
        k = triton_kernels()
        fits = x.dtype == torch.float32 and x.is_contiguous() and block <= k.rotation_kernels.MAX_BLOCK
        if fits and _hadamard_works(x.device):
            with triton_probe.on_device(x.device):
                k.rotation_kernels.hadamard_(x, block, eden.hadamard_scale(block))
            return
    eden.hadamard_reference_(x, block)


def _hadamard_works(device: torch.device) -> bool:
    """The Triton butterfly equals the reference (bit for bit) on blocks of 1 to 4096 with NaN, infinities,
    subnormals and values near FLT_MAX: checked once per device."""

    def check() -> None:
        g = torch.Generator().manual_seed(2)
        for block in (1, 2, 8, 512, 4096):
            x = torch.randn(3 * block, generator=g) * 3
            x[0], x[-1], x[block // 2] = float("nan"), 3e38, 1e-41
            if block > 2:
                x[2 * block + 1] = float("-inf")
            want = x.clone()
            eden.hadamard_reference_(want, block)
            got = x.to(device)
            with triton_probe.on_device(device):
                triton_kernels().rotation_kernels.hadamard_(got, block, eden.hadamard_scale(block))
            difference = triton_probe._difference("rotated values", want, got.cpu())
            if difference:
                raise RuntimeError(f"the Triton Hadamard transform differs from the reference: {difference}")

    return triton_probe.first_use(("hadamard", str(device)), "the Hadamard transform kernel", device, check, _EAGER)


# ---------------------------------------------------------------------------------------------- bf16 window
def add_square_sr_(acc: torch.Tensor, g: torch.Tensor, seed: int, chunk: int) -> None:
    """``qcomm::add_square_sr_``: one launch over the whole tensor (``rounding_kernels``; no fp32 piece held) for a
    contiguous flat bf16 ``acc`` and a contiguous float ``g`` of its size once the kernel's first-use check passed on
    the device; else ``rng.add_square_sr_reference_`` (``chunk`` elements at a time)."""
    if _triton_on(acc.device):
        fits = acc.dtype == torch.bfloat16 and acc.is_contiguous() and g.is_contiguous() and g.numel() == acc.numel()
        if fits and g.dtype in (torch.float32, torch.bfloat16, torch.float16) and _add_square_sr_works(acc.device):
            with triton_probe.on_device(acc.device):
                triton_kernels().rounding_kernels.add_square_sr_(acc, g, seed)
            return
    rng.add_square_sr_reference_(acc, g, seed, chunk)


def _add_square_sr_works(device: torch.device) -> bool:
    """The Triton pass equals the reference (bit for bit) on fp32 and bf16 gradients with NaN, infinities and
    subnormals, the window's values near FLT_MAX: checked once per device."""

    def check() -> None:
        gen = torch.Generator().manual_seed(4)
        for dtype in (torch.float32, torch.bfloat16):
            acc = (torch.rand(3000, generator=gen) * 4).to(torch.bfloat16)
            acc[7] = 3e38
            g = (torch.randn(3000, generator=gen) * 3).to(dtype)
            g[1], g[2], g[3] = float("nan"), float("inf"), 1e-41
            want = acc.clone()
            rng.add_square_sr_reference_(want, g, -5, 1024)
            got = acc.to(device)
            with triton_probe.on_device(device):
                triton_kernels().rounding_kernels.add_square_sr_(got, g.to(device), -5)
            difference = triton_probe._difference("window sums", want.float(), got.float().cpu())
            if difference:
                raise RuntimeError(f"the Triton rounded window sum differs from the reference: {difference}")

    return triton_probe.first_use(("add_square_sr", str(device)), "the bf16 window kernel", device, check, _EAGER)


__all__ = [
    "decode",
    "decode_rows",
    "decode_rows_into",
    "decode_rows_sum",
    "encode",
    "encode_rows",
    "hadamard_",
    "kernels_for",
]
