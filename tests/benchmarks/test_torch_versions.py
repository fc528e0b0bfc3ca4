"""benchmarks/torch_versions.py's run selection (``--only``) and strategy table, without starting processes.

DDP is each plan's reference and must stay in every plan that runs another strategy; a diagnostic joins the
2-rank plan; an unknown name is refused up front (not as a KeyError inside a spawned rank).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks import torch_versions  # noqa: E402


def test_every_plan_without_only():
    plans = torch_versions.select_plans(None)
    assert [(w, n) for w, n, _ in plans] == [(2, 2), (4, 2)]
    assert all(names[0] == "ddp" for _, _, names in plans)
    assert not torch_versions.DIAGNOSTICS & {x for _, _, names in plans for x in names}


def test_only_keeps_ddp_and_drops_plans_left_with_ddp_alone():
    assert torch_versions.select_plans("qsdp_w4g4,local_sgd") == [(2, 2, ["ddp", "qsdp_w4g4", "local_sgd"])]
    assert torch_versions.select_plans("hsdp_w8g8") == [(4, 2, ["ddp", "hsdp_w8g8"])]


def test_diagnostics_join_the_two_rank_plan():
    plans = torch_versions.select_plans("qsdp_w4g4,qsdp_w4g8,qsdp_w8g4,qsdp_w4g4_b128")
    assert plans == [(2, 2, ["ddp", "qsdp_w4g4", "qsdp_w4g8", "qsdp_w8g4", "qsdp_w4g4_b128"])]


def test_unknown_name_is_refused_with_the_allowed_set():
    with pytest.raises(ValueError, match=r"--only qsdp_w3g3: unknown; allowed: .*qsdp_w4g4_b128"):
        torch_versions.select_plans("qsdp_w4g4,qsdp_w3g3")


@pytest.mark.parametrize("name", sorted(torch_versions.DIAGNOSTICS))
def test_each_diagnostic_builds_its_strategy(name):
    strategy = torch_versions._strategy(name)
    weight, grad = {"qsdp_w4g8": (4, 8), "qsdp_w8g4": (8, 4), "qsdp_w4g4_b128": (4, 4)}[name]
    assert (strategy.weight_bits, strategy.grad_bits) == (weight, grad)
    assert strategy.run_config.bucket_size == (128 if name.endswith("_b128") else 1024)


def test_the_causal_feed_is_consecutive_text_with_next_token_labels():
    src, x, y = torch_versions.dataset("causal", 3).tensors
    t = torch_versions.SEQ
    stream = torch_versions._tokens(3 * (2 * t + 1)).view(3, -1)
    assert torch.equal(torch.cat([src, x, y[:, -1:]], dim=1), stream)
    assert torch.equal(y[:, :-1], x[:, 1:])


def _outputs_moved(feed: str, position: int) -> torch.Tensor:
    """Per position of one sample, whether the benchmark module's prediction changes when label ``position`` is
    changed in the stream (so in every input that holds that token too)."""
    module = torch_versions._module().eval()
    batch = [t[:1].clone() for t in torch_versions.dataset(feed, 1).tensors]
    changed = [t.clone() for t in batch]
    y, x = changed[-1], changed[-2]
    y[0, position] = (y[0, position] + 1) % torch_versions.VOCAB
    if position + 1 < x.shape[1]:
        x[0, position + 1] = y[0, position]  # label i is input i + 1
    with torch.no_grad():
        a, b = module.predict(batch)[0], module.predict(changed)[0]
    return (a - b).abs().amax(dim=-1) > 0


def test_the_causal_feed_hides_each_label_from_its_prediction_and_the_demo_feed_does_not():
    for position in (0, 4, 8):
        moved = _outputs_moved("causal", position)
        assert not moved[: position + 1].any(), "a prediction saw its label or a later token"
        assert _outputs_moved("demo", position)[position], "the demo feed's prediction i reads label i"


def test_an_unknown_feed_is_refused_with_the_allowed_set():
    with pytest.raises(ValueError, match=r"feed='shifted': allowed \('causal', 'demo'\)"):
        torch_versions.dataset("shifted", 2)
