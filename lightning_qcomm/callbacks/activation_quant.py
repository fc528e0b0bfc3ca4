"""ActivationQuantization: Lightning glue for b-bit saved activations (Lightning layer; docs/design.md,
"Activation quantization"; the math is ``lightning_qcomm.memory``).

It checks the typed arguments, builds an ``ActivationQuantizer``, attaches it at fit start and runs it around
every training forward (from ``on_train_batch_start`` to ``on_before_backward``; under manual optimization after
each ``manual_backward``), never during validation or prediction. Seeds: ``derive_seed(seed, global_step,
forward index, global rank, site)``. The budget policy's calibration sums per-site statistics over ranks so every
rank fixes the same plan (a step with a non-finite gradient is rejected); the plan is checkpointed. Optional FP8
gradient storage between accumulation micro-batches (``grad_storage``, ``memory.grad_storage``) keeps the
accumulation itself in fp32. Rank 0 logs ``actq/saved_bytes``, ``actq/baseline_bytes``, ``actq/ratio`` and
related metrics every ``log_every_n_steps``. The full rules: docs/design.md, "Module notes".

Example::

    Trainer(callbacks=[ActivationQuantization(bits=4)])                      # any strategy, any device count
    Trainer(callbacks=[ActivationQuantization(bits=4, policy="budget", budget_bits=5.0)])
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn

from lightning_qcomm._checks import build_as, check_bool, check_choice, check_int
from lightning_qcomm.codecs import get_codec
from lightning_qcomm.memory.bit_allocation import average_bits
from lightning_qcomm.memory.config import ActivationQuantConfig, parse_patterns
from lightning_qcomm.memory.grad_storage import FP8GradientStore
from lightning_qcomm.memory.quantizer import ActivationQuantizer
from lightning_qcomm.memory.saved_tensors import SavedBytes

log = logging.getLogger(__name__)

GRAD_STORAGE = ("fp32", "fp8_e4m3", "fp8_e5m2")
LOW_COVERAGE = 0.5  # below this share of eligible saved bytes quantized, the first step warns


class ActivationQuantization(pl.Callback):
    """Store the activations a training forward saves blockwise in ``bits`` bits, chosen by the op that saves
    them: projections (linear, conv, addmm, matmul with a weight), norms, activation functions and the
    element-wise products around them, whatever module class calls them.

    Attention (SDPA / MultiheadAttention, softmax, matmuls of two activations; modules matching
    ``attention_patterns``), losses and parameters are never quantized; see
    ``lightning_qcomm.memory.op_rules`` for the exact rules.

    Args:
        bits: code width (1..8) of quantized activations (the base width for ``layer_aware``/``budget``).
        policy: ``"uniform"`` (every site at ``bits``), ``"layer_aware"`` (first and last site at
            ``edge_bits``), ``"budget"`` (4/5/6/8 bits by measured sensitivity, mean ``budget_bits``).
        block_size: elements per scale block (min, unit): overhead 64 / block_size bits per element.
        min_numel: saved tensors with fewer elements stay in full precision.
        recompute: norms and activations keep only their quantized input and recompute in backward.
        attention_patterns: comma-separated fnmatch patterns (case-insensitive) of module attribute or class
            names whose every save stays in full precision; ``None`` or ``""`` (default): attention is
            recognised by op only.
        edge_bits: ``layer_aware`` width of the first and last quantized site (bits..8). The first forward
            (which counts the sites) stores every site at 8 bits.
        budget_bits: ``budget`` mean code bits per quantized element (bits..8; None: bits + 1, at most 8).
        calibration_steps: optimizer steps measured (all sites at 8 bits: about twice the saved bytes of a
            4-bit step) before the budget plan is fixed.
        stochastic: stochastic rounding (unbiased); False rounds to nearest.
        seed: user seed folded into every site's random bits.
        batch_saves: on a GPU, a layer's saves are encoded together when its forward ends and decoded together
            in backward (a few launches per layer instead of three per save; the layer's saves are held in full
            precision until its forward ends). False: each save is encoded at once. No effect on CPU.
        log_every_n_steps: metric period in optimizer steps; ``None`` follows the Trainer's.
        record_saves: keep, for the last forward, a record of every saved tensor and the decision
            (``self.quantizer.records``), for inspection.
        grad_storage: ``"fp32"`` (off), or ``"fp8_e4m3"`` / ``"fp8_e5m2"``: hold accumulated gradients in FP8
            (blocks of ``block_size``) between gradient-accumulation micro-batches.

    Example::

        trainer = Trainer(strategy="ddp", callbacks=[ActivationQuantization(bits=4, policy="layer_aware")])
    """

    def __init__(
        self,
        bits: int = 4,
        policy: Literal["uniform", "layer_aware", "budget"] = "uniform",
        block_size: int = 128,
        min_numel: int = 1024,
        recompute: bool = True,
        attention_patterns: str | None = None,
        edge_bits: int = 8,
        budget_bits: float | None = None,
        calibration_steps: int = 1,
        stochastic: bool = True,
        seed: int = 0,
        batch_saves: bool = True,
        log_every_n_steps: int | None = None,
        record_saves: bool = False,
        grad_storage: Literal["fp32", "fp8_e4m3", "fp8_e5m2"] = "fp32",
    ) -> None:
        own = type(self).__name__
        if isinstance(budget_bits, int) and not isinstance(budget_bits, bool):
            budget_bits = float(budget_bits)
        if attention_patterns is not None and not isinstance(attention_patterns, str):
            raise TypeError(
                f"{own}(attention_patterns={attention_patterns!r}) must be a comma-separated str or None "
                "(e.g. '*attn*,*attention*')"
            )
        fields = dict(locals(), attention_patterns=parse_patterns(attention_patterns, owner=own))
        self.config = build_as(own, ActivationQuantConfig, fields)
        check_int(own, "log_every_n_steps", log_every_n_steps, minimum=1, optional=True)
        check_bool(own, "record_saves", record_saves)
        check_choice(own, "grad_storage", grad_storage, GRAD_STORAGE)
        self.grad_storage = grad_storage
        self.grad_store = (
            None
            if grad_storage == "fp32"
            else FP8GradientStore(get_codec(grad_storage, bucket_size=block_size), min_numel=min_numel)
        )
        self.grad_bytes = (0, 0)  # (stored, baseline) of the last compress
        self._warned_manual = False
        self.log_every_n_steps = log_every_n_steps
        self.quantizer = ActivationQuantizer(self.config)
        self.quantizer.record = record_saves
        self.step_stats = SavedBytes()  # largest forward of the current optimizer step
        self.last_step_stats = SavedBytes()  # ... of the last finished optimizer step
        self._step = -1
        self._forward_in_step = 0
        self._grads_to_compress = False  # an accumulating backward ran; compress before the next forward
        self._calibration_start: int | None = None  # global step where the current budget calibration began
        self._checked_effect = False  # the first finished step was checked for quantized saves

    # ------------------------------------------------------------------ lifecycle
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        compiled = _compiled_parts(pl_module)
        if compiled:
            rank_zero_warn(
                f"ActivationQuantization: {', '.join(compiled)} runs under torch.compile, which is not supported: "
                "the saved-tensor hooks break the compiled graphs (much slower than eager) and saves inside "
                "compiled regions may stay unquantized; train without torch.compile or without this callback"
            )
        self._checked_effect = False
        self.quantizer.attach(pl_module)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.quantizer.end()
        self.quantizer.detach()
        self._restore_grads()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.quantizer.end()
        self.quantizer.detach()
        self._restore_grads()

    def _restore_grads(self) -> None:
        if self.grad_store is not None and self.grad_store.holding:
            self.grad_store.restore()

    def _mark_grads(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """After a backward: remember to compress if another micro-batch of this window follows."""
        if not pl_module.automatic_optimization:
            if not self._warned_manual:
                self._warned_manual = True
                log.warning("ActivationQuantization: grad_storage applies to automatic optimization only; ignored")
            return
        should_accumulate = getattr(trainer.fit_loop, "_should_accumulate", None)
        self._grads_to_compress = should_accumulate is not None and should_accumulate()

    def _compress_grads(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Before a forward: hold the gradients in FP8 if the last backward's window is still open."""
        pending, self._grads_to_compress = self._grads_to_compress, False
        if not pending or trainer.global_step != self._step or self.grad_store.holding:
            return  # nothing accumulated, or the optimizer step already consumed the gradients
        self.grad_store.compress(pl_module.parameters())
        self.grad_bytes = (self.grad_store.nbytes, self.grad_store.original_nbytes)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer) -> None:
        self._grads_to_compress = False
        self._restore_grads()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._end()
        self._grads_to_compress = False
        self._restore_grads()

    def _begin(self, trainer: pl.Trainer) -> None:
        if self.quantizer.active:  # the last forward was never closed (on_train_batch_end skipped)
            self._end()
        if self.config.policy == "budget" and self.quantizer.plan is None and self._calibration_start is None:
            self._calibration_start = trainer.global_step
        if trainer.global_step != self._step:
            self._step = trainer.global_step
            self._forward_in_step = 0
            self.step_stats = SavedBytes()
        self.quantizer.begin(step=trainer.global_step, micro=self._forward_in_step, rank=trainer.global_rank)
        self._forward_in_step += 1

    def _end(self) -> None:
        if not self.quantizer.active:
            return
        self.quantizer.end()
        if self.quantizer.stats.stored >= self.step_stats.stored:
            self.step_stats = self.quantizer.stats

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.grad_store is not None:
            self._compress_grads(trainer, pl_module)
        self._begin(trainer)

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self._end()
        self._restore_grads()  # autograd accumulates this micro-batch into fp32 gradients

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.grad_store is not None:
            self._mark_grads(trainer, pl_module)
        if not pl_module.automatic_optimization:  # a manual training_step may run more forwards
            self._begin(trainer)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._end()
        if trainer.global_step == self._step:
            return  # gradient accumulation: the optimizer step has not happened yet
        self.last_step_stats = self.step_stats
        if not self._checked_effect:
            self._checked_effect = True
            self._warn_low_coverage()
        if self.config.policy == "budget" and self.quantizer.plan is None:
            self._calibrate(trainer)
        every = self.log_every_n_steps or trainer.log_every_n_steps
        if trainer.global_step % every or not trainer.is_global_zero or not trainer.loggers:
            return
        metrics = self.metrics()
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step - 1)  # Lightning's 0-based step index

    def _warn_low_coverage(self) -> None:
        """Once, after the first training step: say so when under ``LOW_COVERAGE`` of the saved bytes outside
        attention and losses were quantized (the callback then saves little on this model)."""
        s = self.step_stats
        if s.coverage >= LOW_COVERAGE and s.quantized_tensors:
            return
        mib = 2.0**20
        rank_zero_warn(
            f"ActivationQuantization(bits={self.config.bits}): the first training step quantized "
            f"{s.coverage:.0%} of the saved activation bytes outside attention and losses "
            f"({s.quantized_baseline / mib:.1f} of {(s.baseline - s.exact_by_rule) / mib:.1f} MiB), so it saves "
            "little on this model. It quantizes what projections (linear, conv, addmm, matmul with a weight), norms, "
            f"activation functions and element-wise products save, at least min_numel={self.config.min_numel} "
            "elements each; an ActivationQuantizer with record = True lists every save with the reason it was kept"
        )

    def _calibrate(self, trainer: pl.Trainer) -> None:
        """At the end of a budget calibration step: reject it if any rank saw a non-finite gradient, else fix
        the plan once ``calibration_steps`` accepted steps are in (every rank takes the same branches)."""
        q = self.quantizer
        device = trainer.strategy.root_device

        def reduce(t: torch.Tensor) -> torch.Tensor:
            return trainer.strategy.reduce(t.to(device), reduce_op="sum").cpu()

        nonfinite = float(reduce(torch.tensor([float(q.nonfinite_grads)], dtype=torch.float64))[0])
        if nonfinite > 0:
            log.warning(
                "ActivationQuantization: budget calibration step %d rejected (%d non-finite gradient measurements "
                "over all ranks, e.g. an fp16 overflow step); calibrating again from step %d",
                trainer.global_step - 1,
                int(nonfinite),
                trainer.global_step,
            )
            q.reset_calibration()
            self._calibration_start = trainer.global_step
            return
        start = self._calibration_start if self._calibration_start is not None else 0
        if trainer.global_step - start < self.config.calibration_steps:
            return
        plan = q.finish_calibration(reduce=reduce)
        log.info(
            "ActivationQuantization: budget plan fixed: %d sites, mean %.2f bits (target %.2f)",
            len(plan),
            average_bits([c.numel for c in q.calibration], plan),
            self.config.budget_bits,
        )

    def metrics(self) -> dict[str, float]:
        """The ``actq/*`` numbers of the last finished optimizer step (see module docstring)."""
        s = self.last_step_stats
        grads = {}
        if self.grad_store is not None:
            grads = {
                "actq/grad_stored_bytes": float(self.grad_bytes[0]),
                "actq/grad_baseline_bytes": float(self.grad_bytes[1]),
            }
        return {
            **grads,
            "actq/saved_bytes": float(s.stored),
            "actq/baseline_bytes": float(s.baseline),
            "actq/ratio": s.ratio,
            "actq/quantized_ratio": s.quantized_ratio,
            "actq/quantized_tensors": float(s.quantized_tensors),
            "actq/avg_bits": s.avg_bits,
        }

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """The quantizer's state (versioned there): the plan and the policy / widths it was made for."""
        return self.quantizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.quantizer.load_state_dict(state_dict)


def _compiled_parts(module: torch.nn.Module) -> list[str]:
    """Which parts of ``module`` run under torch.compile: the LightningModule itself (``trainer.fit(torch.compile(
    model))``), or submodules wrapped by ``torch.compile`` / compiled in place with ``nn.Module.compile``."""
    parts = ["the LightningModule"] if getattr(module, "_compiler_ctx", None) else []
    for name, m in module.named_modules():
        if name and (hasattr(m, "_orig_mod") or getattr(m, "_compiled_call_impl", None) is not None):
            parts.append(f"submodule {name!r}")
    return parts
