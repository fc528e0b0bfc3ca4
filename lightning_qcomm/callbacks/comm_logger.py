"""CommVolumeLogger: turns the CommLedger into Lightning metrics and an end-of-fit summary, against DDP fp32
(Lightning layer; docs/design.md, "Byte accounting").

It installs a ``CommLedger`` at setup when none is active and calls ``ledger.next_step()`` once per optimizer step
(strategies never do). The headline baseline is plain DDP in fp32: 2(N-1)/N * 4 * P bytes per rank and step for
the P trainable elements; ``vs_ddp`` = bytes sent / that, beside the per-collective ``ratio``. A step's traffic is
the ledger's totals differenced over the step, so evaluation traffic is never charged to training. Metrics
(``comm/bytes_sent``, ``comm/vs_ddp``, ``comm/cum_*``, ``comm/scope/<scope>/...``, with ``per_op`` also per op and
tag) are logged by rank 0 every ``log_every_n_steps``; the summary at the end sums every rank (one small
all-reduce, not in the ledger) and is printed on rank 0 and optionally written as JSON. Totals survive a resume
(per-rank side files, ``parallel.rank_files``). Strategies of this package record their own collectives; another
DDP-wrapped strategy gets a counting DDP hook (so plain DDP reports vs_ddp 1.0); any other multi-process strategy
is reported as not measured. Lightning's own bookkeeping collectives are not counted. The full list of metrics
and rules: docs/design.md, "Module notes".

Example::

    Trainer(strategy="qsdp", devices=2, callbacks=[CommVolumeLogger(summary_file="comm.json")])
"""

from __future__ import annotations

import logging
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from lightning_qcomm._checks import check_bool, check_int, check_writable_file
from lightning_qcomm.callbacks.comm_report import (
    Totals,
    add_totals,
    aggregate_over_ranks,
    ddp_fp32_step_bytes,
    diff_totals,
    format_summary,
    local_sgd_info,
    metrics_from_totals,
    onebit_info,
    overall,
    snapshot,
    summary_notes,
    totals_from_rows,
    totals_to_rows,
    write_summary_json,
)
from lightning_qcomm.comm.ledger import CommLedger, ensure_ledger, get_ledger
from lightning_qcomm.parallel import rank_files

log = logging.getLogger(__name__)


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


def trainable_numel(module: torch.nn.Module) -> int:
    """Elements of the parameters with ``requires_grad`` (shared ones once; a DTensor counts its global size)."""
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


class CommVolumeLogger(pl.Callback):
    """Log communication volume from the ``CommLedger`` against DDP fp32, and print a summary at the end.

    Args:
        log_every_n_steps: log every this many optimizer steps; ``None`` follows ``Trainer(log_every_n_steps)``.
        per_op: also log per-op (``comm/op/...``) and per-tag (``comm/tag/...``) metrics.
        summary: print the summary table on global rank 0 when training ends.
        summary_file: if set, global rank 0 also writes the summary as JSON to this path.
        prog_bar: show ``comm/vs_ddp`` (this rank, this step; ``comm/ratio`` on one process) in the progress bar.
        count_ddp: attach the counting hook to plain DDP models (see module docstring).

    Example::

        trainer = Trainer(strategy=QuantDDPStrategy(codec="nuqsgd", bits=4), callbacks=[CommVolumeLogger()])
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
        own = "CommVolumeLogger"
        self.log_every_n_steps = check_int(own, "log_every_n_steps", log_every_n_steps, minimum=1, optional=True)
        self.per_op = check_bool(own, "per_op", per_op)
        self.summary = check_bool(own, "summary", summary)
        self.summary_file = check_writable_file(own, "summary_file", summary_file)  # now, not after training
        self.prog_bar = check_bool(own, "prog_bar", prog_bar)
        self.count_ddp = check_bool(own, "count_ddp", count_ddp)
        self.summary_totals: Totals = {}  # summed over ranks, filled at train end
        self.summary_table: str = ""
        self.summary_doc: dict[str, Any] = {}  # the headline numbers of the summary (also in the JSON)
        self._ledger: CommLedger | None = None
        self._fit_start: Totals = {}
        self._step_start: Totals | None = None
        self._last_global_step = 0
        self._hook_checked = False
        self._reset_history()

    def _reset_history(self) -> None:
        """Totals since training start that come before this fit (from a checkpoint) or from its steps."""
        self._prior: Totals = {}  # all traffic of earlier fits of this training run
        self._train: Totals = {}  # training-step traffic since training start
        self._ddp_bytes = 0.0  # DDP-fp32 baseline since training start
        self._steps = 0  # optimizer steps counted since training start
        self._numel = 0  # trainable parameters at the last step

    # read-only totals of this rank since training start (what LossVsBytesPlot draws) ----------------------
    @property
    def steps_counted(self) -> int:
        """Optimizer steps counted since training start (resumed runs included)."""
        return self._steps

    @property
    def global_step_counted(self) -> int:
        """``trainer.global_step`` after the last optimizer step this callback counted (the totals' step)."""
        return self._last_global_step

    @property
    def train_bytes_sent(self) -> float:
        """Wire bytes this rank sent in training steps since training start."""
        return overall(self._train).wire_bytes

    @property
    def ddp_fp32_bytes(self) -> float:
        """What DDP fp32 would have sent from this rank over the same steps (2(N-1)/N * 4 * P per step)."""
        return self._ddp_bytes

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
            if self._ledger is not None:  # keep what the replaced ledger counted during this fit
                self._prior = add_totals(self._prior, diff_totals(self._ledger.cumulative, self._fit_start))
            self._ledger = ledger
            self._fit_start = {}
            self._step_start = {} if self._step_start is not None else None
        return ledger

    def _since_start(self) -> Totals:
        """All traffic since training start (earlier fits restored from a checkpoint included)."""
        return add_totals(self._prior, diff_totals(self._active_ledger().cumulative, self._fit_start))

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        rank_files.attach(trainer.strategy)  # each rank's totals in its own side file, any strategy
        self._device = trainer.strategy.root_device
        if stage != "fit":
            return
        self._ledger = ensure_ledger()
        self._fit_start = snapshot(self._ledger.cumulative)
        self._step_start = None
        self._hook_checked = False
        self._reset_history()  # a checkpoint's state (load_state_dict) comes after setup

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_global_step = trainer.global_step  # after a checkpoint restore, unlike setup

    # checkpoint (per rank) ------------------------------------------------------------------------------
    def _mine(self) -> dict[str, Any]:
        return {
            "all": totals_to_rows(self._since_start()) if self._ledger is not None else totals_to_rows(self._prior),
            "train": totals_to_rows(self._train),
            "ddp_bytes": self._ddp_bytes,
            "steps": self._steps,
        }

    def state_dict(self) -> dict[str, Any]:
        """The totals since training start summed over ranks (collective: Lightning calls this on every rank)."""
        mine, device = self._mine(), getattr(self, "_device", torch.device("cpu"))
        everything, _ = aggregate_over_ranks(totals_from_rows(mine["all"]), device)
        train, (ddp_bytes,) = aggregate_over_ranks(totals_from_rows(mine["train"]), device, [mine["ddp_bytes"]])
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        summed = {"all": totals_to_rows(everything), "train": totals_to_rows(train), "ddp_bytes": ddp_bytes}
        return {"world_size": world, "summed": {**summed, "steps": mine["steps"]}}

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        rank_files.stash(checkpoint, self.state_key, self._mine())  # this rank's own totals

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        self._own_saved = rank_files.own_entry(checkpoint, self.state_key)  # before load_state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        distributed = dist.is_available() and dist.is_initialized()
        rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
        # an earlier version's checkpoint holds every rank's totals; this one the sum and a side file per rank
        saved = state_dict.get("per_rank") or [state_dict["summed"]]
        own, self._own_saved = getattr(self, "_own_saved", None), None
        if state_dict["world_size"] == world:
            entries = [saved[rank]] if "per_rank" in state_dict else [e for e in (own,) if e is not None]
        else:
            rank_zero_warn(
                f"CommVolumeLogger: the checkpoint's totals were written by {state_dict['world_size']} ranks, now "
                f"{world}; they are summed into rank 0's (the summary stays right, per-rank metrics restart)"
            )
            entries = saved if rank == 0 else []
        for entry in entries:
            self._prior = add_totals(self._prior, totals_from_rows(entry["all"]))
            self._train = add_totals(self._train, totals_from_rows(entry["train"]))
            self._ddp_bytes += float(entry["ddp_bytes"])
            self._steps = max(self._steps, int(entry["steps"]))

    # plain-DDP counting ----------------------------------------------------------------------------------
    def _attach_counting_hook(self, trainer: pl.Trainer) -> None:
        self._hook_checked = True
        strategy = trainer.strategy
        if type(strategy).__module__.startswith("lightning_qcomm."):
            return  # our strategies record their own traffic
        model = strategy.model
        if isinstance(model, DistributedDataParallel):
            existing = model._get_ddp_logging_data().get("comm_hook")
            hooks = [hook for hook, _ in getattr(model, "_comm_hooks", ())]
            if existing and hooks and all(getattr(h, "__module__", "").startswith("lightning_qcomm.") for h in hooks):
                return  # one of ours (e.g. 1-bit Adam's warm-up hook): it records its own traffic
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
            self._step_start = snapshot(self._active_ledger().cumulative)

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
        self._numel = trainable_numel(pl_module)
        ddp_step = ddp_fp32_step_bytes(self._numel, trainer.world_size)
        self._train = add_totals(self._train, step_totals)
        self._ddp_bytes += ddp_step
        self._steps += 1
        sent = overall(step_totals)
        if self.prog_bar:
            shown = ("comm/vs_ddp", sent.wire_bytes / ddp_step) if ddp_step else ("comm/ratio", sent.ratio)
            pl_module.log(*shown, prog_bar=True, logger=False, on_step=True, on_epoch=False)
        every = self.log_every_n_steps or trainer.log_every_n_steps
        if trainer.global_step % every or not trainer.is_global_zero or not trainer.loggers:
            return
        metrics = metrics_from_totals(step_totals, self._since_start(), self.per_op, ddp_step, self._ddp_bytes)
        metrics.update(self._method_metrics(trainer))
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step - 1)  # Lightning's 0-based step index

    def _method_metrics(self, trainer: pl.Trainer) -> dict[str, float]:
        out: dict[str, float] = {}
        sgd = local_sgd_info(trainer.strategy, self._steps)
        if sgd is not None:
            out["comm/syncs"] = float(sgd["syncs"])
            if sgd["mean_h"] is not None:
                out["comm/mean_h"] = float(sgd["mean_h"])
        onebit = onebit_info(trainer.optimizers)
        if onebit is not None:
            out["comm/onebit_compressed"] = float(onebit["last"])
        return out

    # summary ------------------------------------------------------------------------------------------------
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        device = trainer.strategy.root_device
        totals, _ = aggregate_over_ranks(self._since_start(), device)
        train, (ddp_bytes,) = aggregate_over_ranks(self._train, device, [self._ddp_bytes])
        self.summary_totals = totals
        steps = trainer.global_step
        train_sent = overall(train).wire_bytes
        outside = overall(totals).wire_bytes - train_sent
        doc, notes = summary_notes(
            trainer.strategy, trainer.optimizers, steps, self._steps, train_sent, ddp_bytes, self._numel, outside
        )
        self.summary_doc = doc
        extra = {
            k: float(v) for k, v in trainer.callback_metrics.items() if ("loss" in k or "acc" in k) and v.numel() == 1
        }
        self.summary_table = format_summary(totals, trainer.world_size, steps, extra, notes)
        if not trainer.is_global_zero:
            return
        if self.summary:
            print(self.summary_table, flush=True)
        if self.summary_file:
            write_summary_json(self.summary_file, totals, trainer.world_size, steps, extra, doc)


__all__ = [
    "CommVolumeLogger",
    "aggregate_over_ranks",
    "counting_allreduce_hook",
    "ddp_fp32_step_bytes",
    "diff_totals",
    "format_summary",
    "metrics_from_totals",
    "trainable_numel",
    "write_summary_json",
]
