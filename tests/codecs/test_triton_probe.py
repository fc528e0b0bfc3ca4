"""The CUDA kernels of the codec ops check that Triton works before trusting it.

``codecs.triton_probe.triton_works`` runs a codec's Triton encode/decode once per device next to the torch
reference; a kernel that raises (a driver or architecture Triton does not support) or disagrees makes that
codec use the reference there, with one warning. On CPU the Triton kernels are replaced by stand-ins: the
reference itself (works), one that raises, one that flips a code; the CUDA kernels of ``encode``/``decode`` are called
directly on CPU tensors (their logic does not depend on the device beyond ``on_device``).
"""

from __future__ import annotations

import logging

import pytest
import torch

from lightning_qcomm import kernels
from lightning_qcomm.codecs import get_codec, ops, triton_probe


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(triton_probe, "_verdicts", {})
    monkeypatch.setattr(triton_probe, "_failures", {})
    monkeypatch.setattr(kernels, "HAS_TRITON", True)
    monkeypatch.delenv("LIGHTNING_QCOMM_DISABLE_TRITON", raising=False)
    calls = {"encode": 0, "decode": 0}

    def enc(codec, xf, p, s):
        calls["encode"] += 1
        return codec.encode_reference(xf, p, s)

    def dec(codec, codes, p, n, wire=False):
        calls["decode"] += 1
        return codec.decode_reference(codes, codec._decode_params(p) if wire else p, n)

    def wire(codec, xf, out_max):  # the fused scales kernel's stand-in: the reference's scales and parameters
        scales = codec.bucket_scales(xf)
        return scales, codec._encode_params(scales, out_max)

    monkeypatch.setattr(kernels, "encode", enc)
    monkeypatch.setattr(kernels, "decode", dec)
    monkeypatch.setattr(kernels, "wire_encode_params", wire)
    return calls


CPU = torch.device("cpu")


def test_working_kernels_are_used_after_one_check(fresh):
    codec = get_codec("uniform", bits=4, bucket_size=128)
    x = torch.randn(1000)
    want = ops.kernel("encode", "other")(x, *codec.op_args(), 3)
    got = ops.kernel("encode", "cuda")(x, *codec.op_args(), 3)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert fresh["encode"] == 2  # the probe's one, then the real call
    ops.kernel("encode", "cuda")(x, *codec.op_args(), 4)
    assert fresh["encode"] == 3  # checked once per codec and device
    out = ops.kernel("decode", "cuda")(*got, 1000, *codec.op_args())
    assert torch.equal(out, ops.kernel("decode", "other")(*got, 1000, *codec.op_args()))


@pytest.mark.parametrize("failure", ["raises", "wrong codes"])
def test_failing_kernels_fall_back_to_the_reference_with_one_warning(failure, monkeypatch, caplog):
    def bad(codec, xf, p, s):
        if failure == "raises":
            raise RuntimeError("PTX .version 9.9 does not support .target sm_99")
        codes = codec.encode_reference(xf, p, s)
        codes[0] ^= 1
        return codes

    monkeypatch.setattr(kernels, "encode", bad)
    codec = get_codec("qsgd", bits=4, bucket_size=256)
    x = torch.randn(2000)
    with caplog.at_level(logging.WARNING, logger=triton_probe.__name__):
        for seed in range(3):
            got = ops.kernel("encode", "cuda")(x, *codec.op_args(), seed)
            want = ops.kernel("encode", "other")(x, *codec.op_args(), seed)
            assert all(torch.equal(a, b) for a, b in zip(want, got))
    warnings = [r for r in caplog.records if "first-use check" in r.getMessage()]
    assert len(warnings) == 1
    assert "qsgd" in warnings[0].getMessage() and "cpu" in warnings[0].getMessage()
    assert triton_probe.triton_works(codec, CPU) is False


def test_verdict_is_per_codec_configuration(monkeypatch):
    def enc(codec, xf, p, s):
        if codec.bits == 2:
            raise RuntimeError("no 2-bit kernel on this device")
        return codec.encode_reference(xf, p, s)

    monkeypatch.setattr(kernels, "encode", enc)
    assert triton_probe.triton_works(get_codec("uniform", bits=2), CPU) is False
    assert triton_probe.triton_works(get_codec("uniform", bits=8), CPU) is True


def _decode_that(change):
    """A decode stand-in: the reference's values, then ``change(values)``."""

    def dec(codec, codes, p, n, wire=False):
        out = codec.decode_reference(codes, codec._decode_params(p) if wire else p, n)
        change(out)
        return out

    return dec


def test_nan_equals_nan_whatever_its_bits(monkeypatch):
    """A GPU's arithmetic makes NaNs of other bits than a CPU's (0x7fffffff against 0xffc00000): a decode that
    agrees on every finite value and on where the NaNs are passes, whatever the NaNs' sign and payload."""

    def other_nan_bits(out):
        bits = out.view(torch.int32)
        bits[out.isnan()] = 0x7FFFFFFF  # the canonical NaN of an NVIDIA GPU; the probe's NaN decodes to NaN
        bits[out.isnan()] ^= 1 << 31  # and of the other sign

    codec = get_codec("qsgd", bits=4, bucket_size=128)
    monkeypatch.setattr(kernels, "decode", _decode_that(other_nan_bits))
    assert triton_probe.triton_works(codec, CPU) is True
    assert triton_probe.failure(codec, CPU) is None


@pytest.mark.parametrize("change", ["finite value", "NaN for a number"])
def test_a_disagreement_is_named_with_its_place_and_bits(change, monkeypatch, caplog):
    """Anything but a NaN's bits is a disagreement: a finite value one ulp off, a NaN where the reference has a
    number. The warning (and ``failure``) says which output, how many positions and the first, with its bits."""
    codec = get_codec("uniform", bits=8, bucket_size=512)
    x = triton_probe._probe_input(codec, CPU)
    i = int(torch.isfinite(x).nonzero()[-1])  # a finite position, past the probe's NaN and infinities

    def edit(out):
        if change == "finite value":
            out.view(torch.int32)[i] += 1
        else:
            out[i] = float("nan")

    monkeypatch.setattr(kernels, "decode", _decode_that(edit))
    with caplog.at_level(logging.WARNING, logger=triton_probe.__name__):
        assert triton_probe.triton_works(codec, CPU) is False
    why = triton_probe.failure(codec, CPU)
    assert why is not None and "decode differs" in why and f"1 of {x.numel()} values differ, the first at {i}" in why
    assert "0x" in why, why
    assert why in caplog.text


def test_zeros_of_other_signs_differ():
    assert triton_probe._difference("values", torch.tensor([1.0, 0.0]), torch.tensor([1.0, -0.0])) is not None
    assert triton_probe._difference("values", torch.tensor([float("nan")]), torch.tensor([-float("nan")])) is None
    assert triton_probe._difference("codes", torch.tensor([3], dtype=torch.uint8), torch.tensor([4], dtype=torch.uint8))
    half = torch.tensor([1.0, float("nan")], dtype=torch.bfloat16)
    assert triton_probe._difference("values", half, -half) is not None  # -1.0; the NaN's sign alone would pass
    assert triton_probe._difference("values", half[1:], -half[1:]) is None
