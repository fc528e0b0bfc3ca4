"""Triton kernels of the codec layer, shipped as ``lightning_qcomm.kernels``.

``encode(codec, xf, enc_params, seed)`` and ``decode(codec, codes, dec_params, numel)`` are the fused
element-wise halves of every codec (random bits, quantize, bit packing and back), bit-identical to
``Codec.encode_reference`` / ``Codec.decode_reference``; their constants are the codec's ``kernel_spec()``,
the same the C kernels read. They are the CUDA kernels of the ops ``qcomm::encode`` / ``decode``
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
    from .codec_kernels import decode, encode
else:

    def encode(codec, xf, enc_params, seed):  # noqa: D103
        raise ImportError("lightning_qcomm.kernels.encode needs triton, which is not installed")

    def decode(codec, codes, dec_params, numel):  # noqa: D103
        raise ImportError("lightning_qcomm.kernels.decode needs triton, which is not installed")


__all__ = ["HAS_TRITON", "decode", "encode"]
