"""The one description of a codec's element-wise kernel that every backend reads: kind and constants.

``Codec.kernel_spec()`` returns a ``KernelSpec``. The C kernels (``kernels/cpu``, CPU) receive its
fields as the arguments of the ``qcomm::c_*`` ops, the Triton kernels (``lightning_qcomm.kernels``, CUDA) as
``tl.constexpr`` values, and both switch on the same ``KernelKind`` numbers (the C build gets them as
``-DQC_KIND_<NAME>=<value>``, so there is no second table to keep in step).

Fields (0 where a kind does not use one):

- ``kind``: the element-wise map (``KernelKind``); qsgd and qsgdinf share one, their norms differ in torch;
- ``bits``; ``bucket`` (elements per bucket, 0 = the whole tensor); ``stochastic`` (draw u, else round to nearest);
- ``levels``: uniform 2^b - 1, qsgd s = 2^(b-1) - 1, nuqsgd L - 1; ``sign_bit``: 2^(b-1) (qsgd, nuqsgd);
- ``emin``: nuqsgd's smallest level exponent, fp8's 1 - bias; ``mbits``, ``bias``: fp8's mantissa bits, bias;
- ``fmax``: fp8's largest finite value; qsgd: 256, the clamp of the scaled magnitude (> s + 1, so it changes
  no level, and the C loop stays branch-free);
- ``fp8_e4m3fn``: e4m3fn decoding (one NaN pattern, no infinities) instead of e5m2's IEEE-like one;
- ``enc_params`` / ``dec_params``: P, the per-bucket parameters of ``_encode_params`` / ``_decode_params``.

Example::

    >>> get_codec("qsgd", bits=4).kernel_spec().levels
    7
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass


def redo_floor(row_len: int) -> float:
    """The smallest first-pass norm ``qsgd.l2_norm_rows64`` accepts for rows of ``row_len`` elements: sqrt(n) * 2^-51
    (the norm kernels read it as ``REDO_FLOOR``)."""
    return math.sqrt(row_len) * 2.0**-51


class KernelKind(enum.IntEnum):
    """The element-wise maps the native kernels implement."""

    UNIFORM = 0
    QSGD = 1
    NUQSGD = 2
    SIGN = 3
    FP8 = 4


@dataclass(frozen=True)
class KernelSpec:
    kind: KernelKind
    bits: int
    bucket: int
    stochastic: bool
    enc_params: int
    dec_params: int
    levels: int = 0
    sign_bit: int = 0
    emin: int = 0
    mbits: int = 0
    bias: int = 0
    fmax: float = 0.0
    fp8_e4m3fn: bool = False

    def c_args(self) -> dict[str, object]:
        """Keyword arguments of the ``qcomm::c_*`` ops (their schemas name these fields)."""
        return {
            "kind": int(self.kind),
            "bits": self.bits,
            "bucket": self.bucket,
            "stochastic": self.stochastic,
            "levels": self.levels,
            "sign_bit": self.sign_bit,
            "emin": self.emin,
            "mbits": self.mbits,
            "bias": self.bias,
            "fmax": self.fmax,
        }


# The schema fragment of those keyword arguments, in the order of QC_SPEC_PARAMS in kernels/cpu/qcomm_ops.cpp.
C_SPEC_SCHEMA = "int kind, int bits, int bucket, bool stochastic, int levels, int sign_bit, int emin, int mbits, int bias, float fmax"


def c_kind_defines() -> tuple[str, ...]:
    """``-DQC_KIND_UNIFORM=0 ...``: the kind numbers, for the C build."""
    return tuple(f"-DQC_KIND_{k.name}={k.value}" for k in KernelKind)
