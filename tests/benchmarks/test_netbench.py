"""Smoke tests of benchmarks/netbench (``python -m benchmarks.netbench``) so the harness can't rot (no timing is asserted).

One reduced end-to-end run on loopback (tiny model, 4 steps, a few variants) checks that the report,
JSON and plot are written and that the byte accounting is exact: torch's fp32 all-reduce hook must
put exactly 4 bytes per parameter per step into the ledger (wire factor 2(N-1)/N = 1 at N = 2), the
fp16 hook exactly half, the no-communication floor nothing. Pure functions (schedule, aggregation,
efficiency) are checked on synthetic numbers; namespace teardown on error is checked when root.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks import netbench  # noqa: E402


def test_schedule_interleaves_and_reverses_odd_repeats():
    s = netbench.make_schedule(["a", "b", "c"], 2)
    assert [e["variant"] for e in s] == ["a", "b", "c", "c", "b", "a"]
    assert [e["repeat"] for e in s] == [0, 0, 0, 1, 1, 1]
    assert [e["id"] for e in s] == list(range(6))


def _row(variant, repeat, rank, step, tx, ledger, loss=2.0, rate=100.0):
    return {
        "event": "done",
        "variant": variant,
        "repeat": repeat,
        "rank": rank,
        "rate_mbit": rate,
        "step_median_s": step,
        "step_mean_s": step,
        "tx_per_step": tx,
        "ledger_per_step": ledger,
        "dist_per_step": ledger,
        "train_loss_last5": loss,
        "val_loss": loss,
        "ledger_source": "x",
    }


def test_aggregate_efficiency_speedup_and_floor_check():
    rate = 100.0  # Mbit/s -> 12.5e6 bytes/s
    res = []
    for rep in (0, 1):
        for rank in (0, 1):
            res.append(_row("floor", rep, rank, 0.2 + 0.01 * rank, 0.0, 0.0))
            # slower rank 1.25 s; 12.5e6 bytes on rank 1 -> ideal = 0.21 + 1.0
            res.append(_row("ddp_fp32", rep, rank, 1.2 + 0.05 * rank, 12.0e6 + 0.5e6 * rank, 12.0e6))
            res.append(_row("ddp_fp16", rep, rank, 0.8, 6.25e6, 6.0e6))
    t = netbench.aggregate(res, [rate], ["floor", "ddp_fp32", "ddp_fp16"])["100.0"]
    rows = t["rows"]
    assert t["floor_s"] == pytest.approx(0.21)
    assert t["floor_sound"] is True
    assert rows["ddp_fp32"]["step_mean_s"] == pytest.approx(1.25)  # the slower rank
    assert rows["ddp_fp32"]["ideal_s"] == pytest.approx(0.21 + 12.5e6 / 12.5e6)
    assert rows["ddp_fp32"]["efficiency"] == pytest.approx(1.21 / 1.25)
    assert rows["ddp_fp32"]["limit_s"] == pytest.approx(1.0)  # max(floor 0.21, wire 1.0)
    assert rows["ddp_fp32"]["over_limit"] == pytest.approx(1.25)
    assert rows["ddp_fp16"]["limit_s"] == pytest.approx(0.5)  # 6.25 MB at 12.5 MB/s
    assert rows["ddp_fp16"]["speedup_vs_fp32"] == pytest.approx(1.25 / 0.8)
    assert rows["ddp_fp16"]["bytes_vs_fp32"] == pytest.approx(6.25 / 12.5)
    assert rows["ddp_fp32"]["wire_over_ledger"] == pytest.approx(12.25e6 / 12.0e6)
    # a floor slower than a communicating variant is flagged (fp16 median over 5 repeats becomes 0.1 s)
    res += [_row("ddp_fp16", rep, rank, 0.1, 6.25e6, 6.0e6) for rep in (2, 3, 4) for rank in (0, 1)]
    assert netbench.aggregate(res, [rate], ["floor", "ddp_fp32", "ddp_fp16"])["100.0"]["floor_sound"] is False


def test_bad_arguments_are_rejected(capsys):
    for argv in (["--variants", "floor,nope"], ["--rates", "100,fast"], ["--steps", "5", "--warmup", "5"]):
        with pytest.raises(SystemExit):
            netbench.main(["--loopback", "--out", "/nonexistent-never-created", *argv])
        err = capsys.readouterr().err
        assert "nope" in err or "fast" in err or "warmup" in err


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and iproute2")
def test_namespaces_are_torn_down_on_error():
    net = netbench.NamespaceNet(100.0, prefix="lqnbt")
    with pytest.raises(RuntimeError, match="boom"), net:
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert all(ns in listed for ns in net.ns)
        net.shape(1000.0)  # re-shaping an existing link works
        raise RuntimeError("boom")
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(ns in listed for ns in net.ns)


@pytest.mark.slow
def test_reduced_loopback_run(tmp_path):
    variants = ["floor", "ddp_fp32", "ddp_fp16"]
    if netbench.variant_available(netbench.VARIANT_BY_NAME["qddp_uniform8"])[0]:
        variants.append("qddp_uniform8")
    cmd = [sys.executable, "-m", "benchmarks.netbench", "--loopback", "--model", "tiny"]
    cmd += ["--steps", "4", "--warmup", "1", "--repeats", "1", "--variants", ",".join(variants)]
    cmd += ["--out", str(tmp_path), "--variant-timeout", "120", "--collective-timeout", "120"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "netbench.json").read_text())
    rows = data["table"]["None"]["rows"]
    assert set(rows) == set(variants)
    raw = [r for r in data["raw"] if r.get("event") == "done"]
    assert {(r["variant"], r["rank"]) for r in raw} == {(v, k) for v in variants for k in (0, 1)}
    params = raw[0]["params"]
    for r in raw:
        assert r["steps_measured"] == 3 and len(r["step_times_s"]) == 3
        assert r["step_mean_s"] > 0
        assert 0.0 < r["train_loss_last5"] < 10.0 and r["val_loss"] is not None
    by = {(r["variant"], r["rank"]): r for r in raw}
    for rank in (0, 1):
        # the floor sends only Lightning's own control collectives (a few bytes per step); the hooks add
        # exactly one fp32 (fp16) gradient all-reduce per step on top of the same control traffic
        control = by[("floor", rank)]["ledger_per_step"]
        assert 0.0 <= control < 64.0
        assert by[("ddp_fp32", rank)]["ledger_per_step"] - control == pytest.approx(4.0 * params)
        assert by[("ddp_fp16", rank)]["ledger_per_step"] - control == pytest.approx(2.0 * params)
        assert by[("ddp_fp32", rank)]["ledger_source"] == "torch.distributed call counter"
        if "qddp_uniform8" in variants:
            q = by[("qddp_uniform8", rank)]
            assert q["ledger_source"] == "lightning_qcomm CommLedger"
            assert 0 < q["ledger_per_step"] < 0.5 * 4.0 * params
    # ranks start from the same weights and see different data; same seed -> same loss for fp32 and fp16 hook
    assert rows["ddp_fp16"]["train_loss"] == pytest.approx(rows["ddp_fp32"]["train_loss"], rel=1e-2)
    md = (tmp_path / "netbench.md").read_text()
    assert "| variant |" in md and all(f"| {v} |" in md for v in variants)
    assert "loopback" in md
    # the report can be rebuilt from the JSON alone
    assert netbench.main(["--render", str(tmp_path / "netbench.json"), "--out", str(tmp_path / "again")]) == 0
    assert (tmp_path / "again" / "netbench.md").read_text() == md
    try:
        import matplotlib  # noqa: F401

        assert (tmp_path / "netbench.png").stat().st_size > 0
    except ImportError:
        pass


@pytest.mark.slow
def test_reduced_loopback_run_two_ranks_per_node(tmp_path):
    """``--ranks-per-node 2``: four ranks as a num_nodes=2, devices=2 job; the ledger's scopes are exact.

    DDP fp32 is one whole-world all-reduce: 2(N-1)/N x 4 bytes = 6 bytes per parameter per rank at N = 4, all
    of it "flat". FSDP2 HSDP all-reduces each rank's half shard across the two nodes (a 2-rank group, factor
    1): 2 bytes per parameter per rank in the "inter" scope, which only the worker's group classifier can
    assign. Hierarchical QuantDDP sends its 8-bit inter-node leg: less than half of HSDP's fp32 one.
    """
    variants = ["floor", "ddp_fp32", "fsdp2_hsdp"]
    if netbench.variant_available(netbench.VARIANT_BY_NAME["qddp_uniform8_hier"])[0]:
        variants.append("qddp_uniform8_hier")
    cmd = [sys.executable, "-m", "benchmarks.netbench", "--loopback", "--ranks-per-node", "2", "--model", "tiny"]
    cmd += ["--steps", "3", "--warmup", "1", "--repeats", "1", "--variants", ",".join(variants)]
    cmd += ["--out", str(tmp_path), "--variant-timeout", "120", "--collective-timeout", "120"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "netbench.json").read_text())
    assert data["meta"]["ranks_per_node"] == 2
    raw = [r for r in data["raw"] if r.get("event") == "done"]
    assert {(r["variant"], r["rank"], r["node"], r["local_rank"]) for r in raw} == {
        (v, k, k // 2, k % 2) for v in variants for k in range(4)
    }
    params = raw[0]["params"]
    by = {(r["variant"], r["rank"]): r for r in raw}
    for rank in range(4):
        control = by[("floor", rank)]["ledger_flat_per_step"]
        assert 0.0 <= control < 64.0 and by[("floor", rank)]["ledger_inter_per_step"] == 0.0
        fp32 = by[("ddp_fp32", rank)]
        assert fp32["steps_measured"] == 2 and fp32["lo_tx_per_step"] is None  # loopback: no intra split
        assert fp32["ledger_flat_per_step"] - control == pytest.approx(6.0 * params)
        assert fp32["ledger_inter_per_step"] == 0.0 and fp32["ledger_intra_per_step"] == 0.0
        hsdp = by[("fsdp2_hsdp", rank)]
        assert hsdp["ledger_inter_per_step"] == pytest.approx(2.0 * params)
        assert hsdp["ledger_intra_per_step"] > 0.0
        if "qddp_uniform8_hier" in variants:
            q = by[("qddp_uniform8_hier", rank)]
            assert q["ledger_source"] == "lightning_qcomm CommLedger"
            assert 0.0 < q["ledger_inter_per_step"] < 0.5 * 2.0 * params
    rows = data["table"]["None"]["rows"]
    assert set(rows) == set(variants)
    # same seed, same global batch: HSDP computes the same fp32 update as DDP
    assert rows["fsdp2_hsdp"]["train_loss"] == pytest.approx(rows["ddp_fp32"]["train_loss"], rel=1e-4)
    md = (tmp_path / "netbench.md").read_text()
    assert "2 nodes x 2 ranks" in md and "inter MB/step/node (veth)" in md
    assert all(f"| {v} |" in md for v in variants)
    assert netbench.main(["--render", str(tmp_path / "netbench.json"), "--out", str(tmp_path / "again")]) == 0
    assert (tmp_path / "again" / "netbench.md").read_text() == md


def test_multi_rank_variants_need_two_ranks_per_node(capsys):
    with pytest.raises(SystemExit):
        netbench.main(["--loopback", "--variants", "floor,qddp_uniform8_hier", "--out", "/nonexistent-never-created"])
    assert "--ranks-per-node 2" in capsys.readouterr().err
    assert netbench.parse_args(["--ranks-per-node", "2"]).variant_list[:2] == ["floor", "ddp_fp32"]
    assert netbench.parse_args([]).variant_list == [v.name for v in netbench.VARIANTS if v.in_all]


def _node_row(variant, rank, step, tx, inter, flat=0.0, rate=100.0):
    row = _row(variant, 0, rank, step, tx, inter + flat, rate=rate)
    row.update(node=rank // 2, local_rank=rank % 2, lo_tx_per_step=1e6, ledger_inter_per_step=inter)
    row.update(ledger_flat_per_step=flat, ledger_intra_per_step=0.0)
    return row


def test_aggregate_nodes_per_node_bytes_and_bound_ratio():
    from benchmarks.netbench.report_nodes import aggregate_nodes

    res = [_node_row("floor", k, 0.2 + 0.01 * k, 0.0, 0.0) for k in range(4)]  # floor = the slowest rank, 0.23 s
    # both ranks of a node read one veth counter: node 1 reads 25.0e6 and 25.5e6 -> 25.25e6 B = 2.02 s at 100 Mbit/s
    res += [_node_row("ddp_fp32", k, 2.5, (10e6, 10e6, 25.0e6, 25.5e6)[k], 0.0, 6e6) for k in range(4)]
    res += [_node_row("hier", k, 0.25 + 0.05 * (k == 3), 1.0e6, 0.9e6) for k in range(4)]  # wire 0.08 s < floor
    rows = aggregate_nodes(res, [100.0], ["floor", "ddp_fp32", "hier"])["100.0"]["rows"]
    assert rows["ddp_fp32"]["tx_max"] == pytest.approx(25.25e6)
    assert rows["ddp_fp32"]["ledger_flat"] == pytest.approx(12e6)  # summed over a node's two ranks
    assert rows["ddp_fp32"]["t_inter_wire_s"] == pytest.approx(25.25e6 / 12.5e6)
    assert rows["ddp_fp32"]["bound_ratio"] == pytest.approx(2.5 / (25.25e6 / 12.5e6))
    assert rows["hier"]["ledger_inter"] == pytest.approx(1.8e6)
    assert rows["hier"]["bound_ratio"] == pytest.approx(0.30 / 0.23)  # the floor is the larger bound here
    assert rows["hier"]["speedup_vs_fp32"] == pytest.approx(2.5 / 0.30)


def test_an_ablation_patch_ends_with_its_entry(monkeypatch):
    """A worker runs a whole schedule in one process: an ablation that patches a module (QSDP's reduce-scatters
    inline) must leave the next entry, the default it is compared with, unpatched."""
    import lightning_qcomm.adapters.ddp.hooks as ddp_hooks
    import lightning_qcomm.adapters.fsdp2.install as fsdp_install
    from benchmarks.netbench import worker
    from benchmarks.netbench.build import build_variant

    originals = fsdp_install.deferrable, ddp_hooks.quantized_all_reduce
    seen = []

    def train(entry, spec, rank):
        build_variant(entry["variant"], warmup=1, lr=1e-3, lr_warmup=1, timeout_s=30.0)
        seen.append((fsdp_install.deferrable, ddp_hooks.quantized_all_reduce))
        return {}

    monkeypatch.setattr(worker, "_train_entry", train, raising=False)
    for name in ("qsdp_w8g8_rs_inline", "qddp_nuqsgd4_cap4_p17"):
        worker.run_entry({"variant": name, "repeat": 0}, {}, 0)
    assert seen[0][0] is not originals[0] and seen[1][1] is not originals[1]  # each ablation did patch
    assert (fsdp_install.deferrable, ddp_hooks.quantized_all_reduce) == originals  # ... for its entry only
