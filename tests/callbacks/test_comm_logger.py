"""CommVolumeLogger: logged numbers equal the ledger, step boundaries, the DDP-fp32 headline, resume, ranks.

Single-process part: a module records known synthetic collectives into the ledger, so every logged value
is predicted by arithmetic. Two-rank part (one spawn, every fit in the same two workers):

* plain ``strategy="ddp"`` is counted by the counting comm hook (bytes = gradient bytes x 2(N-1)/N);
* the headline vs-DDP ratio (bytes sent / what DDP's fp32 ring all-reduce of the trainable parameters
  would send, 2(N-1)/N * 4 * P per optimizer step) of DDP (1.0), QuantDDP uniform-8 (~0.25), QSDP W8G8
  (~0.38: weights gathered in forward and again in backward, gradients reduce-scattered, 8 bits each) and
  Local SGD with H=4 (0.25), each predicted from its formula with the codec's scale overhead as tolerance;
* Local SGD's sync count and mean H, 1-bit Adam's phase;
* the end-of-fit summary sums rank-asymmetric records, including a tag only one rank has;
* a resumed fit continues every rank's totals and ``comm/cum_*`` from the checkpoint.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import warnings
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from _launch import free_port, rank_results, spawn, write_rank_result
from lightning.pytorch.loggers import CSVLogger, Logger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_qcomm import LocalSGDStrategy, OneBitAdamCallback, QSDPStrategy, QuantDDPStrategy
from lightning_qcomm.callbacks import CommVolumeLogger
from lightning_qcomm.callbacks.comm_logger import (
    ddp_fp32_step_bytes,
    diff_totals,
    format_summary,
    metrics_from_totals,
)
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


def callback_of(trainer: pl.Trainer) -> CommVolumeLogger:
    (cb,) = [c for c in trainer.callbacks if isinstance(c, CommVolumeLogger)]
    return cb


def test_ddp_fp32_baseline_formula_and_metrics():
    # ring all-reduce: each rank sends 2(N-1)/N of the fp32 buffer
    assert ddp_fp32_step_bytes(1000, 2) == 4000.0
    assert ddp_fp32_step_bytes(1000, 4) == 2 * 3 / 4 * 4 * 1000
    assert ddp_fp32_step_bytes(1000, 1) == 0.0
    step = {("all_gather", "weights"): OpTotals(1, 100, 100.0, 400.0)}
    m = metrics_from_totals(step, step, per_op=False, ddp_step_bytes=1000.0, ddp_cum_bytes=4000.0)
    assert m["comm/ddp_bytes"] == 1000.0 and m["comm/vs_ddp"] == 0.1
    assert m["comm/cum_ddp_bytes"] == 4000.0 and m["comm/cum_vs_ddp"] == 0.025
    assert "comm/vs_ddp" not in metrics_from_totals(step, step, per_op=False)  # no baseline (one process)


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
            callbacks=[CommVolumeLogger(log_every_n_steps=1)],
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
        second = trainer(4, logger)
        second.fit(SyntheticTraffic(), _loader(), ckpt_path=tmp_path / "two.ckpt")
    finally:
        set_ledger(prev)
    rows = [(step, m) for step, m in logger.rows if "comm/bytes_sent" in m]
    assert [step for step, _ in rows] == [2, 3]
    assert all(m["comm/bytes_sent"] == 3000.0 for _, m in rows)  # two micro-batches per step, as before
    # the totals since training start continue from the checkpoint: 2 steps x 3000 before the resume
    assert [m["comm/cum_bytes_sent"] for _, m in rows] == [9000.0, 12000.0]
    assert [m["comm/cum_baseline_bytes"] for _, m in rows] == [36000.0, 48000.0]
    assert ledger.step == 2 + 2
    resumed = callback_of(second)
    assert resumed.summary_totals[("reduce_scatter", "grads")] == OpTotals(8, 8 * 2000, 8 * 1000.0, 8 * 4000.0)
    assert "4 optimizer steps" in resumed.summary_table


# ------------------------------------------------------------------------------------- two ranks (one spawn)

N = 2
WIDTH = 64  # every block is Linear(64, 64, bias=False): 4096 weights, no 1-D parameter
BLOCKS = 2
P = BLOCKS * WIDTH * WIDTH  # trainable parameters
STEPS = 8
DDP_STEP = 2 * (N - 1) / N * 4 * P  # DDP fp32: ring all-reduce of P fp32 gradients, bytes per rank per step


def uniform8_nbytes(numel: int, bucket: int) -> int:
    """Uniform 8-bit codec on the wire: 1 byte per element + (min, unit) fp32 per bucket."""
    return numel + math.ceil(numel / bucket) * 2 * 4


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(BLOCKS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x


class Blocks(pl.LightningModule):
    """Two bias-free 64x64 blocks; ``adam`` for 1-bit Adam, ``extra_record`` for rank-asymmetric traffic."""

    def __init__(self, adam: bool = False, extra_record: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = Stack()
        self.adam = adam
        self.extra_record = extra_record

    def training_step(self, batch, batch_idx):
        if self.extra_record:
            r = self.global_rank
            get_ledger().record("all_to_all", 1000 * (r + 1), 4000 * (r + 1), N, tag=f"rank{r}")
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        if self.adam:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)
        return torch.optim.SGD(self.parameters(), lr=0.01)


class ShardedBlocks(Blocks):
    """QSDP on one FSDP tree: each block its own group under the root ``net`` (called in forward), so FSDP2
    reshards a block after forward and gathers it again in backward."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for block in self.net.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.net, mesh=mesh)


def _block_loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(
        TensorDataset(torch.randn(128, WIDTH, generator=g), torch.randn(128, WIDTH, generator=g)), batch_size=4
    )


def _trainer(out_dir: Path, name: str, strategy, max_steps: int, callbacks: list, version: int = 0) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=N,
        strategy=strategy,
        max_steps=max_steps,
        limit_val_batches=0,
        logger=CSVLogger(str(out_dir), name=name, version=version),
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )


def _result(cb: CommVolumeLogger, trainer: pl.Trainer) -> dict:
    return {
        "totals": {
            f"{op}|{tag}": [t.calls, t.wire_bytes, t.baseline_bytes] for (op, tag), t in cb.summary_totals.items()
        },
        "doc": cb.summary_doc,
        "table": cb.summary_table,
        "global_step": trainer.global_step,
    }


def _run(out: Path, name: str, strategy, model: pl.LightningModule, max_steps: int = STEPS, extra_cbs=()) -> dict:
    cb = CommVolumeLogger(log_every_n_steps=1, summary=False)
    trainer = _trainer(out, name, strategy, max_steps, [*extra_cbs, cb])
    trainer.fit(model, _block_loader())
    return _result(cb, trainer)


class _Messages(logging.Handler):
    """Keeps every message Lightning's rank-zero helpers log."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _two_rank_worker(rank: int, port: int, out_dir: str) -> None:
    # Processes are created here, so Lightning's LightningEnvironment sees LOCAL_RANK and does not launch.
    os.environ.update(
        OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), NODE_RANK="0"
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=N, timeout=timedelta(seconds=120))
    out = Path(out_dir)
    res = {
        "ddp": _run(out, "ddp", "ddp", Blocks()),
        "asymmetric": _run(out, "asymmetric", "ddp", Blocks(extra_record=True), max_steps=3),
        "quant_ddp": _run(out, "quant_ddp", QuantDDPStrategy(codec="uniform", bits=8, bucket_size=512), Blocks()),
        "qsdp": _run(out, "qsdp", QSDPStrategy(bits=8, bucket_size=1024), ShardedBlocks()),
        "local_sgd": _run(out, "local_sgd", LocalSGDStrategy(sync="constant", period=4), Blocks()),
    }
    messages = _Messages()
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addHandler(messages)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        res["onebit"] = _run(out, "onebit", "ddp", Blocks(adam=True), extra_cbs=[OneBitAdamCallback(freeze_step=3)])
    logging.getLogger("lightning.pytorch.utilities.rank_zero").removeHandler(messages)
    res["onebit"]["messages"] = messages.lines + [str(w.message) for w in warned]
    # resume: 4 steps, checkpoint, a new trainer and callback continue to STEPS from it
    first_cb = CommVolumeLogger(log_every_n_steps=1, summary=False)
    first = _trainer(out, "resume", "ddp", 4, [first_cb], version=0)
    first.fit(Blocks(extra_record=True), _block_loader())
    first.save_checkpoint(out / "resume.ckpt")
    res["before_resume"] = _result(first_cb, first)
    second_cb = CommVolumeLogger(log_every_n_steps=1, summary=False)
    second = _trainer(out, "resume", "ddp", STEPS, [second_cb], version=1)
    second.fit(Blocks(extra_record=True), _block_loader(), ckpt_path=out / "resume.ckpt")
    res["resumed"] = _result(second_cb, second)
    write_rank_result(out, rank, res)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("comm_logger_two_ranks")
    spawn(_two_rank_worker, free_port(), str(out), nprocs=N, timeout_s=400.0)
    return out, rank_results(out, N)


def _metric_rows(out: Path, name: str, version: int = 0) -> list[dict]:
    with open(out / name / f"version_{version}" / "metrics.csv") as f:
        return [r for r in csv.DictReader(f) if r.get("comm/bytes_sent")]


def _vs_ddp(res: dict) -> float:
    vs = res["doc"]["vs_ddp"]
    assert vs["trainable_params"] == P
    assert vs["ddp_fp32_bytes"] == pytest.approx(N * STEPS * DDP_STEP)  # summed over ranks
    return vs["ratio"]


@pytest.mark.slow
def test_two_ranks_plain_ddp_ratio_one_and_aggregation(two_ranks):
    out, results = two_ranks
    per_step = DDP_STEP  # the counting hook sees the whole fp32 gradient bucket
    for res in results:
        # every rank's summary is the sum over both ranks
        assert res["ddp"]["totals"] == {"all_reduce|grads": [N * STEPS, N * STEPS * per_step, N * STEPS * per_step]}
        assert _vs_ddp(res["ddp"]) == 1.0
        # asymmetric: rank r recorded all_to_all (1000(r+1), baseline 4x) x 3 steps at factor 1/2; this fit starts
        # from zero although the process-wide ledger still holds the previous fits' traffic
        assert res["asymmetric"]["totals"] == {
            "all_reduce|grads": [6, 6 * per_step, 6 * per_step],
            "all_to_all|rank0": [3, 3 * 500.0, 3 * 2000.0],
            "all_to_all|rank1": [3, 3 * 1000.0, 3 * 4000.0],
        }
    rows = _metric_rows(out, "ddp")
    assert [int(r["step"]) for r in rows] == list(range(STEPS))
    for k, r in enumerate(rows, start=1):  # rank 0's own numbers, as logged
        assert float(r["comm/bytes_sent"]) == per_step == float(r["comm/baseline_bytes"])
        assert float(r["comm/ddp_bytes"]) == DDP_STEP and float(r["comm/vs_ddp"]) == 1.0
        assert float(r["comm/ratio"]) == 1.0 and float(r["comm/op/all_reduce/collectives"]) == 1.0
        assert float(r["comm/cum_bytes_sent"]) == k * per_step == float(r["comm/cum_ddp_bytes"])


@pytest.mark.slow
def test_two_ranks_quant_ddp_uniform8_vs_ddp(two_ranks):
    """Precision-preserving all-reduce: all-to-all + all-gather of N chunks of P/N elements, 8-bit codes.

    Per rank and step 2(N-1)/N * N * nbytes(P/N) against DDP's 2(N-1)/N * 4P: 1/4 plus the codec's scales
    (2 fp32 per 512-element bucket, +1.6%) and the once-per-bucket-layout consistency check (bytes, no baseline).
    """
    codes_only = 0.25
    with_scales = 2 * (N - 1) / N * N * uniform8_nbytes(P // N, 512) / DDP_STEP
    for res in results_of(two_ranks, "quant_ddp"):
        ratio = _vs_ddp(res)
        check = sum(v[1] for k, v in res["totals"].items() if k != "all_reduce|grads")  # pure overhead
        assert ratio == pytest.approx(with_scales + check / (N * STEPS * DDP_STEP), rel=1e-9)
        assert codes_only < ratio < codes_only * (1 + 2 * 8 / 512)


@pytest.mark.slow
def test_two_ranks_qsdp_w8g8_vs_ddp(two_ranks):
    """QSDP: each step gathers every block's 8-bit weights twice (forward, then again in backward after the
    reshard) and reduce-scatters its 8-bit gradients once. A gather or reduce-scatter moves (N-1)/N of N rows of
    nbytes(shard) bytes: per rank and step 3 (N-1) * sum_blocks nbytes(4096/N), against DDP's 2(N-1)/N * 4P, i.e.
    3/8 plus the scales (2 fp32 per 1024-element bucket, +0.8%), plus the 8-byte all-reduce per step by which
    the ranks agree that every gradient shard is finite (the non-finite policy; tag "control")."""
    codes_only = 3 / 8
    control = 2 * (N - 1) / N * 8
    expected = (3 * (N - 1) * BLOCKS * uniform8_nbytes(WIDTH * WIDTH // N, 1024) + control) / DDP_STEP
    for res in results_of(two_ranks, "qsdp"):
        ratio = _vs_ddp(res)
        assert ratio == pytest.approx(expected, rel=1e-9)
        assert codes_only < ratio < codes_only * (1 + 8 / 1024) * (1 + 1e-9) + control / DDP_STEP
        assert res["totals"]["all_reduce|control"][0] == N * STEPS
        gathers = res["totals"]["all_gather|weights"][0]
        assert gathers == N * STEPS * BLOCKS * 2 == 2 * res["totals"]["reduce_scatter|grads"][0]


@pytest.mark.slow
def test_two_ranks_local_sgd_h4_vs_ddp_and_syncs(two_ranks):
    """Constant H=4 over 8 steps: 2 fp32 parameter averages (each the bytes of one DDP all-reduce) -> 2/8."""
    out, _ = two_ranks
    for res in results_of(two_ranks, "local_sgd"):
        averaged = res["totals"]["all_reduce|param_average"]
        overhead = sum(v[1] for k, v in res["totals"].items() if k != "all_reduce|param_average")
        assert averaged[1] == pytest.approx(N * 2 * DDP_STEP)
        assert _vs_ddp(res) == pytest.approx(0.25 + overhead / (N * STEPS * DDP_STEP), rel=1e-9)
        assert overhead < 0.01 * averaged[1]  # the layout check of the first average: a few bytes
        assert res["doc"]["local_sgd"] == {"syncs": 2, "mean_h": 4.0, "forced_syncs": 0}
        assert "2 parameter averages in 8 optimizer steps (mean H 4.00)" in res["table"]
    rows = _metric_rows(out, "local_sgd")
    assert [float(r["comm/syncs"]) for r in rows] == [0, 0, 0, 1, 1, 1, 1, 2]
    assert [float(r["comm/vs_ddp"]) for r in rows][3] == pytest.approx(1.0, rel=0.01)  # a sync step ~ one DDP step


@pytest.mark.slow
def test_two_ranks_onebit_adam_phase(two_ranks):
    out, results = two_ranks
    for res in results:
        assert res["onebit"]["doc"]["onebit_adam"] == {"phase": "compressed", "frozen_at": 3}
        assert (
            "1-bit Adam: warm-up (fp32 AdamW) for the first 3 optimizer steps, compressed since"
            in res["onebit"]["table"]
        )
    rows = _metric_rows(out, "onebit")
    assert [float(r["comm/onebit_compressed"]) for r in rows] == [0, 0, 0, 1, 1, 1, 1, 1]
    # 1-bit Adam's own warm-up hook records into the ledger: no message that its traffic might not be counted
    rank0 = results[0]["onebit"]["messages"]
    assert any("replaced AdamW by OneBitAdam" in m for m in rank0)  # the capture works
    assert not [m for m in rank0 if "comm hook" in m], rank0
    warm, compressed = [float(r["comm/vs_ddp"]) for r in rows[:3]], [float(r["comm/vs_ddp"]) for r in rows[3:]]
    assert warm == [1.0, 1.0, 1.0]  # fp32 gradient all-reduce through the callback's hook
    assert all(0 < v < 0.05 for v in compressed[1:])  # 1 bit per element + scales ~ 1/32


@pytest.mark.slow
def test_two_ranks_totals_survive_a_resume(two_ranks):
    out, results = two_ranks
    per_step = DDP_STEP
    for res in results:
        before, after = res["before_resume"], res["resumed"]
        assert after["global_step"] == STEPS
        assert f"{STEPS} optimizer steps" in after["table"]
        # everything since training start: 8 steps on each rank, each rank's own tag continued
        assert after["totals"] == {
            "all_reduce|grads": [N * STEPS, N * STEPS * per_step, N * STEPS * per_step],
            "all_to_all|rank0": [STEPS, STEPS * 500.0, STEPS * 2000.0],
            "all_to_all|rank1": [STEPS, STEPS * 1000.0, STEPS * 4000.0],
        }
        assert before["totals"]["all_to_all|rank1"] == [4, 4 * 1000.0, 4 * 4000.0]
        assert after["doc"]["vs_ddp"]["ddp_fp32_bytes"] == pytest.approx(N * STEPS * DDP_STEP)
    first, second = _metric_rows(out, "resume", 0), _metric_rows(out, "resume", 1)
    assert [int(r["step"]) for r in second] == list(range(4, STEPS))
    rank0_step = per_step + 500.0  # rank 0's own all_reduce + its all_to_all|rank0 record
    assert float(first[-1]["comm/cum_bytes_sent"]) == 4 * rank0_step
    assert [float(r["comm/cum_bytes_sent"]) for r in second] == [k * rank0_step for k in range(5, STEPS + 1)]
    assert [float(r["comm/cum_ddp_bytes"]) for r in second] == [k * DDP_STEP for k in range(5, STEPS + 1)]


def results_of(two_ranks, name: str) -> list[dict]:
    return [res[name] for res in two_ranks[1]]
