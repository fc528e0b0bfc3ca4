"""The codec layer's torch ops, ``torch.ops.qcomm.*``: schemas, fake kernels, and which kernel runs where
(docs/design.md, "Registry, ops and kernels").

A codec travels through the ops as ``Codec.op_args()`` = ``(codec, bits, bucket_size, stochastic)``, rebuilt once
here (``registry.codec_for_op``) for the kernel. torch's dispatcher is the only chooser of a backend: CPU tensors
run ``codecs.cpu`` (the fused C passes where they apply), CUDA tensors ``codecs.cuda`` / ``codecs.cuda_segments``
(the Triton kernels where they apply), any other device the torch reference (``codecs.rows``, ``rows_reduce``,
``rows_segments``); each backend falls back to that reference itself. The ops: ``encode`` / ``decode`` /
``decode_into``; the rows ops; the sum and error-feedback ops; the segment ops; the C kernels' ``c_*`` ops (CPU
only); the 1-bit ``sign_*`` ops (``codecs.sign_ops``); ``tree_norm`` (``codecs.qsgd``); ``hadamard_``
(``codecs.eden``); ``add_square_sr_`` (``codecs.rng``: 1-bit Adam's bf16 variance window). ``segments_fused`` and ``row_at_a_time`` answer the
callers that lay rows out themselves which form the dispatcher will run.

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

import torch

from lightning_qcomm.codecs import (
    cpu,
    cuda,
    cuda_segments,
    eden,
    layout,
    qsgd,
    registry,
    rng,
    rows,
    rows_reduce,
    rows_segments,
    scaling,
    sign_ops,  # noqa: F401  (defines the sign_* ops)
)
from lightning_qcomm.codecs.base import Codec
from lightning_qcomm.codecs.layout import C_SPEC_SCHEMA

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
# The norm codecs' L2 norm of each row in one fixed order (``qsgd.tree_norm``).
_lib.define("tree_norm(Tensor xb) -> Tensor")
# acc (bf16) <- acc + g² rounded stochastically with the counter-based bits (``rng.add_square_sr_reference_``).
_lib.define("add_square_sr_(Tensor(a!) acc, Tensor g, int seed, int chunk) -> ()")
# The Hadamard transform of whole blocks, in place (``codecs.eden``).
_lib.define("hadamard_(Tensor(a!) x, int block) -> ()")
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
_lib.define("c_hadamard(Tensor(a!) x, int block, float scale) -> ()")
_lib.define(
    f"c_uniform_encode(Tensor x, int k1, int k2, {C_SPEC_SCHEMA}, Tensor(a!) scales, Tensor(b!) params, "
    "Tensor(c!) out, int offset=0) -> bool"
)


# ---------------------------------------------------------------------------------------------- the reference
def _encode(x, c: Codec, seed: int):
    return c.encode_torch(x.reshape(-1).to(torch.float32), seed, scaling.output_max(x.dtype))


def _decode(codes, scales, numel: int, c: Codec):
    return c.decode_reference(codes, c._decode_params(scales), numel)


def _decode_into(codes, scales, c: Codec, dtype, out) -> None:
    """``qcomm::decode_into`` on CUDA and other devices: the ``decode`` op's values cast to ``dtype``."""
    out.copy_(torch.ops.qcomm.decode(codes, scales, out.numel(), *c.op_args()).to(dtype).view(out.shape))


# ---------------------------------------------------------------------------------------------- fake: shapes
def _encode_fake(x, c: Codec, seed: int):
    n = x.numel()
    codes = x.new_empty(layout.packed_nbytes(n, c.bits), dtype=torch.uint8)
    return codes, x.new_empty((c.num_buckets(n), c.scales_per_bucket), dtype=torch.float32)


def _decode_fake(codes, scales, numel: int, c: Codec):
    return codes.new_empty(numel, dtype=torch.float32)


def _encode_rows_fake(rows_, seeds, c: Codec):
    return rows_.new_empty((rows_.shape[0], c.nbytes(rows_.shape[1])), dtype=torch.uint8)


def _decode_rows_fake(wire, n: int, c: Codec):
    return wire.new_empty((wire.numel() // rows.check_wire(c, wire, n), n), dtype=torch.float32)


def _decode_rows_sum_fake(wire, n: int, c: Codec, avg: bool, rank_order: bool = False):
    rows.check_wire(c, wire, n)
    return wire.new_empty((n,), dtype=torch.float32)


def _feedback_rows_fake(y, wire, n: int, c: Codec, *args) -> None:
    rows_reduce.feedback_rows_prefix(c, wire, n, y)


def _tree_norm_fake(xb):
    return xb.new_empty((xb.shape[0],), dtype=torch.float32)


def _nothing(*args) -> None:
    return None


# ---------------------------------------------------------------------------------------------- registration
def _with_codec(fn, at: int):
    """``fn`` called with the op's four codec arguments, from position ``at``, as one ``Codec``."""

    def kernel(*args):
        return fn(*args[:at], registry.codec_for_op(*args[at : at + 4]), *args[at + 4 :])

    kernel.__name__ = kernel.__qualname__ = getattr(fn, "__name__", "kernel")
    return kernel


def _codec_first(body, at: int):
    """A reference ``body(codec, *rest)`` called in the op's argument order, the ``Codec`` at position ``at``."""

    def reference(*args):
        return body(args[at], *args[:at], *args[at + 1 :])

    reference.__name__ = reference.__qualname__ = body.__name__
    return reference


# op: (position of the codec arguments or None, CPU, CUDA, the reference (any other device), fake); a CPU or CUDA
# entry None: the reference runs there too
KERNELS = {
    "encode": (1, cpu.encode, cuda.encode, _encode, _encode_fake),
    "decode": (3, cpu.decode, cuda.decode, _decode, _decode_fake),
    "decode_into": (2, cpu.decode_into, None, _decode_into, _nothing),
    "encode_rows": (2, cpu.encode_rows, cuda.encode_rows, _codec_first(rows.encode_rows_body, 2), _encode_rows_fake),
    "decode_rows": (2, cpu.decode_rows, cuda.decode_rows, _codec_first(rows.decode_rows_body, 2), _decode_rows_fake),
    "decode_rows_into": (
        2,
        cpu.decode_rows_into,
        cuda.decode_rows_into,
        _codec_first(rows.decode_rows_into_body, 2),
        _nothing,
    ),
    "decode_rows_sum": (
        2,
        None,
        cuda.decode_rows_sum,
        _codec_first(rows_reduce.decode_rows_sum_body, 2),
        _decode_rows_sum_fake,
    ),
    "feedback_update": (None, None, cuda.feedback_update, rows_reduce.feedback_update_body, _nothing),
    "feedback_rows": (
        3,
        None,
        cuda.feedback_rows,
        _codec_first(rows_reduce.feedback_rows_body, 3),
        _feedback_rows_fake,
    ),
    "encode_segments": (
        4,
        None,
        cuda_segments.encode_segments,
        _codec_first(rows_segments.encode_segments_body, 4),
        _nothing,
    ),
    "decode_segments_into": (
        3,
        None,
        cuda_segments.decode_segments_into,
        _codec_first(rows_segments.decode_segments_body, 3),
        _nothing,
    ),
    "decode_segments_sum": (
        5,
        None,
        cuda_segments.decode_segments_sum,
        _codec_first(rows_segments.sum_segments_body, 5),
        _nothing,
    ),
    "tree_norm": (None, cpu.tree_norm, None, qsgd.tree_norm_reference, _tree_norm_fake),
    "hadamard_": (None, cpu.hadamard_, cuda.hadamard_, eden.hadamard_reference_, _nothing),
    "add_square_sr_": (None, None, cuda.add_square_sr_, rng.add_square_sr_reference_, _nothing),
}


def kernel(op: str, device: str):
    """The registered kernel of ``qcomm::<op>`` for ``device`` ("cpu", "cuda", anything else: the reference), taking
    the op's arguments (``benchmarks/launch_counts.cuda_path_on_cpu`` registers the CUDA ones for CPU)."""
    at, on_cpu, on_cuda, default, _ = KERNELS[op]
    fn = {"cpu": on_cpu, "cuda": on_cuda}.get(device) or default
    return fn if at is None else _with_codec(fn, at)


for _op, (_at, *_kernels, _fake) in KERNELS.items():
    for _key, _device in (("CPU", "cpu"), ("CUDA", "cuda"), ("CompositeExplicitAutograd", "other")):
        _lib.impl(_op, kernel(_op, _device), _key)
    torch.library.register_fake(f"qcomm::{_op}", _fake if _at is None else _with_codec(_fake, _at), lib=_lib)


# ---------------------------------------------------------------------------------------------- which form runs
row_at_a_time = cpu.row_at_a_time
encode_row = cpu.encode_row
segments_fused = cuda_segments.segments_fused
segments_kernel = cuda_segments.segments_kernel
