"""Codecs: pure tensor -> Packed -> tensor functions (layer 0; docs/design.md, "Codecs", "Layers and files").
Every layer goes through ``get_codec``.

>>> codec = get_codec("qsgd", bits=4, bucket_size=512)
>>> packed = codec.encode(x, seed=derive_seed(0, step, rank))
>>> y = codec.decode(packed)          # same shape and dtype as x; packed.nbytes on the wire

The names, bit ranges and options come from the registry (``codecs.registry``: ``register_codec`` on each
class, ``codec_names`` / ``codec_spec`` for the lists); ``encode`` / ``decode`` run as the torch ops
``torch.ops.qcomm.*`` (``codecs.ops``), and so do ``encode_rows`` / ``decode_rows`` (R rows of one codec, row j
with its own seed, in a number of ops that does not depend on R: ``codecs.rows``).
"""

from __future__ import annotations

# The codec modules register their classes on import, in this order: the order of CODEC_NAMES.
from lightning_qcomm.codecs.uniform import UniformCodec

# isort: split
from lightning_qcomm.codecs.qsgd import NUQSGDCodec, QSGDCodec, QSGDInfCodec, SignCodec

# isort: split
from lightning_qcomm.codecs.fp8 import FP8Codec

# isort: split
from lightning_qcomm.codecs.eden import EdenCodec

# isort: split
from lightning_qcomm.codecs import ops as _ops  # noqa: F401  (defines torch.ops.qcomm.*)
from lightning_qcomm.codecs import sign_phases  # noqa: F401  (the 1-bit all-reduce's phases)
from lightning_qcomm.codecs.base import Codec, Packed
from lightning_qcomm.codecs.ops import encode_row, row_at_a_time, segments_fused, segments_kernel
from lightning_qcomm.codecs.registry import (
    NO_COMPRESSION,
    CodecSpec,
    allowed_bits,
    check_codec_bits,
    codec_names,
    codec_spec,
    register_codec,
    resolve_codec,
)
from lightning_qcomm.codecs.rng import derive_seed
from lightning_qcomm.codecs.rows import decode_rows, decode_rows_into, encode_rows
from lightning_qcomm.codecs.rows_reduce import decode_rows_sum, feedback_rows, feedback_update

CODEC_NAMES = codec_names()


def get_codec(name: str, bits: int | None = None, bucket_size: int | None = None, **opts) -> Codec:
    """Build a codec by name.

    Args:
        name: one of ``CODEC_NAMES`` (``codec_names()``).
        bits: code width, within ``codec_spec(name).bits`` (uniform 1..8, qsgd/qsgdinf/nuqsgd 2..8, sign1 1,
            fp8_* 8, eden 1..4). None picks the codec's default (1 for sign1, 2 for eden, else 8).
        bucket_size: elements per scale block; None picks the codec default (``codec_spec(name).default_bucket(bits)``:
            512; 128 for qsgd at 4 bits or fewer; the whole tensor for sign1; 4096 for eden, a power of two).
        opts: the options of ``codec_spec(name).options``: ``stochastic`` (uniform: False rounds to nearest),
            ``rounding`` (fp8: "nearest" | "stochastic").

    Example::

        >>> get_codec("fp8_e4m3", rounding="stochastic").stochastic
        True
    """
    return codec_spec(name).build(bits, bucket_size, **opts)


__all__ = [
    "CODEC_NAMES",
    "NO_COMPRESSION",
    "Codec",
    "CodecSpec",
    "EdenCodec",
    "FP8Codec",
    "NUQSGDCodec",
    "Packed",
    "QSGDCodec",
    "QSGDInfCodec",
    "SignCodec",
    "UniformCodec",
    "allowed_bits",
    "check_codec_bits",
    "codec_names",
    "codec_spec",
    "decode_rows",
    "decode_rows_into",
    "decode_rows_sum",
    "derive_seed",
    "encode_row",
    "encode_rows",
    "feedback_rows",
    "feedback_update",
    "get_codec",
    "register_codec",
    "resolve_codec",
    "row_at_a_time",
    "segments_fused",
    "segments_kernel",
]
