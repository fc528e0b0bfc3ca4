"""The CUDA kernels of the codec ops check that Triton works before trusting it (issue 19 item 4).

``codecs.triton_probe.triton_works`` runs a codec's Triton encode/decode once per device next to the torch
reference; a kernel that raises (a driver or architecture Triton does not support) or disagrees makes that
codec use the reference there, with one warning. On CPU the Triton kernels are replaced by stand-ins: the
reference itself (works), one that raises, one that flips a code; ``encode_cuda``/``decode_cuda`` are called
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
    want = ops.encode_reference(x, *codec.op_args(), 3)
    got = ops.encode_cuda(x, *codec.op_args(), 3)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert fresh["encode"] == 2  # the probe's one, then the real call
    ops.encode_cuda(x, *codec.op_args(), 4)
    assert fresh["encode"] == 3  # checked once per codec and device
    out = ops.decode_cuda(*got, 1000, *codec.op_args())
    assert torch.equal(out, ops.decode_reference(*got, 1000, *codec.op_args()))


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
            got = ops.encode_cuda(x, *codec.op_args(), seed)
            want = ops.encode_reference(x, *codec.op_args(), seed)
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
