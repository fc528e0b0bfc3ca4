"""The CUDA kernels of the segment ops (``qcomm::encode_segments``, ``decode_segments_into``,
``decode_segments_sum``; the door and the reference: ``codecs.rows_segments``), registered by ``codecs.ops``.

Every segment of every row in two launches to encode (the scales, then the codes and raw bytes), one to decode or
to sum, from a per-layout int32 table uploaded once per (layout, device); each encode's keys go up through pinned
memory (no host sync). Where (``segments_kernel``): ``cuda.kernels_for``'s conditions, buckets of at most
``MAX_BUCKET`` elements, rows of fp32 / bf16 / fp16, int32 counters, for the norm codecs every quantized segment at
least one bucket long, and the first-use check passed (the kernels next to the reference once per (codec, dtype,
device)); else the reference. ``segments_fused`` is the question a caller laying rows out asks (QSDP's row codec).

Example::

    >>> segments_kernel(codec, rows, [4096, 64], [True, False], 2, torch.bfloat16)     # CUDA rows, Triton working
    True
"""

from __future__ import annotations

import array
import functools

import torch

from lightning_qcomm.codecs import cpu, cuda, rng, scaling, triton_probe
from lightning_qcomm.codecs.base import Codec
from lightning_qcomm.codecs.layout import KernelKind
from lightning_qcomm.codecs.rows_segments import (
    check_segments,
    decode_segments_body,
    encode_segments_body,
    flat_coded,
    sum_segments_body,
    wire_nbytes,
)

_INT32 = 1 << 31
_COUNT_FREE = (KernelKind.UNIFORM, KernelKind.FP8)  # scales that do not depend on a tensor's length past count
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def segments_kernel(codec: Codec, t: torch.Tensor, numels, quantized, r: int, dtype: torch.dtype) -> bool:
    """Whether the Triton segment kernels take this layout: ``cuda.kernels_for``'s conditions, buckets of at most
    ``MAX_BUCKET`` elements, rows of fp32 / bf16 / fp16, int32 counters, and for codecs whose scales depend on
    a tensor's length (the norm codecs) every quantized segment at least one bucket long."""
    b = codec.bucket_size
    if b is None or dtype not in (torch.float32, torch.bfloat16, torch.float16) or r * sum(numels) >= _INT32:
        return False
    if not cuda.kernels_for(codec, t.device, b, encode=True):
        return False
    if not (codec.kernel_spec().kind in _COUNT_FREE or all(n >= b for n, q in zip(numels, quantized) if q)):
        return False
    return _kernels_work(codec, t.device, dtype)


def segments_fused(codec: Codec, t: torch.Tensor, numels, quantized, r: int, dtype: torch.dtype) -> bool:
    """Whether R rows of this layout on ``t``'s device take the segment kernels: no fused C pass there (CPU keeps
    its row loop: ``cpu.c_pass_available``) and ``segments_kernel``."""
    return not cpu.c_pass_available(codec, t.device) and segments_kernel(codec, t, numels, quantized, r, dtype)


def _kernels_work(codec: Codec, device: torch.device, dtype: torch.dtype) -> bool:
    """The segment kernels on ``device`` equal the reference (bytes; values with any NaN equal to any NaN) on a
    probe of three rows of raw and quantized segments (a segment not a whole number of buckets, NaN, infinities
    and subnormals): checked once per (codec, dtype, device), else the reference, with one warning. Not on CPU
    tensors (Triton's interpreter, where the tests compare them)."""
    if device.type != "cuda":
        return True

    def check() -> None:
        b = codec.bucket_size
        numels, quantized = [24, 3 * b, 5, b + 40], [False, True, False, True]
        x = torch.randn(3, sum(numels), generator=torch.Generator().manual_seed(2)) * 3
        x[0, 30], x[2, 3 * b + 31], x[1, 9], x[1, 40] = float("nan"), float("inf"), 1e-41, -0.0
        x = x.to(dtype)
        p = wire_nbytes(codec, numels, quantized, dtype)
        want, got = torch.zeros(3, p, dtype=torch.uint8), torch.zeros(3, p, dtype=torch.uint8, device=device)
        encode_segments_body(codec, x, numels, quantized, [5, 6], want)
        _encode_kernel(codec, x.to(device), numels, quantized, [5, 6], got)
        dec, dec_d = torch.full(x.shape, 7.0), torch.full(x.shape, 7.0, device=device)
        decode_segments_body(codec, want, numels, quantized, dtype, 1, dec)
        _decode_kernel(codec, want.to(device), numels, quantized, dtype, 1, dec_d)
        tot, tot_d = torch.empty(x.shape[1]), torch.empty(x.shape[1], device=device)
        sum_segments_body(codec, want, x, 2, numels, quantized, tot)
        _decode_kernel(codec, want.to(device), numels, quantized, dtype, 2, tot_d, x.to(device))
        for what, a, c in (("decode", dec, dec_d), ("sum", tot, tot_d)):
            difference = triton_probe._difference(what, a, c.cpu())
            if difference:
                raise RuntimeError(f"the segment kernels' {what} differs from the reference: {difference}")
        if not torch.equal(got.cpu(), want):
            raise RuntimeError("the segment kernels' encode differs from the reference")

    key = ("segments", tuple(sorted(codec.config().items())), str(dtype), str(device))
    what = f"the segment kernels of {codec.config()} on {dtype} rows"
    return triton_probe.first_use(key, what, device, check, "the per-segment reference runs there")


@functools.lru_cache(maxsize=256)
def _device_table(codec: Codec, numels: tuple, quantized: tuple, raw_bytes: int, device: str):
    layout = cuda.triton_kernels().segment_kernels.segment_table(codec, numels, quantized, raw_bytes)
    return layout, _upload(list(layout[0]), torch.device(device))


def _upload(words: list[int], device: torch.device) -> torch.Tensor:
    t = torch.frombuffer(array.array("i", words), dtype=torch.int32)  # no aten op: nothing the host waits on
    if device.type == "cuda":  # from pageable memory the copy would wait for the stream: pinned, it is queued
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def _keys(codec: Codec, numels, quantized, seeds, r: int, device: torch.device) -> torch.Tensor:
    """(R, K, 3) int32 words (k1, k2, counter of the first element) of every (row, segment); raw segments 0."""
    words: list[int] = []
    per_segment = []
    it = iter(seeds)
    for n, q in zip(numels, quantized):
        per_segment.append((next(it), flat_coded(codec, n, r), n) if q else None)
    for j in range(r):
        for seg in per_segment:
            if seg is None:
                words += [0, 0, 0]
                continue
            seed, flat, n = seg
            k1, k2 = rng.seed_to_key(seed if flat else rng.derive_seed(seed, j))
            words += [rng._as_int32(k1), rng._as_int32(k2), j * n if flat else 0]
    return _upload(words, device)


def _layout(codec: Codec, numels, quantized, dtype: torch.dtype, device: torch.device):
    es = torch.empty((), dtype=dtype).element_size()
    return _device_table(codec, tuple(numels), tuple(bool(q) for q in quantized), es, str(device))


def _encode_kernel(codec: Codec, rows, numels, quantized, seeds, out) -> None:
    layout, table = _layout(codec, numels, quantized, rows.dtype, rows.device)
    keys = _keys(codec, numels, quantized, seeds, rows.shape[0], rows.device)
    with triton_probe.on_device(rows.device):
        cuda.triton_kernels().segment_kernels.encode_segments(
            codec, rows, table, keys, layout, out, scaling.output_max(rows.dtype)
        )


def _decode_kernel(codec: Codec, wire, numels, quantized, wire_dtype, own: int, out, rows=None) -> None:
    layout, table = _layout(codec, numels, quantized, wire_dtype, wire.device)
    with triton_probe.on_device(wire.device):
        cuda.triton_kernels().segment_kernels.decode_segments(codec, wire, table, layout, wire_dtype, out, own, x=rows)


# ---------------------------------------------------------------------------------------------- the ops' kernels
def encode_segments(rows, numels, quantized, seeds, c: Codec, out) -> None:
    """``qcomm::encode_segments``: two launches where ``segments_kernel`` holds."""
    check_segments(numels, quantized, rows.shape[1], "encode_segments")
    if sum(quantized) != len(seeds):
        raise ValueError(f"encode_segments: {sum(quantized)} quantized segments need as many seeds, got {len(seeds)}")
    if rows.stride(1) == 1 and segments_kernel(c, rows, numels, quantized, rows.shape[0], rows.dtype):
        _encode_kernel(c, rows, numels, quantized, seeds, out)
    else:
        encode_segments_body(c, rows, numels, quantized, seeds, out)


def decode_segments_into(wire, numels, quantized, c: Codec, wire_dtype, skip: int, out) -> None:
    """``qcomm::decode_segments_into``: one launch where ``segments_kernel`` holds."""
    check_segments(numels, quantized, out.shape[-1], "decode_segments")
    ok = out.stride(-1) == 1 and out.dtype in _FLOATS
    if ok and segments_kernel(c, wire, numels, quantized, wire.shape[0], wire_dtype):
        _decode_kernel(c, wire, numels, quantized, wire_dtype, skip, out)
    else:
        decode_segments_body(c, wire, numels, quantized, wire_dtype, skip, out)


def decode_segments_sum(wire, rows, own: int, numels, quantized, c: Codec, out) -> None:
    """``qcomm::decode_segments_sum``: one launch where ``segments_kernel`` holds."""
    check_segments(numels, quantized, rows.shape[1], "decode_segments_sum")
    ok = out.is_contiguous() and out.dtype in _FLOATS and rows.stride(1) == 1
    if ok and segments_kernel(c, wire, numels, quantized, wire.shape[0], rows.dtype):
        _decode_kernel(c, wire, numels, quantized, rows.dtype, own, out.view(-1), rows)
    else:
        sum_segments_body(c, wire, rows, own, numels, quantized, out)


__all__ = ["decode_segments_into", "decode_segments_sum", "encode_segments", "segments_fused", "segments_kernel"]
