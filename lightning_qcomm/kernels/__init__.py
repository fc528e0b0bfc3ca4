"""Triton kernels of the codec layer, shipped as ``lightning_qcomm.kernels``.

``encode(codec, xf, enc_params, seed)`` and ``decode(codec, codes, dec_params, numel)`` are the fused
element-wise halves of every codec (random bits, quantize, bit packing and back), bit-identical to
``Codec.encode_reference`` / ``Codec.decode_reference``; their constants are the codec's ``kernel_spec()``,
the same the C kernels read; ``wire_encode_params(codec, xf)`` computes the wire scales and encode parameters of
every codec in one launch (``fused_scales`` says when). They are the CUDA kernels of the ops
``qcomm::encode`` / ``decode``
(``codecs.ops``), used when ``HAS_TRITON``. With ``TRITON_INTERPRET=1`` set before this package is imported (Triton reads it
when the kernels are decorated), the same kernels run on CPU tensors through Triton's interpreter,
which is how the tests compare them with the reference.
"""

from __future__ import annotations

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:  # e.g. macOS / Windows, where triton is not a dependency
    HAS_TRITON = False

if HAS_TRITON:
    from .codec_kernels import decode, decode_rows, encode, encode_rows
    from .wire_params import fused_scales, wire_encode_params
else:

    def encode(codec, xf, enc_params, seed):  # noqa: D103
        raise ImportError("lightning_qcomm.kernels.encode needs triton, which is not installed")

    def decode(codec, codes, dec_params, numel, wire=False):  # noqa: D103
        raise ImportError("lightning_qcomm.kernels.decode needs triton, which is not installed")

    def decode_rows(codec, wire, n):  # noqa: D103
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
    Two launches (scales and parameters of every row's buckets; the codes of every row, straight into the wire
    rows) and one copy of the scales behind the codes."""
    import torch

    from lightning_qcomm.codecs import packing, scaling

    r, n = rows.shape
    xf = rows.detach().to(torch.float32).contiguous()
    scales, params = wire_encode_params(codec, xf, scaling.output_max(rows.dtype))
    wire = torch.empty(r, codec.nbytes(n), dtype=torch.uint8, device=rows.device)
    encode_rows(codec, xf, params, keys, wire)
    wire[:, packing.packed_nbytes(n, codec.bits) :].copy_(scales.view(r, -1).view(torch.uint8))
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
