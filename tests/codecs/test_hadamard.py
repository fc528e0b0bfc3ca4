"""The Hadamard transform op ``qcomm::hadamard_`` and the randomized rotation (``codecs.eden``): the reference is
H_B / sqrt(B) in one fixed butterfly order; the C kernel and the Triton kernel (interpreted) give its bits, NaN and
infinities, subnormals and values near FLT_MAX included; a non-finite value stays in its block; the op passes
torch's op checks and its CUDA path (on CPU tensors) is one launch with no host sync."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from lightning_qcomm.codecs import eden, native

U = 2.0**-24  # fp32's unit roundoff
BLOCKS = (1, 2, 4, 8, 16, 64, 512, 4096)
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _special(block: int, seed: int) -> torch.Tensor:
    """Three blocks: NaN in the first, +inf and a subnormal in the second (from block 4), one near FLT_MAX in the
    third, -0.0 somewhere, the rest N(0, 9)."""
    x = torch.randn(3 * block, generator=torch.Generator().manual_seed(seed)) * 3
    x[0] = float("nan")
    if block >= 4:
        x[block + 1], x[block + 2] = float("inf"), 1e-41
    x[-1], x[block // 2 + 2 * block] = 3e38, -0.0
    return x


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits, any NaN equal to any NaN."""
    nan = a.isnan()
    return bool(torch.equal(nan, b.isnan()) and torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32)))


def _butterfly_by_loops(x: torch.Tensor, block: int) -> torch.Tensor:
    """The spec, one scalar fp32 operation at a time: the order ``eden.hadamard_reference_`` documents."""
    v = [torch.tensor(float(t), dtype=torch.float32) for t in x]
    for o in range(0, len(v), block):
        h = 1
        while h < block:
            for i in range(o, o + block, 2 * h):
                for j in range(i, i + h):
                    v[j], v[j + h] = v[j] + v[j + h], v[j] - v[j + h]
            h *= 2
    s = torch.tensor(eden.hadamard_scale(block), dtype=torch.float32)
    return torch.stack([t * s for t in v])


@pytest.mark.parametrize("block", (1, 2, 8, 16))
def test_reference_is_the_butterfly_in_its_documented_order(block):
    x = torch.randn(2 * block, generator=torch.Generator().manual_seed(block)) * 5
    got = x.clone()
    eden.hadamard_reference_(got, block)
    assert _same(got, _butterfly_by_loops(x, block))


@pytest.mark.parametrize("block", (2, 8, 64, 512))
def test_reference_is_the_orthonormal_hadamard_matrix(block):
    """|y - H x / sqrt(B)| <= (log2 B + 2) u sum|x| / sqrt(B) per output: log2 B rounded additions, the rounded
    factor and the product."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < block:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    x = torch.randn(3, block, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(torch.float32)
    y = x.clone().view(-1)
    eden.hadamard_reference_(y, block)
    exact = (x.double() @ h.T) / math.sqrt(block)
    bound = (math.log2(block) + 2) * U * x.double().abs().sum(dim=1, keepdim=True) / math.sqrt(block)
    assert bool(((y.view(3, block).double() - exact).abs() <= bound).all())
    twice = y.clone()
    eden.hadamard_reference_(twice, block)  # H H = I
    assert torch.allclose(twice.view(3, block), x, atol=4 * (math.log2(block) + 2) * U * float(x.abs().max()) * 8)


@pytest.mark.skipif(native.load() is None, reason="the C kernels could not be built here")
@pytest.mark.parametrize("block", (*BLOCKS, 1 << 16))
def test_c_kernel_gives_the_reference_bits(block, monkeypatch):
    x = _special(block, block)
    want = x.clone()
    eden.hadamard_reference_(want, block)
    calls = []
    c_op = torch.ops.qcomm.c_hadamard
    monkeypatch.setattr(eden, "hadamard_reference_", lambda *a: calls.append(a))  # the C kernel must run
    got = x.clone()
    torch.ops.qcomm.hadamard_(got, block)
    assert not calls and c_op is torch.ops.qcomm.c_hadamard
    assert _same(got, want)


@pytest.mark.parametrize("block", BLOCKS)
def test_a_non_finite_value_spreads_over_its_block_only(block):
    x = torch.randn(3 * block, generator=torch.Generator().manual_seed(5))
    x[block + block // 2] = float("nan")
    torch.ops.qcomm.hadamard_(x, block)
    finite = x.view(3, block).isfinite()
    assert bool(finite[0].all() and finite[2].all()) and not bool(finite[1].any())


def test_values_near_the_float_limits():
    """A block of the smallest normals keeps its mass exactly (sums of equal powers of two; subnormals are the
    codec's to pre-scale, as the suite flushes them); a block whose l1 norm passes FLT_MAX overflows (the
    documented limit a codec pre-scales), a block under it stays finite."""
    tiny = torch.full((64,), 2.0**-126)
    torch.ops.qcomm.hadamard_(tiny, 64)
    assert tiny[0].item() == 2.0**-123 and bool((tiny[1:] == 0).all())
    big = torch.full((8,), 3e38)
    torch.ops.qcomm.hadamard_(big, 8)
    assert math.isinf(big[0].item())
    fits = torch.full((8,), 3e38 / 8)
    torch.ops.qcomm.hadamard_(fits, 8)
    assert bool(fits.isfinite().all()) and fits[0].item() == pytest.approx(3e38 / math.sqrt(8), rel=1e-6)


@pytest.mark.parametrize("block", (0, 3, 12, 1 << 17))
def test_bad_blocks_are_refused(block):
    with pytest.raises(ValueError, match="block must be a power of two"):
        torch.ops.qcomm.hadamard_(torch.zeros(48), block)


def test_partial_blocks_are_refused():
    with pytest.raises(ValueError, match="not whole blocks"):
        torch.ops.qcomm.hadamard_(torch.zeros(24), 16)


def test_the_op_passes_torchs_op_checks():
    x = torch.randn(2 * 64, generator=torch.Generator().manual_seed(1))
    torch.library.opcheck(torch.ops.qcomm.hadamard_.default, (x, 64))


def _worker() -> dict:
    from _sync_guard import NoHostSync
    from launch_counts import cuda_path_on_cpu

    from lightning_qcomm.codecs import cuda

    out = {}
    for block in (*BLOCKS, 8192):
        x = _special(block, 7 * block)
        want = x.clone()
        eden.hadamard_reference_(want, block)
        with cuda_path_on_cpu() as log:
            assert cuda._hadamard_works(x.device)  # the first-use check: may launch; then cleared
            log.clear()
            got = x.clone()
            with NoHostSync():
                torch.ops.qcomm.hadamard_(got, block)
        out[f"bits_{block}"] = _same(got, want)
        out[f"launches_{block}"] = log == ["hadamard"]
    big = torch.randn(2 * 16384, generator=torch.Generator().manual_seed(3))
    want = big.clone()
    eden.hadamard_reference_(want, 16384)
    with cuda_path_on_cpu() as log:
        torch.ops.qcomm.hadamard_(big, 16384)  # past the kernel's MAX_BLOCK: the reference
    out["bits_reference_past_max_block"] = _same(big, want) and "hadamard" not in log
    return out


@pytest.fixture(scope="module")
def report() -> dict:
    pytest.importorskip("triton")
    from _interpreted import run_interpreted

    return run_interpreted(__file__, 600)


@pytest.mark.parametrize("kind", ["bits", "launches"])
def test_triton_kernel_under_the_interpreter(report, kind):
    from _interpreted import assert_kind_passed

    assert_kind_passed(report, kind)


if __name__ == "__main__":
    sys.path[:0] = [str(BENCHMARKS), str(Path(__file__).resolve().parents[1] / "_helpers")]
    print(json.dumps(_worker()))
