"""The codec layer's torch ops, ``torch.ops.qcomm.*``: schemas, fake kernels, and which kernel runs where
(docs/design.md, "Registry, ops and kernels").

A codec travels through the ops as ``Codec.op_args()`` = ``(codec, bits, bucket_size, stochastic)`` (rebuilt by
``registry.codec_for_op``); torch's dispatcher picks the kernel by device: CPU the fused C passes
(``codecs.cpu_fused``, ``codecs.native``) where they apply, CUDA the Triton kernels (``lightning_qcomm.kernels``),
any other device the torch reference. The ops: ``encode`` / ``decode`` / ``decode_into``; the C kernels'
``c_*`` ops (CPU only); the 1-bit ``sign_*`` ops (``codecs.sign_ops``); the rows ops ``encode_rows`` /
``decode_rows`` / ``decode_rows_into`` (``codecs.rows``); ``decode_rows_sum`` / ``feedback_update`` /
``feedback_rows`` (``codecs.rows_reduce``, ``codecs.rows_feedback``); the segment ops (``codecs.rows_segments``).

Invariants: every kernel gives the reference's bits; the fake kernels give the output shapes, so
``torch.compile`` traces ``Codec.encode`` / ``decode`` without a graph break; ``seed`` is ``rng.signed_seed``'s
int64; codecs without native kernels run the reference everywhere; ``LIGHTNING_QCOMM_DISABLE_TRITON=1`` (or no
Triton, said once) makes CUDA use the reference. Schemas and per-op kernels: docs/design.md, "Module notes".

Example::

    >>> codes, scales = torch.ops.qcomm.encode(x, "qsgd", 4, 512, True, 7)
    >>> torch.equal(codes, get_codec("qsgd", 4, 512).encode(x, seed=7).codes)
    True
"""

from __future__ import annotations

import logging
import os

import torch

from lightning_qcomm._log import log_once
from lightning_qcomm.codecs import (  # noqa: F401
    cpu_fused,
    packing,
    registry,
    rows,
    rows_encode,
    rows_feedback,
    rows_reduce,
    rows_segments,
    scaling,
    sign_ops,
    triton_probe,
)
from lightning_qcomm.codecs.kernel_spec import C_SPEC_SCHEMA

log = logging.getLogger(__name__)
_CODEC = "str codec, int bits, int? bucket_size, bool stochastic"

_lib = torch.library.Library("qcomm", "DEF")
_lib.define(f"encode(Tensor x, {_CODEC}, int seed) -> (Tensor codes, Tensor scales)")
_lib.define(f"decode(Tensor codes, Tensor scales, int numel, {_CODEC}) -> Tensor")
_lib.define(f"decode_into(Tensor codes, Tensor scales, {_CODEC}, ScalarType dtype, Tensor(a!) out) -> ()")
# The rows form (``codecs.rows``): R payloads of n elements, row j coded with seeds[j] as a tensor of its own.
_lib.define(f"encode_rows(Tensor rows, int[] seeds, {_CODEC}) -> Tensor")
_lib.define(f"decode_rows(Tensor wire, int n, {_CODEC}) -> Tensor")
_lib.define(f"decode_rows_into(Tensor wire, int n, {_CODEC}, Tensor(a!) out) -> ()")
# Segmented rows (``codecs.rows_segments``): rows of quantized and raw segments, QSDP's wire rows.
_SEGS = "int[] numels, bool[] quantized"
_lib.define(f"encode_segments(Tensor rows, {_SEGS}, int[] seeds, {_CODEC}, Tensor(a!) out) -> ()")
_lib.define(
    f"decode_segments_into(Tensor wire, {_SEGS}, {_CODEC}, ScalarType wire_dtype, int skip_row, Tensor(a!) out) -> ()"
)
_lib.define(f"decode_segments_sum(Tensor wire, Tensor rows, int own, {_SEGS}, {_CODEC}, Tensor(a!) out) -> ()")
# The all-reduce's server step and error-feedback tail (``codecs.rows_reduce``): one launch each on CUDA.
_lib.define(f"decode_rows_sum(Tensor wire, int n, {_CODEC}, bool avg, bool rank_order=False) -> Tensor")
_lib.define(
    "feedback_update(Tensor y, Tensor dec, Tensor reduced, Tensor held, int start, float k, ScalarType held_dtype, "
    "Tensor(a!) err) -> ()"
)
_lib.define(
    f"feedback_rows(Tensor y, Tensor wire, int n, {_CODEC}, Tensor reduced, Tensor held, int start, float k, "
    "ScalarType held_dtype, Tensor(a!) err) -> ()"
)
# The C kernels (CPU only; kernels/cpu/qcomm_ops.cpp), on flat contiguous tensors given the per-bucket parameters.
_lib.define(
    f"c_encode_codes(Tensor x, Tensor params, int k1, int k2, {C_SPEC_SCHEMA}, Tensor(a!) out, int offset=0) -> ()"
)
_lib.define(
    "c_decode_codes(Tensor codes, Tensor params, Tensor lut, int numel, int bits, int bucket, Tensor(a!) out) -> ()"
)
_lib.define("c_uniform_decode(Tensor codes, Tensor scales, int numel, int bits, int bucket, Tensor(a!) out) -> ()")
_lib.define(
    "c_bucket_stats(Tensor x, int bucket, Tensor(a!) lo, Tensor(b!) hi, Tensor(c!) amax, Tensor(d!) flags) -> ()"
)
_lib.define("c_tree_norm(Tensor x, int width, Tensor(a!) out) -> ()")
_lib.define(
    f"c_uniform_encode(Tensor x, int k1, int k2, {C_SPEC_SCHEMA}, Tensor(a!) scales, Tensor(b!) params, "
    "Tensor(c!) out, int offset=0) -> bool"
)


# ---------------------------------------------------------------------------------------------- default: reference
def encode_reference(x, codec: str, bits: int, bucket_size: int | None, stochastic: bool, seed: int):
    c = registry.codec_for_op(codec, bits, bucket_size, stochastic)
    return c.encode_torch(x.reshape(-1).to(torch.float32), seed, scaling.output_max(x.dtype))


def decode_reference(codes, scales, numel: int, codec: str, bits: int, bucket_size: int | None, stochastic: bool):
    c = registry.codec_for_op(codec, bits, bucket_size, stochastic)
    return c.decode_reference(codes, c._decode_params(scales), numel)


def decode_into_reference(codes, scales, codec: str, bits: int, bucket_size, stochastic: bool, dtype, out) -> None:
    values = torch.ops.qcomm.decode(codes, scales, out.numel(), codec, bits, bucket_size, stochastic)
    out.copy_(values.to(dtype).view(out.shape))


# ---------------------------------------------------------------------------------------------- CUDA: Triton
def _triton_for(c, device: torch.device) -> bool:
    """True when the Triton kernels should do the element-wise work of codec ``c`` on ``device``: Triton is
    installed, not disabled, and passed its first-use check there (``codecs.triton_probe``)."""
    if not registry.has_kernels(c) or os.environ.get("LIGHTNING_QCOMM_DISABLE_TRITON") == "1":
        return False
    from lightning_qcomm import kernels

    if not kernels.HAS_TRITON:
        log_once(
            log, "no-triton", "lightning_qcomm: Triton is not available; CUDA tensors use the torch reference codecs"
        )
        return False
    return triton_probe.triton_works(c, device)


def encode_cuda(x, codec: str, bits: int, bucket_size: int | None, stochastic: bool, seed: int):
    c = registry.codec_for_op(codec, bits, bucket_size, stochastic)
    if not _triton_for(c, x.device):
        return encode_reference(x, codec, bits, bucket_size, stochastic, seed)
    from lightning_qcomm import kernels

    with triton_probe.on_device(x.device):
        return kernels.encode_codec(c, x.reshape(-1).to(torch.float32), seed, scaling.output_max(x.dtype))


def decode_cuda(codes, scales, numel: int, codec: str, bits: int, bucket_size: int | None, stochastic: bool):
    c = registry.codec_for_op(codec, bits, bucket_size, stochastic)
    if not _triton_for(c, codes.device):
        return decode_reference(codes, scales, numel, codec, bits, bucket_size, stochastic)
    from lightning_qcomm import kernels

    with triton_probe.on_device(codes.device):  # one launch: the decode parameters are made in the kernel
        return kernels.decode_codec(c, codes, scales, numel)


def rows_kernel(c, rows: torch.Tensor, encode: bool = True) -> bool:
    """Whether the rows kernels code the (R, n) ``rows`` (or, ``encode=False``, decode payloads of that many
    rows) of codec ``c``: a CUDA tensor (or any, with the kernels interpreted), a registered codec with kernels and
    Triton working for it there (``_triton_for``); to encode also a codec whose buckets the scales kernel reduces
    (``kernels.fused_scales``: buckets up to ``MAX_BUCKET``)."""
    return kernels_for(c, rows.device, rows.shape[1], encode)


def kernels_for(c, device: torch.device, n: int, encode: bool = True) -> bool:
    """``rows_kernel`` for rows of n elements on ``device``."""
    from lightning_qcomm import kernels

    if not kernels.HAS_TRITON or not registry.is_registered(c) or not registry.has_kernels(c):
        return False
    if not (device.type == "cuda" or kernels.codec_kernels._is_interpreted()):
        return False
    return (not encode or kernels.fused_scales(c, n)) and _triton_for(c, device)


def decode_rows_kernel(c, wire: torch.Tensor, n: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """(R, n) fp32 values of the payloads ``wire`` (R, ``c.nbytes(n)``), row j
    ``c.decode(c.from_bytes(wire[j], (n,), fp32))``, in one launch (``out``: a flat contiguous fp32 tensor of m
    elements, (R - 1) n < m <= R n, that takes the first m values). Only where ``rows_kernel(c, ..., False)``."""
    from lightning_qcomm import kernels

    with triton_probe.on_device(wire.device):
        return kernels.decode_rows(c, wire, n, out)


def decode_rows_sum_kernel(c, wire: torch.Tensor, n: int, avg: bool, rank_order: bool = False) -> torch.Tensor:
    """(n,) fp32 sum (``avg``: times fl(1/R)) of the R payloads ``wire`` decoded, in torch's CUDA ``sum(dim=0)``
    order (``rank_order``: row 0, then + row 1, + row 2, ...; ``codecs.rows_reduce``), in one launch. Only where
    ``rows_kernel(c, wire, False)``."""
    from lightning_qcomm.kernels.cuda import reduce_kernels

    with triton_probe.on_device(wire.device):
        return reduce_kernels.decode_rows_sum(c, wire, n, avg, rank_order)


def encode_rows_kernel(c, rows: torch.Tensor, keys: torch.Tensor | None) -> torch.Tensor:
    """(R, ``c.nbytes(n)``) uint8 payloads of the rows of ``rows``, row j ``c.encode(rows[j], seed_j).to_bytes()``
    bit for bit (``keys``: the seeds' (R, 2) int32 key words; None for a deterministic codec): two launches
    whatever R (``kernels.encode_rows_codec``). Only where ``rows_kernel(c, rows)``."""
    from lightning_qcomm import kernels

    with triton_probe.on_device(rows.device):
        return kernels.encode_rows_codec(c, rows, keys)


# ---------------------------------------------------------------------------------------------- fake: shapes
def _encode_fake(x, codec: str, bits: int, bucket_size: int | None, stochastic: bool, seed: int):
    c = registry.codec_for_op(codec, bits, bucket_size, stochastic)
    n = x.numel()
    codes = x.new_empty(packing.packed_nbytes(n, bits), dtype=torch.uint8)
    return codes, x.new_empty((c.num_buckets(n), c.scales_per_bucket), dtype=torch.float32)


def _decode_fake(codes, scales, numel: int, codec: str, bits: int, bucket_size: int | None, stochastic: bool):
    return codes.new_empty(numel, dtype=torch.float32)


def _decode_into_fake(codes, scales, codec: str, bits: int, bucket_size, stochastic: bool, dtype, out) -> None:
    return None


for _op, _cpu, _cuda, _default, _fake in (
    ("encode", cpu_fused.encode_kernel, encode_cuda, encode_reference, _encode_fake),
    ("decode", cpu_fused.decode_kernel, decode_cuda, decode_reference, _decode_fake),
    ("decode_into", cpu_fused.decode_into_kernel, decode_into_reference, decode_into_reference, _decode_into_fake),
    # rows: CPU the C pass per row or the torch hooks, CUDA the Triton rows kernels (else the same as CPU)
    (
        "encode_rows",
        rows_encode.encode_rows_reference,
        rows_encode.encode_rows_cuda,
        rows_encode.encode_rows_reference,
        rows_encode.encode_rows_fake,
    ),
    (
        "decode_rows",
        rows.decode_rows_reference,
        rows.decode_rows_cuda,
        rows.decode_rows_reference,
        rows.decode_rows_fake,
    ),
    (
        "decode_rows_sum",
        rows_reduce.decode_rows_sum_reference,
        rows_reduce.decode_rows_sum_cuda,
        rows_reduce.decode_rows_sum_reference,
        rows_reduce.decode_rows_sum_fake,
    ),
    (
        "feedback_update",
        rows_reduce.feedback_update_reference,
        rows_reduce.feedback_update_cuda,
        rows_reduce.feedback_update_reference,
        rows_reduce.feedback_update_fake,
    ),
    (
        "feedback_rows",
        rows_feedback.feedback_rows_reference,
        rows_feedback.feedback_rows_cuda,
        rows_feedback.feedback_rows_reference,
        rows_feedback.feedback_rows_fake,
    ),
    (
        "encode_segments",
        rows_segments.encode_segments_reference,
        rows_segments.encode_segments_cuda,
        rows_segments.encode_segments_reference,
        rows_segments._fake,
    ),
    (
        "decode_segments_into",
        rows_segments.decode_segments_reference,
        rows_segments.decode_segments_cuda,
        rows_segments.decode_segments_reference,
        rows_segments._fake,
    ),
    (
        "decode_segments_sum",
        rows_segments.sum_segments_reference,
        rows_segments.sum_segments_cuda,
        rows_segments.sum_segments_reference,
        rows_segments._fake,
    ),
    (
        "decode_rows_into",
        rows.decode_rows_into_kernel,
        rows.decode_rows_into_cuda,
        rows.decode_rows_into_kernel,
        rows.decode_rows_into_fake,
    ),
):
    _lib.impl(_op, _cpu, "CPU")
    _lib.impl(_op, _cuda, "CUDA")
    _lib.impl(_op, _default, "CompositeExplicitAutograd")
    torch.library.register_fake(f"qcomm::{_op}", _fake, lib=_lib)
