"""The fused CPU codec path (codecs/cpu_fused.py, the C kernels of kernels/cpu) against the torch
reference, bit for bit.

The reference (``LIGHTNING_QCOMM_CPU_FUSED=0``) is the spec: for every codec, on lengths above the
dispatch threshold that are not multiples of the bucket, with NaN/Inf, signed zeros, subnormals and huge
values, the fused ``encode`` must give the same code bytes and the same scale bits, and the fused
``decode`` the same fp32 bits (NaN payloads included). The element-wise entry points are also checked
directly on small tensors and odd bucket sizes.
"""

from __future__ import annotations

import logging

import pytest
import torch
from _siblings import from_test_file

from lightning_qcomm import _log
from lightning_qcomm.codecs import cpu_fused, get_codec, layout, native

extreme_values, flush_denormal = from_test_file("codecs/test_codecs", "extreme_values", "flush_denormal")

CONFIGS = (
    [("uniform", b, {}) for b in (1, 2, 3, 4, 8)]
    + [("uniform", 3, {"stochastic": False})]
    + [("qsgd", b, {}) for b in (2, 4, 8)]
    + [("qsgdinf", 4, {})]
    + [("nuqsgd", b, {}) for b in (2, 4, 8)]
    + [("sign1", 1, {})]
    + [(f, 8, {"rounding": r}) for f in ("fp8_e4m3", "fp8_e5m2") for r in ("nearest", "stochastic")]
)
N_LARGE = cpu_fused.FUSED_MIN_NUMEL + 4099  # above the threshold, odd, not a multiple of any bucket used


def _cfg_id(c) -> str:
    name, bits, opts = c
    return f"{name}-{bits}" + "".join(f"-{v}" for v in opts.values())


def _nasty(n: int, seed: int) -> torch.Tensor:
    """Heavy-tailed values plus the special cases: NaN, +-Inf, signed zeros as bucket min/max, constant
    and all-zero buckets, subnormals, values near the fp32 maximum."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(2 * torch.randn(n, generator=g))
    x[3] = float("nan")
    x[1000] = float("inf")
    x[5000] = -float("inf")
    x[2048:2560] = x[2048:2560].abs()  # a non-negative bucket whose min is a signed zero
    x[2050], x[2100] = 0.0, -0.0
    x[2560:3072] = -x[2560:3072].abs()  # a non-positive bucket whose max is a signed zero
    x[2600], x[2700] = -0.0, 0.0
    x[3072:3584] = 1.5  # constant bucket
    x[3584:4096] = 0.0  # all-zero bucket
    x[4096:4200] = 1e-40  # subnormal
    x[6000:6010] = 3e38
    # fp8 round-to-nearest ties: block max 448 gives scale 1 (e4m3) or 2^-7 (e5m2), so k/64 hits exact halves
    x[6144:6656] = torch.arange(512) / 64.0 * (1 - 2 * (torch.arange(512) % 2))
    x[6144] = 448.0
    x[-1] = -2.5
    return x


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


def test_library_builds():
    assert native.load() is not None, native.load_error()


@pytest.mark.parametrize("cfg", CONFIGS, ids=_cfg_id)
def test_codec_api_bit_identical(cfg, monkeypatch):
    name, bits, opts = cfg
    buckets = [None] if name == "sign1" else [512, 37]
    for bucket in buckets:
        codec = get_codec(name, bits, bucket, **opts)
        for n, seed in ((N_LARGE, 11), (cpu_fused.FUSED_MIN_NUMEL, 12)):
            x = _nasty(n, seed)
            assert cpu_fused.use_fused(codec, x, n)
            fused = codec.encode(x, seed=seed)
            fused_dec = codec.decode(fused)
            monkeypatch.setenv(cpu_fused.ENV_SWITCH, "0")
            assert not cpu_fused.use_fused(codec, x, n)
            ref = codec.encode(x, seed=seed)
            ref_dec = codec.decode(ref)
            monkeypatch.delenv(cpu_fused.ENV_SWITCH)
            assert torch.equal(fused.codes, ref.codes), f"codes differ: {codec} n={n}"
            assert _bits_equal(fused.scales, ref.scales), f"scales differ: {codec} n={n}"
            assert _bits_equal(fused_dec, ref_dec), f"decode differs: {codec} n={n}"
            assert fused.shape == ref.shape and fused.dtype == ref.dtype
            # the fused decode reads the exact wire form too
            back = codec.decode(codec.from_bytes(fused.to_bytes(), fused.shape, fused.dtype))
            assert _bits_equal(back, ref_dec)


def test_bf16_and_2d_input():
    codec = get_codec("uniform", 4, 512)
    x = _nasty(N_LARGE, 3).reshape(-1, 1)[: 2 * (N_LARGE // 2)].reshape(-1, 2).to(torch.bfloat16)
    fused = codec.encode(x, seed=5)
    ref_codes = codec.encode_reference(x.reshape(-1).float(), *_enc_params(codec, x.reshape(-1).float()), 5)
    assert torch.equal(fused.codes, ref_codes)
    assert codec.decode(fused).dtype == torch.bfloat16 and codec.decode(fused).shape == x.shape


def _enc_params(codec, xf: torch.Tensor):
    xb, counts = codec._buckets(xf)
    scales = codec._scales(xb, counts)
    scales = torch.where(codec._finite_mask(xb), scales, torch.full_like(scales, float("nan")))
    return (codec._encode_params(scales),)


@pytest.mark.parametrize("cfg", CONFIGS, ids=_cfg_id)
def test_elementwise_small_and_odd_buckets(cfg):
    """cpu_fused.encode / decode (below the threshold, called directly) == encode_reference / decode_reference."""
    name, bits, opts = cfg
    g = torch.Generator().manual_seed(7)
    for n in (1, 7, 9, 1000, 70001):
        x = torch.randn(n, generator=g) * torch.exp(3 * torch.randn(n, generator=g))
        if n > 20:
            x[5], x[n // 2], x[n - 3], x[10] = float("nan"), float("inf"), -float("inf"), -0.0
        for bucket in (None, 1, 37, 512, 70000):
            codec = get_codec(name, bits, bucket, **opts)
            xb, counts = codec._buckets(x)
            scales = codec._scales(xb, counts)
            scales = torch.where(codec._finite_mask(xb), scales, torch.full_like(scales, float("nan")))
            enc_p, dec_p = codec._encode_params(scales), codec._decode_params(scales)
            seed = 2**40 + n
            ref = codec.encode_reference(x, enc_p, seed)
            got = cpu_fused.encode(codec, x, enc_p, seed)
            assert torch.equal(got, ref), f"{codec} n={n}"
            assert _bits_equal(cpu_fused.decode(codec, ref, dec_p, n), codec.decode_reference(ref, dec_p, n))


@pytest.mark.parametrize("flush", [False, True], ids=["subnormals_kept", "flush_denormal"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=_cfg_id)
def test_extreme_values_bit_identical(cfg, flush, monkeypatch):
    """Buckets at +-FLT_MAX, near it, of subnormals and mixed (test_codecs.extreme_values), bucket 128 and 37:
    the fused path gives the reference's codes and decoded bits, and the decode is finite. With subnormals
    kept the scales are bit-identical too; under flush-denormal torch's min / max / amax of a bucket of
    subnormals (all equal to zero then) may return any of them, so only what is decoded is compared."""
    name, bits, opts = cfg
    x = extreme_values(repeat=11)
    assert x.numel() >= cpu_fused.FUSED_MIN_NUMEL
    for bucket in [None] if name == "sign1" else [128, 37]:
        codec = get_codec(name, bits, bucket, **opts)
        with flush_denormal(flush):
            fused = codec.encode(x, seed=6)
            fused_dec = codec.decode(fused)
            monkeypatch.setenv(cpu_fused.ENV_SWITCH, "0")
            ref = codec.encode(x, seed=6)
            ref_dec = codec.decode(ref)
            monkeypatch.delenv(cpu_fused.ENV_SWITCH)
        assert bool(torch.isfinite(fused_dec).all()), f"non-finite decode: {codec}"
        assert torch.equal(fused.codes, ref.codes), f"codes differ: {codec}"
        assert _bits_equal(fused_dec, ref_dec), f"decode differs: {codec}"
        if not flush:
            assert _bits_equal(fused.scales, ref.scales), f"scales differ: {codec}"


@pytest.mark.parametrize("flagged", [False, True], ids=["plain", "with_prescaled_buckets"])
@pytest.mark.parametrize("bits", [1, 3, 4, 8])
def test_uniform_decode_from_wire_scales(bits, flagged):
    """``c_uniform_decode`` (the decode parameters made per bucket in C from the wire scales) gives the reference
    decode's bits for crafted scales: a unit of -0 (kept as -0 in a call without flags, taken by magnitude once
    any bucket is flagged, as ``scaling.unflag`` does), NaN scales, and with ``flagged`` tiny and wide
    pre-scaled buckets (a negative unit)."""
    codec = get_codec("uniform", bits, 64)
    n = cpu_fused.FUSED_MIN_NUMEL + 37
    nb = codec.num_buckets(n)
    g = torch.Generator().manual_seed(bits)
    lo = torch.randn(nb, generator=g)
    unit = torch.rand(nb, generator=g) * 0.1
    unit[0], lo[0] = -0.0, -0.0
    unit[1], lo[1] = -0.0, 2.0
    lo[2], unit[3] = float("nan"), float("nan")
    if flagged:
        unit[4] = -(2.0**-100 * 2.0**64)  # tiny: m = 2^-64
        unit[5], lo[5] = -(1e38 * 2.0**-64), -(3e38 * 2.0**-64)  # wide: m = 2^64
    scales = torch.stack([lo, unit], dim=1)
    codes = torch.randint(0, 256, (layout.packed_nbytes(n, bits),), dtype=torch.uint8, generator=g)
    ref = codec.decode_reference(codes, codec._decode_params(scales), n)
    got = cpu_fused.decode_wire(codec, codes, scales, n)
    assert _bits_equal(got, ref)
    assert bool((scales[:, 1] < 0).any()) == flagged


def test_env_switch_disables(monkeypatch):
    codec = get_codec("uniform", 8, 512)
    x = torch.randn(N_LARGE)
    monkeypatch.setenv(cpu_fused.ENV_SWITCH, "0")

    def boom(*a, **k):
        raise AssertionError("fused path used although disabled")

    monkeypatch.setattr(cpu_fused, "encode", boom)
    monkeypatch.setattr(cpu_fused, "decode", boom)
    monkeypatch.setattr(cpu_fused, "encode_packed", boom)
    codec.decode(codec.encode(x))
    monkeypatch.delenv(cpu_fused.ENV_SWITCH)
    with pytest.raises(AssertionError, match="fused path used"):
        codec.encode(x)


def test_small_and_unsupported_use_reference():
    x = torch.randn(cpu_fused.FUSED_MIN_NUMEL - 1)
    assert not cpu_fused.use_fused(get_codec("uniform", 8), x, x.numel())
    from lightning_qcomm.codecs.uniform import UniformCodec

    class Custom(UniformCodec):
        pass

    big = torch.randn(cpu_fused.FUSED_MIN_NUMEL)
    assert not cpu_fused.use_fused(Custom(8, 512), big, big.numel())
    assert cpu_fused.use_fused(UniformCodec(8, 512), big, big.numel())


def test_native_flag_rejected_falls_back_to_baseline_build(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(native, "NATIVE_FLAGS", ("-fno-such-flag-for-this-test",))
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setattr(native, "_load_error", None)
    lib = native.load()
    assert lib is not None, native.load_error()
    codec = get_codec("qsgd", 4, 37)
    x = _nasty(N_LARGE, 9)
    fused = codec.encode(x, seed=2)
    monkeypatch.setenv(cpu_fused.ENV_SWITCH, "0")
    assert torch.equal(fused.codes, codec.encode(x, seed=2).codes)


def test_build_failure_warns_once_and_uses_reference(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # a "compiler" that always fails
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setattr(native, "_load_error", None)
    monkeypatch.setattr(_log, "_said", set())
    codec = get_codec("fp8_e4m3", 8, 512)
    x = torch.randn(N_LARGE)
    with caplog.at_level(logging.WARNING, logger=cpu_fused.log.name):
        p1 = codec.encode(x, seed=1)
        p2 = codec.encode(x, seed=1)
        codec.decode(p1)
    warnings = [r for r in caplog.records if "fused CPU codecs unavailable" in r.getMessage()]
    assert len(warnings) == 1 and "failed" in warnings[0].getMessage()
    assert torch.equal(p1.codes, p2.codes)


def test_no_compiler_warns_once_and_uses_reference(monkeypatch, tmp_path, caplog):
    """No C++ compiler on the machine at all: one warning naming that, the reference's codes, no error."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing to find there
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setattr(native, "_load_error", None)
    monkeypatch.setattr(_log, "_said", set())
    codec = get_codec("qsgd", 4, 512)
    x = _nasty(N_LARGE, 4)
    with caplog.at_level(logging.WARNING, logger=cpu_fused.log.name):
        got = [codec.encode(x, seed=3) for _ in range(2)]
        codec.decode(got[0])
    warnings = [r.getMessage() for r in caplog.records if "fused CPU codecs unavailable" in r.getMessage()]
    assert len(warnings) == 1 and "no C++ compiler" in warnings[0], warnings
    monkeypatch.setenv(cpu_fused.ENV_SWITCH, "0")
    assert torch.equal(got[0].codes, codec.encode(x, seed=3).codes) and torch.equal(got[0].codes, got[1].codes)


# ---------------------------------------------------------------------------------------------- cache safety
_PLANT = r"""
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen("%s", "w");
    if (f) { fputs("planted code ran", f); fclose(f); }
}
"""

_PROBE = r"""
import logging, os, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(message)s")
from lightning_qcomm.codecs import native
lib = native.load()
print("LOADED", lib is not None, lib if lib is not None else native.load_error())
"""


def _plant_and_probe(tmp_path, dir_mode: int, file_mode: int, owner: int | None = None) -> tuple[str, bool]:
    """Plant a library with a constructor at the exact path the cache would load, then load in a fresh process."""
    import os
    import shutil
    import subprocess
    import sys

    cc = native._compiler()
    if cc is None:
        pytest.skip("no C compiler")
    root = tmp_path / "ext"
    d = root / native.CACHE_SUBDIR
    d.mkdir(parents=True)
    marker = tmp_path / "planted.txt"
    src = tmp_path / "planted.c"
    src.write_text(_PLANT % marker)
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(root))
    for flags, machine in (
        ((*native.CXXFLAGS, *native.NATIVE_FLAGS), native._cpu_fingerprint()),
        (native.CXXFLAGS, ""),
    ):
        so = native.library_path(str(root), cc, flags, machine)
        subprocess.run([cc, "-shared", "-fPIC", str(src), "-o", so], check=True)
        os.chmod(so, file_mode)
        if owner is not None:
            os.chown(so, owner, -1)
    os.chmod(d, dir_mode)
    os.chmod(root, dir_mode)
    res = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=120)
    shutil.rmtree(root, ignore_errors=True)
    assert res.returncode == 0, res.stderr
    return res.stdout, marker.exists()


@pytest.mark.parametrize(
    "dir_mode,file_mode,owner",
    [(0o777, 0o755, None), (0o755, 0o777, None), (0o755, 0o755, 65534)],
    ids=["world_writable_dir", "world_writable_file", "foreign_owner"],
)
def test_planted_library_in_unsafe_cache_is_refused(tmp_path, dir_mode, file_mode, owner):
    """A library planted in a shared or writable cache is never loaded: the cache is refused (as ssh refuses
    a writable ~/.ssh), the codecs are built privately and still load, and the refusal is logged."""
    import os

    if owner is not None and os.geteuid() != 0:
        pytest.skip("chown to another user needs root")
    out, ran = _plant_and_probe(tmp_path, dir_mode, file_mode, owner)
    assert not ran, f"planted code ran: {out}"
    assert "LOADED True" in out, out
    assert "refus" in out.lower(), out


def test_safe_cache_is_reused(tmp_path):
    """Control for the test above: the same probe against our own safe cache loads the cached library."""
    import os
    import subprocess
    import sys

    root = tmp_path / "ext"
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(root))
    first = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300)
    second = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert "LOADED True" in first.stdout and "LOADED True" in second.stdout, (first.stdout, first.stderr)
    path = second.stdout.split("LOADED True", 1)[1].strip()
    assert path.startswith(str(root)), path
    assert "refus" not in second.stdout.lower()
