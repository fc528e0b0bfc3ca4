"""Segmented rows: R rows of one layout, each row a concatenation of segments, each quantized as a tensor of its
own or carried raw (docs/design.md, "QSDP"), as torch ops of the codec layer::

    encode_segments(Tensor rows, int[] numels, bool[] quantized, int[] seeds, <codec>, Tensor(a!) out) -> ()
    decode_segments_into(Tensor wire, int[] numels, bool[] quantized, <codec>, ScalarType wire_dtype,
                         int skip_row, Tensor(a!) out) -> ()
    decode_segments_sum(Tensor wire, Tensor rows, int own, int[] numels, bool[] quantized, <codec>,
                        Tensor(a!) out) -> ()

The wire row is ``[seg_0 | seg_1 | ...]``: a quantized segment of n elements is ``codec.encode(x, seed).to_bytes()``,
a raw one its bytes in the rows' dtype. A quantized segment's R rows are one flat tensor with one seed when R = 1 or
n is a whole number of buckets and of 8 (``flat_coded``), else row r with ``derive_seed(seed, r)``. The sum adds
rows 0, 1, ... in fp32 (one rounding each), row ``own`` exact from ``rows``, rounded once into ``out``. Kernels:
any device but CUDA a codec door per segment; CUDA the Triton segment kernels (``segments_kernel``: two launches
to encode, one to decode or sum), keys through pinned memory, no host sync. Details: docs/design.md, "Module notes".

Example::

    >>> wire = torch.empty(2, wire_nbytes(codec, [4096, 64], [True, False], torch.float32), dtype=torch.uint8)
    >>> encode_segments(codec, rows, [4096, 64], [True, False], [7], wire)       # rows (2, 4160) fp32
    >>> decode_segments_into(codec, wire, [4096, 64], [True, False], torch.float32, torch.empty(2, 4160))
"""

from __future__ import annotations

import array
import functools
from collections.abc import Sequence

import torch

from lightning_qcomm.codecs import registry, rng
from lightning_qcomm.codecs.base import Codec
from lightning_qcomm.codecs.kernel_spec import KernelKind
from lightning_qcomm.codecs.rows import c_pass_available, decode_rows_into, encode_flat, encode_rows

_INT32 = 1 << 31
_COUNT_FREE = (KernelKind.UNIFORM, KernelKind.FP8)  # scales that do not depend on a tensor's length past count


def flat_coded(codec: Codec, n: int, rows: int) -> bool:
    """Whether a quantized segment of n elements is coded as one flat tensor of its ``rows`` rows."""
    b = codec.bucket_size
    return rows == 1 or (b is not None and n % b == 0 and n % 8 == 0)


def wire_nbytes(codec: Codec, numels: Sequence[int], quantized: Sequence[bool], dtype: torch.dtype) -> int:
    """Bytes of one wire row: ``codec.nbytes(n)`` per quantized segment, n times the element size per raw one."""
    es = torch.empty((), dtype=dtype).element_size()
    return sum(codec.nbytes(n) if q else n * es for n, q in zip(numels, quantized))


def _check(codec: Codec, numels, quantized, s: int, what: str) -> None:
    if len(numels) != len(quantized) or any(n < 1 for n in numels) or sum(numels) != s:
        raise ValueError(
            f"{what}: numels {list(numels)} (each >= 1) must sum to the row's {s} elements, one quantized flag each "
            f"(got {len(quantized)})"
        )


# ---------------------------------------------------------------------------------------------- reference
def _encode_reference(codec: Codec, rows, numels, quantized, seeds, out) -> None:
    r = rows.shape[0]
    off = boff = 0
    it = iter(seeds)
    for n, q in zip(numels, quantized):
        x = rows[:, off : off + n]
        if not q:
            raw = x.contiguous().view(torch.uint8)
            out[:, boff : boff + raw.shape[1]].copy_(raw)
            boff += raw.shape[1]
        elif flat_coded(codec, n, r):
            codes, scales = encode_flat(codec, x, next(it))
            out[:, boff : boff + codes.shape[1]].copy_(codes)
            out[:, boff + codes.shape[1] : boff + codec.nbytes(n)].copy_(scales)
            boff += codec.nbytes(n)
        else:
            seed = next(it)
            out[:, boff : boff + codec.nbytes(n)].copy_(
                encode_rows(codec, x, [rng.derive_seed(seed, j) for j in range(r)])
            )
            boff += codec.nbytes(n)
        off += n


def as_dtype(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows of raw bytes read as ``dtype``: a view where every row starts on a multiple of its element size, else
    a contiguous copy first (the byte offset may not be aligned for ``dtype``)."""
    es = torch.empty((), dtype=dtype).element_size()
    if raw.storage_offset() % es == 0 and all(st % es == 0 for st in raw.stride()[:-1]):
        return raw.view(dtype)
    return raw.clone(memory_format=torch.contiguous_format).view(dtype)


def _decode_reference(codec: Codec, wire, numels, quantized, wire_dtype, skip_row: int, out) -> None:
    r = wire.shape[0]
    es = torch.empty((), dtype=wire_dtype).element_size()
    spans = [(0, r)] if skip_row < 0 else [(0, skip_row), (skip_row + 1, r)]
    off = boff = 0
    for n, q in zip(numels, quantized):
        nb = codec.nbytes(n) if q else n * es
        for a, b in spans:
            if a == b:
                continue
            src, dst = wire[a:b, boff : boff + nb], out[a:b, off : off + n]
            if q:
                decode_rows_into(codec, src, n, dst)
            else:
                dst.copy_(as_dtype(src, wire_dtype))
        off, boff = off + n, boff + nb


def _sum_reference(codec: Codec, wire, rows, own: int, numels, quantized, out) -> None:
    r, s = wire.shape[0], rows.shape[1]
    total = out if out.dtype == torch.float32 else torch.empty(s, dtype=torch.float32, device=out.device)
    row = torch.empty(1, s, dtype=torch.float32, device=out.device)
    for j in range(r):  # rank order, the same order on every rank
        dst = total.view(1, s) if j == 0 else row
        if j == own:
            dst.copy_(rows[own : own + 1])  # the own row never left this rank: exact
        else:
            _decode_reference(codec, wire[j : j + 1], numels, quantized, rows.dtype, -1, dst)
        if j > 0:
            total.add_(row.view(-1))
    if total is not out:
        out.copy_(total)


# ---------------------------------------------------------------------------------------------- CUDA
def segments_kernel(codec: Codec, t: torch.Tensor, numels, quantized, r: int, dtype: torch.dtype) -> bool:
    """Whether the Triton segment kernels take this layout: ``ops.rows_kernel``'s conditions, buckets of at most
    ``MAX_BUCKET`` elements, rows of fp32 / bf16 / fp16, int32 counters, and for codecs whose scales depend on
    a tensor's length (the norm codecs) every quantized segment at least one bucket long."""
    from lightning_qcomm.codecs import ops

    b = codec.bucket_size
    if b is None or dtype not in (torch.float32, torch.bfloat16, torch.float16) or r * sum(numels) >= _INT32:
        return False
    if not ops.kernels_for(codec, t.device, b, encode=True):
        return False
    if not (codec.kernel_spec().kind in _COUNT_FREE or all(n >= b for n, q in zip(numels, quantized) if q)):
        return False
    return _kernels_work(codec, t.device, dtype)


def segments_fused(codec: Codec, t: torch.Tensor, numels, quantized, r: int, dtype: torch.dtype) -> bool:
    """Whether R rows of this layout on ``t``'s device take the segment kernels: no fused C pass there (CPU keeps
    its row loop: ``rows.c_pass_available``) and ``segments_kernel``."""
    return not c_pass_available(codec, t.device) and segments_kernel(codec, t, numels, quantized, r, dtype)


def _kernels_work(codec: Codec, device: torch.device, dtype: torch.dtype) -> bool:
    """The segment kernels on ``device`` equal the reference (bytes; values with any NaN equal to any NaN) on a
    probe of three rows of raw and quantized segments (a segment not a whole number of buckets, NaN, infinities
    and subnormals): checked once per (codec, dtype, device), else the reference, with one warning. Not on CPU
    tensors (Triton's interpreter, where the tests compare them)."""
    from lightning_qcomm.codecs import triton_probe

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
        _encode_reference(codec, x, numels, quantized, [5, 6], want)
        _encode_kernel(codec, x.to(device), numels, quantized, [5, 6], got)
        dec, dec_d = torch.full(x.shape, 7.0), torch.full(x.shape, 7.0, device=device)
        _decode_reference(codec, want, numels, quantized, dtype, 1, dec)
        _decode_kernel(codec, want.to(device), numels, quantized, dtype, 1, dec_d)
        tot, tot_d = torch.empty(x.shape[1]), torch.empty(x.shape[1], device=device)
        _sum_reference(codec, want, x, 2, numels, quantized, tot)
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
    from lightning_qcomm.kernels.cuda import segment_kernels

    layout = segment_kernels.segment_table(codec, numels, quantized, raw_bytes)
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


def _on(device: torch.device):
    from lightning_qcomm.codecs import triton_probe

    return triton_probe.on_device(device)


_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _layout(codec: Codec, numels, quantized, dtype: torch.dtype, device: torch.device):
    es = torch.empty((), dtype=dtype).element_size()
    return _device_table(codec, tuple(numels), tuple(bool(q) for q in quantized), es, str(device))


def _encode_kernel(codec: Codec, rows, numels, quantized, seeds, out) -> None:
    from lightning_qcomm.codecs import scaling
    from lightning_qcomm.kernels.cuda import segment_kernels

    layout, table = _layout(codec, numels, quantized, rows.dtype, rows.device)
    keys = _keys(codec, numels, quantized, seeds, rows.shape[0], rows.device)
    with _on(rows.device):
        segment_kernels.encode_segments(codec, rows, table, keys, layout, out, scaling.output_max(rows.dtype))


def _decode_kernel(codec: Codec, wire, numels, quantized, wire_dtype, own: int, out, rows=None) -> None:
    from lightning_qcomm.kernels.cuda import segment_kernels

    layout, table = _layout(codec, numels, quantized, wire_dtype, wire.device)
    with _on(wire.device):
        segment_kernels.decode_segments(codec, wire, table, layout, wire_dtype, out, own, x=rows)


def encode_body(codec: Codec, rows, numels, quantized, seeds, out, triton: bool) -> None:
    _check(codec, numels, quantized, rows.shape[1], "encode_segments")
    if sum(quantized) != len(seeds):
        raise ValueError(f"encode_segments: {sum(quantized)} quantized segments need as many seeds, got {len(seeds)}")
    r = rows.shape[0]
    if triton and rows.stride(1) == 1 and segments_kernel(codec, rows, numels, quantized, r, rows.dtype):
        _encode_kernel(codec, rows, numels, quantized, seeds, out)
    else:
        _encode_reference(codec, rows, numels, quantized, seeds, out)


def decode_body(codec: Codec, wire, numels, quantized, wire_dtype, skip_row: int, out, triton: bool) -> None:
    _check(codec, numels, quantized, out.shape[-1], "decode_segments")
    ok = triton and out.stride(-1) == 1 and out.dtype in _FLOATS
    if ok and segments_kernel(codec, wire, numels, quantized, wire.shape[0], wire_dtype):
        _decode_kernel(codec, wire, numels, quantized, wire_dtype, skip_row, out)
    else:
        _decode_reference(codec, wire, numels, quantized, wire_dtype, skip_row, out)


def sum_body(codec: Codec, wire, rows, own: int, numels, quantized, out, triton: bool) -> None:
    _check(codec, numels, quantized, rows.shape[1], "decode_segments_sum")
    ok = triton and out.is_contiguous() and out.dtype in _FLOATS and rows.stride(1) == 1
    if ok and segments_kernel(codec, wire, numels, quantized, wire.shape[0], rows.dtype):
        _decode_kernel(codec, wire, numels, quantized, rows.dtype, own, out.view(-1), rows)
    else:
        _sum_reference(codec, wire, rows, own, numels, quantized, out.view(-1))


# ---------------------------------------------------------------------------------------------- the ops' kernels
def _codec(args) -> Codec:
    return registry.codec_for_op(*args)


def encode_segments_reference(rows, numels, quantized, seeds, codec, bits, bucket_size, stochastic, out) -> None:
    """``qcomm::encode_segments`` on any device but CUDA: a codec door per segment."""
    encode_body(_codec((codec, bits, bucket_size, stochastic)), rows, numels, quantized, seeds, out, False)


def encode_segments_cuda(rows, numels, quantized, seeds, codec, bits, bucket_size, stochastic, out) -> None:
    """``qcomm::encode_segments`` on CUDA: two Triton launches where ``segments_kernel`` holds."""
    encode_body(_codec((codec, bits, bucket_size, stochastic)), rows, numels, quantized, seeds, out, True)


def decode_segments_reference(wire, numels, quantized, codec, bits, bucket_size, stochastic, wire_dtype, skip, out):
    """``qcomm::decode_segments_into`` on any device but CUDA."""
    decode_body(_codec((codec, bits, bucket_size, stochastic)), wire, numels, quantized, wire_dtype, skip, out, False)


def decode_segments_cuda(wire, numels, quantized, codec, bits, bucket_size, stochastic, wire_dtype, skip, out):
    """``qcomm::decode_segments_into`` on CUDA: one Triton launch where ``segments_kernel`` holds."""
    decode_body(_codec((codec, bits, bucket_size, stochastic)), wire, numels, quantized, wire_dtype, skip, out, True)


def sum_segments_reference(wire, rows, own, numels, quantized, codec, bits, bucket_size, stochastic, out) -> None:
    """``qcomm::decode_segments_sum`` on any device but CUDA."""
    sum_body(_codec((codec, bits, bucket_size, stochastic)), wire, rows, own, numels, quantized, out, False)


def sum_segments_cuda(wire, rows, own, numels, quantized, codec, bits, bucket_size, stochastic, out) -> None:
    """``qcomm::decode_segments_sum`` on CUDA: one Triton launch where ``segments_kernel`` holds."""
    sum_body(_codec((codec, bits, bucket_size, stochastic)), wire, rows, own, numels, quantized, out, True)


def _fake(*args) -> None:
    return None


# ---------------------------------------------------------------------------------------------- the door
def encode_segments(
    codec: Codec, rows: torch.Tensor, numels: Sequence[int], quantized: Sequence[bool], seeds: Sequence[int], out
) -> torch.Tensor:
    """Every row's segments into the (R, ``wire_nbytes``) uint8 ``out`` (module docstring), returned.

    Example::

        >>> encode_segments(codec, rows, [4096, 64], [True, False], [7], wire) is wire
        True
    """
    rows = rows.detach() if rows.requires_grad else rows
    signed = [rng.signed_seed(s) for s in seeds]
    if registry.is_registered(codec):
        torch.ops.qcomm.encode_segments(rows, list(numels), list(quantized), signed, *codec.op_args(), out)
    else:
        encode_body(codec, rows, list(numels), list(quantized), [int(s) for s in seeds], out, False)
    return out


def decode_segments_into(
    codec: Codec,
    wire: torch.Tensor,
    numels: Sequence[int],
    quantized: Sequence[bool],
    wire_dtype: torch.dtype,
    out: torch.Tensor,
    skip_row: int | None = None,
) -> torch.Tensor:
    """The (R, P) ``wire`` rows decoded into the (R, S) ``out`` (any float dtype), row ``skip_row`` left as it is;
    raw segments read in ``wire_dtype``. Returns ``out``.

    Example::

        >>> decode_segments_into(codec, wire, [4096, 64], [True, False], torch.float32, torch.empty(2, 4160)).shape
        torch.Size([2, 4160])
    """
    skip = -1 if skip_row is None else int(skip_row)
    if registry.is_registered(codec):
        torch.ops.qcomm.decode_segments_into(
            wire, list(numels), list(quantized), *codec.op_args(), wire_dtype, skip, out
        )
    else:
        decode_body(codec, wire, list(numels), list(quantized), wire_dtype, skip, out, False)
    return out


def decode_segments_sum(
    codec: Codec,
    wire: torch.Tensor,
    rows: torch.Tensor,
    own: int,
    numels: Sequence[int],
    quantized: Sequence[bool],
    out: torch.Tensor,
) -> torch.Tensor:
    """Sum in rank order of the (R, P) ``wire`` rows decoded, row ``own`` exact from ``rows[own]`` (rows: (R, S) in
    the wire's raw dtype), into the S-element ``out`` (any float dtype; fp32 sum rounded once). Returns ``out``.

    Example::

        >>> decode_segments_sum(codec, recv, rows, rank, [4096, 64], [True, False], torch.empty(4160)).shape
        torch.Size([4160])
    """
    if registry.is_registered(codec):
        torch.ops.qcomm.decode_segments_sum(wire, rows, int(own), list(numels), list(quantized), *codec.op_args(), out)
    else:
        sum_body(codec, wire, rows, int(own), list(numels), list(quantized), out, False)
    return out


__all__ = ["decode_segments_into", "decode_segments_sum", "encode_segments", "flat_coded", "wire_nbytes"]
