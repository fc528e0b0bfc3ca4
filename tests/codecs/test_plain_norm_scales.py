"""The fused path's shortcut for ordinary buckets of the L2-norm codecs (qsgd, nuqsgd, sign1): when every
bucket's first-pass fp32 norm lies in the codec's ``plain_norm_range``, ``cpu_fused`` takes the wire scales
and encode parameters from ``plain_scales_params`` instead of the general ``_scales`` / ``_encode_params``
(redo rows, flags, level caps, the finiteness pass). The general path is the spec: on data inside the range,
at both of its ends, just outside them, with all-zero and flushed-to-zero buckets and short last buckets, for
fp32 / fp16 / bf16 input, the fused encode must give the reference's code bytes, scale bits and decoded bits,
and on ordinary gradients the shortcut must be what runs.
"""

from __future__ import annotations

import struct

import pytest
import torch
from _siblings import from_test_file

from lightning_qcomm.codecs import cpu_fused, get_codec, scaling, sign_ops

flush_denormal = from_test_file("codecs/test_codecs", "flush_denormal")

CODECS = [("qsgd", 2), ("qsgd", 4), ("qsgd", 8), ("nuqsgd", 2), ("nuqsgd", 4), ("nuqsgd", 8), ("sign1", 1)]
N = cpu_fused.FUSED_MIN_NUMEL + 4099  # above the fused threshold, not a multiple of the buckets used
FIRST_PASS_MAX = 1e19


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


def _with_norms(x: torch.Tensor, blen: int, targets: torch.Tensor) -> torch.Tensor:
    """``x`` with each bucket rescaled so its L2 norm is about the bucket's entry of ``targets`` (fp64)."""
    nb = -(-x.numel() // blen)
    xb = torch.nn.functional.pad(x.double(), (0, nb * blen - x.numel())).view(nb, blen)
    norm = xb.norm(dim=1, keepdim=True).clamp(min=1e-300)
    return (xb * targets.view(nb, 1).double() / norm).reshape(-1)[: x.numel()].float()


def _cases(codec, blen: int, dtype: torch.dtype):
    """(name, x, inside): data whose bucket norms sit inside the plain range, near its ends (5%: the cast to
    fp16 / bf16 moves a norm by less), or with one bucket outside."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(N, generator=g)
    nb = -(-N // blen)
    lo, hi = codec.plain_norm_range(blen, scaling.output_max(dtype))
    # the first pass is an fp32 sum of squares: it overflows above ~1.8e19, which then leaves the range too
    # and fp16 elements of such a bucket would overflow (about norm / sqrt(B), a few times more at most)
    top = min(hi, FIRST_PASS_MAX, torch.finfo(dtype).max * blen**0.5 / 16)
    spread = torch.exp(torch.randn(nb, generator=g, dtype=torch.float64).abs())
    yield "ordinary", x * torch.exp(torch.randn(N, generator=g)), True
    yield "at_high_end", _with_norms(x, blen, top * 0.95 / spread), True
    above = top * 0.95 / spread
    above[1 % nb] = 2.0 * top
    yield "one_above", _with_norms(x, blen, above), 2.0 * top <= min(hi, FIRST_PASS_MAX)  # top: fp16's cap
    zero = x.clone()
    zero[(1 % nb) * blen : (1 % nb + 1) * blen] = 0.0
    yield "zero_bucket", zero, False
    if dtype == torch.float16:
        return  # fp16 cannot hold elements of a bucket whose norm is near the low end
    yield "at_low_end", _with_norms(x, blen, lo * 1.05 * spread), True
    below = lo * 1.05 * spread
    below[nb // 2] = lo * 0.5
    yield "one_below", _with_norms(x, blen, below), False
    tiny = x.clone()
    tiny[(2 % nb) * blen : (2 % nb + 1) * blen] = (
        1e-30  # squares underflow: the first pass says 0 (or less than the floor)
    )
    yield "tiny_bucket", tiny, False


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name,bits", CODECS, ids=[f"{n}-{b}" for n, b in CODECS])
def test_plain_shortcut_bit_identical_to_reference(name, bits, dtype, monkeypatch):
    taken = []
    real = cpu_fused._plain_scales_params
    monkeypatch.setattr(
        cpu_fused,
        "_plain_scales_params",
        lambda *a: taken.append(r := real(*a)) or r,  # noqa: B023
    )
    for bucket in [None] if name == "sign1" else [512, 37]:
        codec = get_codec(name, bits, bucket)
        blen = codec.bucket_len(N)
        for case, x, inside in _cases(codec, blen, dtype):
            xin = x.to(dtype)
            for flush in (False, True):
                with flush_denormal(flush):
                    taken.clear()
                    fused = codec.encode(xin, seed=9)
                    fused_dec = codec.decode(fused)
                    took = bool(taken) and taken[0] is not None
                    monkeypatch.setenv(cpu_fused.ENV_SWITCH, "0")
                    ref = codec.encode(xin, seed=9)
                    ref_dec = codec.decode(ref)
                    monkeypatch.delenv(cpu_fused.ENV_SWITCH)
                where = f"{codec} {case} {dtype} flush={flush}"
                assert torch.equal(fused.codes, ref.codes), f"codes differ: {where}"
                assert _bits_equal(fused.scales, ref.scales), f"scales differ: {where}"
                assert _bits_equal(fused_dec.float(), ref_dec.float()), f"decode differs: {where}"
                if inside:
                    assert took, f"the shortcut did not run on plain buckets: {where}"
                elif case.startswith("one_"):
                    assert not took, f"the shortcut ran with a bucket outside the plain range: {where}"


def test_sign_scale_shortcut_matches_general_path(monkeypatch):
    """``sign_ops.sign_scale`` (1-bit Adam's per-chunk scale) with and without the shortcut."""
    g = torch.Generator().manual_seed(5)
    for n in (cpu_fused.FUSED_MIN_NUMEL, 70001, 1000):
        for scale in (1.0, 1e-12, 1e30, 3e38):
            y = (torch.randn(n, generator=g) * scale).contiguous()
            got = sign_ops.sign_scale(y)
            plain = cpu_fused._plain_scales_params(sign_ops._sign1(), y, scaling.FLT_MAX)
            assert (plain is not None) == (scale < 1e19), (n, scale)  # the first pass overflows above
            monkeypatch.setattr(cpu_fused, "_plain_scales_params", lambda *a: None)
            want = sign_ops.sign_scale(y)
            monkeypatch.undo()
            assert struct.pack("<d", got) == struct.pack("<d", want), (n, scale, got, want)
