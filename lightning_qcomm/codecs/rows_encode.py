"""The rows encode of the codec layer: R rows of one codec, row j with its own seed, in a number of torch ops that
does not depend on R (the kernels of ``qcomm::encode_rows``; ``codecs.rows`` is the door and the decode;
docs/design.md, "Registry, ops and kernels").

    encode_rows(rows, seeds)[j] == codec.encode(rows[j], seeds[j]).to_bytes()      (bit for bit)

The kernels (``encode_rows_reference`` on CPU and other devices, ``encode_rows_cuda``, ``encode_rows_fake``; one
body, ``encode_rows_body``): on CUDA the Triton rows kernels (``codecs.ops.rows_kernel``; buckets up to
``MAX_BUCKET``), every row's scales in one launch and its codes in another, keys through pinned memory (no host
sync); on CPU rows large enough for the fused C path take one C pass per row (``rows_one_by_one``;
``encode_row_into`` writes one row's payload where the caller wants it); otherwise the codec's math hooks run once
over all rows' buckets, in blocks that bound the temporaries (a codec class this module does not know is coded
row by row, logged once). ``encode_flat_row_into``: row j of a flat-coded matrix from row j alone.

Example::

    >>> codec = get_codec("qsgd", 4, 128)
    >>> wire = encode_rows_reference(rows, [7, 8], *codec.op_args())        # (2, codec.nbytes(n)) uint8
    >>> torch.equal(wire[1], codec.encode(rows[1], seed=8).to_bytes())
    True
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import torch

from lightning_qcomm._log import log_once
from lightning_qcomm.codecs import cpu_fused, packing, registry, rng, scaling
from lightning_qcomm.codecs.base import Codec
from lightning_qcomm.codecs.fp8 import FP8Codec
from lightning_qcomm.codecs.qsgd import NUQSGDCodec, QSGDCodec, QSGDInfCodec
from lightning_qcomm.codecs.sign import SignCodec
from lightning_qcomm.codecs.uniform import UniformCodec

log = logging.getLogger(__name__)

# The codec classes whose hooks this module drives (exact types: a subclass may change the math).
_BATCHED = (UniformCodec, QSGDCodec, QSGDInfCodec, NUQSGDCodec, FP8Codec, SignCodec)
# Deterministic codecs whose wire scales are per-bucket functions with no rule for a tensor's last bucket,
# so rows of whole buckets can be coded as one flat tensor by the public ``encode``.
_FLAT_DETERMINISTIC = (FP8Codec, SignCodec)
_BLOCK_NUMEL = {"cpu": 1 << 18, "default": 1 << 22}  # elements per block of the batched element-wise encode
_INT32_COUNTERS = 1 << 31


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


# ---------------------------------------------------------------------------------------------- encode
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
    ncode = packing.packed_nbytes(rows.shape[1], codec.bits)
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


def encode_rows_body(codec: Codec, rows: torch.Tensor, seeds: Sequence[int], triton: bool) -> torch.Tensor:
    """(R, codec.nbytes(n)) uint8 payloads, row j = ``codec.encode(rows[j], seeds[j]).to_bytes()`` bit for bit
    (checked ``rows`` and one int seed per row); ``triton``: the rows kernels may take them (the CUDA kernel)."""
    r, n = rows.shape
    if triton and n < _INT32_COUNTERS:
        from lightning_qcomm.codecs import ops

        if ops.rows_kernel(codec, rows):  # CUDA: every row (one too) in two launches, straight into the payloads
            return ops.encode_rows_kernel(codec, rows, _row_keys(seeds, rows.device) if codec.stochastic else None)
    if r == 1:
        return codec.encode(rows[0], seed=seeds[0]).to_bytes().view(1, -1)
    if rows_one_by_one(codec, rows):
        return _per_row(codec, rows, seeds)
    if type(codec) not in _BATCHED or n >= _INT32_COUNTERS:
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


def _row_keys(seeds: Sequence[int], device: torch.device) -> torch.Tensor:
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
    keys = _row_keys(seeds, device) if codec.stochastic else None
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
    packed = packing.pack_bits(grid.reshape(-1), codec.bits).view(r, -1)
    return torch.cat([packed, scales.reshape(r, -1).view(torch.uint8)], dim=1)


# ---------------------------------------------------------------------------------------------- the op's kernels
def encode_rows_reference(rows, seeds, codec: str, bits: int, bucket_size: int | None, stochastic: bool):
    """``qcomm::encode_rows`` on any device but CUDA: the C pass per row or the batched torch hooks."""
    c = registry.codec_for_op(codec, bits, bucket_size, stochastic)
    return encode_rows_body(c, rows, seeds, triton=False)


def encode_rows_cuda(rows, seeds, codec: str, bits: int, bucket_size: int | None, stochastic: bool):
    """``qcomm::encode_rows`` on CUDA: the Triton rows kernels where they take the rows, else the torch hooks."""
    c = registry.codec_for_op(codec, bits, bucket_size, stochastic)
    return encode_rows_body(c, rows, seeds, triton=True)


def encode_rows_fake(rows, seeds, codec: str, bits: int, bucket_size: int | None, stochastic: bool):
    """The shape of ``qcomm::encode_rows``: (R, nbytes(n)) uint8 on ``rows``' device."""
    c = registry.codec_for_op(codec, bits, bucket_size, stochastic)
    return rows.new_empty((rows.shape[0], c.nbytes(rows.shape[1])), dtype=torch.uint8)


__all__ = [
    "c_pass_available",
    "encode_flat_row_into",
    "encode_row",
    "encode_row_into",
    "encode_rows_body",
    "encode_rows_cuda",
    "encode_rows_fake",
    "encode_rows_reference",
    "row_bucketed",
    "row_at_a_time",
    "rows_one_by_one",
]
