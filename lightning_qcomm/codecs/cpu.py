"""The CPU backend of the codec ops: each ``qcomm`` op's kernel on CPU tensors (registered by ``codecs.ops``), the
fused C passes (``codecs.cpu_fused``, built by ``codecs.native``) where they apply, else the torch reference
(docs/design.md, "Registry, ops and kernels").

* ``encode`` / ``decode`` / ``decode_into``: the C passes on tensors of at least ``cpu_fused.FUSED_MIN_NUMEL``
  elements of a codec with native kernels.
* the rows ops: rows of the fused path's size one C pass per row (``rows_one_by_one``), each row's payload written
  where it goes (``encode_row_into``); the others the reference (``codecs.rows``) in a fixed number of ops.
* ``tree_norm``: the C kernel of the norm codecs' fixed-order L2 norm for fp32 rows.
* ``hadamard_``: the C butterfly for fp32 contiguous tensors when the C kernels are loaded.
* ``row_at_a_time`` / ``encode_row``: the same C pass for a caller that lays rows out in its own buffer (QSDP's
  row codec, through the ``codecs`` door).

Invariant: every kernel gives the reference's bits (tests/codecs/test_cpu_fused.py, tests/codecs/test_rows.py).

Example::

    >>> codec = get_codec("qsgd", 4, 128)
    >>> rows = torch.randn(2, 1 << 15)
    >>> rows_one_by_one(codec, rows)                       # CPU, rows large enough for the C pass
    True
    >>> torch.equal(encode_rows(rows, [7, 8], codec)[1], codec.encode(rows[1], seed=8).to_bytes())
    True
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from lightning_qcomm.codecs import cpu_fused, eden, layout, native, qsgd, scaling
from lightning_qcomm.codecs.base import Codec
from lightning_qcomm.codecs.rows import (
    check_wire,
    decode_rows_body,
    decode_rows_into_body,
    encode_rows_body,
    row_bucketed,
)
from lightning_qcomm.codecs.uniform import UniformCodec


# ---------------------------------------------------------------------------------------------- encode, decode
def encode(x: torch.Tensor, c: Codec, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``qcomm::encode``: (codes, wire scales) of ``x``."""
    xf = x.reshape(-1).to(torch.float32)
    out_max = scaling.output_max(x.dtype)
    if cpu_fused.use_fused(c, xf, xf.numel()):  # same codes and scales, in compiled passes
        return cpu_fused.encode_packed(c, xf, seed, out_max)
    return c.encode_torch(xf, seed, out_max)


def decode(codes: torch.Tensor, scales: torch.Tensor, numel: int, c: Codec) -> torch.Tensor:
    """``qcomm::decode``: flat fp32 values."""
    if cpu_fused.use_fused(c, codes, numel):
        return cpu_fused.decode_wire(c, codes, scales, numel)
    return c.decode_reference(codes, c._decode_params(scales), numel)


def decode_into(codes: torch.Tensor, scales: torch.Tensor, c: Codec, dtype: torch.dtype, out: torch.Tensor) -> None:
    """``qcomm::decode_into``: a contiguous fp32 ``out`` is written directly by the C decode;
    any other ``out`` gets ``decode(...)`` cast to ``dtype`` (the payload's), as ``Codec.decode`` returns it."""
    n = out.numel()
    direct = out.dtype == torch.float32 and out.is_contiguous() and out.device.type == "cpu"
    if direct and cpu_fused.use_fused(c, codes, n):
        cpu_fused.decode_wire(c, codes, scales, n, out=out.view(-1))
        return
    out.copy_(decode(codes, scales, n, c).to(dtype).view(out.shape))


# ---------------------------------------------------------------------------------------------- one row at a time
def rows_one_by_one(codec: Codec, rows: torch.Tensor) -> bool:
    """Whether ``encode_rows`` codes (R, n) ``rows`` one codec call per row: CPU rows large enough for the fused
    C path (compiled passes, no launches to save)."""
    return rows.device.type == "cpu" and cpu_fused.use_fused(codec, rows, rows.shape[-1])


def c_pass_available(codec: Codec, device: torch.device) -> bool:
    """Whether the fused C pass can code rows of ``codec`` on ``device`` one at a time, whatever their length:
    CPU, a codec with native kernels, the library built and not switched off (``cpu_fused.use_fused`` with its
    size threshold met: the C pass is bit-identical to the reference at every size)."""
    return device.type == "cpu" and cpu_fused.use_fused(codec, _CPU_PROBE, cpu_fused.FUSED_MIN_NUMEL)


_CPU_PROBE = torch.empty(0)


def _c_row_into(codec: Codec, rows: torch.Tensor, j: int, seed: int, out: torch.Tensor, offset: int) -> torch.Tensor:
    """The fused C encode of row j (random counters from ``offset``): codes into ``out``, then the scales; returns
    the (buckets, scales per bucket) fp32 scales."""
    if not c_pass_available(codec, rows.device):
        raise ValueError(f"{codec!r} rows on {rows.device}: the fused C pass is not available (c_pass_available)")
    ncode = layout.packed_nbytes(rows.shape[1], codec.bits)
    xf = rows[j].detach().to(torch.float32)
    _, scales = cpu_fused.encode_packed(codec, xf, seed, scaling.output_max(rows.dtype), out=out[:ncode], offset=offset)
    out[ncode:].copy_(scales.reshape(-1).view(torch.uint8))
    return scales


def encode_row_into(codec: Codec, rows: torch.Tensor, j: int, seed: int, out: torch.Tensor) -> torch.Tensor:
    """``out`` (contiguous uint8, ``codec.nbytes(n)``) <- ``codec.encode(rows[j], seed).to_bytes()``, bit for bit, by
    the fused C pass, which writes the codes into ``out`` (``c_pass_available``)."""
    _c_row_into(codec, rows, j, seed, out, 0)
    return out


def encode_flat_row_into(codec: Codec, rows: torch.Tensor, j: int, seed: int, out: torch.Tensor) -> torch.Tensor:
    """``out`` <- row j of ``encode_flat(codec, rows, seed)``, bit for bit, from row j alone: the fused C pass on
    the row with the flat tensor's random counters (from j * n), no copy of the other rows
    (``c_pass_available``)."""
    r, n = rows.shape
    scales = _c_row_into(codec, rows, j, seed, out, j * n)
    if type(codec) is UniformCodec and j < r - 1 and bool(scales[-1, 0] == 0):
        # In the flat tensor this row's last bucket is not the last one: its min and max are reduced like any
        # bucket's, not by the tensor's last-bucket rule, whose torch reduction may pick the other zero of a
        # bucket holding +0 and -0. Only a zero min can change the wire scales (lo; unit = hi - lo is exact for
        # lo != 0 whatever the sign of a zero max): those scales again (the codes do not depend on it).
        xb = rows[j, n - codec.bucket_size :].to(torch.float32).expand(2, -1)
        scales = codec._scales(xb, torch.full((2,), float(codec.bucket_size)))[:1]
        scales = torch.where(codec._finite_mask(xb[:1]), scales, torch.full_like(scales, float("nan")))
        out[out.numel() - 4 * codec.scales_per_bucket :].copy_(scales.reshape(-1).view(torch.uint8))
    return out


def row_at_a_time(codec: Codec, rows: torch.Tensor, batch_max_numel: int) -> bool:
    """Whether the (R, n) ``rows`` are coded one row at a time into the caller's buffer (``encode_row``): on CPU,
    rows of the fused path's size (``rows_one_by_one``), or more than ``batch_max_numel`` elements in all where the
    C pass codes rows of any length (``c_pass_available``), so no temporary grows with R."""
    return rows_one_by_one(codec, rows) or (rows.numel() > batch_max_numel and c_pass_available(codec, rows.device))


def encode_row(codec: Codec, rows: torch.Tensor, j: int, seed: int, out: torch.Tensor, flat: bool) -> torch.Tensor:
    """``out`` <- row j's payload, bit for bit, where ``row_at_a_time`` holds: ``codec.encode(rows[j], seed)``, or
    with ``flat`` row j of ``encode_flat(codec, rows, seed)`` (``encode_row_into`` / ``encode_flat_row_into``)."""
    return (encode_flat_row_into if flat else encode_row_into)(codec, rows, j, seed, out)


def _per_row(codec: Codec, rows: torch.Tensor, seeds: Sequence[int]) -> torch.Tensor:
    out = torch.empty(rows.shape[0], codec.nbytes(rows.shape[1]), dtype=torch.uint8, device=rows.device)
    for j, s in enumerate(seeds):
        encode_row_into(codec, rows, j, s, out[j])
    return out


def _fused_rows(codec: Codec, wire: torch.Tensor, n: int) -> bool:
    """Rows of n elements go to the fused C path one call each: on CPU there are no launches to save, and
    a row decodes straight into its place, where one call over all rows first repacks them."""
    return wire.device.type == "cpu" and cpu_fused.use_fused(codec, wire, n)


def _c_decode_row_into(codec: Codec, payload: torch.Tensor, n: int, out: torch.Tensor) -> None:
    """``codec.decode_into(codec.from_bytes(payload, (n,), fp32), out)`` on the fused C path (``_fused_rows``),
    called directly: a contiguous fp32 ``out`` is written by the C decode from the wire scales, no op dispatch."""
    ncode = layout.packed_nbytes(n, codec.bits)
    if out.dtype != torch.float32 or not out.is_contiguous():
        codec.decode_into(codec.from_bytes(payload, (n,), torch.float32), out)
        return
    # clone: scales at a byte offset that is not a multiple of 4 cannot be viewed as fp32
    scales = payload[ncode:].clone().view(torch.float32).view(-1, codec.scales_per_bucket)
    cpu_fused.decode_wire(codec, payload[:ncode], scales, n, out=out.view(-1))


# ---------------------------------------------------------------------------------------------- the rows ops
def encode_rows(rows: torch.Tensor, seeds: Sequence[int], c: Codec) -> torch.Tensor:
    """``qcomm::encode_rows``: one C pass per row where ``rows_one_by_one``, else the reference."""
    if rows.shape[0] > 1 and rows_one_by_one(c, rows):
        return _per_row(c, rows, seeds)
    return encode_rows_body(c, rows, seeds)


def decode_rows(wire: torch.Tensor, n: int, c: Codec) -> torch.Tensor:
    """``qcomm::decode_rows``: one compiled decode per row where the rows would need repacking, else the
    reference."""
    p = check_wire(c, wire, n)
    wire = wire.reshape(-1, p)
    r = wire.shape[0]
    if r > 1 and _fused_rows(c, wire, n) and not _whole_aligned(c, n):
        out = torch.empty(r, n, dtype=torch.float32, device=wire.device)
        for j in range(r):  # the rows need repacking to be one call: on CPU one compiled decode each is cheaper
            _c_decode_row_into(c, wire[j], n, out[j])
        return out
    return decode_rows_body(c, wire, n)


def decode_rows_into(wire: torch.Tensor, n: int, c: Codec, out: torch.Tensor) -> None:
    """``qcomm::decode_rows_into``: one compiled decode per row straight into ``out``'s rows where the reference
    would decode into a temporary (rows to repack, or an ``out`` not contiguous fp32), else the reference."""
    p = check_wire(c, wire, n)
    wire = wire.reshape(-1, p)
    r = wire.shape[0]
    direct = out.dtype == torch.float32 and out.is_contiguous() and _whole_aligned(c, n)
    target = out.view(r, n) if out.is_contiguous() and out.numel() == r * n else None
    if target is None and tuple(out.shape) == (r, n):
        target = out
    if r > 1 and not direct and target is not None and _fused_rows(c, wire, n):
        for j in range(r):
            _c_decode_row_into(c, wire[j], n, target[j])
        return
    decode_rows_into_body(c, wire, n, out)


def _whole_aligned(c: Codec, n: int) -> bool:
    """Rows of whole byte-aligned buckets: their codes are already the flat layout (no repacking)."""
    b = row_bucketed(c, n).bucket_size
    return n % b == 0 and n % 8 == 0


# ---------------------------------------------------------------------------------------------- norm, rotation
def _c_kernels() -> bool:
    """Whether the C kernels are loaded (and not switched off, ``native.ENV_SWITCH``)."""
    return os.environ.get(native.ENV_SWITCH) != "0" and native.load() is not None


def tree_norm(xb: torch.Tensor) -> torch.Tensor:
    """``qcomm::tree_norm``: the C kernel (the same order, one compiled pass) for fp32 rows, else the reference."""
    if xb.dtype == torch.float32 and xb.numel() and _c_kernels():
        out = torch.empty(xb.shape[0], dtype=torch.float32)
        torch.ops.qcomm.c_tree_norm(xb.contiguous(), xb.shape[1], out)
        return out
    return qsgd.tree_norm_reference(xb)


def hadamard_(x: torch.Tensor, block: int) -> None:
    """``qcomm::hadamard_``: the C butterfly (``kernels/cpu``) in the reference's order, for a contiguous fp32 ``x``
    when the C kernels are loaded (and not switched off); else ``eden.hadamard_reference_``."""
    eden.check_block(block, x.numel())
    if x.dtype == torch.float32 and x.is_contiguous() and _c_kernels():
        torch.ops.qcomm.c_hadamard(x, block, eden.hadamard_scale(block))
        return
    eden.hadamard_reference_(x, block)
