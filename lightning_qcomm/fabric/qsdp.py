"""QSDPFabricStrategy: QSDP under Lightning Fabric (Lightning layer; docs/design.md, "QSDP").

Fabric's ``ModelParallelStrategy`` with ``parallelize_fn = apply_qsdp`` on a 1-D data-parallel mesh over all
processes: ``fabric.setup_module(model)`` shards the model and installs the quantized comms (a model the user
already sharded with ``fully_shard`` keeps its grouping); every ``optimizer.step()`` through Fabric applies
the non-finite policy, then advances the RNG step; ``fabric.save`` stores the RNG step with the checkpoint
(``state["qsdp"]``, the same on every rank) and ``fabric.load`` restores it. As with Fabric's own
``ModelParallelStrategy``, make the optimizer after ``setup_module`` (it must hold the sharded parameters).
A width of ``"auto"`` is chosen by timed trial steps (``comm.auto_trial``, ``self.comm_state.trial``: one trial
for every model this strategy sets up), logged once, saved with ``fabric.save``.

Example::

    fabric = Fabric(accelerator="cpu", devices=2, strategy=QSDPFabricStrategy(bits=8))   # or strategy="qsdp"
    # or QSDPFabricStrategy(weight_bits="auto", grad_bits="auto", min_bits=4): chosen by the first steps
    fabric.launch()
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3))
    fabric.save("ckpt", {"model": model, "optimizer": optimizer})
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import ModelParallelStrategy
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import nn
from typing_extensions import override

from lightning_qcomm._checks import check_bool, check_timeout
from lightning_qcomm.adapters.fsdp2.comms import QSDPCommState
from lightning_qcomm.comm.comm_worker import BackgroundComm
from lightning_qcomm.fabric._base import QCommFabricStrategy, config_from
from lightning_qcomm.parallel.hsdp import hsdp_mesh, mesh_topology
from lightning_qcomm.parallel.qsdp import QSDPHandle, apply_qsdp, config_fingerprint, new_trial
from lightning_qcomm.parallel.qsdp_config import QSDPConfig
from lightning_qcomm.parallel.qsdp_state import load_run_state, run_state
from lightning_qcomm.strategies.presets import QSDP_PRESETS
from lightning_qcomm.strategies.qsdp_checks import no_effect_message


class QSDPFabricStrategy(QCommFabricStrategy, ModelParallelStrategy):
    """Fabric strategy: FSDP2 with quantized weight all-gather and gradient reduce-scatter.

    Args:
        config: a ``parallel.QSDPConfig``; or, instead, its fields as keyword arguments (``bits=8``, the
            arguments of ``QSDPStrategy``, the Trainer's class).
        save_distributed_checkpoint, process_group_backend, timeout: Fabric's ``ModelParallelStrategy``'s.

    Example::

        fabric = Fabric(accelerator="cpu", devices=2, strategy=QSDPFabricStrategy(bits=8))
    """

    checkpoint_key = "qsdp"
    presets = QSDP_PRESETS

    def __init__(
        self,
        config: QSDPConfig | None = None,
        *,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        **config_fields: Any,
    ) -> None:
        owner = type(self).__name__
        self.config: QSDPConfig = config_from(owner, QSDPConfig, config, config_fields)[0]
        if config_fields:
            raise TypeError(f"{owner} got unexpected keyword arguments {sorted(config_fields)}")
        check_bool(owner, "save_distributed_checkpoint", save_distributed_checkpoint)
        check_timeout(owner, timeout)
        super().__init__(
            parallelize_fn=self._parallelize,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.comm_state = QSDPCommState(seed=self.config.seed, step=0)
        self.qsdp: QSDPHandle | None = None  # set by setup_module
        self._hsdp: tuple[QSDPConfig, Any] | None = None  # (config, 2-D mesh) once resolved
        self._background = BackgroundComm("lightning_qcomm-qsdp", timeout=timeout)

    @override
    def setup_environment(self) -> None:
        # 1-D data parallelism over all processes: mesh (world, 1) named ("data_parallel", "tensor_parallel")
        self._data_parallel_size = self.num_nodes * self.num_processes
        self._tensor_parallel_size = 1
        super().setup_environment()
        if self.config.has_auto and self.comm_state.trial is None:
            self.comm_state.trial = new_trial(self.config, self.world_size, self.comm_state.step, type(self).__name__)

    @override
    def config_fingerprint(self) -> dict[str, Any]:
        return {**config_fingerprint(self.config), "save_distributed_checkpoint": self._save_distributed_checkpoint}

    def _parallelize(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        """Fabric's ``parallelize_fn``: the whole QSDP setup is ``apply_qsdp`` (with ``hsdp``, on the 2-D mesh of
        this job's nodes: ranks per node = Fabric's devices, or ``LOCAL_WORLD_SIZE``)."""
        config, mesh = self.config, device_mesh["data_parallel"]
        if config.hsdp:
            if self._hsdp is None:
                self._hsdp = hsdp_mesh(config, None, self.num_processes, type(self).__name__, self._timeout)
            config, mesh = self._hsdp[0], self._hsdp[1] or mesh
        self.qsdp = apply_qsdp(
            module,
            mesh,
            config,
            comm_state=self.comm_state,
            background=self._background,
            owner=type(self).__name__,
            check_ranks=False,  # done in setup_environment, with the checkpoint form
        )
        quantizes = self.qsdp.quantizes_any_param()
        message = no_effect_message(type(self).__name__, self.config, self.world_size, quantizes, type(module).__name__)
        if message is not None:
            rank_zero_warn(message)
        return module

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        if self.qsdp is None:
            return super().optimizer_step(optimizer, **kwargs)
        self.qsdp.before_step(optimizer)  # non-finite gradient shards: the ranks agree, then skip or raise
        out = super().optimizer_step(optimizer, **kwargs)
        self.qsdp.after_step()
        return out

    @property
    def topology(self) -> list[int] | None:
        """``[num_nodes, node_size]`` of ``hsdp`` (None: flat QSDP)."""
        return None if self._hsdp is None else mesh_topology(self._hsdp[1])

    @override
    def checkpoint_entry(self, state: dict[str, Any]) -> tuple[dict[str, Any], None]:
        return run_state(self.comm_state, self.world_size, self.topology), None  # the same on every rank

    @override
    def restore_entry(self, entry: dict[str, Any] | None, state: dict[str, Any], own: Any = None) -> None:
        if entry is None:
            rank_zero_warn(f"{type(self).__name__}: the checkpoint has no 'qsdp' entry; the RNG step stays")
            return
        load_run_state(type(self).__name__, self.comm_state, entry, self.world_size, self.topology, rank_zero_warn)


__all__ = ["QSDPFabricStrategy"]
