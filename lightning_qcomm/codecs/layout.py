"""What the torch codecs and every kernel agree on: the packed layout of the codes, the element-wise kernel's spec.

Packing of b-bit codes (1 <= b <= 8): codes are packed in groups of 8, the group's value
``v = sum_i code_i << (b*i)`` occupies exactly ``b`` bytes, written little-endian. A tensor of n codes therefore
takes ``ceil(n/8) * b`` bytes; the last group is padded with zero codes. The layout is the same in the Triton
kernels.

``Codec.kernel_spec()`` returns a ``KernelSpec``: the kind and constants of the codec's element-wise kernel, the
one description every backend reads. The C kernels (``kernels/cpu``, CPU) receive its fields as the arguments of
the ``qcomm::c_*`` ops, the Triton kernels (``lightning_qcomm.kernels``, CUDA) as ``tl.constexpr`` values, and both
switch on the same ``KernelKind`` numbers (the C build gets them as ``-DQC_KIND_<NAME>=<value>``, so there is no
second table to keep in step).

Example::

    >>> get_codec("qsgd", bits=4).kernel_spec().levels
    7
    >>> packed_nbytes(10, 3)  # two groups of 8 codes, 3 bytes each
    6
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch


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
    """The kind and constants of a codec's element-wise kernel. Fields (0 where a kind does not use one):

    - ``kind``: the element-wise map (``KernelKind``); qsgd and qsgdinf share one, their norms differ in torch;
    - ``bits``; ``bucket`` (elements per bucket, 0 = the whole tensor); ``stochastic`` (draw u, else round to nearest);
    - ``levels``: uniform 2^b - 1, qsgd s = 2^(b-1) - 1, nuqsgd L - 1; ``sign_bit``: 2^(b-1) (qsgd, nuqsgd);
    - ``emin``: nuqsgd's smallest level exponent, fp8's 1 - bias; ``mbits``, ``bias``: fp8's mantissa bits, bias;
    - ``fmax``: fp8's largest finite value; qsgd: 256, the clamp of the scaled magnitude (> s + 1, so it changes
      no level, and the C loop stays branch-free);
    - ``fp8_e4m3fn``: e4m3fn decoding (one NaN pattern, no infinities) instead of e5m2's IEEE-like one;
    - ``enc_params`` / ``dec_params``: P, the per-bucket parameters of ``_encode_params`` / ``_decode_params``.
    """

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


def packed_nbytes(numel: int, bits: int) -> int:
    """Bytes that ``numel`` codes of ``bits`` bits occupy once packed (padding included)."""
    return -(-numel // 8) * bits


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack a flat uint8 tensor of codes (< 2**bits) into ``packed_nbytes(len, bits)`` bytes."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    n = codes.numel()
    groups = -(-n // 8)
    if groups * 8 != n:
        codes = torch.nn.functional.pad(codes.reshape(-1), (0, groups * 8 - n))
    if bits == 8:
        return codes.reshape(-1).contiguous()
    # Code i occupies bits [b*i, b*i + b) of the group: its low part goes to byte j = b*i // 8 at bit
    # s = b*i % 8, the rest (if s + b > 8) to byte j + 1. uint8 shifts drop the bits above 7.
    c = codes.reshape(groups, 8)
    out = torch.zeros(groups, bits, dtype=torch.uint8, device=codes.device)
    for i in range(8):
        j, s = divmod(bits * i, 8)
        out[:, j] |= c[:, i] << s
        if s + bits > 8:
            out[:, j + 1] |= c[:, i] >> (8 - s)
    return out.reshape(-1)


def unpack_bits(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``numel`` codes as uint8."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    if bits == 8:
        return packed.reshape(-1)[:numel]
    groups = packed.numel() // bits
    b = packed.reshape(groups, bits)
    codes = torch.empty(groups, 8, dtype=torch.uint8, device=packed.device)
    for i in range(8):
        j, s = divmod(bits * i, 8)
        v = b[:, j] >> s
        if s + bits > 8:
            v |= b[:, j + 1] << (8 - s)  # uint8: only the low bits survive, the mask keeps b of them
        torch.bitwise_and(v, (1 << bits) - 1, out=codes[:, i])
    return codes.reshape(-1)[:numel]
