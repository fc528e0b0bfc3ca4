"""The 1-bit sign ops, the CPU kernels of the 1-bit all-reduce's phases (``codecs.sign_phases``): schemas, fake
kernels, default kernels and their checked entry points.

    qcomm::sign_encode_err(y, scale, payload!, err!, valid, err_len)   one sign1 payload of y, and y - C(y)
    qcomm::sign_server_sum(buf, world, c, server_error, valid, z!)     z = (sum_r C_r) / world + e_s, in rank order
    qcomm::sign_decode(payload, c, out!)                               the first len(out) decoded values

A payload of c elements is ceil(c/8) code bytes (bit k of byte g set where y[8g+k] < 0, as ``layout``) then
the scale as fp32; decoding flips the scale's sign bit where the code is 1 (``(1 - 2 code) * s`` for every
non-NaN s). The CPU kernels are the C ones (``kernels/cpu``, registered when ``codecs.native`` loads them); the
default kernels below are the same arithmetic in torch (any device), bit for bit (tests/codecs/test_torch_ops.py).
``sign_scale`` is the sign1 codec's one-bucket scale; ``sign_encode_err`` / ``sign_server_sum`` / ``sign_decode``
check their buffers and call the ops.

Example::

    >>> payload = torch.empty((c + 7) // 8 + 4, dtype=torch.uint8)
    >>> sign_encode_err(y, sign_scale(y), payload, err, c, c)
"""

from __future__ import annotations

import torch

from lightning_qcomm.codecs import layout, registry
from lightning_qcomm.codecs.cpu_fused import FLT_MAX, _check_f32, _plain_scales_params, _require, _scales

_lib = torch.library.Library("qcomm", "FRAGMENT")
_lib.define("sign_encode_err(Tensor y, float scale, Tensor(a!) payload, Tensor(b!) err, int valid, int err_len) -> ()")
_lib.define("sign_server_sum(Tensor buf, int world, int c, Tensor server_error, int valid, Tensor(a!) z) -> ()")
_lib.define("sign_decode(Tensor payload, int c, Tensor(a!) out) -> ()")


def _scale32(scale: float, device: torch.device) -> torch.Tensor:
    return torch.tensor([scale], dtype=torch.float32, device=device)  # rounded as the C kernel's (float) cast


def _values(payload: torch.Tensor, c: int, length: int) -> torch.Tensor:
    """The first ``length`` decoded values of a c-element payload: the scale with its sign bit flipped where
    the code bit is set."""
    nb = (c + 7) // 8
    su = payload[nb : nb + 4].clone().view(torch.int32)
    bits = layout.unpack_bits(payload[:nb], 1, length).to(torch.int32)
    return (su ^ (bits << 31)).view(torch.float32)


def sign_encode_err_reference(
    y: torch.Tensor, scale: float, payload: torch.Tensor, err: torch.Tensor, valid: int, err_len: int
) -> None:
    """Default kernel of ``qcomm::sign_encode_err``: codes of ``y < 0`` and, where the fp32 scale s is finite,
    err[:valid] = y - (y < 0 ? -s : s); a non-finite s gives zero codes and leaves err[:valid]; err[valid:err_len]
    = 0; the scale after the codes."""
    c = y.numel()
    nb = (c + 7) // 8
    s_host = _scale32(scale, torch.device("cpu"))
    s = s_host.to(y.device)
    flat = y.reshape(-1)
    if torch.isfinite(s_host).item():  # the scale is a host number: asking reads no device memory
        payload[:nb] = layout.pack_bits((flat < 0).to(torch.uint8), 1)
        if valid > 0:
            head = flat[:valid]
            err.view(-1)[:valid] = head - torch.where(head < 0, -s, s)
    else:
        payload[:nb] = 0
    err.view(-1)[max(valid, 0) : err_len] = 0.0
    payload[nb : nb + 4] = s.view(torch.uint8)


def sign_server_sum_reference(
    buf: torch.Tensor, world: int, c: int, server_error: torch.Tensor, valid: int, z: torch.Tensor
) -> None:
    """Default kernel of ``qcomm::sign_server_sum``: z[:n] = (v_0 + v_1 + ... + v_{world-1}) / world + e_s[:n]
    (left to right, n = clamp(valid, 0, c)), z[n:c] = 0."""
    p = (c + 7) // 8 + 4
    n = max(min(valid, c), 0)
    zf = z.view(-1)
    if n:
        acc = _values(buf[:p], c, n)
        for r in range(1, world):
            acc = acc + _values(buf[r * p : (r + 1) * p], c, n)
        # a true division by a tensor, as the C kernel's acc / (float)world (never x * (1 / world))
        zf[:n] = acc / torch.full_like(acc, float(world)) + server_error.reshape(-1)[:n]
    zf[n:c] = 0.0


def sign_decode_reference(payload: torch.Tensor, c: int, out: torch.Tensor) -> None:
    """Default kernel of ``qcomm::sign_decode``."""
    length = out.numel()
    if length:
        out.view(-1).copy_(_values(payload, c, length))


_lib.impl("sign_encode_err", sign_encode_err_reference, "CompositeExplicitAutograd")
_lib.impl("sign_server_sum", sign_server_sum_reference, "CompositeExplicitAutograd")
_lib.impl("sign_decode", sign_decode_reference, "CompositeExplicitAutograd")


@torch.library.register_fake("qcomm::sign_encode_err")
def _sign_encode_err_fake(y, scale, payload, err, valid, err_len) -> None:
    return None


@torch.library.register_fake("qcomm::sign_server_sum")
def _sign_server_sum_fake(buf, world, c, server_error, valid, z) -> None:
    return None


@torch.library.register_fake("qcomm::sign_decode")
def _sign_decode_fake(payload, c, out) -> None:
    return None


# ---------------------------------------------------------------------------------------------- checked entry points
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
