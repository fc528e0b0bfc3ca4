"""The segment ops on a GPU (``codecs.rows_segments``: QSDP's wire rows, a layer's batched activation saves): the
Triton kernels give the CPU reference's bytes and values (any NaN equal to any NaN) for every codec kind, fp32
and bf16 rows, one and four rows, raw and quantized segments with NaN, Inf, -0.0 and subnormals; their first-use
check passes (so the kernels, not the reference, ran); and a second call makes the host wait for nothing.
Skipped without CUDA or Triton."""

from __future__ import annotations

import pytest
import torch
from _cuda_checks import NO_CUDA, has_triton

from lightning_qcomm.codecs import cuda_segments, get_codec, triton_probe
from lightning_qcomm.codecs import rows_segments as rs

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA),
    pytest.mark.skipif(torch.cuda.is_available() and not has_triton(), reason="needs Triton (a CUDA build of torch)"),
]

CODECS = [("uniform", 8, 1024), ("uniform", 4, 128), ("fp8_e4m3", 8, 256), ("qsgd", 4, 128), ("sign1", 1, 128)]
LAYOUT = [(96, False), (2048, True), (40, False), (1000, True), (16, False), (4 * 1024 + 8, True)]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.float().cpu(), b.float().cpu()
    nan = a.isnan()
    return bool(torch.equal(nan, b.isnan()) and torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32)))


@pytest.mark.parametrize("r", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("spec", CODECS, ids=lambda c: f"{c[0]}{c[1]}-{c[2]}")
def test_segment_kernels_are_the_reference(spec, dtype, r):
    name, bits, bucket = spec
    codec = get_codec(name, bits, bucket)
    numels, quantized = [n for n, _ in LAYOUT], [q for _, q in LAYOUT]
    x = torch.randn(r, sum(numels), generator=torch.Generator().manual_seed(r)) * 3
    x[0, 100], x[-1, 3000], x[0, 5], x[-1, 7000] = float("nan"), float("inf"), -0.0, 1e-41
    x = x.to(dtype)
    seeds = [11, 12, 13]
    p = rs.wire_nbytes(codec, numels, quantized, dtype)
    want = torch.zeros(r, p, dtype=torch.uint8)
    rs.encode_segments_body(codec, x, numels, quantized, seeds, want)
    xd = x.cuda()
    assert cuda_segments.segments_kernel(codec, xd, numels, quantized, r, dtype)
    key = ("segments", tuple(sorted(codec.config().items())), str(dtype), str(xd.device))
    assert triton_probe._verdicts.get(key) is True, triton_probe._failures.get(key)
    got = rs.encode_segments(codec, xd, numels, quantized, seeds, torch.zeros(r, p, dtype=torch.uint8, device="cuda"))
    assert torch.equal(got.cpu(), want)
    for out_dtype in (torch.float32, torch.bfloat16):
        ref = torch.full(x.shape, 7.0, dtype=out_dtype)
        rs.decode_segments_body(codec, want, numels, quantized, dtype, r - 1 if r > 1 else -1, ref)
        dec = torch.full(x.shape, 7.0, dtype=out_dtype, device="cuda")
        rs.decode_segments_into(codec, got, numels, quantized, dtype, dec, r - 1 if r > 1 else None)
        assert _same(dec, ref)
        ref_sum = torch.empty(x.shape[1], dtype=out_dtype)
        rs.sum_segments_body(codec, want, x, 0, numels, quantized, ref_sum)
        total = rs.decode_segments_sum(codec, got, xd, 0, numels, quantized, torch.empty_like(ref_sum, device="cuda"))
        assert _same(total, ref_sum)


def test_segment_ops_wait_for_nothing():
    from _sync_guard import NoHostSync

    codec = get_codec("uniform", 8, 1024)
    numels, quantized = [n for n, _ in LAYOUT], [q for _, q in LAYOUT]
    x = torch.randn(4, sum(numels), device="cuda")
    wire = torch.empty(4, rs.wire_nbytes(codec, numels, quantized, x.dtype), dtype=torch.uint8, device="cuda")
    out, total = torch.empty_like(x), torch.empty(x.shape[1], device="cuda")
    for guard in (None, NoHostSync):  # the first call checks the kernels and uploads the layout's table
        with guard() if guard else torch.no_grad():
            rs.encode_segments(codec, x, numels, quantized, [1, 2, 3], wire)
            rs.decode_segments_into(codec, wire, numels, quantized, x.dtype, out)
            rs.decode_segments_sum(codec, wire, x, 1, numels, quantized, total)
    torch.cuda.synchronize()
