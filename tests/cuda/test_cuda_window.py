"""``qcomm::add_square_sr_`` (1-bit Adam's bf16 variance window) on a GPU: the Triton pass gives the CPU reference's
bits for fp32, bf16 and fp16 gradients with NaN, infinities and subnormals; its first-use check passes (so the
kernel, not the reference, ran); a second call makes the host wait for nothing. Skipped without CUDA or Triton."""

from __future__ import annotations

import pytest
import torch
from _cuda_checks import NO_CUDA, has_triton

from lightning_qcomm.codecs import rng, triton_probe

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA),
    pytest.mark.skipif(torch.cuda.is_available() and not has_triton(), reason="needs Triton (a CUDA build of torch)"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [1, 4099, 1 << 20])
def test_the_kernel_is_the_reference(dtype, n):
    gen = torch.Generator().manual_seed(n)
    acc = (torch.rand(n, generator=gen) * 4).to(torch.bfloat16)
    g = (torch.randn(n, generator=gen) * 2).to(dtype)
    if n > 10:
        g[3], g[5], g[6], acc[7] = float("nan"), float("inf"), 1e-41, 3e38
    want = acc.clone()
    rng.add_square_sr_reference_(want, g, 123, 1 << 16)
    got = acc.cuda()
    torch.ops.qcomm.add_square_sr_(got, g.cuda(), 123, 1 << 16)
    assert triton_probe._verdicts.get(("add_square_sr", str(got.device))) is True, triton_probe._failures
    got = got.cpu()
    nan = want.isnan()
    assert torch.equal(nan, got.isnan()) and torch.equal(want[~nan].view(torch.int16), got[~nan].view(torch.int16))


def test_the_op_waits_for_nothing():
    from _sync_guard import NoHostSync

    acc = torch.zeros(1 << 22, dtype=torch.bfloat16, device="cuda")
    g = torch.randn(1 << 22, device="cuda")
    for guard in (None, NoHostSync):  # the first call runs the first-use check
        with guard() if guard else torch.no_grad():
            torch.ops.qcomm.add_square_sr_(acc, g, 5, 1 << 16)
    torch.cuda.synchronize()
