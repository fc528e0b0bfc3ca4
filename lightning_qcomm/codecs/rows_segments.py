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
rows 0, 1, ... in fp32 (one rounding each), row ``own`` exact from ``rows``, rounded once into ``out``. Here the
door and the reference (a codec door per segment); the CUDA kernels (two launches to encode, one to decode or sum)
are ``codecs.cuda_segments``'. Details: docs/design.md, "Module notes".

Example::

    >>> wire = torch.empty(2, wire_nbytes(codec, [4096, 64], [True, False], torch.float32), dtype=torch.uint8)
    >>> encode_segments(codec, rows, [4096, 64], [True, False], [7], wire)       # rows (2, 4160) fp32
    >>> decode_segments_into(codec, wire, [4096, 64], [True, False], torch.float32, torch.empty(2, 4160))
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightning_qcomm.codecs import registry, rng
from lightning_qcomm.codecs.base import Codec
from lightning_qcomm.codecs.rows import decode_rows_into, encode_flat, encode_rows


def flat_coded(codec: Codec, n: int, rows: int) -> bool:
    """Whether a quantized segment of n elements is coded as one flat tensor of its ``rows`` rows."""
    b = codec.bucket_size
    return rows == 1 or (b is not None and n % b == 0 and n % 8 == 0)


def wire_nbytes(codec: Codec, numels: Sequence[int], quantized: Sequence[bool], dtype: torch.dtype) -> int:
    """Bytes of one wire row: ``codec.nbytes(n)`` per quantized segment, n times the element size per raw one."""
    es = torch.empty((), dtype=dtype).element_size()
    return sum(codec.nbytes(n) if q else n * es for n, q in zip(numels, quantized))


def check_segments(numels, quantized, s: int, what: str) -> None:
    """ValueError unless ``numels`` (each >= 1) sum to the row's s elements with one quantized flag each."""
    if len(numels) != len(quantized) or any(n < 1 for n in numels) or sum(numels) != s:
        raise ValueError(
            f"{what}: numels {list(numels)} (each >= 1) must sum to the row's {s} elements, one quantized flag each "
            f"(got {len(quantized)})"
        )


# ---------------------------------------------------------------------------------------------- reference
def encode_segments_body(codec: Codec, rows, numels, quantized, seeds, out) -> None:
    """``qcomm::encode_segments`` by a codec door per segment (module docstring)."""
    check_segments(numels, quantized, rows.shape[1], "encode_segments")
    if sum(quantized) != len(seeds):
        raise ValueError(f"encode_segments: {sum(quantized)} quantized segments need as many seeds, got {len(seeds)}")
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


def decode_segments_body(codec: Codec, wire, numels, quantized, wire_dtype, skip_row: int, out) -> None:
    """``qcomm::decode_segments_into`` by a codec door per segment (module docstring)."""
    check_segments(numels, quantized, out.shape[-1], "decode_segments")
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


def sum_segments_body(codec: Codec, wire, rows, own: int, numels, quantized, out) -> None:
    """``qcomm::decode_segments_sum`` in rank order, the own row exact (module docstring)."""
    check_segments(numels, quantized, rows.shape[1], "decode_segments_sum")
    out = out.view(-1)
    r, s = wire.shape[0], rows.shape[1]
    total = out if out.dtype == torch.float32 else torch.empty(s, dtype=torch.float32, device=out.device)
    row = torch.empty(1, s, dtype=torch.float32, device=out.device)
    for j in range(r):  # rank order, the same order on every rank
        dst = total.view(1, s) if j == 0 else row
        if j == own:
            dst.copy_(rows[own : own + 1])  # the own row never left this rank: exact
        else:
            decode_segments_body(codec, wire[j : j + 1], numels, quantized, rows.dtype, -1, dst)
        if j > 0:
            total.add_(row.view(-1))
    if total is not out:
        out.copy_(total)


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
        encode_segments_body(codec, rows, list(numels), list(quantized), [int(s) for s in seeds], out)
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
        decode_segments_body(codec, wire, list(numels), list(quantized), wire_dtype, skip, out)
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
        sum_segments_body(codec, wire, rows, int(own), list(numels), list(quantized), out)
    return out


__all__ = ["decode_segments_into", "decode_segments_sum", "encode_segments", "flat_coded", "wire_nbytes"]
