"""The device kernels of the codec layer, shipped as ``lightning_qcomm.kernels``: this facade, the Triton kernels
(``kernels.cuda``, CUDA) and the C++ sources of the CPU kernels (``kernels/cpu``, compiled by ``codecs.native``);
docs/design.md, "Layers and files".

``encode(codec, xf, enc_params, seed)`` and ``decode(codec, codes, dec_params, numel)`` are the fused element-wise
halves of every codec, bit-identical to ``Codec.encode_reference`` / ``decode_reference`` (their constants are the
codec's ``kernel_spec()``, the same the C kernels read); ``wire_encode_params(codec, xf)`` computes the wire scales
and encode parameters in one launch (``fused_scales`` says when). They are the CUDA kernels of ``qcomm::encode`` /
``decode`` (``codecs.ops``), used when ``HAS_TRITON``. With ``TRITON_INTERPRET=1`` set before import, the same
kernels run on CPU tensors through Triton's interpreter, which is how the tests compare them with the reference.

The repository keeps the modules in its top-level ``kernels/`` (``cuda/``, ``cpu/``), which ``pyproject.toml`` maps
to ``lightning_qcomm/kernels/`` in a wheel; in a source checkout this facade adds that folder to its ``__path__``.
The folder has no ``__init__.py`` on purpose: with the repository root on ``sys.path`` it is only a namespace
portion, which never shadows PyPI's ``kernels`` package (which ``transformers`` imports).

Example::

    >>> from lightning_qcomm import kernels
    >>> kernels.encode is kernels.codec_kernels.encode  # with triton installed
    True
"""

from __future__ import annotations

import os as _os

_CHECKOUT_KERNELS = _os.path.join(_os.path.dirname(_os.path.dirname(_os.path.dirname(__file__))), "kernels")
if not _os.path.isdir(_os.path.join(_os.path.dirname(__file__), "cuda")) and _os.path.isfile(
    _os.path.join(_CHECKOUT_KERNELS, "cuda", "codec_kernels.py")
):  # a source checkout: the modules are in the repository's top-level kernels/
    __path__.append(_CHECKOUT_KERNELS)

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:  # e.g. macOS / Windows, where triton is not a dependency
    HAS_TRITON = False

if HAS_TRITON:
    # kernels.codec_kernels / .wire_params: the modules the ops read (tests patch them there)
    from .cuda import (  # noqa: F401
        codec_kernels,
        elementwise,
        reduce_kernels,
        rotation_kernels,
        rounding_kernels,
        segment_kernels,
        wire_params,
    )
    from .cuda.codec_kernels import decode, decode_rows, encode, encode_rows
    from .cuda.wire_params import fused_scales, wire_encode_params
else:

    def encode(codec, xf, enc_params, seed):  # noqa: D103
        raise ImportError("lightning_qcomm.kernels.encode needs triton, which is not installed")

    def decode(codec, codes, dec_params, numel, wire=False):  # noqa: D103
        raise ImportError("lightning_qcomm.kernels.decode needs triton, which is not installed")

    def decode_rows(codec, wire, n, out=None):  # noqa: D103
        raise ImportError("lightning_qcomm.kernels.decode_rows needs triton, which is not installed")

    def encode_rows(codec, rows, enc_params, keys, out):  # noqa: D103
        raise ImportError("lightning_qcomm.kernels.encode_rows needs triton, which is not installed")

    def fused_scales(codec, numel):  # noqa: D103
        return False

    def wire_encode_params(codec, xf, out_max=None):  # noqa: D103
        raise ImportError("lightning_qcomm.kernels.wire_encode_params needs triton, which is not installed")


def encode_codec(codec, xf, seed: int, out_max: float):
    """(packed codes, wire scales) of flat fp32 ``xf`` through the kernels, as ``codec.encode_torch(xf, seed,
    out_max)``: two launches where ``fused_scales`` holds, else the parameters in torch and the codes in one."""
    if fused_scales(codec, xf.numel()):
        scales, params = wire_encode_params(codec, xf, out_max)
        return encode(codec, xf, params, seed), scales
    return codec.encode_torch(xf, seed, out_max, lambda v, p, s: encode(codec, v, p, s))


def encode_rows_codec(codec, rows, keys):
    """(R, ``codec.nbytes(n)``) uint8: row j is ``codec.encode(rows[j], seed_j).to_bytes()`` bit for bit, for a codec
    with ``fused_scales`` and ``keys`` the (R, 2) int32 key words of the seeds (None: a deterministic codec).
    Two launches, both writing the wire rows: every row's buckets' scales (as bytes behind the codes) and encode
    parameters; then the codes of every row."""
    import torch

    from lightning_qcomm.codecs import scaling

    r, n = rows.shape
    xf = rows.detach().to(torch.float32).contiguous()
    wire = torch.empty(r, codec.nbytes(n), dtype=torch.uint8, device=rows.device)
    _, params = wire_encode_params(codec, xf, scaling.output_max(rows.dtype), wire=wire)
    encode_rows(codec, xf, params, keys, wire)
    return wire


def decode_codec(codec, codes, scales, numel: int):
    """Flat fp32 values of ``numel`` packed codes given the wire scales, in one launch."""
    return decode(codec, codes, scales, numel, wire=True)


__all__ = [
    "HAS_TRITON",
    "decode",
    "decode_codec",
    "decode_rows",
    "encode",
    "encode_codec",
    "encode_rows",
    "encode_rows_codec",
    "fused_scales",
    "wire_encode_params",
]
