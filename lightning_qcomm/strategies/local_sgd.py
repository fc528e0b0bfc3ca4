"""LocalSGDStrategy: Local SGD / Local AdamW in Lightning, with the Quadratic Synchronization Rule (Lightning layer;
docs/design.md, "Local SGD and QSR").

Each rank trains its own replica and takes H optimizer steps between parameter averages, with no per-step
gradient all-reduce; H comes from a rule of ``parallel.sync_rules`` (``"qsr"``, ``"constant"``, ``"post_local"``).
The settings are a ``parallel.LocalSGDConfig``, the schedule and the averaging ``parallel.LocalSGD``; this file is
the Lightning glue: no DDP wrapper (parameters and buffers broadcast from rank 0 once), one optimizer step per
``optimizer_step`` call, H chosen before a round's first step from the largest lr of all param groups and capped
so training ends on a sync, averages forced before validation, checkpoints and the end of training (they do not
change the schedule), post_local's data-parallel steps reduced in the optimizer closure, ``scope="inter_node"``
over node groups made at setup, and the checkpoint entry ``checkpoint["local_sgd"]`` (per-rank optimizer states
in side files unless they are averaged). The full rules: docs/design.md, "Module notes".

Example::

    Trainer(strategy=LocalSGDStrategy(sync="qsr", h_base=4, alpha=0.01))      # or strategy="local_sgd_qsr"
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_qcomm._checks import START_METHODS, build_as, check_choice, check_timeout
from lightning_qcomm.comm.consistency import check_same_config, presence_timeout
from lightning_qcomm.comm.nonfinite import NonFiniteGuard
from lightning_qcomm.comm.process_group import destroy_gloo_group_at_exit
from lightning_qcomm.comm.topology import NodeGroups, Topology, node_groups
from lightning_qcomm.parallel import rank_files
from lightning_qcomm.parallel.local_sgd import LocalSGD, broadcast_module_states
from lightning_qcomm.parallel.local_sgd_config import LocalSGDConfig, config_fingerprint, inter_node_topology
from lightning_qcomm.parallel.local_sgd_overlap import AveragingLane
from lightning_qcomm.parallel.rank_files import this_rank_entries
from lightning_qcomm.parallel.sync_rules import check_optimizers_have_lr
from lightning_qcomm.strategies.presets import LOCAL_SGD_PRESETS, register_presets

log = logging.getLogger(__name__)

CHECKPOINT_KEY = "local_sgd"


class LocalSGDStrategy(DDPStrategy):
    """Local SGD with a constant, post-local or QSR synchronization period (see module docstring).

    The arguments from ``sync`` to ``max_period`` are the fields of ``parallel.LocalSGDConfig`` (same names, defaults
    and checks); the strategy keeps them as ``self.config``. The others are ``DDPStrategy``'s. Under Lightning
    Fabric use ``LocalSGDFabricStrategy`` (Fabric takes only its own strategy classes and refuses this one).

    Example::

        trainer = Trainer(accelerator="cpu", devices=2, strategy=LocalSGDStrategy(sync="qsr", h_base=4))
        # DiLoCo across nodes: DDP inside each node, an outer Nesterov step across nodes every H steps
        Trainer(num_nodes=2, devices=8, strategy=LocalSGDStrategy(scope="inter_node", outer_optimizer="nesterov"))
    """

    strategy_name = "local_sgd"
    writes_rank_files = True  # per-rank side files (parallel.rank_files), also for callbacks' entries

    def __init__(
        self,
        sync: Literal["qsr", "constant", "post_local"] = "qsr",
        h_base: int = 4,
        alpha: float = 0.0175,
        power: float = 2.0,
        period: int = 8,
        switch_step: int | None = None,
        warmup_steps: int = 0,
        average_buffers: bool = True,
        average_optimizer_state: bool = False,
        codec: str | None = None,
        bits: int = 8,
        bucket_size: int | None = None,
        quantize_delta: bool = True,
        comm_bucket_mb: float = 25.0,
        save_rank_optimizer_states: bool = True,
        seed: int = 0,
        nonfinite: str = "skip",
        scope: Literal["global", "inter_node"] = "global",
        node_size: int | None = None,
        outer_optimizer: Literal["average", "nesterov"] = "average",
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        overlap: bool = False,
        max_period: int | None = None,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        self.config: LocalSGDConfig = build_as("LocalSGDStrategy", LocalSGDConfig, locals())
        check_choice("LocalSGDStrategy", "start_method", start_method, START_METHODS)
        check_timeout("LocalSGDStrategy", timeout)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        self.nonfinite = NonFiniteGuard(nonfinite, "LocalSGDStrategy")  # one count for every fit
        self.local_sgd: LocalSGD | None = None  # made at setup of a fit
        self._loaded_state: dict[str, Any] | None = None
        self._rank_optimizer_states: list[dict[str, Any]] = []  # this rank's, for its side file
        self._topology: Topology | None = None  # scope="inter_node"'s, resolved at setup; None: the global form
        self._run_config = self.config  # what the fit runs with: the global form if there is no node level
        self._node_groups: NodeGroups | None = None  # scope="inter_node": made once (collective), reused by later fits
        self._lane: AveragingLane | None = None  # overlap=True: its worker and groups, made once like the node groups

    # ------------------------------------------------------------------ registry

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register "local_sgd" (constant period) and "local_sgd_qsr" (``presets.LOCAL_SGD_PRESETS``); names
        already present are left alone."""
        register_presets(strategy_registry, cls, LOCAL_SGD_PRESETS)

    # ------------------------------------------------------------------ public read-only state

    @property
    def sync(self) -> str:
        return self.config.sync

    @property
    def sync_period(self) -> int | None:
        """H of the current round (None between a sync and the next optimizer step)."""
        return None if self.local_sgd is None else self.local_sgd.sync_period

    @property
    def num_syncs(self) -> int:
        """Scheduled synchronizations so far (data-parallel steps of post_local included)."""
        return 0 if self.local_sgd is None else self.local_sgd.num_syncs

    @property
    def num_forced_syncs(self) -> int:
        """Extra averages before validation / checkpoint / end of training."""
        return 0 if self.local_sgd is None else self.local_sgd.num_forced_syncs

    @property
    def last_sync_step(self) -> int:
        return 0 if self.local_sgd is None else self.local_sgd.last_sync_step

    @property
    def topology(self) -> tuple[int, int] | None:
        """(nodes, ranks per node) of ``scope="inter_node"`` once set up; None for the global form."""
        return (
            None
            if self._node_groups is None
            else (self._node_groups.topology.num_nodes, self._node_groups.topology.node_size)
        )

    @property
    def schedule_state(self) -> dict[str, Any]:
        return {} if self.local_sgd is None else self.local_sgd.schedule.state_dict()

    # ------------------------------------------------------------------ setup
    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        destroy_gloo_group_at_exit()  # a finished rank must not abort in interpreter teardown
        topo = None
        if self.config.scope == "inter_node":
            topo = inter_node_topology(type(self).__name__, self.world_size, self.config.node_size, self.num_processes)
        self._run_config = (
            self.config if topo is not None else dataclasses.replace(self.config, scope="global", node_size=None)
        )
        self._topology = topo
        check_same_config("LocalSGDStrategy", self.config_fingerprint(), timeout=presence_timeout(self._timeout))
        if topo is None:
            self._node_groups = None
        elif self._node_groups is None or self._node_groups.topology != topo:
            self._node_groups = node_groups(topo, timeout=self._timeout, device_type=self.root_device.type)
        if self.config.overlap and self._lane is None:
            self._lane = AveragingLane(None, self._node_groups)

    def config_fingerprint(self) -> dict[str, Any]:
        """The settings (compared across ranks at setup: a period or alpha that differs would make ranks sync
        on different steps and wait in each other's averages), with the resolved ranks per node."""
        return config_fingerprint(self.config, None if self._topology is None else self._topology.node_size)

    @override
    def configure_ddp(self) -> None:
        """No DDP wrapper: broadcast parameters and buffers from rank 0 once; no gradient hooks."""
        assert self.model is not None
        broadcast_module_states(self.model)

    @override
    def setup(self, trainer: Any) -> None:
        if self._layer_sync is not None:
            raise ValueError(
                "sync_batchnorm=True is not supported by LocalSGDStrategy (it all-reduces statistics in every "
                "forward); use average_buffers=True to average BatchNorm statistics at each sync"
            )
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        assert self.lightning_module is not None
        # broadcast already done by configure_ddp; the strategy drives the steps (no optimizer hooks)
        self.local_sgd = LocalSGD(
            self.lightning_module,
            self.optimizers,
            self._run_config,
            register_hooks=False,
            broadcast=False,
            nonfinite=self.nonfinite,
            owner=type(self).__name__,
            node_groups=self._node_groups,
            lane=self._lane,
        )
        if self._loaded_state is not None:
            self.local_sgd.load_state_dict(self._loaded_state)
            self._loaded_state = None

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        if self.local_sgd is not None:
            self.local_sgd.schedule.total_steps = self.lightning_module.trainer.estimated_stepping_batches

    def _check_optimizers_have_lr(self) -> None:
        check_optimizers_have_lr(self.optimizers, self.config.sync)

    # ------------------------------------------------------------------ the step

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Any = None,
        **kwargs: Any,
    ) -> Any:
        """Run the optimizer step; close the round with an average when H steps are done."""
        local_sgd = self.local_sgd
        if local_sgd is None:  # not fitting (or not set up): plain step
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        local_sgd.begin_step()  # before the closure: H from the lr this step uses
        scaler = getattr(self.precision_plugin, "scaler", None)

        def closure_then_prepare() -> Any:
            out = closure()
            if scaler is None:  # a GradScaler skips non-finite steps itself (the guard stands aside)
                local_sgd.prepare_gradients(optimizer)
            elif local_sgd.schedule.round_data_parallel:
                local_sgd.prepare_gradients(optimizer, check_finite=False)
            return out

        out = super().optimizer_step(optimizer, closure_then_prepare, model, **kwargs)
        local_sgd.end_step()
        return out

    # ------------------------------------------------------------------ sync points outside the schedule

    def _sync_if_dirty(self) -> None:
        if self.local_sgd is not None:
            self.local_sgd.sync()

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        self._sync_if_dirty()

    @override
    def on_train_end(self) -> None:
        self._sync_if_dirty()
        super().on_train_end()

    @override
    def teardown(self) -> None:
        # after an error an average may still be in flight: its daemon thread is left to end (or time out) alone
        in_flight = self.local_sgd is not None and self.local_sgd.overlap is not None and self.local_sgd.overlap.pending
        if self._lane is not None and not in_flight:
            self._lane.close()
        super().teardown()

    # ------------------------------------------------------------------ checkpointing

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Called on every rank first thing in ``dump_checkpoint``: average, then hand out the state."""
        self._rank_optimizer_states = []
        self._sync_if_dirty()
        return super().lightning_module_state_dict()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """This rank's optimizer state, also kept for this rank's side file when the ranks' states differ."""
        state = super().optimizer_state(optimizer)
        if self.local_sgd is not None and self.local_sgd.optimizer_states_differ(self.world_size):
            self._rank_optimizer_states.append(state)
        return state

    def local_sgd_state_dict(self) -> dict[str, Any]:
        assert self.local_sgd is not None
        return {**self.local_sgd.state_dict(), "world_size": self.world_size}

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if self.local_sgd is not None:
            checkpoint[CHECKPOINT_KEY] = self.local_sgd_state_dict()
        if self._rank_optimizer_states:
            rank_files.stash(checkpoint, CHECKPOINT_KEY, {"optimizer_states": self._rank_optimizer_states})
        self._rank_optimizer_states = []
        write = super().save_checkpoint
        rank_files.save(
            self, checkpoint, filepath, lambda: write(checkpoint, filepath, storage_options=storage_options)
        )

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        super().remove_checkpoint(filepath)
        rank_files.remove(self, filepath)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = rank_files.load(
            self, super().load_checkpoint(checkpoint_path, weights_only=weights_only), checkpoint_path
        )
        state = checkpoint.get(CHECKPOINT_KEY)
        trainer = getattr(self.lightning_module, "_trainer", None)
        if state is None or (trainer is not None and trainer.state.fn != TrainerFn.FITTING):
            return checkpoint  # validate/test/predict(ckpt_path=...): the schedule is not a later fit's
        if state.get("sync") != self.config.sync:
            log.warning(
                "checkpoint was written with sync=%r, resuming with sync=%r: the schedule counters are reused",
                state.get("sync"),
                self.config.sync,
            )
        self._loaded_state = state
        per_rank = state.get("optimizer_states_per_rank")  # a checkpoint of an earlier version
        own = rank_files.own_entry(checkpoint, CHECKPOINT_KEY)
        if per_rank and "optimizer_states" in checkpoint:
            mine = this_rank_entries(per_rank, state.get("world_size"), self.world_size, self.global_rank)
            if mine is not None:
                checkpoint["optimizer_states"] = mine
        elif own is not None and "optimizer_states" in checkpoint:
            checkpoint["optimizer_states"] = own["optimizer_states"]
        elif rank_files.saved_world_size(checkpoint) not in (None, self.world_size):
            this_rank_entries([], state.get("world_size"), self.world_size, self.global_rank)  # logs the policy
        return checkpoint


def register_local_sgd_strategies(registry: Any) -> None:
    """Register the lowercase names "local_sgd" and "local_sgd_qsr" in a Lightning ``StrategyRegistry``.

    Safe to call more than once (names already registered are skipped).
    """
    LocalSGDStrategy.register_strategies(registry)
