"""QSDPStrategy: FSDP2 with quantized weight all-gather and gradient reduce-scatter (docs/design.md, "QSDP").

Lightning glue only: this file validates the user's choices, shards the model with FSDP2 (``fully_shard``
on a 1-D data-parallel device mesh) when the LightningModule does not do it in ``configure_model``,
installs the quantized comms of ``lightning_qcomm.comm.fsdp`` on every ``FSDPModule``, advances the
QSDP RNG step once per optimizer step, optionally projects the sharded master weights onto the
quantization lattice after each step, and saves / restores the RNG step in checkpoints (the files:
``qsdp_checkpoint``; arguments and presets: ``qsdp_config``; the grouping: ``qsdp_sharding``).

    Trainer(strategy=QSDPStrategy(bits=8))                     # weights and gradients at 8 bits
    Trainer(strategy=QSDPStrategy(weight_bits=8, grad_bits=4)) # or strategy="qsdp" / "qsdp_w8g8" / "qsdp_w4g4"

Bit widths: ``bits`` sets both widths; ``weight_bits`` / ``grad_bits`` override one each. A width of 32
means "unquantized" (the comm still runs through the adapter and the ledger). Codec names are those of
``lightning_qcomm.codecs.CODEC_NAMES`` or ``"none"`` (unquantized).

Auto-sharding (no ``configure_model`` calling ``fully_shard``): ``qsdp_sharding.plan_fsdp_groups``
(``layer_classes`` or ``nn.ModuleList`` elements, else a ``min_wrap_numel`` size policy; then the
LightningModule's children; then the LightningModule itself for parameters it holds or that are tied across
children). When the LightningModule is an FSDP group itself, every ``*_step`` runs through its forward so
FSDP2 gathers it. A user's ``configure_model`` that calls ``fully_shard`` keeps its grouping and still gets
the quantized comms. Setup is idempotent: fit -> validate -> test -> predict, or a new Trainer, take an
already sharded module as it is and install this strategy's comms on it.
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
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_qcomm._checks import check_bool, check_int, check_timeout
from lightning_qcomm.comm.comm_worker import CommWorker, dedicated_group
from lightning_qcomm.comm.consistency import check_same_config, presence_timeout
from lightning_qcomm.comm.fsdp import (
    QSDPCommConfig,
    QSDPCommState,
    check_torch_fsdp_api,
    fsdp_param_shards,
    install_qsdp_comms,
    is_quantized_param,
    project_master_weights,
    sync_unsharded_requires_grad,
)
from lightning_qcomm.comm.nonfinite import NonFiniteGuard
from lightning_qcomm.comm.onebit import max_over_ranks
from lightning_qcomm.comm.process_group import destroy_gloo_group_at_exit
from lightning_qcomm.strategies.qsdp_checkpoint import (
    FullStateLauncher,
    check_sharded_checkpoint,
    missing_checkpoint_hint,
    save_sharded_checkpoint,
)
from lightning_qcomm.strategies.qsdp_config import (
    DEFAULT_MIN_WRAP_NUMEL,
    START_METHODS,
    build_codec,
    check_precision,
    no_effect_message,
    register_presets,
    resolve_bits,
)
from lightning_qcomm.strategies.qsdp_sharding import plan_fsdp_groups

log = logging.getLogger(__name__)

CHECKPOINT_KEY = "qsdp"


class QSDPStrategy(ModelParallelStrategy):
    """Fully sharded data parallel (FSDP2) whose weight all-gather and gradient reduce-scatter are quantized.

    Args:
        bits: sets both ``weight_bits`` and ``grad_bits`` (the one-argument form ``QSDPStrategy(bits=8)``).
        weight_bits: bits of the weight all-gather codes (codec range, e.g. uniform 1..8; 32 = unquantized).
        grad_bits: bits of the gradient reduce-scatter codes (same rule).
        bucket_size: elements per scale bucket of both codecs.
        weight_codec / grad_codec: codec names (``CODEC_NAMES`` or ``"none"``); default min-max stochastic
            rounding (unbiased).
        min_quant_numel: parameters with fewer elements, and all 1-D parameters (norms, biases), travel raw.
        quantize_master: project the sharded fp32 master weights onto the weight codec's lattice after each
            optimizer step (the variant QSDP's convergence proof analyses).
        seed: user seed folded with (step, FSDP group, rank) into every codec seed.
        layer_classes: comma-separated module class names to shard as separate FSDP groups when the model has
            no ``configure_model``; None picks every element of an ``nn.ModuleList`` that has parameters.
        min_wrap_numel: when neither ``layer_classes`` nor a ``ModuleList`` gives groups, a module whose
            parameters not taken by an inner group number at least this many elements becomes a group
            (FSDP1's ``size_based_auto_wrap_policy``). See ``qsdp_sharding`` for the whole policy.
        reshard_after_forward: FSDP2's option for the groups this strategy creates; None is FSDP2's default
            (reshard every group but the root, which the backward needs first).
        overlap_comm: on CPU (gloo), run the weight all-gathers on a background thread over a process group
            of their own, and have each FSDP group prefetch the next one's weights in forward (FSDP2 already
            prefetches in backward), so transfers overlap compute. Bit-identical to the inline path. CUDA
            runs inline (FSDP2's streams overlap there).
        nonfinite: a step with a NaN/Inf gradient on any rank is ``"skip"``-ped on every rank (logged, counted
            in ``nonfinite.skipped``; one 8-byte all-reduce per step), ``"raise"``-s FloatingPointError, or
            ``"propagate"``-s (see ``strategies.nonfinite``).
        save_distributed_checkpoint: True saves one shard per rank (a folder, replaced atomically, see
            ``qsdp_checkpoint``; ``python -m lightning_qcomm.consolidate IN OUT`` makes it one file for
            ``load_from_checkpoint``), False a full state dict in one file, gathered on rank 0 at each save.
        start_method: "popen" (re-run the script per rank, like ``ModelParallelStrategy``) or a
            multiprocessing start method ("spawn", "fork", "forkserver").
        process_group_backend / timeout: as in ``ModelParallelStrategy``.
    """

    strategy_name = "qsdp"

    def __init__(
        self,
        bits: int | None = None,
        weight_bits: int | None = None,
        grad_bits: int | None = None,
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
        save_distributed_checkpoint: bool = True,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        check_bool("QSDPStrategy", "quantize_master", quantize_master)
        check_bool("QSDPStrategy", "save_distributed_checkpoint", save_distributed_checkpoint)
        check_int("QSDPStrategy", "seed", seed, minimum=0)
        check_timeout("QSDPStrategy", timeout)
        super().__init__(
            data_parallel_size="auto",
            tensor_parallel_size="auto",
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        for arg, val in (("bits", bits), ("weight_bits", weight_bits), ("grad_bits", grad_bits)):
            if val is not None and (not isinstance(val, int) or isinstance(val, bool)):
                raise TypeError(f"{arg} must be an int or None, got {type(val).__name__}")
        if not isinstance(bucket_size, int) or isinstance(bucket_size, bool) or bucket_size < 1:
            raise ValueError(f"bucket_size must be an int >= 1, got {bucket_size!r}")
        for arg, val in (("min_quant_numel", min_quant_numel), ("min_wrap_numel", min_wrap_numel)):
            if not isinstance(val, int) or isinstance(val, bool):
                raise TypeError(f"{arg} must be an int, got {type(val).__name__}")
            if val < 0:
                raise ValueError(f"{arg} must be an int >= 0, got {val!r}")
        if start_method not in START_METHODS:
            raise ValueError(f"start_method={start_method!r} is not allowed; allowed: {', '.join(START_METHODS)}")
        if layer_classes is not None and not isinstance(layer_classes, str):
            raise TypeError(f"layer_classes must be a comma-separated str or None, got {type(layer_classes).__name__}")
        self.weight_bits = resolve_bits(bits, weight_bits)
        self.grad_bits = resolve_bits(bits, grad_bits)
        self.bucket_size = bucket_size
        self.weight_codec_name = weight_codec
        self.grad_codec_name = grad_codec
        self.weight_codec = build_codec("weight_bits", self.weight_bits, "weight_codec", weight_codec, bucket_size)
        self.grad_codec = build_codec("grad_bits", self.grad_bits, "grad_codec", grad_codec, bucket_size)
        self.min_quant_numel = min_quant_numel
        self.quantize_master = bool(quantize_master)
        if self.quantize_master and self.weight_codec is None:
            raise ValueError("quantize_master=True needs a quantized weight codec (weight_bits < 32, codec not 'none')")
        self.seed = int(seed)
        self.layer_classes = (
            None if layer_classes is None else {c.strip() for c in layer_classes.split(",") if c.strip()}
        )
        if self.layer_classes is not None and not self.layer_classes:
            raise ValueError(f"layer_classes={layer_classes!r} names no class")
        self.min_wrap_numel = min_wrap_numel
        if reshard_after_forward is not None and not isinstance(reshard_after_forward, bool):
            raise TypeError(f"reshard_after_forward must be a bool or None, got {type(reshard_after_forward).__name__}")
        self.reshard_after_forward = reshard_after_forward
        if not isinstance(overlap_comm, bool):
            raise TypeError(f"overlap_comm must be a bool, got {type(overlap_comm).__name__}")
        self.overlap_comm = overlap_comm
        # gradient shards differ per rank: agree on "all finite" (one 8-byte all-reduce per step)
        self.nonfinite = NonFiniteGuard(nonfinite, "QSDPStrategy", agree=self._all_ranks_finite)
        self._comm_worker: CommWorker | None = None
        self._worker_group = None  # created once, reused by every later stage of this strategy
        self._start_method = start_method
        self.comm_state = QSDPCommState(seed=self.seed, step=0)
        self._fsdp_modules: list[nn.Module] = []
        self._root_is_group = False
        self._in_root_step = False
        self._warned_no_effect = False

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

    def config_fingerprint(self) -> dict[str, Any]:
        """Everything that decides the FSDP groups and what their collectives send (compared across ranks at
        setup: codecs with equal payload sizes would otherwise decode each other's bytes as garbage)."""
        return {
            "weight_codec": None if self.weight_codec is None else self.weight_codec.config(),
            "grad_codec": None if self.grad_codec is None else self.grad_codec.config(),
            "min_quant_numel": self.min_quant_numel,
            "quantize_master": self.quantize_master,
            "seed": self.seed,
            "layer_classes": None if self.layer_classes is None else sorted(self.layer_classes),
            "min_wrap_numel": self.min_wrap_numel,
            "reshard_after_forward": self.reshard_after_forward,
            "overlap_comm": self.overlap_comm,
            "nonfinite": self.nonfinite.policy,
            "save_distributed_checkpoint": self._save_distributed_checkpoint,
        }

    @property
    def dp_mesh(self):
        """The 1-D data-parallel mesh every FSDP group of this strategy shards over (explicit: docs/design.md)."""
        return self.device_mesh["data_parallel"]

    # ------------------------------------------------------------------ model setup
    @override
    def setup(self, trainer) -> None:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

        check_precision(str(self.precision_plugin.precision))  # before anything is sharded
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        check_torch_fsdp_api()
        if any(isinstance(m, FullyShardedDataParallel) for m in self.model.modules()):
            raise TypeError(f"{type(self).__name__} supports FSDP2 (fully_shard) only; found FSDP1-wrapped modules")
        if not any(p.numel() > 0 for p in self.model.parameters()):
            raise ValueError(
                f"{type(self).__name__}: the LightningModule {type(self.lightning_module).__name__} has no parameters"
                " to shard"
            )
        fsdp_modules = [m for m in self.model.modules() if isinstance(m, FSDPModule)]
        if not fsdp_modules:
            if is_overridden("configure_model", self.lightning_module):
                log.warning(
                    "QSDP: configure_model did not call fully_shard; sharding the model with the default policy"
                )
            self._auto_shard(self.model)
        else:
            # sharded before (configure_model, an earlier stage or Trainer): take it as it is; a group left
            # gathered by its last forward (FSDP2 keeps the root's) goes back to its shards first
            for m in fsdp_modules:
                m.reshard()
        self._check_all_sharded(self.model)
        self._root_is_group = isinstance(self.lightning_module, FSDPModule)
        worker, worker_group = None, None
        if self.overlap_comm and self.root_device.type == "cpu":
            if self._worker_group is None:
                self._worker_group = dedicated_group(self.dp_mesh.get_group(), timeout=self._timeout)
            self._comm_worker = worker = CommWorker("lightning_qcomm-qsdp")
            worker_group = self._worker_group
        self._fsdp_modules = install_qsdp_comms(
            self.model,
            QSDPCommConfig(self.weight_codec, self.grad_codec, self.min_quant_numel),
            self.comm_state,
            worker=worker,
            worker_group=worker_group,
        )
        self._warn_if_no_effect()
        if worker is not None:
            self._chain_forward_prefetch(self._fsdp_modules)
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
        if not self._warned_no_effect:
            self._warned_no_effect = True
            shards = [p for m in self._fsdp_modules for p in fsdp_param_shards(m)]
            message = no_effect_message(self, any(is_quantized_param(p, self.min_quant_numel) for p in shards))
            if message is not None:
                rank_zero_warn(message)

    @staticmethod
    def _chain_forward_prefetch(fsdp_modules: list[nn.Module]) -> None:
        """Within each FSDP root's tree, in registration order (the root's group, then its layers), group i
        issues group i+1's all-gather before its own compute. Trees are not linked to each other: every FSDP
        root has its own communication context, set up in its own first forward. A wrong order would only
        prefetch early."""
        roots = [m for m in fsdp_modules if not any(o is not m and m in set(o.modules()) for o in fsdp_modules)]
        for root in roots:
            members = set(root.modules())
            tree = [m for m in fsdp_modules if m in members]
            for cur, nxt in zip(tree, tree[1:]):
                cur.set_modules_to_forward_prefetch([nxt])

    def _check_all_sharded(self, root: nn.Module) -> None:
        """Trainable parameters outside every FSDP group would never have their gradients synchronized."""
        from torch.distributed.tensor import DTensor

        loose = [n for n, p in root.named_parameters() if p.requires_grad and not isinstance(p, DTensor)]
        if loose:
            raise ValueError(
                f"{type(self).__name__}: trainable parameters {loose[:8]}{' ...' if len(loose) > 8 else ''} are not"
                " sharded by fully_shard (configure_model must also shard the module that holds them, e.g. the root)"
            )

    def _auto_shard(self, root: nn.Module) -> None:
        """``fully_shard`` every module of ``plan_fsdp_groups`` (inner first, the root last if it keeps params)."""
        from torch.distributed.fsdp import fully_shard

        for m in plan_fsdp_groups(root, self.layer_classes, self.min_wrap_numel):
            fully_shard(m, mesh=self.dp_mesh, reshard_after_forward=self.reshard_after_forward)

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
        if self._comm_worker is not None:
            self._comm_worker.close()
            self._comm_worker = None
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
        if self.quantize_master:
            project_master_weights(self._fsdp_modules, self.weight_codec, self.comm_state, self.min_quant_numel)
        self.comm_state.step += 1
        self._regather_root()
        return out

    def _all_ranks_finite(self, finite: bool) -> bool:
        return max_over_ranks(0.0 if finite else 1.0, self.dp_mesh.get_group(), device=self.root_device) == 0.0

    # ------------------------------------------------------------------ checkpoints
    def qsdp_state_dict(self) -> dict[str, Any]:
        """What continuing training needs besides weights and optimizer: the RNG step (identical on all ranks)."""
        return {"rng_step": self.comm_state.step, "seed": self.comm_state.seed}

    def load_qsdp_state_dict(self, state: Mapping[str, Any]) -> None:
        self.comm_state.step = int(state["rng_step"])
        if int(state.get("seed", self.seed)) != self.seed:
            log.warning("QSDP: checkpoint seed %s differs from this strategy's seed %s", state["seed"], self.seed)

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
    def register_strategies(cls, strategy_registry: Any) -> None:
        register_qsdp_strategies(strategy_registry)


def register_qsdp_strategies(registry: Any) -> None:
    """Register "qsdp", "qsdp_w8g8", "qsdp_w4g4" (skipping names already present, so it is idempotent)."""
    register_presets(registry, QSDPStrategy)
