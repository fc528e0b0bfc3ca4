"""``QSDPStrategy(weight_bits="auto", grad_bits="auto")``: each direction's width chosen from measured costs with
QSDP's own wire formula, deterministically and alike on every rank (issue 17 item 2; ``comm.auto_qsdp`` on the
shared cost model of ``comm.auto_width``).

The cost model is checked with injected measurements (no timing in any assertion): a fast link keeps 32 bits, a
slow one takes the narrowest allowed width, a slower link never takes a wider width, a tie goes to the wider
width, and the predicted terms are the formula's. Bad settings are refused naming the argument, the value and
what is allowed. On 2 gloo ranks (one spawn): ``apply_qsdp`` with real measurements chooses the same widths on
both ranks and logs one line; the formula's bytes are the ledger's bytes per step (the root groups gathered
once, the others twice); a Trainer with injected costs runs the widths they imply and measures once over two
fits; Fabric chooses the "auto" direction and keeps the fixed one; one rank measures nothing.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from _launch import free_port, lightning_env, rank_results, spawn, write_rank_result

from lightning_qcomm.comm.auto_qsdp import (
    GroupTraffic,
    choose_qsdp_bits,
    qsdp_codec_pairs,
    qsdp_predicted_seconds,
    qsdp_times,
    qsdp_wire_bytes,
)
from lightning_qcomm.comm.auto_width import UNCOMPRESSED, WidthCosts, codec_work_factor, fastest
from lightning_qcomm.comm.row_codec import Segment
from lightning_qcomm.parallel.qsdp_config import QSDPConfig

N = 2


def _block(scale: int = 1) -> GroupTraffic:
    """A transformer block's row on one of 2 ranks: four matrices quantized, norms and biases raw."""
    q = [24576 * scale, 8192 * scale, 32768 * scale, 32768 * scale]
    raw = [64, 64, 192, 64, 256, 64]
    return GroupTraffic(tuple([Segment(n, True) for n in q] + [Segment(n, False) for n in raw]))


GROUPS = [_block(), _block(), GroupTraffic((Segment(8192, True), Segment(1024, False)), gathers=1)]


def _costs(link: float, ns_per_element: float) -> WidthCosts:
    return WidthCosts(link, {b: ns_per_element * 1e-9 for b in (8, 4, 2)})


# ------------------------------------------------------------------------------------------ the cost model
@pytest.mark.parametrize("direction", ["weights", "grads"])
def test_fast_link_keeps_32_bits_and_slow_link_takes_the_narrowest_allowed(direction):
    assert choose_qsdp_bits(direction, GROUPS, N, _costs(1e15, 1.0), 4) == UNCOMPRESSED
    for min_bits in (2, 4, 8):
        assert choose_qsdp_bits(direction, GROUPS, N, _costs(1e6, 1.0), min_bits) == min_bits


@pytest.mark.parametrize("direction", ["weights", "grads"])
def test_a_slower_link_never_picks_a_wider_width(direction):
    rates = (1e13, 1e11, 1.25e9, 1.25e8, 1.25e7, 1e6)
    chosen = [choose_qsdp_bits(direction, GROUPS, 4, _costs(rate, 2.0), 2) for rate in rates]
    assert chosen == sorted(chosen, reverse=True)
    assert chosen[0] == UNCOMPRESSED and chosen[-1] == 2  # both ends are reached


def test_ties_go_to_the_wider_width():
    assert fastest({32: 1.0, 8: 1.0, 4: 2.0}) == 32
    assert fastest({4: 0.5, 8: 0.5, 2: 0.7}) == 8  # whatever the order of the candidates
    free = WidthCosts(float("inf"), dict.fromkeys((8, 4, 2), 0.0))  # a free link and a free codec: all cost 0
    assert choose_qsdp_bits("weights", GROUPS, N, free, 2) == UNCOMPRESSED
    assert set(qsdp_times("weights", GROUPS, N, free, 2).values()) == {0.0}
    # one rank sends nothing: every width costs 0 and the choice is 32
    assert set(qsdp_times("grads", GROUPS, 1, _costs(1.0, 1.0), 2).values()) == {0.0}


def test_predicted_terms_are_the_formula():
    from lightning_qcomm.codecs import get_codec

    g = GroupTraffic((Segment(4096, True), Segment(100, False)), gathers=2, weight_itemsize=2, grad_itemsize=4)
    code = get_codec("uniform", bits=8, bucket_size=1024)
    n = 4
    # all-gather: (N-1) x row bytes per call, twice per step; the raw segment in the buffer dtype's bytes
    assert qsdp_wire_bytes("weights", 8, [g], n) == 2 * (n - 1) * (code.nbytes(4096) + 2 * 100)
    assert qsdp_wire_bytes("weights", 32, [g], n) == 2 * (n - 1) * 2 * 4196
    assert qsdp_wire_bytes("grads", 8, [g], n) == (n - 1) * (code.nbytes(4096) + 4 * 100)
    # codec work: all-gather encodes the own row and decodes N; reduce-scatter encodes N rows, decodes N-1
    assert qsdp_codec_pairs("weights", [g], n) == pytest.approx(2 * (1 + n) / 2 * 4096)
    assert qsdp_codec_pairs("grads", [g], n) == pytest.approx((2 * n - 1) / 2 * 4096)
    assert codec_work_factor(n, "all_gather") * n == pytest.approx((1 + n) / 2)
    costs = _costs(1e6, 3.0)
    expected = qsdp_wire_bytes("grads", 4, [g], n) / 1e6 + (2 * n - 1) / 2 * 4096 * 3e-9
    assert qsdp_predicted_seconds("grads", 4, [g], n, costs) == pytest.approx(expected, rel=1e-12)
    with pytest.raises(ValueError, match="direction='both'.*allowed: weights, grads"):
        qsdp_wire_bytes("both", 8, [g], n)


def test_one_choice_serves_every_group():
    """The b-dependent terms scale with each group's quantized size: a group alone, scaled, or the whole model
    choose alike (the reason for one width per direction, module docstring of ``comm.auto_qsdp``)."""
    for rate in (1e7, 1e8, 1e9, 1e10):
        costs = _costs(rate, 2.0)
        whole = choose_qsdp_bits("grads", GROUPS, N, costs, 2)
        assert [choose_qsdp_bits("grads", [_block(s)], N, costs, 2) for s in (1, 4)] == [whole, whole]


# -------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"min_bits": 3, "bits": "auto"}, ValueError, r"min_bits=3\) is not allowed; allowed: 2, 4, 8"),
        ({"min_bits": 16, "bits": "auto"}, ValueError, r"min_bits=16\) is not allowed; allowed: 2, 4, 8"),
        ({"min_bits": 4.0, "bits": "auto"}, ValueError, r"min_bits=4.0\) is not allowed; allowed: 2, 4, 8"),
        ({"min_bits": True, "bits": "auto"}, ValueError, r"min_bits=True\) is not allowed"),
        ({"weight_bits": "Auto"}, ValueError, r"weight_bits='Auto'\) is not allowed; allowed: an int, 'auto' or None"),
        ({"grad_bits": "8"}, ValueError, r"grad_bits='8'\) is not allowed; allowed: an int, 'auto' or None"),
        ({"bits": 8.0}, TypeError, r"bits=8.0\) is not allowed; allowed: an int, 'auto' or None"),
        ({"weight_bits": "auto", "weight_codec": "none"}, ValueError, r"weight_codec='none'.*allowed: .*uniform"),
        ({"grad_bits": "auto", "grad_codec": "fp8_e4m3"}, ValueError, r"grad_codec='fp8_e4m3'.*\(8, 4\).*allowed"),
        (
            {"grad_bits": "auto", "grad_codec": "lz4"},
            ValueError,
            r"grad_codec='lz4'\) cannot be used.*allowed: uniform",
        ),
        ({"grad_bits": "auto", "hsdp": True}, ValueError, r"hsdp=True, grad_bits='auto'\) is not supported"),
        ({"bits": "auto", "quantize_master": True}, ValueError, r"quantize_master=True, weight_bits='auto'"),
    ],
)
def test_bad_auto_settings_are_refused_naming_argument_value_and_allowed(kwargs, error, match):
    from lightning_qcomm import QSDPFabricStrategy, QSDPStrategy

    with pytest.raises(error, match=match):
        QSDPConfig(**kwargs)
    for owner in (QSDPStrategy, QSDPFabricStrategy):  # the class the user called is named
        with pytest.raises(error, match=f"{owner.__name__}\\("):
            owner(**kwargs)


def test_auto_forms_resolve_and_report_what_is_left():
    both = QSDPConfig(bits="auto", min_bits=2)
    assert (both.weight_bits, both.grad_bits, both.has_auto) == ("auto", "auto", True)
    mixed = QSDPConfig(bits=8, grad_bits="auto")  # bits is the default of the direction not given
    assert (mixed.weight_bits, mixed.grad_bits, mixed.auto_weights, mixed.auto_grads) == (8, "auto", False, True)
    assert QSDPConfig(grad_bits="auto", grad_codec="fp8_e4m3", min_bits=8).auto_grads  # 8 bits is all it needs
    with pytest.raises(ValueError, match="weight_bits='auto' is resolved by apply_qsdp"):
        both.build_weight_codec()
    resolved = both.resolve_auto(32, 4)
    assert (resolved.weight_bits, resolved.grad_bits, resolved.has_auto, resolved.min_bits) == (32, 4, False, 4)
    assert resolved.build_weight_codec() is None and resolved.build_grad_codec().bits == 4
    assert mixed.resolve_auto(None, 2).weight_bits == 8
    with pytest.raises(ValueError, match="leaves an 'auto' width"):
        both.resolve_auto(8, None)
    with pytest.warns(UserWarning, match=r"min_bits=2\) has no effect"):
        QSDPConfig(bits=8, min_bits=2)


def test_yaml_through_lightning_cli(tmp_path, monkeypatch):
    import yaml

    from lightning_qcomm.cli import make_cli

    monkeypatch.setattr(sys, "argv", ["lightning-qcomm"])
    strategy = {"class_path": "QSDPStrategy", "init_args": {"weight_bits": "auto", "grad_bits": 8, "min_bits": 2}}
    cfg = {
        "trainer": {"accelerator": "cpu", "devices": 2, "strategy": strategy, "logger": False},
        "model": "lightning_qcomm.demo.ByteGPT",
        "data": "lightning_qcomm.demo.StdlibBytes",
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    config = make_cli(["--config", str(path)], run=False).trainer.strategy.config
    assert (config.weight_bits, config.grad_bits, config.min_bits) == ("auto", 8, 2)


# ---------------------------------------------------------------------------------------------- 2 ranks
SLOW = WidthCosts(1e3, dict.fromkeys((8, 4, 2), 1e-12))  # compression is all gain: the narrowest allowed
FAST = WidthCosts(1e15, dict.fromkeys((8, 4, 2), 1e-6))  # compression is all cost: 32 bits


def _inject(costs: WidthCosts, calls: list):
    def measure_widths(group, min_bits, device, codecs):
        calls.append(len(codecs))
        return tuple(costs for _ in codecs)

    return measure_widths


def _ledger_bytes_per_step(model, handle, steps: int = 2) -> dict:
    """Wire bytes this rank's QSDP comms recorded in the last of ``steps`` training steps, by tag."""
    from test_qsdp import BATCH, token_data

    from lightning_qcomm.comm.ledger import CommLedger, ensure_ledger

    ledger = ensure_ledger()
    ledger.reset()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    handle.attach(opt)
    seq = token_data(BATCH * steps)
    for i in range(steps):
        batch = seq[i * BATCH : (i + 1) * BATCH]
        logits = model(batch[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()
        last = ledger.next_step()
    return {k: v.wire_bytes for k, v in CommLedger.summarize(last, by="tag").items()}


def _plain(rank: int, result: dict) -> None:
    """apply_qsdp by hand: real measurements, then injected ones; the formula against the ledger."""
    import torch.distributed as dist
    from test_qsdp import TinyGPT
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_qcomm.comm import auto_qsdp, auto_width
    from lightning_qcomm.parallel.qsdp import apply_qsdp

    mesh = init_device_mesh("cpu", (2,))
    lines: list[str] = []
    torch.manual_seed(0)
    model = TinyGPT()
    handle = apply_qsdp(model, mesh, QSDPConfig(bits="auto", overlap_comm=False), info=lines.append)
    choice = handle.auto_choice
    result["real"] = {
        "bits": [handle.config.weight_bits, handle.config.grad_bits],
        "costs": {d: [c.link_bytes_per_s, sorted(c.codec_s_per_element.items())] for d, c in choice.costs.items()},
        "lines": lines,
    }
    real = auto_qsdp.measure_widths
    for name, costs in (("slow", SLOW), ("fast", FAST)):
        auto_qsdp.measure_widths = _inject(costs, [])
        torch.manual_seed(0)
        model = TinyGPT()
        if name == "slow":  # sharded by the user: the blocks under one FSDP root (the model's own tensors)
            from torch.distributed.fsdp import fully_shard

            for blk in model.blocks:
                fully_shard(blk, mesh=mesh)
            fully_shard(model, mesh=mesh)
        handle = apply_qsdp(model, mesh, QSDPConfig(bits="auto", overlap_comm=False), info=lambda line: None)
        groups = auto_qsdp.group_traffic(model, 1024)
        bits = (handle.config.weight_bits, handle.config.grad_bits)
        result[name] = {
            "bits": list(bits),
            "ledger": _ledger_bytes_per_step(model, handle),
            "formula": {
                "weights": qsdp_wire_bytes("weights", bits[0], groups, 2),
                "grads": qsdp_wire_bytes("grads", bits[1], groups, 2),
            },
            "gathers": [g.gathers for g in groups],
        }
    auto_qsdp.measure_widths = real
    # one rank: nothing travels, nothing is measured (it used to divide by a zero rate)
    alone = [dist.new_group([0]), dist.new_group([1])][rank]
    (one,) = auto_width.measure_widths(alone)
    result["one_rank"] = [one.link_bytes_per_s, sorted(one.codec_s_per_element.items())]


def _fit_twice(strategy) -> None:
    """Two fits of one Trainer: the second runs the strategy's setup again, on the sharded module."""
    import lightning.pytorch as pl
    from test_qsdp import GPTModule

    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = GPTModule()
    trainer.fit(model)
    trainer.fit_loop.epoch_loop.max_steps = 3
    trainer.fit(model)


def _lightning(rank: int, result: dict) -> None:
    from lightning.fabric import Fabric
    from test_qsdp import TinyGPT

    from lightning_qcomm import QSDPFabricStrategy, QSDPStrategy
    from lightning_qcomm.comm import auto_qsdp

    real = auto_qsdp.measure_widths
    for name, costs in (("slow", SLOW), ("fast", FAST)):
        calls: list = []
        auto_qsdp.measure_widths = _inject(costs, calls)
        strategy = QSDPStrategy(weight_bits="auto", grad_bits="auto", min_bits=4, overlap_comm=False)
        before = [strategy.weight_bits, strategy.grad_bits]
        _fit_twice(strategy)  # the second setup keeps the choice: measured once
        installed = strategy._qsdp.modules[0]._get_fsdp_state()._fsdp_param_groups[0]
        codecs = [installed._all_gather_comm.codec, installed._reduce_scatter_comm.codec]
        result[f"trainer_{name}"] = {
            "before": before,
            "bits": [strategy.weight_bits, strategy.grad_bits],
            "installed": [None if c is None else c.bits for c in codecs],
            "measured": calls,
        }
    auto_qsdp.measure_widths = _inject(SLOW, [])
    fabric = Fabric(accelerator="cpu", devices=2, strategy=QSDPFabricStrategy(weight_bits="auto", grad_bits=8))
    fabric.launch()
    fabric.setup_module(TinyGPT())
    config = fabric.strategy.qsdp.config
    result["fabric"] = [config.weight_bits, config.grad_bits, fabric.strategy.config.weight_bits]
    auto_qsdp.measure_widths = real


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(lightning_env(rank, 2, port))
    torch.set_num_threads(1)
    result: dict = {}
    _lightning(rank, result)
    _plain(rank, result)  # on the process group Lightning made (one rendezvous per process)
    write_rank_result(out, rank, result)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("auto_width_qsdp")
    spawn(_worker, free_port(), str(out), nprocs=2)
    return rank_results(out, 2)


def test_real_measurements_give_the_same_choice_on_both_ranks_logged_once(runs):
    assert runs[0]["real"]["bits"] == runs[1]["real"]["bits"]
    assert runs[0]["real"]["costs"] == runs[1]["real"]["costs"]  # the slowest rank's figures, agreed
    assert set(runs[0]["real"]["costs"]) == {"weights", "grads"}
    assert all(b in (32, 8, 4) for b in runs[0]["real"]["bits"])
    for r in runs:
        (line,) = r["real"]["lines"]
        assert "weight_bits='auto' chose" in line and "grad_bits='auto' chose" in line and "MB/s" in line


def test_the_formula_is_what_the_ledger_records(runs):
    for r in runs:
        assert r["slow"]["bits"] == [4, 4] and r["fast"]["bits"] == [32, 32]
        for name in ("slow", "fast"):
            assert r[name]["ledger"]["weights"] == pytest.approx(r[name]["formula"]["weights"], rel=1e-9)
            assert r[name]["ledger"]["grads"] == pytest.approx(r[name]["formula"]["grads"], rel=1e-9)
        assert r["slow"]["gathers"] == [1, 2, 2]  # the root stays gathered after forward, the blocks are re-gathered
        assert set(r["fast"]["gathers"]) == {1}  # the default plan of TinyGPT: every group is a root of its own


def test_trainer_runs_the_widths_the_costs_imply_and_measures_once(runs):
    for r in runs:
        assert r["trainer_slow"] == {"before": ["auto", "auto"], "bits": [4, 4], "installed": [4, 4], "measured": [1]}
        assert r["trainer_fast"] == {
            "before": ["auto", "auto"],
            "bits": [32, 32],
            "installed": [None, None],
            "measured": [1],
        }
        assert r["fabric"] == [4, 8, "auto"]  # only the "auto" direction was chosen


def test_one_rank_measures_nothing(runs):
    for r in runs:
        assert r["one_rank"] == [float("inf"), [[4, 0.0], [8, 0.0]]]
