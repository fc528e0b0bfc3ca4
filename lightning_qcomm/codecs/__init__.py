"""Codecs: pure tensor -> Packed -> tensor functions (docs/design.md, "Codecs"). Every layer goes through ``get_codec``.

>>> codec = get_codec("qsgd", bits=4, bucket_size=512)
>>> packed = codec.encode(x, seed=derive_seed(0, step, rank))
>>> y = codec.decode(packed)          # same shape and dtype as x; packed.nbytes on the wire
"""

from __future__ import annotations

from lightning_qcomm.codecs.base import Codec, Packed
from lightning_qcomm.codecs.fp8 import FP8Codec
from lightning_qcomm.codecs.qsgd import NUQSGDCodec, QSGDCodec, QSGDInfCodec
from lightning_qcomm.codecs.rng import derive_seed
from lightning_qcomm.codecs.sign import SignCodec
from lightning_qcomm.codecs.uniform import UniformCodec

CODEC_NAMES = ("uniform", "qsgd", "qsgdinf", "nuqsgd", "sign1", "fp8_e4m3", "fp8_e5m2")

_DEFAULT_BUCKET = 512


def get_codec(name: str, bits: int | None = None, bucket_size: int | None = None, **opts) -> Codec:
    """Build a codec by name.

    Args:
        name: one of ``CODEC_NAMES``.
        bits: code width; uniform 1..8, qsgd/qsgdinf/nuqsgd 2..8, sign1 1, fp8_* 8. None picks the
            codec's default (1 for sign1, else 8).
        bucket_size: elements per scale block; None picks the codec default (512, or the whole
            tensor for sign1).
        opts: ``stochastic`` (uniform: False rounds to nearest), ``rounding`` (fp8: "nearest" |
            "stochastic").
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    key = name.lower()
    if key not in CODEC_NAMES:
        raise ValueError(f"unknown codec name {name!r}; allowed: {', '.join(CODEC_NAMES)}")
    allowed = {"uniform": {"stochastic"}, "fp8_e4m3": {"rounding"}, "fp8_e5m2": {"rounding"}}.get(key, set())
    extra = set(opts) - allowed
    if extra:
        raise TypeError(f"codec {key!r} got unexpected option(s) {sorted(extra)}; allowed: {sorted(allowed)}")
    if bits is None:
        bits = 1 if key == "sign1" else 8
    if key == "sign1":
        return SignCodec(bits, bucket_size)
    bucket = _DEFAULT_BUCKET if bucket_size is None else bucket_size
    if key == "uniform":
        return UniformCodec(bits, bucket, **opts)
    if key == "qsgd":
        return QSGDCodec(bits, bucket)
    if key == "qsgdinf":
        return QSGDInfCodec(bits, bucket)
    if key == "nuqsgd":
        return NUQSGDCodec(bits, bucket)
    return FP8Codec(bits, bucket, fmt=key.split("_")[1], **opts)


__all__ = [
    "CODEC_NAMES",
    "Codec",
    "FP8Codec",
    "NUQSGDCodec",
    "Packed",
    "QSGDCodec",
    "QSGDInfCodec",
    "SignCodec",
    "UniformCodec",
    "derive_seed",
    "get_codec",
]
