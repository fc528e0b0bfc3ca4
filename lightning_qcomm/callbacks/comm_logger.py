"""CommVolumeLogger: turns the CommLedger into Lightning metrics and an end-of-fit summary table.

What it owns:

* **Step boundaries.** It installs a ``CommLedger`` at setup when none is active (``ensure_ledger``) and
  calls ``ledger.next_step()`` once per optimizer step (``on_train_batch_end`` when ``global_step``
  advanced). Strategies never call ``next_step``.
* **Per-step metrics** (this rank's numbers, written to every Lightning logger by rank 0 every
  ``log_every_n_steps`` optimizer steps). A step's traffic is the ledger's cumulative totals differenced
  from the first micro-batch of the step to the optimizer step, so evaluation and sanity-check traffic is
  never charged to a training step (it is in the cumulative and summary numbers):

  ``comm/bytes_sent``, ``comm/baseline_bytes``, ``comm/ratio`` (= sent / baseline), ``comm/collectives``
  (calls), and the same since fit start as ``comm/cum_bytes_sent``, ``comm/cum_baseline_bytes``,
  ``comm/cum_ratio``. With ``per_op``: ``comm/op/<op>/{bytes_sent,baseline_bytes,ratio,collectives}``
  for each torch.distributed primitive (all_reduce, all_gather, reduce_scatter, all_to_all, broadcast)
  and ``comm/tag/<tag>/...`` for each purpose (grads, weights, param_average, momentum, buffers, control).
  ``bytes_sent`` is the ledger's wire estimate (``wire_bytes``); ``baseline_bytes`` is what the
  uncompressed fp32 collective would send.
* **Summary** at the end of training: the per-(op, tag) totals since fit start, summed over all ranks
  with one all-reduce of a small fp64 tensor (a plain ``torch.distributed`` call, not recorded in the
  ledger), printed as a table on global rank 0 and optionally written as JSON (``summary_file``).

Plain Lightning strategies record nothing into our ledger, so to report them honestly:

* a strategy defined in ``lightning_qcomm`` records its own collectives: nothing is added;
* any other strategy whose model is a ``DistributedDataParallel`` (e.g. ``strategy="ddp"``) gets a
  *counting* DDP communication hook before its first batch: the default all-reduce-and-average hook
  plus one ledger record per gradient bucket (``all_reduce``, tag ``grads``, bytes = the bucket as DDP
  sends it, baseline = the same bytes because uncompressed DDP is the baseline), so ``ratio`` is 1.0;
  if the DDP model already has a communication hook, that hook's owner is responsible for recording;
* any other multi-process strategy (FSDP, DeepSpeed, ...) is reported as not measured (logged once).

Not counted for any strategy: Lightning's own bookkeeping collectives (metric ``sync_dist``, barriers,
the initial parameter broadcast).
"""

from __future__ import annotations

import json
import logging
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from lightning_qcomm.comm.ledger import CommLedger, OpTotals, ensure_ledger, get_ledger

log = logging.getLogger(__name__)

Totals = dict[tuple[str, str], OpTotals]


def counting_allreduce_hook(process_group: dist.ProcessGroup | None, bucket: dist.GradBucket) -> torch.futures.Future:
    """DDP's default gradient all-reduce (sum, then divide by N) plus a ledger record of its bytes."""
    buf = bucket.buffer()
    nbytes = buf.numel() * buf.element_size()
    get_ledger().record("all_reduce", nbytes, nbytes, dist.get_world_size(process_group), tag="grads")
    return default_hooks.allreduce_hook(process_group, bucket)


# DDP checks a hook's annotations against the real classes; ``from __future__ import annotations`` made them strings.
counting_allreduce_hook.__annotations__ = {
    "process_group": dist.ProcessGroup | None,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}


def diff_totals(now: Totals, before: Totals) -> Totals:
    """Per-key ``now - before`` (keys absent from ``before`` count from zero); zero-call keys dropped."""
    out: Totals = {}
    for key, t in now.items():
        b = before.get(key, OpTotals())
        d = OpTotals(
            t.calls - b.calls,
            t.payload_bytes - b.payload_bytes,
            t.wire_bytes - b.wire_bytes,
            t.baseline_bytes - b.baseline_bytes,
        )
        if d.calls:
            out[key] = d
    return out


def _snapshot(totals: Totals) -> Totals:
    return {k: OpTotals(t.calls, t.payload_bytes, t.wire_bytes, t.baseline_bytes) for k, t in totals.items()}


def _group(totals: Totals, by: str) -> dict[str, OpTotals]:
    """Group by ``op`` or ``tag`` (untagged traffic is listed under ``untagged``), or everything as ``all``."""
    out: dict[str, OpTotals] = defaultdict(OpTotals)
    for (op, tag), t in totals.items():
        out[{"op": op, "tag": tag or "untagged", "all": "all"}[by]].add(t)
    return dict(out)


def metrics_from_totals(step: Totals, cumulative: Totals, per_op: bool) -> dict[str, float]:
    """The metric dict logged for one step (see module docstring for the names)."""
    s = _group(step, "all").get("all", OpTotals())
    c = _group(cumulative, "all").get("all", OpTotals())
    m = {
        "comm/bytes_sent": s.wire_bytes,
        "comm/baseline_bytes": s.baseline_bytes,
        "comm/ratio": s.ratio,
        "comm/collectives": float(s.calls),
        "comm/cum_bytes_sent": c.wire_bytes,
        "comm/cum_baseline_bytes": c.baseline_bytes,
        "comm/cum_ratio": c.ratio,
    }
    if per_op:
        for by in ("op", "tag"):
            for name, t in sorted(_group(step, by).items()):
                prefix = f"comm/{by}/{name}"
                m[f"{prefix}/bytes_sent"] = t.wire_bytes
                m[f"{prefix}/baseline_bytes"] = t.baseline_bytes
                if t.baseline_bytes or not t.wire_bytes:  # no ratio for pure overhead (baseline 0)
                    m[f"{prefix}/ratio"] = t.ratio
                m[f"{prefix}/collectives"] = float(t.calls)
    return m


def format_summary(totals: Totals, world_size: int, steps: int, extra: dict[str, float] | None = None) -> str:
    """A plain-text table of ``totals`` (already summed over ranks) grouped by op, by tag, and overall."""
    mb = 1e6
    header = f"{'group':<6} {'name':<16} {'calls':>8} {'sent MB':>12} {'baseline MB':>12} {'ratio':>7} {'saving':>8}"
    lines = [
        f"lightning_qcomm communication summary: {world_size} rank(s), {steps} optimizer steps, "
        "bytes summed over ranks (wire estimate; baseline = uncompressed fp32)",
        header,
        "-" * len(header),
    ]

    def row(group: str, name: str, t: OpTotals) -> str:
        if t.baseline_bytes == 0 and t.wire_bytes > 0:  # pure overhead (e.g. a metadata check): no ratio
            ratio, saving = "-", "-"
        else:
            ratio, saving = f"{t.ratio:.3f}", (f"{1 / t.ratio:.1f}x" if t.ratio > 0 else "inf")
        return f"{group:<6} {name:<16} {t.calls:>8d} {t.wire_bytes / mb:>12.3f} {t.baseline_bytes / mb:>12.3f} {ratio:>7} {saving:>8}"

    for by in ("op", "tag"):
        for name, t in sorted(_group(totals, by).items()):
            lines.append(row(by, name, t))
    lines.append("-" * len(header))
    lines.append(row("total", "", _group(totals, "all").get("all", OpTotals())))
    if not totals:
        lines.append("(no collective was recorded)")
    for name, value in sorted((extra or {}).items()):
        lines.append(f"{name} = {value:.4f}")
    return "\n".join(lines)


class CommVolumeLogger(pl.Callback):
    """Log communication volume from the ``CommLedger`` and print a summary at the end of training.

    Args:
        log_every_n_steps: log every this many optimizer steps; ``None`` follows ``Trainer(log_every_n_steps)``.
        per_op: also log per-op (``comm/op/...``) and per-tag (``comm/tag/...``) metrics.
        summary: print the summary table on global rank 0 when training ends.
        summary_file: if set, global rank 0 also writes the summary as JSON to this path.
        prog_bar: show ``comm/ratio`` (this rank, this step) in the progress bar.
        count_ddp: attach the counting hook to plain DDP models (see module docstring).
    """

    def __init__(
        self,
        log_every_n_steps: int | None = None,
        per_op: bool = True,
        summary: bool = True,
        summary_file: str | None = None,
        prog_bar: bool = True,
        count_ddp: bool = True,
    ) -> None:
        if log_every_n_steps is not None and (not isinstance(log_every_n_steps, int) or log_every_n_steps < 1):
            raise ValueError(f"log_every_n_steps must be None or an int >= 1, got {log_every_n_steps!r}")
        self.log_every_n_steps = log_every_n_steps
        self.per_op = per_op
        self.summary = summary
        self.summary_file = summary_file
        self.prog_bar = prog_bar
        self.count_ddp = count_ddp
        self.summary_totals: Totals = {}  # summed over ranks, filled at train end
        self.summary_table: str = ""
        self._ledger: CommLedger | None = None
        self._fit_start: Totals = {}
        self._step_start: Totals | None = None
        self._last_global_step = 0
        self._hook_checked = False

    # ledger bookkeeping -------------------------------------------------------------------------------
    def _active_ledger(self) -> CommLedger:
        """The ledger to read; if somebody replaced ours mid-fit, count everything in the new one (warned once)."""
        ledger = get_ledger()
        if ledger is not self._ledger:
            if not ledger.enabled:
                ledger = ensure_ledger()
            rank_zero_warn(
                "CommVolumeLogger: the active CommLedger was replaced during fit; reading the new one from zero."
            )
            self._ledger = ledger
            self._fit_start = {}
            self._step_start = {} if self._step_start is not None else None
        return ledger

    def _since_fit_start(self) -> Totals:
        return diff_totals(self._active_ledger().cumulative, self._fit_start)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._ledger = ensure_ledger()
        self._fit_start = _snapshot(self._ledger.cumulative)
        self._step_start = None
        self._hook_checked = False

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_global_step = trainer.global_step  # after a checkpoint restore, unlike setup

    # plain-DDP counting ----------------------------------------------------------------------------------
    def _attach_counting_hook(self, trainer: pl.Trainer) -> None:
        self._hook_checked = True
        strategy = trainer.strategy
        if type(strategy).__module__.startswith("lightning_qcomm."):
            return  # our strategies record their own traffic
        model = strategy.model
        if isinstance(model, DistributedDataParallel):
            existing = model._get_ddp_logging_data().get("comm_hook")
            if existing:
                rank_zero_info(
                    f"CommVolumeLogger: the DDP model already has the comm hook {existing!r}; its traffic is counted only if that hook records into the CommLedger."
                )
                return
            if self.count_ddp:
                model.register_comm_hook(model.process_group, counting_allreduce_hook)
            return
        if trainer.world_size > 1:
            rank_zero_warn(
                f"CommVolumeLogger: {type(strategy).__name__} is not a lightning_qcomm strategy nor plain DDP; its communication is not measured."
            )

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self._hook_checked:
            self._attach_counting_hook(trainer)
        if self._step_start is None:
            self._step_start = _snapshot(self._active_ledger().cumulative)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self._last_global_step:
            return  # gradient accumulation: the optimizer step has not happened yet
        self._last_global_step = trainer.global_step
        ledger = self._active_ledger()
        ledger.next_step()
        step_totals = diff_totals(ledger.cumulative, self._step_start or {})
        self._step_start = None
        if self.prog_bar:
            ratio = _group(step_totals, "all").get("all", OpTotals()).ratio
            pl_module.log("comm/ratio", ratio, prog_bar=True, logger=False, on_step=True, on_epoch=False)
        every = self.log_every_n_steps or trainer.log_every_n_steps
        if trainer.global_step % every or not trainer.is_global_zero or not trainer.loggers:
            return
        metrics = metrics_from_totals(step_totals, self._since_fit_start(), self.per_op)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step - 1)  # Lightning's 0-based step index

    # summary ------------------------------------------------------------------------------------------------
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        totals = aggregate_over_ranks(self._since_fit_start(), trainer.strategy.root_device)
        self.summary_totals = totals
        extra = {
            k: float(v) for k, v in trainer.callback_metrics.items() if ("loss" in k or "acc" in k) and v.numel() == 1
        }
        self.summary_table = format_summary(totals, trainer.world_size, trainer.global_step, extra)
        if not trainer.is_global_zero:
            return
        if self.summary:
            print(self.summary_table, flush=True)
        if self.summary_file:
            write_summary_json(self.summary_file, totals, trainer.world_size, trainer.global_step, extra)


def aggregate_over_ranks(totals: Totals, device: torch.device) -> Totals:
    """Sum ``totals`` over all ranks (keys unioned with ``all_gather_object``; values in one fp64 all-reduce).

    Every rank must call this. These two collectives are deliberately not recorded in the ledger.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return _snapshot(totals)
    key_lists: list[list[tuple[str, str]] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(key_lists, sorted(totals))
    keys = sorted({tuple(k) for ks in key_lists for k in ks})
    values = torch.tensor(
        [[t.calls, t.payload_bytes, t.wire_bytes, t.baseline_bytes] for t in (totals.get(k, OpTotals()) for k in keys)],
        dtype=torch.float64,
        device=device,
    ).reshape(len(keys), 4)
    dist.all_reduce(values, op=dist.ReduceOp.SUM)
    out: Totals = {}
    for key, (calls, payload, wire, baseline) in zip(keys, values.cpu().tolist()):
        out[key] = OpTotals(int(round(calls)), int(round(payload)), wire, baseline)
    return out


def write_summary_json(path: str, totals: Totals, world_size: int, steps: int, extra: dict[str, float]) -> None:
    """JSON with ``total``, ``by_op``, ``by_tag`` (each calls/payload_bytes/wire_bytes/baseline_bytes/ratio)."""

    def as_dict(t: OpTotals) -> dict[str, float]:
        return {
            "calls": t.calls,
            "payload_bytes": t.payload_bytes,
            "wire_bytes": t.wire_bytes,
            "baseline_bytes": t.baseline_bytes,
            "ratio": t.ratio,
        }

    doc = {
        "world_size": world_size,
        "optimizer_steps": steps,
        "total": as_dict(_group(totals, "all").get("all", OpTotals())),
        "by_op": {k: as_dict(v) for k, v in sorted(_group(totals, "op").items())},
        "by_tag": {k: as_dict(v) for k, v in sorted(_group(totals, "tag").items())},
        "metrics": {k: v for k, v in extra.items() if math.isfinite(v)},
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(doc, indent=2, sort_keys=True))
