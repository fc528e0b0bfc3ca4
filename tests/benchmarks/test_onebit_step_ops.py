"""benchmarks/onebit_step_ops.py at a tiny scale: a compressed 1-bit Adam step's momentum sync launches fewer ops in
the batched form than in the per-piece reference, makes no host sync, and the counts are per step."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import onebit_step_ops  # noqa: E402
from lightning_qcomm.codecs import cpu_fused, scaling  # noqa: E402
from lightning_qcomm.collectives import sign_collective  # noqa: E402


def test_batched_momentum_sync_launches_fewer_ops_and_syncs_nothing(monkeypatch):
    monkeypatch.setattr(scaling, "_HOST_BRANCHES", False)
    monkeypatch.setenv(cpu_fused.ENV_SWITCH, "0")
    monkeypatch.setattr(sign_collective, "PATH", sign_collective.PATH)  # restored after the benchmark sets it
    rows = {p: onebit_step_ops.count(p, scale=1 / 32, world=1, steps=1, nonfinite="propagate") for p in PATHS}
    ref, new = rows["reference"], rows["batched"]  # pieces of 256 elements: whole bytes of codes
    assert ref["pieces"] == new["pieces"] > 4 * ref["buckets"]  # several pieces per bucket
    assert new["by_layer"][onebit_step_ops.SYNC] * 4 < ref["by_layer"][onebit_step_ops.SYNC], rows
    assert new["by_layer"]["optim"] == ref["by_layer"]["optim"]
    layers = ("lightning_qcomm/comm/", "lightning_qcomm/collectives/", "lightning_qcomm/adapters/")
    assert not any(layer in site for site in new["sync_sites"] for layer in layers), new["sync_sites"]


PATHS = ("reference", "batched")


def test_compressed_step_reads_the_host_once_at_four_ranks(monkeypatch):
    """After the freeze each rank checks its own gradient, so the ranks agree on the non-finite verdict; the flags
    and the agreed verdict reach the host in one copy, and the optimizer reads no step counter one by one."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    monkeypatch.setattr(scaling, "_HOST_BRANCHES", False)
    monkeypatch.setenv(cpu_fused.ENV_SWITCH, "0")
    monkeypatch.setattr(sign_collective, "PATH", sign_collective.PATH)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        row = onebit_step_ops.count("batched", scale=1 / 32, world=4, steps=1, nonfinite="skip")
    finally:
        dist.destroy_process_group()
    assert row["syncs"] == 1, row["sync_sites"]
    assert row["by_layer"][onebit_step_ops.CHECK] < 16, row["by_layer"]  # not one check per parameter (148)
