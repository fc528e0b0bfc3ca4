"""Triton kernels (``lightning_qcomm.kernels``) against the torch reference codecs, under TRITON_INTERPRET=1.

Triton reads TRITON_INTERPRET when ``@triton.jit`` decorates a kernel, i.e. when
``lightning_qcomm.kernels`` is first imported; the rest of the suite may already have imported it in
this process. So one subprocess (this file run as a script, with the variable set) goes through every
case on CPU tensors and reports per codec; the tests below assert on that report:

- encode: packed codes and wire scales bit-identical to ``Codec.encode_reference`` / ``bucket_scales`` (the ops' CPU kernel replaced by their CUDA
  kernel, so ``codec.encode`` runs what the dispatcher runs for CUDA tensors and the kernels get exactly the
  per-bucket parameters the reference gets), for every codec and bit width,
  default and odd bucket sizes (buckets straddling the 8-element packing groups), lengths that are not
  multiples of 8 or of the bucket, several seeds (64-bit ones too), NaN/+-Inf inputs, constant and zero
  buckets, a bucket of +-2e37 (extreme scales), and once more with int64 element indexing forced;
- decode: kernel decode of those codes, and of random bytes (every code value, FP8 NaN/Inf patterns
  included), equal to ``Codec.decode_reference`` element for element (NaN where the reference is NaN);
- extreme finite values (+-FLT_MAX, subnormals, mixed buckets: ``test_codecs.extreme_values``): codes and
  decoded bits equal to the reference's, and the decode finite;
- the comparison can fail: a different seed changes the kernel's codes of every stochastic codec (and
  none of the deterministic ones).
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("triton")

# (id, name, bits, opts)
CODECS = [
    *[(f"uniform{b}", "uniform", b, {}) for b in range(1, 9)],
    ("uniform4_nearest", "uniform", 4, {"stochastic": False}),
    *[(f"qsgd{b}", "qsgd", b, {}) for b in (2, 4, 8)],
    ("qsgdinf4", "qsgdinf", 4, {}),
    *[(f"nuqsgd{b}", "nuqsgd", b, {}) for b in (2, 3, 4, 8)],
    ("sign1", "sign1", 1, {}),
    ("fp8_e4m3_nearest", "fp8_e4m3", 8, {"rounding": "nearest"}),
    ("fp8_e4m3_stochastic", "fp8_e4m3", 8, {"rounding": "stochastic"}),
    ("fp8_e5m2_nearest", "fp8_e5m2", 8, {"rounding": "nearest"}),
    ("fp8_e5m2_stochastic", "fp8_e5m2", 8, {"rounding": "stochastic"}),
]
BUCKETS = (None, 37)  # codec default (512; sign1: whole tensor), and one that is odd and straddles groups
LENGTHS = (1, 13, 1000, 2051)  # 2051 spans three programs of 1024 elements
EXTREME_BUCKETS = (128, 37)  # the bucket of test_codecs.extreme_values, and one that straddles its cases
INT64_CASES = ("uniform3", "nuqsgd4", "fp8_e4m3_stochastic", "sign1")
WORKER_TIMEOUT_S = 240  # a safety net; the worker takes ~50 s alone (67-110 s on CI before _interpreted.py's patches)


def _inputs(n: int, gen):
    """A test vector of length n: Gaussian plus heavy-tailed entries, with special buckets where n allows."""
    import torch

    x = torch.randn(n, generator=gen) * 3.0
    if n >= 13:
        x[1::5] = torch.randn(len(x[1::5]), generator=gen) / (torch.rand(len(x[1::5]), generator=gen) + 0.05)
        x[3] = float("nan")
        x[11] = float("inf") if n < 100 else x[11]
    if n >= 1000:
        x[100:140] = 0.0  # zero bucket (norm 0) at bucket 37
        x[148:185] = 0.75  # constant bucket (uniform unit 0) at bucket 37
        x[600] = float("-inf")
        x[700] = float("inf")
    if n >= 2000:
        x[1300:1340] = 2.0e37 * torch.randn(40, generator=gen).sign()  # extreme scales (naive L2 norm overflows)
    return x


def _worker() -> dict:
    """Run every case (TRITON_INTERPRET=1 is set by the parent) and return {case id: result}."""
    from unittest import mock

    import torch

    from lightning_qcomm import kernels
    from lightning_qcomm.codecs import Packed, derive_seed, get_codec, ops

    codec_kernels = kernels.codec_kernels

    assert kernels.HAS_TRITON and codec_kernels._is_interpreted(), "worker must run with TRITON_INTERPRET=1"
    seeds = (1, derive_seed(7, 3, 1))  # key words (k1, k2): both >= 2**31, both < 2**31

    class ToKernels:
        """CPU tensors take the ops' CUDA kernels (Triton) while active; the C / reference kernels after."""

        def __enter__(self):
            self.lib = torch.library.Library("qcomm", "IMPL")
            # allow_override: torch 2.11/2.12 refuse a second Python kernel for a key without it (their default)
            self.lib.impl("encode", ops.kernel("encode", "cuda"), "CPU", allow_override=True)
            self.lib.impl("decode", ops.kernel("decode", "cuda"), "CPU", allow_override=True)

        def __exit__(self, *exc):
            self.lib._destroy()  # the earlier CPU kernels are back

    to_kernels = ToKernels()

    def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
        """Equal bits, NaN where NaN (a NaN's payload is not compared)."""
        fin = ~torch.isnan(a)
        return (
            a.shape == b.shape
            and torch.equal(fin, ~torch.isnan(b))
            and torch.equal(a[fin].view(torch.int32), b[fin].view(torch.int32))
        )

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return a.shape == b.shape and bool(torch.isclose(a, b, rtol=0.0, atol=0.0, equal_nan=True).all())

    def run_case(name: str, bits: int, opts: dict, buckets=BUCKETS, lengths=LENGTHS) -> dict:
        res = {"checked": 0, "code_mismatch": [], "decode_mismatch": [], "random_decode_mismatch": []}
        for bucket in buckets:
            codec = get_codec(name, bits, bucket, **opts)
            gen = torch.Generator().manual_seed(1234 + bits)
            for n in lengths:
                x = _inputs(n, gen)
                tri_codes = []
                for seed in seeds:
                    ref = codec.encode(x, seed)  # CPU tensor: torch reference
                    with to_kernels:
                        tri = codec.encode(x, seed)
                    tri_codes.append(tri.codes)
                    res["checked"] += 1
                    if not torch.equal(ref.codes, tri.codes):
                        bad = (ref.codes != tri.codes).nonzero().flatten()[:5].tolist()
                        res["code_mismatch"].append(f"bucket={bucket} n={n} seed={seed}: bytes {bad}")
                    if not same_bits(ref.scales, tri.scales):
                        res["code_mismatch"].append(f"bucket={bucket} n={n} seed={seed}: wire scales differ")
                # decode of the (identical) codes, and of every byte pattern, with this input's scales
                noise = torch.randint(0, 256, ref.codes.shape, generator=gen, dtype=torch.uint8)
                rnd = Packed(codes=noise, scales=ref.scales, shape=ref.shape, dtype=ref.dtype)
                for packed, key in ((ref, "decode_mismatch"), (rnd, "random_decode_mismatch")):
                    with to_kernels:
                        tri_dec = codec.decode(packed)
                    if not same(codec.decode(packed), tri_dec):
                        res[key].append(f"bucket={bucket} n={n}")
                if n == max(lengths):
                    res["seed_changes_codes"] = not torch.equal(tri_codes[0], tri_codes[1])
        return res

    def run_extreme(name: str, bits: int, opts: dict) -> dict:
        """Extreme finite values (test_codecs.extreme_values): kernel codes and decoded bits equal the
        reference's, and the kernel's decode is finite."""
        from _siblings import from_test_file

        extreme_values = from_test_file("codecs/test_codecs", "extreme_values")

        x = extreme_values()
        res = {"checked": 0, "mismatch": [], "nonfinite": []}
        for bucket in EXTREME_BUCKETS:
            codec = get_codec(name, bits, bucket, **opts)
            ref = codec.encode(x, seed=5)
            ref_dec = codec.decode(ref)
            with to_kernels:
                tri = codec.encode(x, seed=5)
                tri_dec = codec.decode(ref)
            res["checked"] += 1
            if not (
                torch.equal(ref.codes, tri.codes)
                and same_bits(ref.scales, tri.scales)
                and torch.equal(ref_dec.view(torch.int32), tri_dec.view(torch.int32))
            ):
                res["mismatch"].append(f"bucket={bucket}")
            if not bool(torch.isfinite(tri_dec).all()):
                res["nonfinite"].append(
                    f"bucket={bucket}: {(~torch.isfinite(tri_dec)).nonzero().flatten()[:5].tolist()}"
                )
        return res

    def run_sync_guard(name: str, bits: int, opts: dict) -> list[str]:
        """Encode and decode through the kernels in their accelerator form under ``NoHostSync``: no op that makes
        the host wait, no tensor made from Python data, anywhere (codec layer and kernels included)."""
        from _sync_guard import NoHostSync

        from lightning_qcomm.codecs import rng, scaling

        x = _inputs(2051, torch.Generator().manual_seed(3))
        problems = []
        with mock.patch.object(scaling, "_HOST_BRANCHES", False), to_kernels:
            for bucket in (37, None):
                codec = get_codec(name, bits, bucket, **opts)
                args = codec.op_args()
                try:  # the ops' CUDA kernels themselves: a dispatch mode does not see inside a custom op
                    with NoHostSync():
                        codes, scales = ops.kernel("encode", "cuda")(x, *args, rng.signed_seed(seeds[1]))
                        ops.kernel("decode", "cuda")(codes, scales, x.numel(), *args)
                except AssertionError as err:
                    problems.append(f"bucket={bucket}: {err}")
        return problems

    report = {}
    from lightning_qcomm.codecs import triton_probe

    for cid, name, bits, opts in CODECS:
        report[cid] = run_case(name, bits, opts)
        report[f"{cid}_extreme"] = run_extreme(name, bits, opts)
        report[f"{cid}_syncs"] = run_sync_guard(name, bits, opts)
    # every configuration above ran on the kernels: none failed its first-use check (which would have meant the
    # reference, and comparisons of the reference with itself)
    report["probe_failures"] = [str(k) for k, ok in triton_probe._verdicts.items() if not ok]
    report["probed"] = len(triton_probe._verdicts)
    with mock.patch.object(codec_kernels, "INT32_INDEX_LIMIT", 0):  # every launch takes the int64 path
        for cid, name, bits, opts in CODECS:
            if cid in INT64_CASES:
                report[f"{cid}_int64"] = run_case(name, bits, opts, buckets=(37,), lengths=(13, 2051))
    return report


@pytest.fixture(scope="module")
def report() -> dict:
    from _interpreted import run_interpreted

    return run_interpreted(__file__, WORKER_TIMEOUT_S)


CASE_IDS = [c[0] for c in CODECS] + [f"{c}_int64" for c in INT64_CASES]


@pytest.mark.parametrize("cid", CASE_IDS)
def test_codes_bit_identical_to_reference(report, cid):
    r = report[cid]
    assert r["checked"] == (2 * 2 if cid.endswith("_int64") else len(BUCKETS) * len(LENGTHS) * 2)
    assert r["code_mismatch"] == []


@pytest.mark.parametrize("cid", CASE_IDS)
def test_decode_equals_reference(report, cid):
    assert report[cid]["decode_mismatch"] == []
    assert report[cid]["random_decode_mismatch"] == []


@pytest.mark.parametrize("cid", [c[0] for c in CODECS])
def test_extreme_values_bit_identical_and_finite(report, cid):
    """+-FLT_MAX, near it, subnormals and mixed buckets: the kernels' codes and decode are the reference's
    bits, and finite. FP8's negative zero (code 0x80) included: Triton <= 3.6 compiles unary minus as 0 - x,
    so a decode that negated the magnitude returned +0.0 there (the GPU image's Triton); the kernel sets the
    sign bit instead."""
    r = report[f"{cid}_extreme"]
    assert r["checked"] == len(EXTREME_BUCKETS)
    assert r["mismatch"] == [] and r["nonfinite"] == []


@pytest.mark.parametrize("cid", [c[0] for c in CODECS])
def test_kernel_path_makes_no_host_sync(report, cid):
    """The CUDA code path (Triton kernels and the codec layer around them) on CPU tensors under ``NoHostSync``,
    which has no exemption: no ``.item()``, no data-dependent shape, no tensor made from Python data."""
    assert report[f"{cid}_syncs"] == []


@pytest.mark.parametrize("cid", [c[0] for c in CODECS])
def test_kernel_codes_depend_on_seed_iff_stochastic(report, cid):
    from lightning_qcomm.codecs import get_codec

    name, bits, opts = next((n, b, o) for i, n, b, o in CODECS if i == cid)
    assert report[cid]["seed_changes_codes"] is get_codec(name, bits, **opts).stochastic


def test_every_configuration_ran_on_the_kernels(report):
    assert report["probed"] >= len(CODECS) and report["probe_failures"] == []


def test_has_triton_and_bad_input():
    import torch

    from lightning_qcomm import kernels
    from lightning_qcomm.codecs import get_codec

    codec_kernels = kernels.codec_kernels
    assert kernels.HAS_TRITON is True
    codec = get_codec("uniform", 4)
    with pytest.raises(TypeError, match="xf"):
        kernels.encode(codec, torch.zeros(4, dtype=torch.float64), torch.zeros(1, 2), 0)
    if not codec_kernels._is_interpreted():
        with pytest.raises(ValueError, match="CUDA"):
            kernels.encode(codec, torch.zeros(4), torch.zeros(1, 2), 0)

    class Unknown:
        name = "mystery"

    with pytest.raises(ValueError, match="mystery"):
        kernels.encode(Unknown(), torch.zeros(4), torch.zeros(1, 2), 0)


if __name__ == "__main__":
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_helpers"))  # _sync_guard
    print(json.dumps(_worker()))
