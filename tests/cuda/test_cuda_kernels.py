"""Triton kernels on a GPU: bit for bit the torch reference, at awkward sizes, beyond 2^31 elements, and free
of host syncs. Skipped without CUDA or Triton.

The reference is ``Codec.encode_reference`` / ``decode_reference`` on CPU, given the same per-bucket parameters
(computed once, on CPU): the kernels do only the element-wise work, so their codes and decoded bits must equal
the reference's exactly, for every codec and width, odd lengths, bucket remainders, buckets that straddle the
8-element packing groups, NaN/Inf, subnormals and values near FLT_MAX.
"""

from __future__ import annotations

import pytest
import torch
from _cuda_checks import NO_CUDA, has_triton

from lightning_qcomm.codecs import derive_seed, get_codec, rng, scaling

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA),
    pytest.mark.skipif(torch.cuda.is_available() and not has_triton(), reason="needs Triton (a CUDA build of torch)"),
]

CODECS = [
    *[(f"uniform{b}", "uniform", b, {}) for b in (1, 2, 3, 4, 5, 6, 7, 8)],
    ("uniform4_nearest", "uniform", 4, {"stochastic": False}),
    *[(f"qsgd{b}", "qsgd", b, {}) for b in (2, 4, 8)],
    ("qsgdinf4", "qsgdinf", 4, {}),
    *[(f"nuqsgd{b}", "nuqsgd", b, {}) for b in (2, 3, 4, 8)],
    ("sign1", "sign1", 1, {}),
    ("fp8_e4m3", "fp8_e4m3", 8, {}),
    ("fp8_e4m3_stochastic", "fp8_e4m3", 8, {"rounding": "stochastic"}),
    ("fp8_e5m2", "fp8_e5m2", 8, {}),
]
LENGTHS = (1, 7, 511, 512, 513, 1023, 4099, 65_537, 1_000_003)
BUCKETS = (None, 37, 512)


def _inputs(n: int, kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g) * 3
    if kind == "special" and n >= 64:
        x[1::7] /= torch.rand(len(x[1::7]), generator=g) + 0.01  # heavy tail
        x[3], x[40] = float("nan"), float("inf")
        x[10:30] = 1e-41 * torch.randn(20, generator=g)  # subnormals
        x[-20:-10] = 3.0e38  # near FLT_MAX
    return x


def _params(codec, x: torch.Tensor):
    """Per-bucket encode parameters and wire scales, exactly as Codec.encode computes them (on CPU)."""
    xb, counts = codec._buckets(x)
    scales = codec._scales(xb, counts)
    scales = torch.where(codec._finite_mask(xb), scales, torch.full_like(scales, float("nan")))
    return codec._encode_params(scales, scaling.FLT_MAX), scales


@pytest.mark.parametrize("cid,name,bits,opts", CODECS, ids=[c[0] for c in CODECS])
def test_triton_equals_reference_bit_for_bit(cid, name, bits, opts):
    from lightning_qcomm import kernels

    for bucket in BUCKETS:
        codec = get_codec(name, bits=bits, bucket_size=bucket, **opts)
        for n in LENGTHS:
            for kind in ("plain", "special"):
                x = _inputs(n, kind)
                seed = derive_seed(n, bits, 1 << 40)
                enc, scales = _params(codec, x)
                want = codec.encode_reference(x, enc, seed)
                got = kernels.encode(codec, x.cuda(), enc.cuda(), seed).cpu()
                assert torch.equal(got, want), f"{cid} bucket={bucket} n={n} {kind}: codes differ"
                dec = codec._decode_params(scales)
                ref = codec.decode_reference(want, dec, n)
                out = kernels.decode(codec, want.cuda(), dec.cuda(), n).cpu()
                same = (out.view(torch.int32) == ref.view(torch.int32)) | (out.isnan() & ref.isnan())
                assert bool(same.all()), f"{cid} bucket={bucket} n={n} {kind}: decoded bits differ"


@pytest.mark.parametrize("cid,name,bits,opts", CODECS, ids=[c[0] for c in CODECS])
def test_wire_path_equals_reference_bit_for_bit(cid, name, bits, opts):
    """What the ops run on CUDA: ``kernels.encode_codec`` (the uniform and FP8 scales in one kernel) and
    ``kernels.decode_codec`` (decode parameters made from the wire scales in the kernel): codes, wire scales and
    decoded bits equal the CPU reference's."""
    from lightning_qcomm import kernels

    for bucket in BUCKETS:
        codec = get_codec(name, bits=bits, bucket_size=bucket, **opts)
        for n in LENGTHS:
            for kind in ("plain", "special"):
                x = _inputs(n, kind)
                seed = derive_seed(n, bits, 3)
                enc, scales = _params(codec, x)
                want = codec.encode_reference(x, enc, seed)
                codes, got_scales = kernels.encode_codec(codec, x.cuda(), seed, scaling.FLT_MAX)
                assert torch.equal(codes.cpu(), want), f"{cid} bucket={bucket} n={n} {kind}: codes differ"
                same = (got_scales.cpu().view(torch.int32) == scales.view(torch.int32)) | (
                    got_scales.cpu().isnan() & scales.isnan()
                )
                assert bool(same.all()), f"{cid} bucket={bucket} n={n} {kind}: wire scales differ"
                ref = codec.decode_reference(want, codec._decode_params(scales), n)
                out = kernels.decode_codec(codec, want.cuda(), scales.cuda(), n).cpu()
                same = (out.view(torch.int32) == ref.view(torch.int32)) | (out.isnan() & ref.isnan())
                assert bool(same.all()), f"{cid} bucket={bucket} n={n} {kind}: decoded bits differ"


def _window_reference(codec, xs, enc, seed, start):
    """Codec.encode_reference's element-wise work for the window xs = x[start : start + len(xs)] of one long
    tensor (start a multiple of the bucket): its buckets' parameters, the uniforms at their global counters."""
    blen = codec.bucket_size
    rows = xs.numel() // blen
    params = enc[start // blen : start // blen + rows].unsqueeze(-1)
    u = rng.uniform(seed, xs.numel(), offset=start).view(rows, blen) if codec.stochastic else None
    x2 = xs.view(rows, blen)
    c = codec._quantize(x2, params, u)
    ok = (x2 - x2 == 0) & torch.isfinite(params).all(dim=1)
    return c.masked_fill_(~ok, 0).to(torch.uint8).view(-1)


@pytest.mark.parametrize("stochastic", [False, True])
def test_beyond_2_31_elements(stochastic):
    """2^31 + 1024 elements (int64 indexing in the kernels, 32-bit counter wrap-around in the random bits):
    8-bit codes and the decode equal the reference in windows at the start, across 2^31 and at the end."""
    from lightning_qcomm import kernels

    n, w = (1 << 31) + 1024, 4096
    free, _ = torch.cuda.mem_get_info()
    if free < 5 * 4 * n:
        pytest.skip(f"needs ~{5 * 4 * n / 2**30:.0f} GiB free on the GPU, has {free / 2**30:.0f}")
    codec = get_codec("uniform", bits=8, bucket_size=512, stochastic=stochastic)
    x = torch.randn(n, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    scales = codec._scales(*codec._buckets(x))  # min/max: the same bits on any device
    enc = codec._encode_params(scales, scaling.FLT_MAX)
    seed = derive_seed(5, int(stochastic))
    codes = kernels.encode(codec, x, enc, seed)
    assert codes.numel() == n  # 8 bits per element
    enc_cpu = enc.cpu()
    for start in (0, (1 << 31) - w // 2, n - w):
        want = _window_reference(codec, x[start : start + w].cpu(), enc_cpu, seed, start)
        assert torch.equal(codes[start : start + w].cpu(), want), f"codes differ in the window at {start}"
    dec = codec._decode_params(scales)
    out = kernels.decode(codec, codes, dec, n)
    tail = codec.decode_reference(codes[-w:].cpu(), dec[-w // 512 :].cpu(), w)
    assert torch.equal(out[-w:].cpu(), tail)
    del x, codes, out, scales
    torch.cuda.empty_cache()


@pytest.mark.parametrize("cid,name,bits,opts", CODECS, ids=[c[0] for c in CODECS])
def test_encode_and_decode_do_not_sync_the_host(cid, name, bits, opts):
    codec = get_codec(name, bits=bits, bucket_size=512, **opts)
    x = torch.randn(1_000_003, device="cuda")
    codec.decode(codec.encode(x, seed=1))  # compile and cache first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        codec.decode(codec.encode(x, seed=2))
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("cid,name,bits,opts", CODECS, ids=[c[0] for c in CODECS])
def test_triton_passes_its_first_use_check(cid, name, bits, opts):
    from lightning_qcomm.codecs import triton_probe

    codec = get_codec(name, bits=bits, bucket_size=512, **opts)
    triton_probe._verdicts.clear()
    assert triton_probe.triton_works(codec, torch.device("cuda", torch.cuda.current_device()))
