"""R payloads of one codec in a fixed number of torch ops: the rows form of the codec layer, the door the chunked
collectives code their rows through, and its torch reference (docs/design.md, "Registry, ops and kernels").

Row j of an (R, n) matrix is its own tensor for the codec (buckets restart at the row start, the random counter at
0) with its own seed::

    encode_rows(codec, rows, seeds)[j] == codec.encode(rows[j], seeds[j]).to_bytes()      (bit for bit)
    decode_rows(codec, wire, n)[j]     == codec.decode(codec.from_bytes(wire[j], (n,), fp32))

as the ops ``qcomm::encode_rows`` / ``decode_rows`` / ``decode_rows_into`` (schemas in ``codecs.ops``). Here the
door and the reference (``encode_rows_body`` / ``decode_rows_body`` / ``decode_rows_into_body``): the codec's math
hooks run once over all rows' buckets, in blocks that bound the temporaries (a codec class this module does not
know is coded row by row, logged once); decode is the codec's public ``decode`` once over the rows laid out
bucket-aligned. The CPU kernels (``codecs.cpu``: the fused C pass per row) and the CUDA ones (``codecs.cuda``: two
launches to encode, one to decode) give the same bits. Rows of whole, byte-aligned buckets can also travel as one
flat tensor with one seed (``encode_flat``). Details: docs/design.md, "Module notes".

Example::

    wire = encode_rows(codec, chunks, [derive_seed(s, 1, rank, j) for j in range(world)])   # (N, P) uint8
    values = decode_rows(codec, wire, chunks.shape[1])                                       # (N, n) fp32
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import torch

from lightning_qcomm._log import log_once
from lightning_qcomm.codecs import layout, registry, rng, scaling
from lightning_qcomm.codecs.base import Codec, Packed
from lightning_qcomm.codecs.fp8 import FP8Codec
from lightning_qcomm.codecs.qsgd import NUQSGDCodec, QSGDCodec, QSGDInfCodec, SignCodec
from lightning_qcomm.codecs.uniform import UniformCodec

log = logging.getLogger(__name__)

# The codec classes whose hooks this module drives (exact types: a subclass may change the math).
_BATCHED = (UniformCodec, QSGDCodec, QSGDInfCodec, NUQSGDCodec, FP8Codec, SignCodec)
# Deterministic codecs whose wire scales are per-bucket functions with no rule for a tensor's last bucket,
# so rows of whole buckets can be coded as one flat tensor by the public ``encode``.
_FLAT_DETERMINISTIC = (FP8Codec, SignCodec)
_BLOCK_NUMEL = {"cpu": 1 << 18, "default": 1 << 22}  # elements per block of the batched element-wise encode
INT32_COUNTERS = 1 << 31


def _check_rows(rows: torch.Tensor) -> None:
    if not isinstance(rows, torch.Tensor) or rows.dim() != 2 or rows.shape[0] < 1 or rows.shape[1] < 1:
        raise ValueError(f"rows must be a non-empty 2-D tensor (rows, n), got {getattr(rows, 'shape', rows)!r}")


@functools.lru_cache(maxsize=64)
def _with_bucket(codec_type: type, config: tuple, bucket_size: int) -> Codec:
    kwargs = dict(config)
    kwargs["bucket_size"] = bucket_size
    return codec_type(**kwargs)


def row_bucketed(codec: Codec, n: int) -> Codec:
    """``codec`` itself, or for ``bucket_size=None`` (one bucket per tensor) the same codec with buckets of n
    elements: for one row of n elements both produce the same codes and scales, and the latter keeps one
    bucket per row on the rows of a flat (R * n) tensor."""
    if codec.bucket_size is not None:
        return codec
    cfg = codec.config()
    cfg.pop("class")
    cfg.pop("name")
    return _with_bucket(type(codec), tuple(sorted(cfg.items())), n)


def _layout(codec: Codec, n: int) -> tuple[int, int, int]:
    """(bucket length B of the flat layout, buckets per row, padded row length nb * B)."""
    b = row_bucketed(codec, n).bucket_size
    nb = -(-n // b)
    return b, nb, nb * b


def check_wire(codec: Codec, wire: torch.Tensor, n: int) -> int:
    """``codec.nbytes(n)``; ValueError unless ``wire`` holds a whole number of payloads of n elements."""
    p = codec.nbytes(n)
    if wire.numel() % p:
        raise ValueError(f"wire has {wire.numel()} bytes, not a multiple of codec.nbytes({n}) = {p}")
    return p


def rows_out(codec: Codec, wire: torch.Tensor, n: int, out: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(``wire`` as (R, P) rows, whether the flat ``out`` takes only the first m values, (R - 1) n < m < R n);
    ValueError unless ``out`` has R n elements or is such a flat prefix."""
    wire = wire.reshape(-1, check_wire(codec, wire, n))
    r, m = wire.shape[0], out.numel()
    partial = out.dim() == 1 and (r - 1) * n < m < r * n
    if not partial and m != r * n:
        raise ValueError(f"out must have R * n = {r} * {n} elements, or more than (R - 1) * n flat, got {m}")
    return wire, partial


# ---------------------------------------------------------------------------------------------- reference: encode
def encode_rows_body(codec: Codec, rows: torch.Tensor, seeds: Sequence[int]) -> torch.Tensor:
    """(R, codec.nbytes(n)) uint8 payloads, row j = ``codec.encode(rows[j], seeds[j]).to_bytes()`` bit for bit
    (checked ``rows`` and one int seed per row): the reference, the kernel of ``qcomm::encode_rows`` where neither
    the C pass (``codecs.cpu``) nor the Triton kernels (``codecs.cuda``) take the rows."""
    r, n = rows.shape
    if r == 1:
        return codec.encode(rows[0], seed=seeds[0]).to_bytes().view(1, -1)
    if type(codec) not in _BATCHED or n >= INT32_COUNTERS:
        log_once(
            log,
            f"rows-{type(codec).__qualname__}",
            f"lightning_qcomm: {type(codec).__qualname__} rows are encoded one codec call per row "
            "(codecs.rows batches the built-in codec classes only)",
        )
        return torch.stack([codec.encode(rows[j], seed=s).to_bytes() for j, s in enumerate(seeds)])
    flat = row_bucketed(codec, n)
    if type(codec) in _FLAT_DETERMINISTIC and not codec.stochastic and n % flat.bucket_size == 0 and n % 8 == 0:
        packed = flat.encode(rows.reshape(-1), seed=0)  # no random bits: the seeds play no part
        scales = packed.scales.reshape(r, -1).view(torch.uint8)
        return torch.cat([packed.codes.view(r, -1), scales], dim=1)
    return _encode_batched(codec, rows, seeds)


def row_keys(seeds: Sequence[int], device: torch.device) -> torch.Tensor:
    """(R, 2) int32: the uint32 key words of each row's seed (``rng.seed_to_key``)."""
    keys = torch.tensor([[rng._as_int32(k) for k in rng.seed_to_key(s)] for s in seeds], dtype=torch.int32)
    if device.type == "cuda":  # from pageable memory the copy would wait for the stream: pinned, it is queued
        keys = keys.pin_memory()
    return keys.to(device, non_blocking=True)


def _uniforms(keys: torch.Tensor, rows_of: torch.Tensor, starts: torch.Tensor, length: int) -> torch.Tensor:
    """``rng.uniform`` of each bucket row q of a block: key of row ``rows_of[q]``, counters starts[q] + 0..length-1."""
    h = starts[:, None] + torch.arange(length, dtype=torch.int32, device=keys.device)[None, :]
    tmp = torch.empty_like(h)
    h ^= keys[rows_of, 0:1]
    rng._mix32_(h, tmp)
    h ^= keys[rows_of, 1:2]
    rng._mix32_(h, tmp)
    u = torch.empty(h.shape, dtype=torch.float32, device=h.device)
    rng._to_uniform(h, u)
    return u


def _bucket_scales(codec: Codec, xb: torch.Tensor, counts: torch.Tensor, r: int, nb: int, tail: int) -> torch.Tensor:
    """Wire scales of the (r * nb, B) zero-padded buckets, each row's last bucket holding ``tail`` real elements,
    as ``Codec.encode`` computes them row by row."""
    if type(codec) is UniformCodec:
        # UniformCodec._scales: min/max of every bucket, the tensor's last bucket over its real elements only
        lo, hi = torch.aminmax(xb, dim=1)
        last = torch.arange(r, device=xb.device) * nb + (nb - 1)
        ends = xb[last]
        valid = torch.arange(xb.shape[1], device=xb.device) < tail
        lo[last] = torch.where(valid, ends, torch.full_like(ends, float("inf"))).amin(dim=1)
        hi[last] = torch.where(valid, ends, torch.full_like(ends, float("-inf"))).amax(dim=1)
        scales = codec._wire_scales(lo, hi)
    else:  # norms and max |x| ignore zero padding; sign1 divides by the real counts
        scales = codec._scales(xb, counts)
    return torch.where(codec._finite_mask(xb), scales, torch.full_like(scales, float("nan")))


def _encode_batched(codec: Codec, rows: torch.Tensor, seeds: Sequence[int]) -> torch.Tensor:
    """``Codec.encode`` + ``to_bytes`` of every row, through the codec's hooks over all rows' buckets at once."""
    r, n = rows.shape
    device = rows.device
    blen = codec.bucket_len(n)  # the codec's buckets of one row: nb of them, the last one ``tail`` long
    nb = -(-n // blen)
    tail = n - (nb - 1) * blen
    x = torch.nn.functional.pad(rows.detach().to(torch.float32), (0, nb * blen - n))
    xb = x.view(r * nb, blen)
    counts = torch.full((r * nb,), blen, dtype=torch.float32, device=device)
    counts.view(r, nb)[:, -1].fill_(tail)  # a kernel argument, not a tensor made from Python data
    scales = _bucket_scales(codec, xb, counts, r, nb, tail)
    params = codec._encode_params(scales, scaling.output_max(rows.dtype)).unsqueeze(-1)  # (r*nb, P, 1)
    keys = row_keys(seeds, device) if codec.stochastic else None
    codes = torch.empty(r * nb, blen, dtype=torch.uint8, device=device)
    step = max(1, _BLOCK_NUMEL.get(device.type, _BLOCK_NUMEL["default"]) // blen)
    for q0 in range(0, r * nb, step):
        q1 = min(q0 + step, r * nb)
        xq, pq = xb[q0:q1], params[q0:q1]
        u = None
        if keys is not None:
            q = torch.arange(q0, q1, device=device)
            u = _uniforms(keys, q // nb, ((q % nb) * blen).to(torch.int32), blen)
        c = codec._quantize(xq, pq, u)
        ok = (xq - xq == 0) & torch.isfinite(pq).all(dim=1)  # as Codec.encode_reference: code 0 there
        codes[q0:q1] = c.masked_fill_(~ok, 0)
    grid = codes.view(r, nb * blen)[:, :n]
    grid = torch.nn.functional.pad(grid, (0, -(-n // 8) * 8 - n))  # each row: whole groups of 8 codes
    packed = layout.pack_bits(grid.reshape(-1), codec.bits).view(r, -1)
    return torch.cat([packed, scales.reshape(r, -1).view(torch.uint8)], dim=1)


# ---------------------------------------------------------------------------------------------- reference: decode
def decode_rows_body(codec: Codec, wire: torch.Tensor, n: int) -> torch.Tensor:
    """(R, n) fp32 values (contiguous) of R payloads of n elements each (``wire``: (R, codec.nbytes(n)) or flat
    uint8), in one ``Codec.decode`` call (the reference; module docstring)."""
    p = check_wire(codec, wire, n)
    wire = wire.reshape(-1, p)
    r = wire.shape[0]
    if r == 1:
        return codec.decode(codec.from_bytes(wire[0], (n,), torch.float32)).view(1, n)
    flat = row_bucketed(codec, n)
    b, nb, padded = _layout(codec, n)
    ncode = layout.packed_nbytes(n, codec.bits)
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
    if not codec.tail_pads:  # the last bucket's length is part of the math: one decode per row
        return torch.stack([codec.decode(codec.from_bytes(wire[j], (n,), torch.float32)) for j in range(r)])
    # repack: each row's codes padded to nb whole buckets (zero codes, cut away after the decode)
    per_row = -(-n // 8) * 8
    unpacked = layout.unpack_bits(codes.reshape(-1), codec.bits, r * per_row).view(r, per_row)
    grid = torch.zeros(r, padded, dtype=torch.uint8, device=wire.device)
    grid[:, :n] = unpacked[:, :n]
    packed = Packed(layout.pack_bits(grid.view(-1), codec.bits), scales, torch.Size((r * padded,)), torch.float32)
    return flat.decode(packed).view(r, padded)[:, :n].contiguous()


def decode_rows_into_body(codec: Codec, wire: torch.Tensor, n: int, out: torch.Tensor) -> torch.Tensor:
    """``out.copy_(decode_rows(codec, wire, n))`` for an (R, n) ``out`` of any float dtype and strides, or the first
    m values of the rows (row-major) into a flat ``out`` of m elements, (R - 1) n < m < R n; rows of whole
    byte-aligned buckets decode straight into a contiguous fp32 ``out`` (no temporary); the others through the
    ``decode_rows`` op (the device's kernel)."""
    wire, partial = rows_out(codec, wire, n, out)
    r = wire.shape[0]
    if partial:
        return out.copy_(decode_rows(codec, wire, n).view(-1)[: out.numel()])
    if r == 1:  # the codec's own decode_into (straight into a contiguous fp32 row)
        codec.decode_into(codec.from_bytes(wire[0], (n,), torch.float32), out.view(n) if out.is_contiguous() else out)
        return out
    _, nb, padded = _layout(codec, n)
    direct = out.dtype == torch.float32 and out.is_contiguous() and r > 1 and padded == n and n % 8 == 0
    if not direct:
        return out.copy_(decode_rows(codec, wire, n).view(out.shape))
    ncode = layout.packed_nbytes(n, codec.bits)
    scales = (
        wire[:, ncode:]
        .clone(memory_format=torch.contiguous_format)
        .view(torch.float32)
        .reshape(r * nb, codec.scales_per_bucket)
    )
    packed = Packed(wire[:, :ncode].reshape(-1), scales, torch.Size((r * n,)), torch.float32)
    row_bucketed(codec, n).decode_into(packed, out.view(-1))
    return out


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
    if registry.is_registered(codec):  # the op: the dispatcher picks the device's kernel
        return torch.ops.qcomm.encode_rows(rows, [rng.signed_seed(s) for s in seeds], *codec.op_args())
    return encode_rows_body(codec, rows, seeds)


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
    return decode_rows_body(codec, wire, n)


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
    "INT32_COUNTERS",
    "decode_rows",
    "decode_rows_into",
    "encode_flat",
    "encode_rows",
    "row_bucketed",
]
