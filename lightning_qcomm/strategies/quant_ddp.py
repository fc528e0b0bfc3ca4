"""QuantDDPStrategy: Lightning's DDP with gradient buckets all-reduced through a codec (Lightning layer).

This file owns the Lightning glue only: argument validation, registering
``lightning_qcomm.comm.ddp_hooks.quant_ddp_comm_hook`` on the wrapped model (on CPU/gloo as well as
CUDA; Lightning's ``DDPStrategy`` registers ``ddp_comm_hook`` only on CUDA), counting optimizer steps
for the hook, per-rank checkpointing of the hook state, and the registry names.

    Trainer(strategy=QuantDDPStrategy(codec="nuqsgd", bits=4))       # or strategy="quant_ddp_nuqsgd4"

Per optimizer step each DDP bucket g (local gradient) becomes avg_r Q(g_r [+ e_r]) by the
precision-preserving all-reduce (docs/design.md, "Collectives"): quantize N chunks, all-to-all, fp32 sum,
requantize, all-gather. Wire bytes per rank ~ 2(N-1)/N * d * (bits + 32 k / bucket_size) / 8 (k fp32 scales per
codec bucket), i.e. (bits + 32 k / bucket_size) / 32 of an fp32 ring all-reduce.

Checkpoint format (per-rank state in a rank-0 file): at ``save_checkpoint`` every rank's hook state
(optimizer-step counter and error-feedback residuals per parameter name) is gathered to rank 0 with
``gather_object`` and stored under ``checkpoint["quant_ddp"] = {"world_size": N, "per_rank": [...]}``.
On load each rank takes entry ``per_rank[global_rank]``. One file keeps Lightning's CheckpointIO,
``ModelCheckpoint`` top-k deletion and copying checkpoints around working; the price is rank 0
holding N residual copies while saving (N x the trainable parameter bytes, only when
``error_feedback=True``). If the world size changed, the step counter is restored and the residuals
are reset to zero (logged): a residual belongs to one rank's data stream.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import rank_zero_warn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lightning_qcomm._checks import START_METHODS, check_choice, check_timeout
from lightning_qcomm.comm.comm_worker import CommWorker, dedicated_group
from lightning_qcomm.comm.consistency import check_same_config, presence_timeout
from lightning_qcomm.comm.ddp_hooks import (
    DDP_CODECS,
    QuantDDPHookConfig,
    QuantDDPHookState,
    quant_ddp_comm_hook,
    relative_compression_error,
)
from lightning_qcomm.comm.nonfinite import NonFiniteGuard
from lightning_qcomm.comm.process_group import destroy_gloo_group_at_exit

log = logging.getLogger(__name__)

CHECKPOINT_KEY = "quant_ddp"

CodecName = Literal["qsgd", "qsgdinf", "nuqsgd", "uniform", "fp8_e4m3", "fp8_e5m2", "none"]

_PRESETS: dict[str, dict[str, Any]] = {
    "quant_ddp": {},
    "quant_ddp_nuqsgd4": {"codec": "nuqsgd", "bits": 4},
    "quant_ddp_qsgd4": {"codec": "qsgd", "bits": 4},
    "quant_ddp_uniform8": {"codec": "uniform", "bits": 8},
    "quant_ddp_fp8": {"codec": "fp8_e4m3", "bits": 8},
}

_RESERVED_DDP_KWARGS = ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper", "model_averaging_period")


def _check_int(name: str, value: Any, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"QuantDDPStrategy({name}=...) must be an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"QuantDDPStrategy({name}={value}) must be >= {minimum}")
    return value


class QuantDDPStrategy(DDPStrategy):
    """DDP whose gradient all-reduce is quantized (QSGD, QSGDinf, NUQSGD, uniform int-b, FP8).

    Args:
        codec: gradient codec; ``"none"`` all-reduces in fp32 through lightning_qcomm (ledger-counted,
            numerically the same as plain DDP).
        bits: code width; None means 8 (fp32 for ``"none"``). Allowed: uniform 1..8,
            qsgd/qsgdinf/nuqsgd 2..8, fp8_* 8.
        bucket_size: elements per codec scale block (>= 1). Not DDP's ``bucket_cap_mb``, which is
            still accepted in ``ddp_kwargs``.
        error_feedback: keep per-rank residual buffers (checkpointed per rank).
        min_quant_numel: parameters with fewer elements are all-reduced uncompressed.
        start_step: optimizer steps of uncompressed warmup.
        seed: seed of the stochastic rounding (folded with step and bucket index).
        overlap_comm: on CPU/gloo, run each bucket's compressed all-reduce on a background thread over a
            process group of its own, so it overlaps the rest of the backward pass (as torch's own
            gloo all-reduce does). Results are bit-identical either way. CUDA buckets always run inline.
        nonfinite: what a step with a NaN/Inf gradient does: ``"skip"`` it on every rank (logged, counted in
            ``nonfinite.skipped``), ``"raise"`` FloatingPointError, or ``"propagate"`` (see ``strategies.nonfinite``).
        ddp_kwargs: everything ``DDPStrategy`` accepts (``find_unused_parameters``, ``start_method``,
            ``bucket_cap_mb``, ...) except its comm-hook arguments, which this strategy owns.
    """

    strategy_name = "quant_ddp"

    def __init__(
        self,
        codec: CodecName = "qsgd",
        bits: int | None = None,
        bucket_size: int = 512,
        error_feedback: bool = False,
        min_quant_numel: int = 1024,
        start_step: int = 0,
        seed: int = 0,
        overlap_comm: bool = True,
        nonfinite: str = "skip",
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **ddp_kwargs: Any,
    ) -> None:
        bad = [k for k in _RESERVED_DDP_KWARGS if ddp_kwargs.get(k) is not None]
        if bad:
            raise ValueError(
                f"QuantDDPStrategy registers its own DDP comm hook; do not pass {bad}. "
                "Use DDPStrategy for a custom hook."
            )
        check_choice("QuantDDPStrategy", "start_method", start_method, START_METHODS)
        check_timeout("QuantDDPStrategy", timeout)
        self.hook_config = self._make_config(
            codec, bits, bucket_size, error_feedback, min_quant_numel, start_step, seed
        )
        super().__init__(
            process_group_backend=process_group_backend, timeout=timeout, start_method=start_method, **ddp_kwargs
        )
        if not isinstance(overlap_comm, bool):
            raise TypeError(f"QuantDDPStrategy(overlap_comm={overlap_comm!r}) must be a bool")
        self.overlap_comm = overlap_comm
        self.nonfinite = NonFiniteGuard(nonfinite, "QuantDDPStrategy")  # averaged grads: same on all ranks
        self._hook_state: QuantDDPHookState | None = None
        self._pending_state: dict | None = None
        self._comm_worker: CommWorker | None = None
        self._comm_group: dist.ProcessGroup | None = None

    @staticmethod
    def _make_config(
        codec: Any, bits: Any, bucket_size: Any, error_feedback: Any, min_quant_numel: Any, start_step: Any, seed: Any
    ) -> QuantDDPHookConfig:
        if not isinstance(codec, str) or codec.lower() not in DDP_CODECS:
            raise ValueError(f"QuantDDPStrategy(codec={codec!r}) is not supported; allowed: {', '.join(DDP_CODECS)}")
        codec = codec.lower()
        if bits is None:
            bits = 32 if codec == "none" else 8
        _check_int("bits", bits, 1)
        if codec == "none" and bits != 32:
            raise ValueError(f"QuantDDPStrategy(codec='none', bits={bits}): the uncompressed path is fp32; use bits=32")
        _check_int("bucket_size", bucket_size, 1)
        if not isinstance(error_feedback, bool):
            raise TypeError(f"QuantDDPStrategy(error_feedback={error_feedback!r}) must be a bool")
        _check_int("min_quant_numel", min_quant_numel, 0)
        _check_int("start_step", start_step, 0)
        _check_int("seed", seed, 0)
        config = QuantDDPHookConfig(
            codec=codec,
            bits=bits,
            bucket_size=bucket_size,
            error_feedback=error_feedback,
            min_quant_numel=min_quant_numel,
            start_step=start_step,
            seed=seed,
        )
        try:
            built = config.build_codec()
        except (ValueError, TypeError) as err:
            raise type(err)(
                f"QuantDDPStrategy(codec={codec!r}, bits={bits}, bucket_size={bucket_size}): {err}"
            ) from err
        if error_feedback and built is not None:
            rho = relative_compression_error(built)
            if rho >= 1.0:
                rank_zero_warn(
                    f"QuantDDPStrategy(codec={codec!r}, bits={bits}, bucket_size={bucket_size}, error_feedback=True): "
                    f"this codec is not contractive (relative error ||Q(x)-x||^2/||x||^2 = {rho:.2f} >= 1 on "
                    "Gaussian data), and error feedback then typically diverges. Use more bits, codec='uniform' "
                    "or 'qsgdinf', or error_feedback=False."
                )
        return config

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        destroy_gloo_group_at_exit()  # a finished rank must not abort in interpreter teardown
        check_same_config("QuantDDPStrategy", self.config_fingerprint(), timeout=presence_timeout(self._timeout))

    def config_fingerprint(self) -> dict[str, Any]:
        """Everything that decides what this strategy's collectives send (compared across ranks at setup)."""
        ddp = {
            k: v if isinstance(v, (bool, int, float, str, type(None))) else repr(v) for k, v in self._ddp_kwargs.items()
        }
        return {
            **dataclasses.asdict(self.hook_config),
            "overlap_comm": self.overlap_comm,
            "nonfinite": self.nonfinite.policy,
            "ddp_kwargs": ddp,
        }

    # ------------------------------------------------------------------ hook registration
    @property
    def hook_state(self) -> QuantDDPHookState | None:
        """The live hook state (None before the model is wrapped)."""
        return self._hook_state

    @override
    def _register_ddp_hooks(self) -> None:
        # Unlike DDPStrategy, register on every device type: gloo supports comm hooks since torch 1.9.
        assert isinstance(self.model, DistributedDataParallel)
        assert self.lightning_module is not None
        names = {p: n for n, p in self.lightning_module.named_parameters() if p.requires_grad}
        group, worker = self.model.process_group, None
        if self.overlap_comm and self.root_device.type == "cpu" and self.world_size > 1:
            if self._comm_worker is None:  # collective: every rank gets here in the same order
                self._comm_group = dedicated_group(self.model.process_group, timeout=self._timeout)
                self._comm_worker = CommWorker()
            group, worker = self._comm_group, self._comm_worker
        state = QuantDDPHookState(
            self.hook_config, names, process_group=group, worker=worker, loss_scale=self._gradient_loss_scale
        )
        # a restored checkpoint, else the previous fit of this strategy (a second ``fit`` continues it)
        previous = self._pending_state
        if previous is None and self._hook_state is not None:
            previous = self._hook_state.state_dict()
        if previous is not None:
            state.load_state_dict(previous)
            self._pending_state = None
        self._hook_state = state
        self.model.register_comm_hook(state, quant_ddp_comm_hook)
        log.debug("QuantDDPStrategy: registered quant_ddp_comm_hook with %s", self.hook_config)

    def _gradient_loss_scale(self) -> torch.Tensor | None:
        """The scale the gradients in DDP's buckets carry: the fp16 GradScaler's (a tensor; reading it does
        not sync), or None without one."""
        scaler = getattr(self.precision_plugin, "scaler", None)
        if scaler is None or not scaler.is_enabled():
            return None
        return getattr(scaler, "_scale", None)  # None until the first scaled backward

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Any = None,
        **kwargs: Any,
    ) -> Any:
        step = self._hook_state.step if self._hook_state is not None else 0
        closure = self.nonfinite.wrap(closure, optimizer, step, scaler=getattr(self.precision_plugin, "scaler", None))
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._hook_state is not None:
            self._hook_state.next_step()
        return out

    @override
    def teardown(self) -> None:
        if self._comm_worker is not None:
            self._comm_worker.close()
        super().teardown()

    # ------------------------------------------------------------------ checkpointing (per rank)
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        local = self._local_state()
        if local is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list | None = [None] * dist.get_world_size() if self.is_global_zero else None
            dist.gather_object(local, gathered, dst=0)
            per_rank = gathered
        else:
            per_rank = [local]
        if self.is_global_zero and local is not None:
            checkpoint[CHECKPOINT_KEY] = {"world_size": len(per_rank), "per_rank": per_rank}
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def _local_state(self) -> dict | None:
        if self._hook_state is not None:
            return self._hook_state.state_dict()
        return self._pending_state

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._restore_from_checkpoint(checkpoint)
        return checkpoint

    def _restore_from_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get(CHECKPOINT_KEY)
        if saved is None:
            step = int(checkpoint.get("global_step", 0))
            rank_zero_warn(
                f"QuantDDPStrategy: the checkpoint has no {CHECKPOINT_KEY!r} entry (not written by QuantDDPStrategy); "
                f"the step counter resumes from global_step={step} and error-feedback residuals start at zero"
            )
            state = {"step": step, "error_feedback": {}}
        else:
            per_rank = saved["per_rank"]
            if saved["world_size"] == self.world_size:
                state = per_rank[self.global_rank]
            else:
                rank_zero_warn(
                    f"QuantDDPStrategy: the checkpoint was written by {saved['world_size']} ranks, now "
                    f"{self.world_size}; the step counter is restored, error-feedback residuals reset to 0"
                )
                state = {"step": int(per_rank[0]["step"]), "error_feedback": {}}
        if self._hook_state is not None:
            self._hook_state.load_state_dict(state)
        else:
            self._pending_state = state

    # ------------------------------------------------------------------ registry
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        register_quant_ddp_strategies(strategy_registry)


def register_quant_ddp_strategies(registry: Any) -> None:
    """Register ``quant_ddp`` and its presets with a Lightning strategy registry (idempotent)."""
    for name, init_params in _PRESETS.items():
        if name in registry:
            continue
        desc = ", ".join(f"{k}={v!r}" for k, v in init_params.items()) or "codec='qsgd', bits=8"
        registry.register(
            name, QuantDDPStrategy, description=f"DDP with quantized gradient all-reduce ({desc})", **init_params
        )


__all__ = ["CHECKPOINT_KEY", "QuantDDPStrategy", "register_quant_ddp_strategies"]
