"""QSDPStrategy: FSDP2 with quantized weight all-gather and gradient reduce-scatter (Lightning layer; docs/design.md,
"QSDP").

Lightning glue only: the settings are a ``parallel.QSDPConfig``; ``parallel.apply_qsdp`` shards the LightningModule
with FSDP2 on the 1-D data-parallel mesh (unless ``configure_model`` did) and installs the quantized comms; this
file runs Lightning's setup around it, advances the RNG step once per optimizer step (``QSDPHandle.after_step``),
runs every ``*_step`` through the root group's forward when the LightningModule is one, and saves / restores the
run state with the checkpoint (``parallel.qsdp_state``; the files: ``qsdp_checkpoint``; registry names:
``presets``; the grouping: ``parallel.sharding``). Setup is idempotent: fit -> validate -> test -> predict, or a new
Trainer, take an already sharded module as it is and install this strategy's comms on it.

Bit widths: ``bits`` sets both, ``weight_bits`` / ``grad_bits`` one each; 32 means unquantized (FSDP2's own
collective, counted in the ledger); codec names are ``lightning_qcomm.codecs.CODEC_NAMES`` or ``"none"``; ``"auto"``
is chosen by timed trial steps (``comm.auto_trial``), logged once, kept for later stages and checkpointed.

Example::

    Trainer(strategy=QSDPStrategy(bits=8))                     # weights and gradients at 8 bits
    Trainer(strategy=QSDPStrategy(weight_bits=8, grad_bits=4)) # or strategy="qsdp" / "qsdp_w8g8" / "qsdp_w4g4"
    Trainer(strategy=QSDPStrategy(weight_bits="auto", grad_bits="auto", min_bits=4))
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_qcomm._checks import START_METHODS, build_as, check_bool, check_choice, check_int, check_timeout
from lightning_qcomm.adapters.fsdp2.comms import QSDPCommState, sync_unsharded_requires_grad
from lightning_qcomm.comm.agree import max_over_ranks_tensor
from lightning_qcomm.comm.comm_worker import BackgroundComm
from lightning_qcomm.comm.consistency import check_same_config, presence_timeout
from lightning_qcomm.comm.nonfinite import NonFiniteGuard
from lightning_qcomm.comm.process_group import destroy_gloo_group_at_exit
from lightning_qcomm.parallel.hsdp import hsdp_mesh, mesh_topology
from lightning_qcomm.parallel.qsdp import QSDPHandle, apply_qsdp, config_fingerprint, new_trial
from lightning_qcomm.parallel.qsdp_config import DEFAULT_MIN_BITS, DEFAULT_MIN_WRAP_NUMEL, BitsArg, QSDPConfig
from lightning_qcomm.parallel.qsdp_state import load_run_state, run_state
from lightning_qcomm.strategies.presets import QSDP_PRESETS, register_presets
from lightning_qcomm.strategies.qsdp_checkpoint import (
    FullStateLauncher,
    check_sharded_checkpoint,
    missing_checkpoint_hint,
    save_sharded_checkpoint,
)
from lightning_qcomm.strategies.qsdp_checks import check_precision, no_effect_message

log = logging.getLogger(__name__)

CHECKPOINT_KEY = "qsdp"


class QSDPStrategy(ModelParallelStrategy):
    """Fully sharded data parallel (FSDP2) whose weight all-gather and gradient reduce-scatter are quantized.

    The arguments from ``bits`` to ``nonfinite`` are the fields of ``parallel.QSDPConfig`` (same names, defaults and
    checks; ``layer_classes`` / ``min_wrap_numel`` apply when the model has no ``configure_model`` calling
    ``fully_shard``); the strategy keeps them as ``self.config``. Under Lightning Fabric use ``QSDPFabricStrategy``
    (Fabric takes only its own strategy classes and refuses this one).

    Args:
        hsdp / intra_node_bits: shard inside a node, replicate across nodes; ``grad_bits`` is then the width of
            the gradient all-reduce across nodes (``parallel.hsdp``; docs/design.md, "Topology").
        node_size: ranks per node for ``hsdp`` (default: Lightning's devices per node).
        min_bits: with ``weight_bits`` / ``grad_bits`` / ``bits`` ``"auto"``, the narrowest width the choice may
            take (2, 4 or 8; ``QSDPConfig.min_bits``).
        save_distributed_checkpoint: True saves one shard per rank (a folder, replaced atomically, see
            ``qsdp_checkpoint``; ``python -m lightning_qcomm.consolidate IN OUT`` makes it one file for
            ``load_from_checkpoint``), False a full state dict in one file, gathered on rank 0 at each save.
        start_method: "popen" (re-run the script per rank, like ``ModelParallelStrategy``) or a
            multiprocessing start method ("spawn", "fork", "forkserver").
        process_group_backend / timeout: as in ``ModelParallelStrategy``.

    Example::

        trainer = Trainer(accelerator="cpu", devices=2, strategy=QSDPStrategy(weight_bits=8, grad_bits=8))
        trainer = Trainer(accelerator="cpu", devices=2, strategy=QSDPStrategy(bits="auto", min_bits=4))
    """

    strategy_name = "qsdp"

    def __init__(
        self,
        bits: BitsArg = None,
        weight_bits: BitsArg = None,
        grad_bits: BitsArg = None,
        bucket_size: int = 1024,
        weight_codec: str = "uniform",
        grad_codec: str = "uniform",
        min_quant_numel: int = 1024,
        quantize_master: bool = False,
        seed: int = 0,
        layer_classes: str | None = None,
        min_wrap_numel: int = DEFAULT_MIN_WRAP_NUMEL,
        reshard_after_forward: bool | None = None,
        overlap_comm: bool = True,
        nonfinite: str = "skip",
        hsdp: bool = False,
        intra_node_bits: int | None = None,
        node_size: int | None = None,
        min_bits: int = DEFAULT_MIN_BITS,
        save_distributed_checkpoint: bool = True,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        check_bool("QSDPStrategy", "save_distributed_checkpoint", save_distributed_checkpoint)
        check_choice("QSDPStrategy", "start_method", start_method, START_METHODS)
        check_timeout("QSDPStrategy", timeout)
        self._node_size = check_int("QSDPStrategy", "node_size", node_size, optional=True, minimum=1)
        self.config: QSDPConfig = build_as("QSDPStrategy", QSDPConfig, locals())
        super().__init__(
            data_parallel_size="auto",
            tensor_parallel_size="auto",
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        # gradient shards differ per rank: agree on "all finite" (one 8-byte all-reduce per step)
        self.nonfinite = NonFiniteGuard(nonfinite, "QSDPStrategy", agree=self._all_ranks_finite)
        self._background = BackgroundComm("lightning_qcomm-qsdp", timeout=timeout)  # one group for every stage
        self._start_method = start_method
        self.comm_state = QSDPCommState(seed=seed, step=0)
        self._qsdp: QSDPHandle | None = None
        self._hsdp: tuple[QSDPConfig, Any] | None = None  # (config, 2-D mesh) once resolved, for every stage
        self._root_is_group = False
        self._in_root_step = False
        self._warned_no_effect = False

    @property
    def run_config(self) -> QSDPConfig:
        """The settings the comms run with: ``config``, with an ``"auto"`` width replaced by the one the trial
        chose (until then ``config`` itself)."""
        trial = self.comm_state.trial
        if trial is None or trial.chosen is None:
            return self.config
        return self.config.resolve_auto(trial.chosen, trial.chosen)

    @property
    def weight_bits(self) -> int | str:
        """The weight width (``"auto"`` until the trial has chosen it)."""
        return self.run_config.weight_bits

    @property
    def grad_bits(self) -> int | str:
        """The gradient width (``"auto"`` until the trial has chosen it)."""
        return self.run_config.grad_bits

    @property
    def weight_codec(self):
        """The weight all-gather's codec (None: unquantized, or ``"auto"`` not chosen yet)."""
        return None if self.run_config.auto_weights else self.run_config.build_weight_codec()

    @property
    def grad_codec(self):
        """The gradient reduce-scatter's codec (None: unquantized, or ``"auto"`` not chosen yet)."""
        return None if self.run_config.auto_grads else self.run_config.build_grad_codec()

    @property
    def _fsdp_modules(self) -> list[nn.Module]:
        """The FSDP groups with quantized comms, in group-id order (empty before setup)."""
        return [] if self._qsdp is None else self._qsdp.modules

    # ------------------------------------------------------------------ processes and mesh
    @override
    def _configure_launcher(self) -> None:
        if self._start_method == "popen":
            super()._configure_launcher()
        else:
            self._launcher = FullStateLauncher(self, start_method=self._start_method)

    @override
    def setup_environment(self) -> None:
        # 1-D data parallelism over all processes: mesh (world, 1) named ("data_parallel", "tensor_parallel").
        self._data_parallel_size = self.num_nodes * self.num_processes
        self._tensor_parallel_size = 1
        super().setup_environment()
        destroy_gloo_group_at_exit()  # a finished rank must not abort in interpreter teardown
        check_same_config("QSDPStrategy", self.config_fingerprint(), timeout=presence_timeout(self._timeout))
        if self.config.has_auto and self.comm_state.trial is None:  # before a checkpoint restores its state
            self.comm_state.trial = new_trial(self.config, self.world_size, self.comm_state.step, "QSDPStrategy")

    def config_fingerprint(self) -> dict[str, Any]:
        """Everything that decides the FSDP groups and what their collectives send (compared across ranks at
        setup: codecs with equal payload sizes would otherwise decode each other's bytes as garbage)."""
        return {
            **config_fingerprint(self.config),
            "node_size": self._node_size,
            "save_distributed_checkpoint": self._save_distributed_checkpoint,
        }

    @property
    def dp_mesh(self):
        """The 1-D data-parallel mesh every FSDP group of this strategy shards over (explicit: docs/design.md)."""
        return self.device_mesh["data_parallel"]

    # ------------------------------------------------------------------ model setup
    @override
    def setup(self, trainer) -> None:
        from torch.distributed.fsdp import FSDPModule

        check_precision(str(self.precision_plugin.precision))  # before anything is sharded
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        sharded = any(isinstance(m, FSDPModule) for m in self.model.modules())
        if not sharded and is_overridden("configure_model", self.lightning_module):
            log.warning("QSDP: configure_model did not call fully_shard; sharding the model with the default policy")
        # the whole QSDP setup (also Fabric's and plain torch's); checked across ranks in setup_environment
        config, mesh = self.config, self.dp_mesh  # "auto" stays: the trial in comm_state sets each step's width
        if config.hsdp:  # shard inside a node, replicate across nodes (parallel.hsdp)
            if self._hsdp is None:
                self._hsdp = hsdp_mesh(config, self._node_size, self.num_processes, "QSDPStrategy", self._timeout)
            config, mesh = self._hsdp[0], self._hsdp[1] or mesh
        self._qsdp = apply_qsdp(
            self.model,
            mesh,
            config,
            comm_state=self.comm_state,
            background=self._background,
            owner=type(self).__name__,
            check_ranks=False,
        )
        self._root_is_group = isinstance(self.lightning_module, FSDPModule)
        self._warn_if_no_effect()
        _materialize_distributed_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _warn_if_no_effect(self) -> None:
        """Settings that change nothing are said once (Lightning's rank_zero_warn), naming the setting."""
        if not self._warned_no_effect and self._qsdp is not None:
            self._warned_no_effect = True
            module_name = type(self.lightning_module).__name__
            quantizes = self._qsdp.quantizes_any_param()
            message = no_effect_message(type(self).__name__, self.config, self.world_size, quantizes, module_name)
            if message is not None:
                rank_zero_warn(message)

    # ------------------------------------------------------------------ steps
    def _step(self, method: str, context, *args: Any, **kwargs: Any) -> Any:
        """When the LightningModule is an FSDP group (it holds parameters), call ``method`` through its forward,
        which is where FSDP2 gathers a group (the redirection Lightning's FSDP strategy uses)."""
        with context():
            if not self._root_is_group:
                return getattr(self.lightning_module, method)(*args, **kwargs)
            self._in_root_step = True
            try:
                return self._forward_redirection(self.model, self.lightning_module, method, *args, **kwargs)
            finally:
                self._in_root_step = False

    def _regather_root(self) -> None:
        """Manual optimization runs backward and optimizer steps inside ``training_step``, i.e. inside the
        root group's forward; FSDP2 reshards the root group at the end of every backward. Gather it again
        (after a step: the new weights) so the rest of the step reads the LightningModule's own parameters
        as DDP would, with the flags ``toggle_optimizer`` set."""
        if self._root_is_group and self._in_root_step:
            self.lightning_module.reshard()  # after a step the gathered copy is stale; unshard alone keeps it
            self.lightning_module.unshard()
            sync_unsharded_requires_grad(self.lightning_module)

    @override
    def backward(self, closure_loss, optimizer, *args: Any, **kwargs: Any) -> Any:
        out = super().backward(closure_loss, optimizer, *args, **kwargs)
        self._regather_root()
        return out

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("training_step", self.precision_plugin.train_step_context, *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("validation_step", self.precision_plugin.val_step_context, *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("test_step", self.precision_plugin.test_step_context, *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("predict_step", self.precision_plugin.predict_step_context, *args, **kwargs)

    @override
    def teardown(self) -> None:
        self._background.close()
        super().teardown()

    # ------------------------------------------------------------------ per-step logic
    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        closure = self.nonfinite.wrap(closure, optimizer, self.comm_state.step)
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._qsdp is not None:
            self._qsdp.after_step()  # master projection (quantize_master), then the RNG step
        else:
            self.comm_state.step += 1
        self._regather_root()
        return out

    def _all_ranks_finite(self, flag: Tensor) -> Tensor:
        return max_over_ranks_tensor(flag, self.dp_mesh.get_group(), device=self.root_device)

    # ------------------------------------------------------------------ checkpoints
    @property
    def topology(self) -> list[int] | None:
        """``[num_nodes, node_size]`` this strategy shards over with ``hsdp`` (None: flat QSDP, also when hsdp
        found no second level)."""
        return None if self._hsdp is None else mesh_topology(self._hsdp[1])

    def qsdp_state_dict(self) -> dict[str, Any]:
        """What continuing training needs besides weights and optimizer (``parallel.qsdp_state.run_state``)."""
        return run_state(self.comm_state, self.world_size, self.topology)

    def load_qsdp_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the RNG step; another layout or seed is warned (``parallel.qsdp_state.load_run_state``)."""
        load_run_state(type(self).__name__, self.comm_state, state, self.world_size, self.topology, rank_zero_warn)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        """A sharded save is atomic (``qsdp_checkpoint.save_sharded_checkpoint``); a full one is Lightning's."""
        checkpoint[CHECKPOINT_KEY] = self.qsdp_state_dict()
        if not self._save_distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint(..., storage_options=...) is not supported")
        save_sharded_checkpoint(self, checkpoint, Path(self.broadcast(filepath)))
        return None

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))
        if path.is_dir():
            check_sharded_checkpoint(path)
        elif not path.exists():
            raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist{missing_checkpoint_hint(path)}")
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        state = checkpoint.pop(CHECKPOINT_KEY, None)
        if state is not None:
            self.load_qsdp_state_dict(state)
        else:
            log.warning(
                "QSDP: checkpoint %s has no %r entry; the RNG step starts at 0", checkpoint_path, CHECKPOINT_KEY
            )
        return checkpoint

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register "qsdp", "qsdp_w8g8", "qsdp_w4g4" (``presets.QSDP_PRESETS``; names already present are kept)."""
        register_presets(strategy_registry, cls, QSDP_PRESETS)


def register_qsdp_strategies(registry: Any) -> None:
    """Register the QSDP names with ``QSDPStrategy`` in a Lightning ``StrategyRegistry`` (idempotent)."""
    QSDPStrategy.register_strategies(registry)
