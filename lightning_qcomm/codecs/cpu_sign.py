"""CPU kernels of the 1-bit sign path of ``collectives.onebit_all_reduce``: the checked entry points of the sign ops.

``sign_scale`` is the sign1 codec's one-bucket scale (its fp32 L2 norm by torch, as ``Codec.encode``), and
``sign_encode_err`` / ``sign_server_sum`` / ``sign_decode`` check their buffers and call the ``qcomm::sign_*``
ops (``codecs.sign_ops``; the C kernels in ``kernels/cpu``), which fuse the worker's encode with its
error update, the server's decode-sum-re-encode and the final decode into one pass each, bit-identical to the
sign1 codec path (tests/test_collectives.py).

Example::

    >>> y = torch.randn(1000)
    >>> payload, err = torch.empty((1000 + 7) // 8 + 4, dtype=torch.uint8), torch.zeros(1000)
    >>> sign_encode_err(y, sign_scale(y), payload, err, 1000, 1000)
"""

from __future__ import annotations

import torch

from lightning_qcomm.codecs import registry
from lightning_qcomm.codecs.cpu_fused import FLT_MAX, _check_f32, _plain_scales_params, _require, _scales


def _check_u8(name: str, t: torch.Tensor, numel: int) -> None:
    if t.dtype != torch.uint8 or t.device.type != "cpu" or not t.is_contiguous() or t.numel() < numel:
        raise ValueError(f"{name} must be a contiguous CPU uint8 tensor of >= {numel} bytes, got {tuple(t.shape)}")


def sign_scale(y: torch.Tensor) -> float:
    """The sign1 codec's wire scale of ``y`` as one bucket: ||y||_2 / sqrt(len y), NaN if any element
    is non-finite (``Codec.encode``'s scale, bit for bit)."""
    _require()
    codec = _sign1()
    x = y.reshape(-1).to(torch.float32).contiguous()
    plain = _plain_scales_params(codec, x, FLT_MAX)
    return float((plain[0] if plain is not None else _scales(codec, x))[0, 0])


_SIGN1 = []


def _sign1():
    """The sign1 codec (one bucket), built once."""
    if not _SIGN1:
        _SIGN1.append(registry.codec_spec("sign1").build())
    return _SIGN1[0]


def sign_encode_err(
    y: torch.Tensor, scale: float, payload: torch.Tensor, err: torch.Tensor, valid: int, err_len: int
) -> None:
    """One sign1 payload of ``y`` (c elements, one bucket) into ``payload`` (``SignCodec().nbytes(c)``
    bytes: packed codes, then ``scale`` as fp32), and the residual y - C(y) into ``err``.

    ``scale`` must be ``sign_scale(y)``. err[:valid] <- y - C(y) if the scale is finite, else unchanged
    (the reference keeps the previous residual where the new one is non-finite); err[valid:err_len] <- 0.
    Equals ``encode(y).to_bytes()`` and ``_update_error(err, y - decode(...))`` of the reference.
    """
    c = y.numel()
    nb = (c + 7) // 8
    _check_f32("y", y, c)
    _check_u8("payload", payload, nb + 4)
    if not 0 <= valid <= err_len <= c:
        raise ValueError(f"need 0 <= valid ({valid}) <= err_len ({err_len}) <= len(y) ({c})")
    _check_f32("err", err, err_len)
    _require()
    torch.ops.qcomm.sign_encode_err(y, scale, payload, err, valid, err_len)


def sign_server_sum(
    buf: torch.Tensor, world: int, c: int, server_error: torch.Tensor, valid: int, z: torch.Tensor
) -> None:
    """z <- (sum over the ``world`` sign1 payloads of ``buf``, decoded, in rank order) / world
    + server_error, for the first ``valid`` elements, 0 for the rest of the c (1-bit Adam's server
    step). Equals ``decode_rows(buf).sum(dim=0).div_(world) + server_error`` with the padding zeroed."""
    if not 1 <= world <= 256:
        raise ValueError(f"world must be in [1, 256], got {world}")
    p = (c + 7) // 8 + 4
    n = max(min(valid, c), 0)
    _check_u8("buf", buf, world * p)
    _check_f32("server_error", server_error, n)
    _check_f32("z", z, c)
    _require()
    torch.ops.qcomm.sign_server_sum(buf, world, c, server_error, valid, z)


def sign_decode(payload: torch.Tensor, c: int, out: torch.Tensor) -> None:
    """The first ``out.numel()`` values of one sign1 payload of c elements, written into ``out``."""
    length = out.numel()
    if length > c:
        raise ValueError(f"out has {length} elements, more than the payload's {c}")
    _check_u8("payload", payload, (c + 7) // 8 + 4)
    _check_f32("out", out, length)
    _require()
    torch.ops.qcomm.sign_decode(payload, c, out)
