"""CommLedger: wire factors, per-step and cumulative totals, grouping, the null ledger and the global slot."""

from __future__ import annotations

import pytest

from lightning_qcomm.comm import CommLedger, NullLedger, OpTotals, ensure_ledger, get_ledger, set_ledger
from lightning_qcomm.comm.ledger import wire_factor


@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_wire_factors(n):
    assert wire_factor("all_reduce", n) == pytest.approx(2 * (n - 1) / n)
    for op in ("all_gather", "reduce_scatter", "all_to_all", "broadcast"):
        assert wire_factor(op, n) == pytest.approx((n - 1) / n)


def test_bad_op_and_world_size():
    with pytest.raises(ValueError, match="op must be one of"):
        wire_factor("gather", 2)
    with pytest.raises(ValueError, match="world_size"):
        wire_factor("all_reduce", 0)
    with pytest.raises(ValueError, match="op must be one of"):
        CommLedger().record("allreduce", 10, 40, 2)
    with pytest.raises(ValueError, match="op must be one of"):
        NullLedger().record("allreduce", 10, 40, 2)
    with pytest.raises(ValueError, match="by must be"):
        CommLedger.summarize({}, by="rank")


def test_record_values():
    led = CommLedger(keep_records=True)
    rec = led.record("all_reduce", 1000, 4000, 4, payload_bytes=1250, tag="grads")
    assert rec.payload_bytes == 1250
    assert rec.wire_bytes == pytest.approx(1.5 * 1000)
    assert rec.baseline_bytes == pytest.approx(1.5 * 4000)
    # payload defaults to the collective size
    assert led.record("all_to_all", 300, 1200, 4).payload_bytes == 300
    assert led.records[0] == rec and len(led.records) == 2


def test_steps_and_cumulative():
    led = CommLedger()
    led.record("all_gather", 100, 400, 2, payload_bytes=50, tag="weights")
    led.record("all_gather", 100, 400, 2, payload_bytes=50, tag="weights")
    led.record("reduce_scatter", 200, 800, 2, tag="grads")
    cur = led.current_step[("all_gather", "weights")]
    assert (cur.calls, cur.payload_bytes, cur.wire_bytes, cur.baseline_bytes) == (2, 100, 100.0, 400.0)
    last = led.next_step()
    assert led.step == 1 and led.current_step == {} and last == led.last_step
    assert last[("reduce_scatter", "grads")].ratio == pytest.approx(0.25)
    led.record("all_gather", 100, 400, 2, payload_bytes=50, tag="weights")
    led.next_step()
    assert led.last_step[("all_gather", "weights")].calls == 1
    total = led.cumulative[("all_gather", "weights")]
    assert total.calls == 3 and total.payload_bytes == 150
    by_tag = CommLedger.summarize(led.cumulative, by="tag")
    assert set(by_tag) == {"weights", "grads"}
    everything = CommLedger.summarize(led.cumulative, by="all")["all"]
    assert everything.calls == 4 and everything.wire_bytes == pytest.approx(3 * 50 + 100)
    led.reset()
    assert led.step == 0 and led.cumulative == {}


def test_ratio_of_nothing_is_one():
    assert OpTotals().ratio == 1.0


def test_null_ledger_and_global_slot():
    prev = set_ledger(NullLedger())
    try:
        null = get_ledger()
        assert isinstance(null, NullLedger) and not null.enabled
        null.record("all_reduce", 10, 40, 2)
        assert null.cumulative == {}
        led = ensure_ledger()
        assert isinstance(led, CommLedger) and led.enabled and get_ledger() is led
        assert ensure_ledger() is led  # an active ledger is kept
        mine = CommLedger()
        assert set_ledger(mine) is led and get_ledger() is mine
    finally:
        set_ledger(prev)


def _train_then_read_the_ledger(rank: int, port: int, outdir: str) -> None:
    """The README's plain-torch flow in its natural order: train first, read ``ensure_ledger()`` afterwards."""
    import torch
    import torch.distributed as dist
    from _launch import set_rank_env, write_rank_result
    from torch.nn.parallel import DistributedDataParallel

    from lightning_qcomm.parallel import QuantDDPConfig, quant_ddp_hook

    set_rank_env(rank, 2, port)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    state, hook = quant_ddp_hook(QuantDDPConfig(codec="uniform", bits=8), ddp, optimizer=optimizer)
    ddp.register_comm_hook(state, hook)
    for step in range(3):
        torch.manual_seed(rank * 100 + step)
        ddp(torch.randn(8, 64)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    totals = CommLedger.summarize(ensure_ledger().cumulative, by="tag")
    numel = sum(p.numel() for p in model.parameters())
    write_rank_result(
        outdir, rank, {k: [t.calls, t.wire_bytes, t.baseline_bytes] for k, t in totals.items()} | {"numel": numel}
    )
    dist.destroy_process_group()


def test_ledger_read_after_training_holds_the_run(tmp_path):
    """``ensure_ledger().cumulative`` after training (not before) holds the run: 3 steps of DDP fp32's baseline,
    2(N-1)/N * 4 bytes * parameters per step at N = 2, and fewer bytes sent by 8-bit codes. It was {}: only a
    null ledger was active while training ran."""
    from _launch import free_port, rank_results, spawn

    spawn(_train_then_read_the_ledger, free_port(), str(tmp_path), nprocs=2, timeout_s=120)
    for result in rank_results(tmp_path, 2):
        numel = result.pop("numel")
        assert "grads" in result, result
        calls, wire, baseline = result["grads"]
        assert calls >= 3 and baseline == pytest.approx(3 * 4 * numel)
        assert 0 < wire < 0.5 * baseline  # 8-bit codes for the 64x64 weight; the 324 smaller elements travel fp32
