"""The fused 1-bit phases: the codec layer's door to the fused CPU sign kernels for ``collectives.onebit_all_reduce``.

With C(y) = (||y||_2 / sqrt(len y)) * sign(y) (the ``sign1`` codec with one bucket, sign(0) = +1) and a payload of
c elements = ceil(c/8) code bytes then the scale as fp32, the three phases are, each one pass, bit-identical to the
sign1 codec's encode / decode (tests/test_collectives.py)::

    encode_with_error(y, payload, err, valid, err_len)   payload <- C(y); err[:valid] <- y - C(y) where the scale
                                                          is finite (else unchanged); err[valid:err_len] <- 0
    server_sum(buf, world, c, server_error, valid, z)    z <- (sum_r C_r) / world + e_s (rank order), padding 0
    decode(payload, c, out)                              out <- the first len(out) values of C

``available(x, c)`` says whether they apply (CPU, the C library built and not switched off, chunks of at least
the fused path's size); the checks and the ``qcomm::sign_*`` ops are in ``codecs.cpu_sign`` / ``codecs.sign_ops``.

Example::

    >>> y = torch.randn(1000)
    >>> payload, err = torch.empty((1000 + 7) // 8 + 4, dtype=torch.uint8), torch.zeros(1000)
    >>> if available(y, 1000):
    ...     encode_with_error(y, payload, err, 1000, 1000)
"""

from __future__ import annotations

import torch

from lightning_qcomm.codecs import cpu_fused, cpu_sign


def available(x: torch.Tensor, c: int) -> bool:
    """Whether the fused sign phases can code chunks of ``c`` elements of ``x``'s device (``cpu_fused.use_fused``
    for the one-bucket sign1 codec)."""
    return cpu_fused.use_fused(cpu_sign._sign1(), x, c)


def encode_with_error(y: torch.Tensor, payload: torch.Tensor, err: torch.Tensor, valid: int, err_len: int) -> None:
    """payload <- C(y)'s bytes (``SignCodec().nbytes(len y)``), err[:valid] <- y - C(y) where the scale is finite,
    err[valid:err_len] <- 0 (see the module docstring); ``y``, ``err``: contiguous CPU fp32."""
    cpu_sign.sign_encode_err(y, cpu_sign.sign_scale(y), payload, err, valid, err_len)


def server_sum(buf: torch.Tensor, world: int, c: int, server_error: torch.Tensor, valid: int, z: torch.Tensor) -> None:
    """z <- (sum over the ``world`` payloads of ``buf``, decoded, in rank order) / world + server_error for the
    first ``valid`` elements, 0 for the rest of the c."""
    cpu_sign.sign_server_sum(buf, world, c, server_error, valid, z)


def decode(payload: torch.Tensor, c: int, out: torch.Tensor) -> None:
    """out <- the first ``out.numel()`` values of one payload of c elements."""
    cpu_sign.sign_decode(payload, c, out)


__all__ = ["available", "decode", "encode_with_error", "server_sum"]
