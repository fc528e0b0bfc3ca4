"""``QuantDDPStrategy(codec="auto")``: the width is chosen from measured costs, deterministically and alike on every
rank (issue 17 item 2; ``comm.auto_width``).

The cost model is checked with injected measurements (no timing in any assertion): its limits follow from
T(b) = W_b / R + k_N · c_b · d (a free codec picks the narrowest allowed width, a free link picks fp32, a slower
link never picks a wider width, nothing below ``min_bits``). On 2 gloo ranks: ``measure_costs`` agrees on the
slowest rank's figures even when the ranks measure differently, and a Trainer with ``codec="auto"`` runs the
width the (injected) costs imply, then with real measurements runs whatever it chose, the same on both ranks.
"""

from __future__ import annotations

import os

import pytest
import torch
from _launch import free_port, rank_results, spawn, write_rank_result

from lightning_qcomm.comm.auto_width import (
    UNCOMPRESSED,
    WidthCosts,
    candidate_widths,
    choose_bits,
    codec_work_factor,
    predicted_seconds,
)
from lightning_qcomm.comm.ddp_config import QuantDDPConfig

D = 3_307_008  # the benchmark GPT's trainable parameters


def _costs(link: float, ns_per_element: float) -> WidthCosts:
    return WidthCosts(link, {b: ns_per_element * 1e-9 for b in (8, 4, 2)})


@pytest.mark.parametrize("min_bits", [2, 4, 8])
def test_free_codec_picks_the_narrowest_allowed_width(min_bits):
    assert choose_bits(D, 2, _costs(12.5e6, 0.0), min_bits) == min_bits


def test_free_link_picks_fp32():
    assert choose_bits(D, 2, _costs(1e18, 1.0), 2) == UNCOMPRESSED


def test_a_slower_link_never_picks_a_wider_width():
    chosen = [choose_bits(D, 4, _costs(rate, 3.0), 2) for rate in (1e12, 1e10, 1.25e9, 1.25e8, 1.25e7, 1e6)]
    assert chosen == sorted(chosen, reverse=True)
    assert chosen[0] == UNCOMPRESSED and chosen[-1] == 2  # both ends are reached


def test_world_of_one_sends_nothing_and_keeps_fp32():
    assert choose_bits(D, 1, _costs(1.0, 1.0), 2) == UNCOMPRESSED


def test_codec_work_counts_both_phases():
    # phase 1 encodes and decodes d; phase 2 encodes d/N and decodes d: (3 + 1/N) / 2 pairs per element
    assert codec_work_factor(2) == pytest.approx(1.75)
    slow_codec = _costs(1e18, 10.0)  # the link costs ~nothing: T(8) is the codec work alone
    assert predicted_seconds(8, D, 2, slow_codec) == pytest.approx(1.75 * 10e-9 * D, rel=1e-6)


def test_bad_min_bits_and_bits_with_auto_are_refused():
    with pytest.raises(ValueError, match="min_bits=3.*allowed: 2, 4, 8"):
        candidate_widths(3)
    with pytest.raises(ValueError, match="min_bits=3"):
        QuantDDPConfig(codec="auto", min_bits=3)
    with pytest.raises(ValueError, match="'auto' chooses the width"):
        QuantDDPConfig(codec="auto", bits=8)
    with pytest.raises(ValueError, match="resolved by QuantDDPStrategy"):
        QuantDDPConfig(codec="auto").build_codec()
    assert QuantDDPConfig(codec="auto").resolve_auto(32).codec == "none"
    assert QuantDDPConfig(codec="auto").resolve_auto(4).build_codec().bits == 4


@pytest.mark.parametrize("value", [4.0, "4"])
def test_min_bits_of_another_type_is_a_type_error(value):
    """``min_bits`` must be an int: 4.0 or "4" is refused with a TypeError naming the argument and the allowed set."""
    with pytest.raises(TypeError, match=r"min_bits.*allowed: 2, 4, 8"):
        QuantDDPConfig(codec="auto", min_bits=value)


# ---------------------------------------------------------------------------------------------- 2 ranks
def _fit(strategy) -> dict:
    import lightning.pytorch as pl
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lightning_qcomm import CommVolumeLogger

    logger = CommVolumeLogger(summary=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        callbacks=[logger],
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(BoringModel())
    run = strategy.run_config
    return {"codec": run.codec, "bits": run.bits}


def _worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from _launch import lightning_env

    from lightning_qcomm import QuantDDPStrategy
    from lightning_qcomm.comm import auto_width
    from lightning_qcomm.strategies import quant_ddp

    os.environ.update(lightning_env(rank, 2, port))
    torch.set_num_threads(1)
    result = {}
    real_measure_codec, real_measure_link = auto_width.measure_codec, auto_width.measure_link
    # the ranks "measure" differently: rank 1's codec is 3x slower; both must end with rank 1's figures
    auto_width.measure_codec = lambda bits, **kw: (1e-9 if rank == 0 else 3e-9) * bits
    auto_width.measure_link = lambda group, **kw: 1e8 if rank == 0 else 5e7
    dist.init_process_group("gloo", rank=rank, world_size=2)
    costs = auto_width.measure_costs(None, 2)
    result["costs"] = [costs.link_bytes_per_s, sorted(costs.codec_s_per_element.items())]
    dist.destroy_process_group()
    auto_width.measure_codec, auto_width.measure_link = real_measure_codec, real_measure_link

    real = quant_ddp.measure_costs
    quant_ddp.measure_costs = lambda group, min_bits, device=None: WidthCosts(1e3, dict.fromkeys((8, 4, 2), 1e-12))
    result["slow_link"] = _fit(QuantDDPStrategy(codec="auto", min_bits=4, overlap_comm=False))
    quant_ddp.measure_costs = lambda group, min_bits, device=None: WidthCosts(1e15, dict.fromkeys((8, 4, 2), 1e-6))
    result["fast_link"] = _fit(QuantDDPStrategy(codec="auto", min_bits=4, overlap_comm=False))
    quant_ddp.measure_costs = real
    result["measured"] = _fit(QuantDDPStrategy(codec="auto", min_bits=4, overlap_comm=False))
    write_rank_result(out, rank, result)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("auto_width")
    spawn(_worker, free_port(), str(out), nprocs=2)
    return rank_results(out, 2)


def test_ranks_agree_on_the_slowest_measurements(runs):
    assert runs[0]["costs"] == runs[1]["costs"]
    link, codec = runs[0]["costs"]
    assert link == pytest.approx(5e7)  # rank 1's slower link
    assert codec == [[2, pytest.approx(6e-9)], [4, pytest.approx(12e-9)], [8, pytest.approx(24e-9)]]


def test_trainer_runs_the_width_the_costs_imply(runs):
    for r in runs:
        assert (r["slow_link"]["codec"], r["slow_link"]["bits"]) == ("uniform", 4)  # narrowest allowed
        assert (r["fast_link"]["codec"], r["fast_link"]["bits"]) == ("none", 32)  # compression would only cost
    assert runs[0]["measured"] == runs[1]["measured"]
    assert runs[0]["measured"]["bits"] in (32, 8, 4)
