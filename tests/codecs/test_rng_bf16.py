"""``codecs.rng.round_bf16_stochastic_``: a bf16 neighbour of x, up with probability the fraction of the place x lies
above the lower one (unbiased), the same bits for the same seed, ±inf and NaN kept, bad dtypes refused; and the op
``qcomm::add_square_sr_`` (1-bit Adam's bf16 window) on its CUDA path, under the interpreter: the reference's bits,
one launch, no host sync."""

from __future__ import annotations

import pytest
import torch

from lightning_qcomm.codecs.rng import round_bf16_stochastic_


def _round(x: torch.Tensor, seed: int) -> torch.Tensor:
    return round_bf16_stochastic_(torch.empty(x.shape, dtype=torch.bfloat16), x.clone(), seed)


def test_a_neighbour_taken_with_the_right_probability_and_repeatable():
    # 1 + 2^-10 lies an eighth of a place (2^-7) above 1: up with probability 1/8; over 2^16 draws the share has
    # sd sqrt(p(1-p)/n) = 1.3e-3, 5 of them bound it
    x = torch.full((1 << 16,), 1 + 2.0**-10)
    y = _round(x, 3).float()
    assert set(y.unique().tolist()) == {1.0, 1 + 2.0**-7}
    assert abs((y > 1).double().mean().item() - 1 / 8) <= 5 * (7 / 64 / (1 << 16)) ** 0.5
    assert torch.equal(_round(x, 3), _round(x, 3))
    assert not torch.equal(_round(x, 3), _round(x, 4))
    z = torch.tensor([float("inf"), float("-inf"), float("nan"), -3.0, 0.0])
    out = _round(z, 1).float()
    assert out[0] == float("inf") and out[1] == float("-inf") and out[2].isnan()
    assert out[3] == -3.0 and out[4] == 0.0  # representable values stay


def test_bad_dtypes_raise_naming_the_function_and_the_allowed():
    with pytest.raises(TypeError, match=r"round_bf16_stochastic_\(.*allowed a bfloat16 out and a float32 x"):
        round_bf16_stochastic_(torch.empty(2, dtype=torch.float16), torch.zeros(2), 0)


def _window_worker() -> dict:
    """Under the interpreter: the op's CUDA path (Triton, one launch, no host sync) against the reference."""
    from _sync_guard import NoHostSync
    from launch_counts import cuda_path_on_cpu

    from lightning_qcomm.codecs import cuda, rng

    out = {}
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for n in (1, 1000, 5000):
            acc = (torch.rand(n, generator=gen) * 4).to(torch.bfloat16)
            g = (torch.randn(n, generator=gen) * 2).to(dtype)
            if n > 10:
                g[3], g[5], acc[7] = float("nan"), float("inf"), 3e38
            want = acc.clone()
            rng.add_square_sr_reference_(want, g, -77, 256)  # pieces of 256: the bits do not depend on them
            with cuda_path_on_cpu() as log:
                assert cuda._add_square_sr_works(acc.device)
                log.clear()
                with NoHostSync():
                    torch.ops.qcomm.add_square_sr_(acc, g, -77, 256)
            same = torch.equal(want.float().isnan(), acc.float().isnan())
            same = same and torch.equal(want[~want.isnan()].view(torch.int16), acc[~acc.isnan()].view(torch.int16))
            out[f"bits_{dtype}_{n}"] = bool(same)
            out[f"launches_{dtype}_{n}"] = log == ["window"]
    return out


@pytest.fixture(scope="module")
def window_report() -> dict:
    pytest.importorskip("triton")
    from _interpreted import run_interpreted

    return run_interpreted(__file__, 600)


@pytest.mark.parametrize("kind", ["bits", "launches"])
def test_window_kernel_under_the_interpreter(window_report, kind):
    from _interpreted import assert_kind_passed

    assert_kind_passed(window_report, kind)


if __name__ == "__main__":
    import json
    import sys
    from pathlib import Path

    here = Path(__file__).resolve()
    sys.path[:0] = [str(here.parents[2] / "benchmarks"), str(here.parents[1] / "_helpers")]
    print(json.dumps(_window_worker()))
