"""CommVolumeLogger: logged numbers equal the ledger, step boundaries, plain DDP reports 1.0, rank aggregation.

Single-process part: a module records known synthetic collectives into the ledger, so every logged value
is predicted by arithmetic. Two-rank part (one spawn, two fits per worker): plain ``strategy="ddp"`` is
counted by the counting comm hook (bytes = gradient bytes x 2(N-1)/N, ratio 1.0), and the end-of-fit
summary sums rank-asymmetric records, including a tag only one rank has.
"""

from __future__ import annotations

import csv
import json
import os
import socket
import time
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning.pytorch.loggers import CSVLogger, Logger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_qcomm.callbacks import CommVolumeLogger
from lightning_qcomm.callbacks.comm_logger import diff_totals, format_summary, metrics_from_totals
from lightning_qcomm.comm.ledger import CommLedger, OpTotals, get_ledger, set_ledger

# ----------------------------------------------------------------------------------------------- helpers


class MemoryLogger(Logger):
    """Keeps every ``log_metrics`` call."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        self.rows.append((step, dict(metrics)))


def _loader(n: int = 64) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g)), batch_size=4)


class TinyRegressor(pl.LightningModule):
    """8 -> 16 -> 1 MLP: 161 parameters, 644 gradient bytes, one DDP bucket."""

    def __init__(self, extra_record: bool = False) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        self.extra_record = extra_record

    def training_step(self, batch, batch_idx):
        if self.extra_record:  # rank-asymmetric traffic under a tag only this rank uses
            r = self.global_rank
            get_ledger().record("all_to_all", 1000 * (r + 1), 4000 * (r + 1), 2, tag=f"rank{r}")
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class SyntheticTraffic(TinyRegressor):
    """Records per micro-batch: all_gather 1000 B (baseline 4000) tag weights; reduce_scatter 2000 B (8000) tag
    grads; per validation batch: all_gather 1000 B (4000). Wire factor for N=2 is 1/2 for both ops."""

    def training_step(self, batch, batch_idx):
        get_ledger().record("all_gather", 1000, 4000, 2, tag="weights")
        get_ledger().record("reduce_scatter", 2000, 8000, 2, tag="grads")
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        get_ledger().record("all_gather", 1000, 4000, 2, tag="weights")


# ------------------------------------------------------------------------------------------ pure functions


def test_diff_and_metrics_names():
    before = {("all_reduce", "grads"): OpTotals(1, 100, 100.0, 400.0)}
    now = {
        ("all_reduce", "grads"): OpTotals(3, 300, 300.0, 1200.0),
        ("all_gather", "weights"): OpTotals(2, 50, 25.0, 100.0),
    }
    d = diff_totals(now, before)
    assert d[("all_reduce", "grads")] == OpTotals(2, 200, 200.0, 800.0)
    assert d[("all_gather", "weights")] == OpTotals(2, 50, 25.0, 100.0)
    assert diff_totals(before, before) == {}  # zero-call keys are dropped
    m = metrics_from_totals(d, now, per_op=True)
    assert m["comm/bytes_sent"] == 225.0 and m["comm/baseline_bytes"] == 900.0 and m["comm/ratio"] == 0.25
    assert m["comm/collectives"] == 4.0
    assert m["comm/cum_bytes_sent"] == 325.0 and m["comm/cum_baseline_bytes"] == 1300.0
    assert m["comm/op/all_reduce/bytes_sent"] == 200.0 and m["comm/tag/weights/ratio"] == 0.25
    assert m["comm/tag/grads/collectives"] == 2.0
    assert "comm/op/all_reduce/bytes_sent" not in metrics_from_totals(d, now, per_op=False)
    table = format_summary(d, world_size=2, steps=7, extra={"train_loss": 1.5})
    assert "2 rank(s), 7 optimizer steps" in table and "train_loss = 1.5000" in table
    assert "all_gather" in table and "weights" in table and "4.0x" in table
    overhead = {("all_gather", "check"): OpTotals(1, 64, 32.0, 0.0)}  # sent bytes with no fp32 counterpart
    assert "comm/op/all_gather/ratio" not in metrics_from_totals(overhead, overhead, per_op=True)
    assert [line.split()[-2:] for line in format_summary(overhead, 2, 1).splitlines() if line.startswith("op")] == [
        ["-", "-"]
    ]


def test_bad_interval_rejected():
    with pytest.raises(ValueError, match="log_every_n_steps"):
        CommVolumeLogger(log_every_n_steps=0)


# ------------------------------------------------------------------------------- single process, synthetic


def test_logged_numbers_equal_ledger_with_accumulation(tmp_path, capsys):
    ledger = CommLedger()
    prev = set_ledger(ledger)
    try:
        logger = MemoryLogger()
        cb = CommVolumeLogger(log_every_n_steps=1, summary_file=str(tmp_path / "summary.json"))
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=4,
            accumulate_grad_batches=2,
            limit_train_batches=8,
            limit_val_batches=1,
            num_sanity_val_steps=1,
            logger=logger,
            callbacks=[cb],
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
        )
        trainer.fit(SyntheticTraffic(), _loader(), _loader(8))
    finally:
        set_ledger(prev)

    rows = [(step, m) for step, m in logger.rows if "comm/bytes_sent" in m]
    assert [step for step, _ in rows] == [0, 1, 2, 3]  # one row per optimizer step, Lightning's 0-based index
    for k, (_, m) in enumerate(rows, start=1):
        # a step = 2 micro-batches x (all_gather 1000*1/2 + reduce_scatter 2000*1/2); baseline 4x
        assert m["comm/bytes_sent"] == 3000.0 and m["comm/baseline_bytes"] == 12000.0
        assert m["comm/ratio"] == 0.25 and m["comm/collectives"] == 4.0
        assert m["comm/op/all_gather/bytes_sent"] == 1000.0 and m["comm/op/reduce_scatter/bytes_sent"] == 2000.0
        assert m["comm/tag/weights/baseline_bytes"] == 4000.0 and m["comm/tag/grads/collectives"] == 2.0
        # cumulative since fit start: the sanity-check batch (500) + k steps; validation is not a training step
        assert m["comm/cum_bytes_sent"] == 500.0 + 3000.0 * k
    assert ledger.step == 4  # next_step once per optimizer step, not per micro-batch

    # summary = everything since fit start, incl. sanity check and the final validation batch
    s = cb.summary_totals
    assert s[("all_gather", "weights")] == OpTotals(8 + 2, 10 * 1000, 10 * 500.0, 10 * 2000.0)
    assert s[("reduce_scatter", "grads")] == OpTotals(8, 8 * 2000, 8 * 1000.0, 8 * 4000.0)
    assert s == ledger.cumulative
    doc = json.loads((tmp_path / "summary.json").read_text())
    assert doc["total"]["wire_bytes"] == 13000.0 and doc["by_op"]["all_gather"]["calls"] == 10
    assert doc["optimizer_steps"] == 4 and doc["world_size"] == 1
    assert "communication summary" in capsys.readouterr().out


def test_resume_with_accumulation_counts_only_new_steps(tmp_path):
    """After a checkpoint restore (global_step 2), micro-batches that do not step must not close a step."""

    def trainer(max_steps: int, logger: Logger) -> pl.Trainer:
        return pl.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=max_steps,
            accumulate_grad_batches=2,
            limit_val_batches=0,
            logger=logger,
            callbacks=[CommVolumeLogger(log_every_n_steps=1, summary=False)],
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
        )

    ledger = CommLedger()
    prev = set_ledger(ledger)
    try:
        first = trainer(2, MemoryLogger())
        first.fit(SyntheticTraffic(), _loader())
        first.save_checkpoint(tmp_path / "two.ckpt")
        logger = MemoryLogger()
        trainer(4, logger).fit(SyntheticTraffic(), _loader(), ckpt_path=tmp_path / "two.ckpt")
    finally:
        set_ledger(prev)
    rows = [(step, m) for step, m in logger.rows if "comm/bytes_sent" in m]
    assert [step for step, _ in rows] == [2, 3]
    assert all(m["comm/bytes_sent"] == 3000.0 for _, m in rows)  # two micro-batches per step, as before
    assert [m["comm/cum_bytes_sent"] for _, m in rows] == [3000.0, 6000.0]  # this fit's traffic only
    assert ledger.step == 2 + 2


# ------------------------------------------------------------------------------------- two ranks (one spawn)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fit(out_dir: Path, name: str, extra_record: bool) -> CommVolumeLogger:
    cb = CommVolumeLogger(log_every_n_steps=1, summary=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=3,
        limit_val_batches=0,
        logger=CSVLogger(str(out_dir), name=name, version=0),
        callbacks=[cb],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(TinyRegressor(extra_record=extra_record), _loader())
    return cb


def _two_rank_worker(rank: int, port: int, out_dir: str) -> None:
    # Processes are created here, so Lightning's LightningEnvironment sees LOCAL_RANK and does not launch.
    os.environ.update(
        OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), NODE_RANK="0"
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=120))
    out = Path(out_dir)
    result = {}
    for name, extra in (("plain_ddp", False), ("asymmetric", True)):
        cb = _fit(out, name, extra)
        result[name] = {
            f"{op}|{tag}": [t.calls, t.wire_bytes, t.baseline_bytes] for (op, tag), t in cb.summary_totals.items()
        }
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def _spawn_two(fn, *args, timeout_s: float = 240.0) -> None:
    ctx = mp.start_processes(fn, args=args, nprocs=2, start_method="spawn", join=False)
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=2):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"2-rank workers did not finish within {timeout_s} s")


@pytest.mark.slow
def test_two_ranks_plain_ddp_ratio_one_and_aggregation(tmp_path):
    _spawn_two(_two_rank_worker, _free_port(), str(tmp_path))
    grad_bytes = 161 * 4  # TinyRegressor's fp32 gradients
    per_step = 2 * (2 - 1) / 2 * grad_bytes  # ring all-reduce wire bytes per rank per step
    for rank in (0, 1):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        # plain DDP: every rank's summary is the sum over both ranks of 3 steps x one bucket
        assert res["plain_ddp"] == {"all_reduce|grads": [6, 6 * per_step, 6 * per_step]}
        # asymmetric: rank r recorded all_to_all (1000(r+1), baseline 4x) x 3 steps at factor 1/2; the second fit
        # starts from zero although the process-wide ledger still holds the first fit's traffic
        assert res["asymmetric"] == {
            "all_reduce|grads": [6, 6 * per_step, 6 * per_step],
            "all_to_all|rank0": [3, 3 * 500.0, 3 * 2000.0],
            "all_to_all|rank1": [3, 3 * 1000.0, 3 * 4000.0],
        }
    with open(tmp_path / "plain_ddp" / "version_0" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("comm/bytes_sent")]
    assert [int(r["step"]) for r in rows] == [0, 1, 2]
    for k, r in enumerate(rows, start=1):  # rank 0's own numbers, as logged
        assert float(r["comm/bytes_sent"]) == per_step == float(r["comm/baseline_bytes"])
        assert float(r["comm/ratio"]) == 1.0 and float(r["comm/op/all_reduce/collectives"]) == 1.0
        assert float(r["comm/cum_bytes_sent"]) == k * per_step
