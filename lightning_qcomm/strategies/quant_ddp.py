"""QuantDDPStrategy: Lightning's DDP with gradient buckets all-reduced through a codec (Lightning layer;
docs/design.md, "QuantDDP").

The Lightning glue only: the settings are an ``adapters.ddp.config.QuantDDPConfig``; the hook comes from
``parallel.quant_ddp_hook`` and is registered on CPU/gloo as well as CUDA (Lightning's ``DDPStrategy`` registers
hooks on CUDA only); this file counts optimizer steps for the hook, checkpoints its state per rank and registers
the names of ``presets.QUANT_DDP_PRESETS``. Each bucket becomes avg_r Q(g_r [+ e_r]) by the precision-preserving
all-reduce (docs/design.md, "Collectives").

Checkpoints: every rank writes its hook state (step, residuals per parameter name, DDP's bucket layout) to its side
file ``<checkpoint>.qcomm-rank<r>of<N>-<token>.pt`` (``parallel.rank_files``); the checkpoint holds
``{"world_size": N, "step": step}``. Another world size or topology restores the step and resets the residuals
(logged). ``hierarchical=True``: exact inside a node, the codec across nodes; groups made once at setup; one node
runs flat, warned once. Details: docs/design.md, "Module notes".

Example::

    Trainer(strategy=QuantDDPStrategy(codec="nuqsgd", bits=4))       # or strategy="quant_ddp_nuqsgd4"
    Trainer(num_nodes=2, devices=8, strategy=QuantDDPStrategy(codec="uniform", bits=8, hierarchical=True))
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lightning_qcomm._checks import START_METHODS, build_as, check_choice, check_timeout
from lightning_qcomm.adapters.ddp.config import DDP_CODECS, QuantDDPConfig, warn_if_not_contractive
from lightning_qcomm.adapters.ddp.hooks import QuantDDPHookState
from lightning_qcomm.comm.comm_worker import BackgroundComm
from lightning_qcomm.comm.consistency import check_same_config, presence_timeout
from lightning_qcomm.comm.nonfinite import NonFiniteGuard
from lightning_qcomm.comm.process_group import destroy_gloo_group_at_exit
from lightning_qcomm.comm.topology import NodeGroups, Topology, node_groups
from lightning_qcomm.parallel import rank_files
from lightning_qcomm.parallel.quant_ddp import (
    checkpoint_entries,
    config_fingerprint,
    quant_ddp_hook,
    resolve_hierarchy,
    select_rank_state,
    topology_entry,
)
from lightning_qcomm.strategies.presets import QUANT_DDP_PRESETS, register_presets

log = logging.getLogger(__name__)

CHECKPOINT_KEY = "quant_ddp"

CodecName = Literal[DDP_CODECS]  # the registry's quantizers and "none", for the CLI's validation

RESERVED_DDP_KWARGS = ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper", "model_averaging_period")


def check_no_comm_hook_kwargs(owner: str, ddp_kwargs: dict[str, Any]) -> None:
    """The strategy registers its own DDP comm hook: refuse DDP's comm-hook arguments (ValueError naming them)."""
    bad = [k for k in RESERVED_DDP_KWARGS if ddp_kwargs.get(k) is not None]
    if bad:
        raise ValueError(
            f"{owner} registers its own DDP comm hook; do not pass {bad}. Use DDPStrategy for a custom hook."
        )


class QuantDDPStrategy(DDPStrategy):
    """DDP whose gradient all-reduce is quantized (QSGD, QSGDinf, NUQSGD, uniform int-b, FP8).

    The arguments from ``codec`` to ``nonfinite`` are the fields of ``adapters.ddp.config.QuantDDPConfig`` (same names,
    defaults and checks); the strategy keeps them as ``self.config``. Under Lightning Fabric use
    ``QuantDDPFabricStrategy`` (Fabric takes only its own strategy classes and refuses this one).

    Args:
        ddp_kwargs: everything ``DDPStrategy`` accepts (``find_unused_parameters``, ``start_method``,
            ``bucket_cap_mb``, ...) except its comm-hook arguments, which this strategy owns.

    Example::

        trainer = Trainer(accelerator="cpu", devices=2, strategy=QuantDDPStrategy(codec="uniform", bits=8))
    """

    strategy_name = "quant_ddp"
    writes_rank_files = True  # per-rank side files (parallel.rank_files), also for callbacks' entries

    def __init__(
        self,
        codec: CodecName = "qsgd",
        bits: int | None = None,
        bucket_size: int | None = None,
        error_feedback: bool = False,
        min_quant_numel: int = 1024,
        start_step: int = 0,
        seed: int = 0,
        overlap_comm: bool = True,
        nonfinite: str = "skip",
        hierarchical: bool = False,
        node_size: int | None = None,
        min_bits: int = 4,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **ddp_kwargs: Any,
    ) -> None:
        check_no_comm_hook_kwargs("QuantDDPStrategy", ddp_kwargs)
        check_choice("QuantDDPStrategy", "start_method", start_method, START_METHODS)
        check_timeout("QuantDDPStrategy", timeout)
        self.config: QuantDDPConfig = build_as("QuantDDPStrategy", QuantDDPConfig, locals())
        warn_if_not_contractive(self.config, "QuantDDPStrategy")
        super().__init__(
            process_group_backend=process_group_backend, timeout=timeout, start_method=start_method, **ddp_kwargs
        )
        self.nonfinite = NonFiniteGuard(nonfinite, "QuantDDPStrategy")  # averaged grads: same on all ranks
        self._hook_state: QuantDDPHookState | None = None
        self._pending_state: dict | None = None
        self._background = BackgroundComm("lightning_qcomm-quant_ddp", timeout=timeout)
        self._topology: Topology | None = None  # resolved at setup; None: flat
        self._run_config = self.config  # what the hook runs with: made flat at setup if there is no hierarchy
        self._node_groups: NodeGroups | None = None  # made once (collective), reused by later fits

    @property
    def hook_config(self) -> QuantDDPConfig:
        """The hook's settings as given (``self.config``; ``run_config`` after setup's decisions)."""
        return self.config

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        destroy_gloo_group_at_exit()  # a finished rank must not abort in interpreter teardown
        owner = type(self).__name__
        self._run_config, self._topology = resolve_hierarchy(self.config, owner, self.world_size, self.num_processes)
        # every rank publishes its settings before any collective of ours (a rank without us must not pair with one)
        check_same_config("QuantDDPStrategy", self.config_fingerprint(), timeout=presence_timeout(self._timeout))
        if self._topology is not None and (self._node_groups is None or self._node_groups.topology != self._topology):
            self._node_groups = node_groups(self._topology, timeout=self._timeout, device_type=self.root_device.type)

    @property
    def run_config(self) -> QuantDDPConfig:
        """The settings the hook runs with: ``config`` after setup's decisions (flat when there is no hierarchy;
        ``codec="auto"`` stays: the hook state's ``trial`` chooses the width of each step)."""
        return self._run_config

    def config_fingerprint(self) -> dict[str, Any]:
        """Everything that decides what this strategy's collectives send (compared across ranks at setup)."""
        node_size = None if self._topology is None else self._topology.node_size
        return config_fingerprint(self.config, self._ddp_kwargs, node_size)

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
        state, hook = quant_ddp_hook(
            self._run_config,
            self.lightning_module,
            process_group=self.model.process_group,
            background=self._background,  # one group for every fit of this strategy (collective the first time)
            loss_scale=self._gradient_loss_scale,
            owner=type(self).__name__,
            node_groups=self._node_groups if self._topology is not None else None,
        )
        # a restored checkpoint, else the previous fit of this strategy (a second ``fit`` continues it)
        previous = self._pending_state
        if previous is None and self._hook_state is not None:
            previous = self._hook_state.state_dict()
        if previous is not None:
            state.load_state_dict(previous)
            self._pending_state = None
        self._hook_state = state
        self.model.register_comm_hook(state, hook)
        log.debug("QuantDDPStrategy: registered quant_ddp_comm_hook with %s", self.config)

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
        self._background.close()
        super().teardown()

    # ------------------------------------------------------------------ checkpointing (per rank)
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        local = self._local_state()
        if local is not None:  # every rank's own: they differ
            checkpoint[CHECKPOINT_KEY], mine = checkpoint_entries(local, self.world_size)
            rank_files.stash(checkpoint, CHECKPOINT_KEY, mine)
        write = super().save_checkpoint
        rank_files.save(
            self, checkpoint, filepath, lambda: write(checkpoint, filepath, storage_options=storage_options)
        )

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        super().remove_checkpoint(filepath)
        rank_files.remove(self, filepath)

    def _local_state(self) -> dict | None:
        if self._hook_state is not None:
            return self._hook_state.state_dict()
        return self._pending_state

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = rank_files.load(
            self, super().load_checkpoint(checkpoint_path, weights_only=weights_only), checkpoint_path
        )
        if self._fitting():  # validate/test/predict(ckpt_path=...): no hook to feed, nor a later fit's
            self._restore_from_checkpoint(checkpoint)
        return checkpoint

    def _fitting(self) -> bool:
        trainer = getattr(self.lightning_module, "_trainer", None)
        return trainer is None or trainer.state.fn == TrainerFn.FITTING

    def _restore_from_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = select_rank_state(
            checkpoint.get(CHECKPOINT_KEY),
            self.world_size,
            self.global_rank,
            global_step=int(checkpoint.get("global_step", 0)),
            owner=type(self).__name__,
            own=rank_files.own_entry(checkpoint, CHECKPOINT_KEY),
            topology=topology_entry(self._topology),
        )
        if self._hook_state is not None:
            self._hook_state.load_state_dict(state)
        else:
            self._pending_state = state

    # ------------------------------------------------------------------ registry
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``quant_ddp`` and its presets (``presets.QUANT_DDP_PRESETS``; names already present are kept)."""
        register_presets(strategy_registry, cls, QUANT_DDP_PRESETS)


def register_quant_ddp_strategies(registry: Any) -> None:
    """Register the QuantDDP names with ``QuantDDPStrategy`` in a Lightning strategy registry (idempotent)."""
    QuantDDPStrategy.register_strategies(registry)


__all__ = ["CHECKPOINT_KEY", "QuantDDPStrategy", "register_quant_ddp_strategies"]
