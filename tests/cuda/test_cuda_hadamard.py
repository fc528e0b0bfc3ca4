"""``qcomm::hadamard_`` on a GPU: the Triton kernel gives the CPU reference's bits (any NaN equal to any NaN) for
blocks of 1 to 2^13 with NaN, infinities, -0.0, subnormals and values near FLT_MAX; its first-use check passes (so
the kernel, not the reference, ran); a second call makes the host wait for nothing. Skipped without CUDA or
Triton."""

from __future__ import annotations

import pytest
import torch
from _cuda_checks import NO_CUDA, has_triton

from lightning_qcomm.codecs import eden, triton_probe

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA),
    pytest.mark.skipif(torch.cuda.is_available() and not has_triton(), reason="needs Triton (a CUDA build of torch)"),
]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.cpu(), b.cpu()
    nan = a.isnan()
    return bool(torch.equal(nan, b.isnan()) and torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32)))


@pytest.mark.parametrize("block", [1, 2, 16, 256, 4096, 8192])
def test_the_kernel_is_the_reference(block):
    x = torch.randn(5 * block, generator=torch.Generator().manual_seed(block)) * 3
    x[0], x[-1], x[block // 2] = float("nan"), 3e38, 1e-41
    if block > 2:
        x[3 * block + 1], x[2 * block + 3] = float("-inf"), -0.0
    want = x.clone()
    eden.hadamard_reference_(want, block)
    got = x.cuda()
    torch.ops.qcomm.hadamard_(got, block)
    assert triton_probe._verdicts.get(("hadamard", str(got.device))) is True, triton_probe._failures
    assert _same(got, want)


def test_the_op_waits_for_nothing():
    from _sync_guard import NoHostSync

    x = torch.randn(64 * 4096, device="cuda")
    for guard in (None, NoHostSync):  # the first call runs the first-use check
        with guard() if guard else torch.no_grad():
            torch.ops.qcomm.hadamard_(x, 4096)
    torch.cuda.synchronize()
