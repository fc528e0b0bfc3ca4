"""``codecs.rng.round_bf16_stochastic_``: a bf16 neighbour of x, up with probability the fraction of the place x lies
above the lower one (unbiased), the same bits for the same seed, ±inf and NaN kept, bad dtypes refused."""

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
