"""Device launches on the CUDA path, counted on CPU tensors under TRITON_INTERPRET=1 (``benchmarks/launch_counts.py``).

On a GPU every eager torch op and every Triton kernel is a launch, and a host-bound codec is a slow codec. The
codec ops' CUDA kernels run here on CPU tensors through Triton's interpreter, in their accelerator form
(``launch_counts.cuda_path_on_cpu``); allocations and views launch nothing.

Criteria, fixed before measuring: a decode is one launch for every codec with kernels (decode parameters made
from the wire scales in the kernel); an encode of every codec with buckets of at most ``MAX_BUCKET`` elements is
two (scales and parameters in one, the codes in the other); R rows of those codecs are coded by the rows kernels
exactly as each row alone; a quantized all-reduce does not grow with N and takes at most a quarter of the launches
of the torch rows.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

FUSED_ENCODE = [("uniform", 8, {}), ("uniform", 4, {"stochastic": False}), ("fp8_e4m3", 8, {})]
FUSED_ENCODE += [("fp8_e5m2", 8, {"rounding": "stochastic"}), ("qsgd", 4, {}), ("qsgd", 8, {}), ("qsgdinf", 4, {})]
FUSED_ENCODE += [("nuqsgd", 4, {}), ("nuqsgd", 2, {}), ("sign1", 1, {"bucket_size": 256})]  # 1-bit Adam's blocks
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
ALL_REDUCE_CODECS = ("uniform-8", "fp8_e4m3-8", "nuqsgd-4")
# Launches of one quantized all-reduce of one bucket (error feedback on), Triton + torch + collectives: the phase-1
# scales and codes, the server's decode-and-sum, its scales and codes, the final decode and the error-feedback tail
# decoding the phase-1 payloads itself (7 Triton); y = x + e and its zero padding (2 torch); all-to-all and
# all-gather. 12 before the tail read the payloads (a phase-1 decode launch of its own).
MAX_ALL_REDUCE_LAUNCHES = 11


def _key(name, bits, opts) -> str:
    return f"{name}-{bits}" + "".join(f"_{v}" for v in opts.values())


def _rows_cases() -> dict:
    """``codecs.rows.encode_rows`` / ``decode_rows`` through the rows kernels against each row's own encode and
    decode (the CPU reference: the ops' CPU kernels are back outside ``cuda_path_on_cpu``), bit for bit."""
    import torch
    from _siblings import from_test_file
    from launch_counts import cuda_path_on_cpu

    extreme_values = from_test_file("codecs/test_codecs", "extreme_values")

    from lightning_qcomm.codecs import cuda, derive_seed, get_codec
    from lightning_qcomm.codecs import rows as row_batch

    gen = torch.Generator().manual_seed(1)
    out = {}
    for name, bits, opts in FUSED_ENCODE:
        for bucket, n in ((512, 1037), (37, 300)):
            codec = get_codec(name, bits, **{**opts, "bucket_size": bucket})
            rows = torch.randn(5, n, generator=gen) * 3
            rows[1, 7] = float("nan")
            ext = extreme_values()[:n]
            rows[2, : ext.numel()] = ext
            rows[3, 40:80] = 0.0
            rows[3, 50:60] = -0.0
            seeds = [derive_seed(9, 1, j) for j in range(5)]
            want = torch.stack([codec.encode(rows[j], seed=s).to_bytes() for j, s in enumerate(seeds)])
            want_dec = torch.stack([codec.decode(codec.from_bytes(w, (n,), torch.float32)) for w in want])
            with cuda_path_on_cpu():
                key = f"{_key(name, bits, opts)}_b{bucket}"
                assert cuda.rows_kernel(codec, rows), "the rows kernels must take these rows"
                out[f"encode_{key}"] = torch.equal(row_batch.encode_rows(codec, rows, seeds), want)
                assert cuda.rows_kernel(codec, want, encode=False), "the rows decode kernel must take these"
                got = row_batch.decode_rows(codec, want, n)
            same = (got.view(torch.int32) == want_dec.view(torch.int32)) | (got.isnan() & want_dec.isnan())
            out[f"decode_{key}"] = bool(same.all())
    return out


def _rows_encode_launches(log: list) -> dict:
    """Launches of one ``encode_rows`` of 4 rows per codec configuration (the rows kernels' path)."""
    import torch
    from launch_counts import count

    from lightning_qcomm.codecs import derive_seed, encode_rows, get_codec

    rows = torch.randn(4, 1037, generator=torch.Generator().manual_seed(2))
    seeds = [derive_seed(3, 1, j) for j in range(4)]
    out = {}
    for name, bits, opts in FUSED_ENCODE:
        codec = get_codec(name, bits, **{"bucket_size": 512, **opts})
        out[_key(name, bits, opts)] = count(lambda c=codec: encode_rows(c, rows, seeds), log)
    return out


def _error_feedback_values() -> list[str]:
    """The quantized all-reduce with error feedback on the CUDA kernels (interpreted; torch's fake group of 4 ranks,
    rank 1, every rank holding this rank's inputs: ``mirrored_collectives``), its residual through
    ``codecs.feedback_rows`` against the two ops it replaced (the rows decode, then ``feedback_update``): outputs
    and error buffers bit for bit over three steps (the second with a NaN, Inf and a subnormal), fp32 and bf16
    input, a bucket whose last chunks are short and one whose last chunk is padding only. Failures listed."""
    from unittest import mock

    import torch
    import torch.distributed as dist
    from launch_counts import cuda_path_on_cpu, mirrored_collectives
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from lightning_qcomm.codecs import decode_rows, feedback_update, get_codec
    from lightning_qcomm.collectives import quantized, quantized_all_reduce

    def two_ops(codec, y, rows, c, reduced, held, start, k, held_dtype, err):
        dec = decode_rows(codec, rows, c).view(-1)[: y.numel()]
        return feedback_update(y, dec, reduced, held, start, k, held_dtype, err)

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    failures = []
    with cuda_path_on_cpu(), mirrored_collectives():
        for label, codec in (("uniform-8", get_codec("uniform", 8, 64)), ("nuqsgd-4", get_codec("nuqsgd", 4, 64))):
            for d, dtype in ((1037, torch.float32), (1037, torch.bfloat16), (13, torch.float32)):
                errs = {path: torch.zeros(d, dtype=dtype) for path in ("fused", "two_ops")}
                for t in range(3):
                    x = torch.randn(d, generator=torch.Generator().manual_seed(t)) * (1 + t)
                    if t == 1:
                        x[300 % d], x[7], x[2] = float("nan"), float("inf"), 1e-41
                    outs = {}
                    for path, e in errs.items():
                        patch = mock.patch.object(quantized, "feedback_rows", two_ops) if path == "two_ops" else None
                        if patch:
                            patch.start()
                        try:
                            outs[path] = quantized_all_reduce(
                                x.to(dtype, copy=True), codec, op="avg", error_feedback=e, seed=t
                            )
                        finally:
                            if patch:
                                patch.stop()
                    for name, a, b in (("output", *outs.values()), ("error", *errs.values())):
                        a, b = a.float(), b.float()
                        same = (a.view(torch.int32) == b.view(torch.int32)) | (a.isnan() & b.isnan())
                        if not bool(same.all()):
                            failures.append(f"{label} d={d} {dtype} step {t}: {name} differs")
    dist.destroy_process_group()
    return failures


def _worker() -> dict:
    from unittest import mock

    from launch_counts import all_reduce_rows, codec_rows, cuda_path_on_cpu

    from lightning_qcomm.codecs import cuda

    report = {"rows": _rows_cases()}
    with cuda_path_on_cpu() as log:
        report["codecs"] = {
            r["codec"] + "".join(f"_{v}" for v in r["options"].values()): r for r in codec_rows(log, FUSED_ENCODE)
        }
        report["rows_encode"] = _rows_encode_launches(log)
        report["all_reduce"] = all_reduce_rows(log, codecs=ALL_REDUCE_CODECS)
        with mock.patch.object(cuda, "rows_kernel", lambda c, r, encode=True: False):
            report["all_reduce_torch_rows"] = all_reduce_rows(log, codecs=("uniform-8", "nuqsgd-4"))
    report["error_feedback_values"] = _error_feedback_values()
    return report


@pytest.fixture(scope="module")
def report() -> dict:
    from _interpreted import run_interpreted

    return run_interpreted(__file__, 600)


@pytest.mark.parametrize("case", FUSED_ENCODE, ids=lambda c: _key(*c))
def test_fused_encode_is_two_launches(report, case):
    enc = report["codecs"][_key(*case)]["encode"]
    assert (enc["triton"], enc["torch"]) == (2, 0), enc


@pytest.mark.parametrize("case", FUSED_ENCODE, ids=lambda c: _key(*c))
def test_rows_encode_is_two_launches(report, case):
    """R payloads in two launches, both writing the wire rows: the scales kernel stores the scales' bytes behind
    each row's codes, the codes kernel the codes (no third launch copying the scales)."""
    enc = report["rows_encode"][_key(*case)]
    assert (enc["triton"], enc["torch"]) == (2, 0), enc


@pytest.mark.parametrize("case", FUSED_ENCODE, ids=lambda c: _key(*c))
def test_decode_is_one_launch(report, case):
    dec = report["codecs"][_key(*case)]["decode"]
    assert (dec["triton"], dec["torch"]) == (1, 0), dec


def test_rows_kernels_equal_each_rows_own_encode(report):
    """R rows (NaN, extreme values, mixed zeros among them) coded in one go by the rows kernels: row j is
    ``codec.encode(rows[j], seed_j).to_bytes()``, bit for bit, for every codec configuration; and R
    payloads of every codec with kernels decoded in one launch equal each payload's own decode, bit for bit."""
    assert len(report["rows"]) == 4 * len(FUSED_ENCODE)
    assert all(report["rows"].values()), report["rows"]


def test_all_reduce_launches_flat_in_world_size(report, capsys):
    """One quantized all-reduce on the CUDA code path: the launches do not grow with N, and the rows kernels
    take at most a quarter of the torch rows' launches."""
    for codec in ("uniform-8", "nuqsgd-4"):
        fused = {r["world"]: r["total"] for r in report["all_reduce"] if r["codec"] == codec}
        before = {r["world"]: r["total"] for r in report["all_reduce_torch_rows"] if r["codec"] == codec}
        with capsys.disabled():
            print(f"\nquantized_all_reduce {codec}, launches by N: rows kernels {fused}, torch rows {before}")
        assert fused[8] <= fused[2], fused
        assert all(fused[w] * 4 <= before[w] for w in fused), (fused, before)


@pytest.mark.parametrize("codec", ALL_REDUCE_CODECS)
def test_all_reduce_launches_per_bucket(report, codec):
    """The per-bucket total of a quantized all-reduce at N = 2, 4, 8 (23 before the server step, its encode, the
    final decode and the error-feedback tail were fused; 12 before the tail decoded the phase-1 payloads itself)."""
    totals = {r["world"]: r for r in report["all_reduce"] if r["codec"] == codec}
    assert sorted(totals) == [2, 4, 8]
    for world, r in totals.items():
        assert r["total"] <= MAX_ALL_REDUCE_LAUNCHES, (codec, world, r)


def test_all_reduce_error_feedback_values(report):
    """The residual decoded inside the feedback kernel (``codecs.feedback_rows``) leaves the outputs and error
    buffers of the rows decode followed by ``feedback_update``, bit for bit, on the CUDA kernels."""
    assert report["error_feedback_values"] == [], report["error_feedback_values"]


if __name__ == "__main__":
    sys.path[:0] = [str(BENCHMARKS), str(Path(__file__).resolve().parents[1] / "_helpers")]
    print(json.dumps(_worker()))
