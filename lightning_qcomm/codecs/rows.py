"""R payloads of one codec in a fixed number of torch ops: the rows form of the codec layer, the door the chunked
collectives code their rows through (docs/design.md, "Registry, ops and kernels").

Row j of an (R, n) matrix is its own tensor for the codec (buckets restart at the row start, the random counter at
0) with its own seed::

    encode_rows(codec, rows, seeds)[j] == codec.encode(rows[j], seeds[j]).to_bytes()      (bit for bit)
    decode_rows(codec, wire, n)[j]     == codec.decode(codec.from_bytes(wire[j], (n,), fp32))

in a number of torch ops that does not depend on R, as the ops ``qcomm::encode_rows`` / ``decode_rows`` /
``decode_rows_into`` (``codecs.ops``). ``seeds``: one ``rng.signed_seed`` per row; on CUDA their keys travel
through pinned memory, queued (no host sync). Decode goes through the codec's public ``decode`` once over the rows
laid out bucket-aligned (on CUDA the Triton rows kernel, one launch); encode is ``codecs.rows_encode``. Rows of
whole, byte-aligned buckets can also travel as one flat tensor with one seed (``encode_flat``). A caller that
writes rows one at a time into its own buffer asks ``row_at_a_time`` and calls ``encode_row``: the fused C pass
is chosen here, not by the caller. Details: docs/design.md, "Module notes".

Example::

    wire = encode_rows(codec, chunks, [derive_seed(s, 1, rank, j) for j in range(world)])   # (N, P) uint8
    values = decode_rows(codec, wire, chunks.shape[1])                                       # (N, n) fp32
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightning_qcomm.codecs import cpu_fused, packing, registry, rng
from lightning_qcomm.codecs.base import Codec, Packed
from lightning_qcomm.codecs.rows_encode import (
    _INT32_COUNTERS,
    _check_rows,
    _layout,
    c_pass_available,
    encode_flat_row_into,
    encode_row,
    encode_row_into,
    encode_rows_body,
    row_at_a_time,
    row_bucketed,
    rows_one_by_one,
)


# ---------------------------------------------------------------------------------------------- decode
def _fused_rows(codec: Codec, wire: torch.Tensor, n: int) -> bool:
    """Rows of n elements go to the fused C path one call each: on CPU there are no launches to save, and
    a row decodes straight into its place, where one call over all rows first repacks them."""
    return wire.device.type == "cpu" and cpu_fused.use_fused(codec, wire, n)


def _check_wire(codec: Codec, wire: torch.Tensor, n: int) -> int:
    """``codec.nbytes(n)``; ValueError unless ``wire`` holds a whole number of payloads of n elements."""
    p = codec.nbytes(n)
    if wire.numel() % p:
        raise ValueError(f"wire has {wire.numel()} bytes, not a multiple of codec.nbytes({n}) = {p}")
    return p


def decode_rows_body(codec: Codec, wire: torch.Tensor, n: int, triton: bool) -> torch.Tensor:
    """(R, n) fp32 values (contiguous) of R payloads of n elements each (``wire``: (R, codec.nbytes(n)) or flat
    uint8), in one ``Codec.decode`` call (see the module docstring); ``triton``: the rows kernel may take them."""
    p = _check_wire(codec, wire, n)
    wire = wire.reshape(-1, p)
    r = wire.shape[0]
    if r == 1:
        return codec.decode(codec.from_bytes(wire[0], (n,), torch.float32)).view(1, n)
    if triton and n < _INT32_COUNTERS:
        from lightning_qcomm.codecs import ops

        if ops.rows_kernel(codec, wire, encode=False):  # CUDA: all rows in one launch
            return ops.decode_rows_kernel(codec, wire, n)
    flat = row_bucketed(codec, n)
    b, nb, padded = _layout(codec, n)
    if _fused_rows(codec, wire, n) and not (padded == n and n % 8 == 0):
        out = torch.empty(r, n, dtype=torch.float32, device=wire.device)
        for j in range(r):  # the rows need repacking to be one call: on CPU one compiled decode each is cheaper
            _c_decode_row_into(codec, wire[j], n, out[j])
        return out
    ncode = packing.packed_nbytes(n, codec.bits)
    codes = wire[:, :ncode]
    scales = (
        wire[:, ncode:]
        .clone(memory_format=torch.contiguous_format)
        .view(torch.float32)
        .reshape(r * nb, codec.scales_per_bucket)
    )
    if padded == n and n % 8 == 0:  # whole buckets, byte-aligned rows: the codes are already the flat layout
        packed = Packed(codes.reshape(-1), scales, torch.Size((r * n,)), torch.float32)
        return flat.decode(packed).view(r, n)
    # repack: each row's codes padded to nb whole buckets (zero codes, cut away after the decode)
    per_row = -(-n // 8) * 8
    unpacked = packing.unpack_bits(codes.reshape(-1), codec.bits, r * per_row).view(r, per_row)
    grid = torch.zeros(r, padded, dtype=torch.uint8, device=wire.device)
    grid[:, :n] = unpacked[:, :n]
    packed = Packed(packing.pack_bits(grid.view(-1), codec.bits), scales, torch.Size((r * padded,)), torch.float32)
    return flat.decode(packed).view(r, padded)[:, :n].contiguous()


def _c_decode_row_into(codec: Codec, payload: torch.Tensor, n: int, out: torch.Tensor) -> None:
    """``codec.decode_into(codec.from_bytes(payload, (n,), fp32), out)`` on the fused C path (``_fused_rows``),
    called directly: a contiguous fp32 ``out`` is written by the C decode from the wire scales, no op dispatch."""
    ncode = packing.packed_nbytes(n, codec.bits)
    if out.dtype != torch.float32 or not out.is_contiguous():
        codec.decode_into(codec.from_bytes(payload, (n,), torch.float32), out)
        return
    # clone: scales at a byte offset that is not a multiple of 4 cannot be viewed as fp32
    scales = payload[ncode:].clone().view(torch.float32).view(-1, codec.scales_per_bucket)
    cpu_fused.decode_wire(codec, payload[:ncode], scales, n, out=out.view(-1))


def decode_rows_into_body(codec: Codec, wire: torch.Tensor, n: int, out: torch.Tensor, triton: bool = False):
    """``out.copy_(decode_rows(codec, wire, n))`` for an (R, n) ``out`` of any float dtype and strides, or the first
    m values of the rows (row-major) into a flat ``out`` of m elements, (R - 1) n < m < R n; rows of whole
    byte-aligned buckets decode straight into a contiguous fp32 ``out`` (no temporary), and so do all rows on
    CUDA (``triton``: the rows kernel, one launch)."""
    p = _check_wire(codec, wire, n)
    wire = wire.reshape(-1, p)
    r = wire.shape[0]
    m = out.numel()
    partial = out.dim() == 1 and (r - 1) * n < m < r * n
    if not partial and m != r * n:
        raise ValueError(f"out must have R * n = {r} * {n} elements, or more than (R - 1) * n flat, got {m}")
    if triton and n < _INT32_COUNTERS and out.dtype == torch.float32 and out.is_contiguous():
        from lightning_qcomm.codecs import ops

        if ops.rows_kernel(codec, wire, encode=False):  # CUDA: all rows in one launch, straight into out
            ops.decode_rows_kernel(codec, wire, n, out=out.view(-1))
            return out
    if partial:
        return out.copy_(decode_rows_body(codec, wire, n, triton).view(-1)[:m])
    if r == 1:  # the codec's own decode_into (straight into a contiguous fp32 row)
        codec.decode_into(codec.from_bytes(wire[0], (n,), torch.float32), out.view(n) if out.is_contiguous() else out)
        return out
    _, nb, padded = _layout(codec, n)
    direct = out.dtype == torch.float32 and out.is_contiguous() and r > 1 and padded == n and n % 8 == 0
    rows = out.view(r, n) if out.is_contiguous() else out if tuple(out.shape) == (r, n) else None
    if not direct and rows is not None and _fused_rows(codec, wire, n):  # one compiled decode per row, in place
        for j in range(r):
            _c_decode_row_into(codec, wire[j], n, rows[j])
        return out
    if not direct:
        return out.copy_(decode_rows(codec, wire, n).view(out.shape))
    ncode = packing.packed_nbytes(n, codec.bits)
    scales = (
        wire[:, ncode:]
        .clone(memory_format=torch.contiguous_format)
        .view(torch.float32)
        .reshape(r * nb, codec.scales_per_bucket)
    )
    packed = Packed(wire[:, :ncode].reshape(-1), scales, torch.Size((r * n,)), torch.float32)
    row_bucketed(codec, n).decode_into(packed, out.view(-1))
    return out


# ---------------------------------------------------------------------------------------------- the ops' kernels
def decode_rows_reference(wire, n: int, codec: str, bits: int, bucket_size: int | None, stochastic: bool):
    """``qcomm::decode_rows`` on any device but CUDA: one flat codec decode (the C pass per row on large CPU rows)."""
    return decode_rows_body(registry.codec_for_op(codec, bits, bucket_size, stochastic), wire, n, triton=False)


def decode_rows_cuda(wire, n: int, codec: str, bits: int, bucket_size: int | None, stochastic: bool):
    """``qcomm::decode_rows`` on CUDA: the Triton rows kernel (one launch) where it takes the rows."""
    return decode_rows_body(registry.codec_for_op(codec, bits, bucket_size, stochastic), wire, n, triton=True)


def decode_rows_into_kernel(wire, n: int, codec: str, bits: int, bucket_size, stochastic: bool, out) -> None:
    """``qcomm::decode_rows_into`` on every device but CUDA (its decodes dispatch by device)."""
    decode_rows_into_body(registry.codec_for_op(codec, bits, bucket_size, stochastic), wire, n, out)


def decode_rows_into_cuda(wire, n: int, codec: str, bits: int, bucket_size, stochastic: bool, out) -> None:
    """``qcomm::decode_rows_into`` on CUDA: the Triton rows kernel straight into a contiguous fp32 ``out``."""
    decode_rows_into_body(registry.codec_for_op(codec, bits, bucket_size, stochastic), wire, n, out, triton=True)


def decode_rows_fake(wire, n: int, codec: str, bits: int, bucket_size: int | None, stochastic: bool):
    """The shape of ``qcomm::decode_rows``: (R, n) fp32, R = the payloads in ``wire``."""
    p = _check_wire(registry.codec_for_op(codec, bits, bucket_size, stochastic), wire, n)
    return wire.new_empty((wire.numel() // p, n), dtype=torch.float32)


def decode_rows_into_fake(wire, n: int, codec: str, bits: int, bucket_size, stochastic: bool, out) -> None:
    return None


# ---------------------------------------------------------------------------------------------- the door
def encode_rows(codec: Codec, rows: torch.Tensor, seeds: Sequence[int]) -> torch.Tensor:
    """(R, codec.nbytes(n)) uint8 payloads, row j = ``codec.encode(rows[j], seeds[j]).to_bytes()`` bit for bit.

    ``rows``: (R, n), any float dtype (its dtype sets the codec's output limit, as for ``Codec.encode``);
    ``seeds``: one int per row. ValueError for an empty or non-2-D ``rows`` or a seed count other than R.

    Example::

        >>> wire = encode_rows(get_codec("uniform", 8), torch.randn(4, 1000), [1, 2, 3, 4])   # (4, 1008) uint8
    """
    _check_rows(rows)
    r = rows.shape[0]
    seeds = [int(s) for s in seeds]
    if len(seeds) != r:
        raise ValueError(f"seeds must hold one seed per row ({r}), got {len(seeds)}")
    rows = rows.detach() if rows.requires_grad else rows  # the op has no autograd formula
    if registry.is_registered(codec):  # the op: the dispatcher picks Triton / C / the torch hooks
        return torch.ops.qcomm.encode_rows(rows, [rng.signed_seed(s) for s in seeds], *codec.op_args())
    return encode_rows_body(codec, rows, seeds, triton=False)


def decode_rows(codec: Codec, wire: torch.Tensor, n: int) -> torch.Tensor:
    """(R, n) fp32 values (contiguous) of R payloads of n elements each (``wire``: (R, codec.nbytes(n)) or flat
    uint8): row j = ``codec.decode(codec.from_bytes(wire[j], (n,), fp32))``, bit for bit. ValueError unless
    ``wire`` holds a whole number of payloads.

    Example::

        >>> decode_rows(codec, encode_rows(codec, rows, seeds), rows.shape[1]).shape == rows.shape
        True
    """
    if registry.is_registered(codec):
        return torch.ops.qcomm.decode_rows(wire, n, *codec.op_args())
    return decode_rows_body(codec, wire, n, triton=False)


def decode_rows_into(codec: Codec, wire: torch.Tensor, n: int, out: torch.Tensor) -> torch.Tensor:
    """``out.copy_(decode_rows(codec, wire, n))`` for an (R, n) ``out`` of any float dtype and strides, returning
    ``out``; a flat ``out`` of m elements, (R - 1) n < m < R n, takes the first m values of the rows (the padding
    of a chunked tensor's last row dropped). Rows of whole byte-aligned buckets decode straight into a contiguous
    fp32 ``out`` (no temporary), and so do all rows of a codec with kernels on CUDA (one launch).

    Example::

        >>> out = torch.empty(4, 1000)
        >>> decode_rows_into(codec, wire, 1000, out) is out
        True
    """
    if registry.is_registered(codec):
        torch.ops.qcomm.decode_rows_into(wire, n, *codec.op_args(), out)
        return out
    return decode_rows_into_body(codec, wire, n, out)


def encode_flat(codec: Codec, rows: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``codec.encode(rows.reshape(-1), seed)`` cut into its R rows, for rows of whole byte-aligned buckets (n a
    multiple of the bucket size and of 8), in one codec call (on a contiguous copy of ``rows``): (R, ncode) uint8
    codes and the (R, 4 * scales) bytes of the rows' scales; row j's payload is the two concatenated.

    Example::

        >>> codes, scales = encode_flat(get_codec("uniform", 8, 128), torch.randn(4, 256), seed=3)   # (4, 256), (4, 16)
    """
    _check_rows(rows)
    r, n = rows.shape
    b = codec.bucket_size
    if r > 1 and (b is None or n % b or n % 8):
        raise ValueError(f"rows of {n} elements are not whole byte-aligned buckets of {b}")
    p = codec.encode(rows.reshape(-1), seed=seed)
    return p.codes.view(r, -1), p.scales.reshape(r, -1).view(torch.uint8)


__all__ = [
    "c_pass_available",
    "decode_rows",
    "decode_rows_into",
    "encode_flat",
    "encode_flat_row_into",
    "encode_row",
    "encode_row_into",
    "encode_rows",
    "row_at_a_time",
    "row_bucketed",
    "rows_one_by_one",
]
