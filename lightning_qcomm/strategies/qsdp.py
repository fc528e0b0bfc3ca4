"""QSDPStrategy: FSDP2 with quantized weight all-gather and gradient reduce-scatter (docs/design.md, "QSDP").

Lightning glue only: this file validates the user's choices, shards the model with FSDP2 (``fully_shard``
on a 1-D data-parallel device mesh) when the LightningModule does not do it in ``configure_model``,
installs the quantized comms of ``lightning_qcomm.comm.fsdp`` on every ``FSDPModule``, advances the
QSDP RNG step once per optimizer step, optionally projects the sharded master weights onto the
quantization lattice after each step, and saves / restores the RNG step in checkpoints.

    Trainer(strategy=QSDPStrategy(bits=8))                     # weights and gradients at 8 bits
    Trainer(strategy=QSDPStrategy(weight_bits=8, grad_bits=4)) # or strategy="qsdp" / "qsdp_w8g8" / "qsdp_w4g4"

Bit widths: ``bits`` sets both widths; ``weight_bits`` / ``grad_bits`` override one each. A width of 32
means "unquantized" (the comm still runs through the adapter and the ledger). Codec names are those of
``lightning_qcomm.codecs.CODEC_NAMES`` or ``"none"`` (unquantized).

Auto-sharding (no ``configure_model``): every module whose class name is in ``layer_classes`` (comma
separated), or by default every element of an ``nn.ModuleList`` that has parameters (transformer blocks),
is its own FSDP group, innermost first; then each direct child of the LightningModule that still holds
unsharded parameters becomes a root group. A user's ``configure_model`` that calls ``fully_shard`` itself
keeps its grouping and still gets the quantized comms.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, Literal

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn
from torch.optim import Optimizer

from lightning_qcomm.codecs import CODEC_NAMES, Codec, get_codec
from lightning_qcomm.comm.comm_worker import CommWorker, dedicated_group
from lightning_qcomm.comm.fsdp import (
    QSDPCommConfig,
    QSDPCommState,
    install_qsdp_comms,
    project_master_weights,
)
from lightning_qcomm.comm.process_group import destroy_gloo_group_at_exit

log = logging.getLogger(__name__)

UNQUANTIZED_BITS = 32
CODEC_CHOICES = (*CODEC_NAMES, "none")
START_METHODS = ("popen", "spawn", "fork", "forkserver")
CHECKPOINT_KEY = "qsdp"

# name -> (description, init kwargs)
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "qsdp": ("QSDP: FSDP2 with 8-bit quantized weights and gradients", {}),
    "qsdp_w8g8": ("QSDP: FSDP2 with 8-bit weight all-gather and 8-bit gradient reduce-scatter", {"bits": 8}),
    "qsdp_w4g4": ("QSDP: FSDP2 with 4-bit weight all-gather and 4-bit gradient reduce-scatter", {"bits": 4}),
}


def _build_codec(arg_bits: str, bits: int, arg_codec: str, name: str, bucket_size: int) -> Codec | None:
    """The codec for one direction, or None when it travels unquantized."""
    if not isinstance(name, str) or name.lower() not in CODEC_CHOICES:
        raise ValueError(f"{arg_codec}={name!r} is not a known codec; allowed: {', '.join(CODEC_CHOICES)}")
    if not isinstance(bits, int) or isinstance(bits, bool):
        raise TypeError(f"{arg_bits} must be an int, got {type(bits).__name__}")
    if name.lower() == "none" or bits == UNQUANTIZED_BITS:
        return None
    try:
        return get_codec(name.lower(), bits=bits, bucket_size=bucket_size)
    except ValueError as err:
        raise ValueError(
            f"{arg_bits}={bits} is not valid for {arg_codec}={name!r} ({err}); use {UNQUANTIZED_BITS} for unquantized"
        ) from None


def _resolve_bits(bits: int | None, specific: int | None, default: int = 8) -> int:
    if specific is not None:
        return specific
    return default if bits is None else bits


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
        reshard_after_forward: FSDP2's option for the groups this strategy creates; None is FSDP2's default
            (reshard every group but the root, which the backward needs first).
        overlap_comm: on CPU (gloo), run the weight all-gathers on a background thread over a process group
            of their own, and have each FSDP group prefetch the next one's weights in forward (FSDP2 already
            prefetches in backward), so transfers overlap compute. Bit-identical to the inline path. CUDA
            runs inline (FSDP2's streams overlap there).
        save_distributed_checkpoint: True saves one shard per rank (a folder), False a full state dict.
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
        reshard_after_forward: bool | None = None,
        overlap_comm: bool = True,
        save_distributed_checkpoint: bool = True,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
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
        if not isinstance(min_quant_numel, int) or isinstance(min_quant_numel, bool) or min_quant_numel < 0:
            raise ValueError(f"min_quant_numel must be an int >= 0, got {min_quant_numel!r}")
        if start_method not in START_METHODS:
            raise ValueError(f"start_method={start_method!r} is not allowed; allowed: {', '.join(START_METHODS)}")
        if layer_classes is not None and not isinstance(layer_classes, str):
            raise TypeError(f"layer_classes must be a comma-separated str or None, got {type(layer_classes).__name__}")
        self.weight_bits = _resolve_bits(bits, weight_bits)
        self.grad_bits = _resolve_bits(bits, grad_bits)
        self.bucket_size = bucket_size
        self.weight_codec_name = weight_codec
        self.grad_codec_name = grad_codec
        self.weight_codec = _build_codec("weight_bits", self.weight_bits, "weight_codec", weight_codec, bucket_size)
        self.grad_codec = _build_codec("grad_bits", self.grad_bits, "grad_codec", grad_codec, bucket_size)
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
        if reshard_after_forward is not None and not isinstance(reshard_after_forward, bool):
            raise TypeError(f"reshard_after_forward must be a bool or None, got {type(reshard_after_forward).__name__}")
        self.reshard_after_forward = reshard_after_forward
        if not isinstance(overlap_comm, bool):
            raise TypeError(f"overlap_comm must be a bool, got {type(overlap_comm).__name__}")
        self.overlap_comm = overlap_comm
        self._comm_worker: CommWorker | None = None
        self._start_method = start_method
        self.comm_state = QSDPCommState(seed=self.seed, step=0)
        self._fsdp_modules: list[nn.Module] = []

    # ------------------------------------------------------------------ processes and mesh
    def _configure_launcher(self) -> None:
        if self._start_method == "popen":
            super()._configure_launcher()
        else:
            self._launcher = _FullStateLauncher(self, start_method=self._start_method)

    def setup_environment(self) -> None:
        # 1-D data parallelism over all processes: mesh (world, 1) named ("data_parallel", "tensor_parallel").
        self._data_parallel_size = self.num_nodes * self.num_processes
        self._tensor_parallel_size = 1
        super().setup_environment()
        destroy_gloo_group_at_exit()  # a finished rank must not abort in interpreter teardown

    @property
    def dp_mesh(self):
        """The 1-D data-parallel mesh every FSDP group of this strategy shards over (explicit: docs/design.md)."""
        return self.device_mesh["data_parallel"]

    # ------------------------------------------------------------------ model setup
    def setup(self, trainer) -> None:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        if any(isinstance(m, FullyShardedDataParallel) for m in self.model.modules()):
            raise TypeError(f"{type(self).__name__} supports FSDP2 (fully_shard) only; found FSDP1-wrapped modules")
        if not any(p.numel() > 0 for p in self.model.parameters()):
            raise ValueError(
                f"{type(self).__name__}: the LightningModule {type(self.lightning_module).__name__} has no parameters"
                " to shard"
            )
        if not any(isinstance(m, FSDPModule) for m in self.model.modules()):
            if is_overridden("configure_model", self.lightning_module):
                log.warning(
                    "QSDP: configure_model did not call fully_shard; sharding the model with the default policy"
                )
            self._auto_shard(self.model)
        self._check_all_sharded(self.model)
        worker, worker_group = None, None
        if self.overlap_comm and self.root_device.type == "cpu":
            self._comm_worker = worker = CommWorker("lightning_qcomm-qsdp")
            worker_group = dedicated_group(self.dp_mesh.get_group())
        self._fsdp_modules = install_qsdp_comms(
            self.model,
            QSDPCommConfig(self.weight_codec, self.grad_codec, self.min_quant_numel),
            self.comm_state,
            worker=worker,
            worker_group=worker_group,
        )
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

    def _wrap_targets(self, root: nn.Module) -> list[nn.Module]:
        if self.layer_classes is not None:
            found = {type(m).__name__ for m in root.modules()}
            missing = self.layer_classes - found
            if missing:
                raise ValueError(
                    f"layer_classes names {sorted(missing)} that are not in the model; module classes present: "
                    f"{sorted(found)}"
                )
            return [m for m in root.modules() if m is not root and type(m).__name__ in self.layer_classes]
        targets = []
        for m in root.modules():
            if isinstance(m, nn.ModuleList):
                targets.extend(c for c in m if any(True for _ in c.parameters()))
        return targets

    def _auto_shard(self, root: nn.Module) -> None:
        """FSDP2 groups: the layer targets (innermost first), then each direct child of ``root`` with params left."""
        from torch.distributed.fsdp import FSDPModule, fully_shard

        mesh = self.dp_mesh
        own = [n for n, _ in root.named_parameters(recurse=False)]
        if own:
            raise ValueError(
                f"{type(self).__name__} cannot auto-shard parameters held directly by the LightningModule ({own}):"
                " move them into a submodule, or shard in configure_model with fully_shard"
            )
        depth = {m: n.count(".") for n, m in root.named_modules()}
        for m in sorted(self._wrap_targets(root), key=lambda m: -depth[m]):
            if not isinstance(m, FSDPModule):
                fully_shard(m, mesh=mesh, reshard_after_forward=self.reshard_after_forward)
        sharded = {id(p) for m in root.modules() if isinstance(m, FSDPModule) for p in m.parameters()}
        for child in root.children():
            if isinstance(child, FSDPModule):
                continue
            if any(id(p) not in sharded for p in child.parameters()):
                fully_shard(child, mesh=mesh, reshard_after_forward=self.reshard_after_forward)

    def teardown(self) -> None:
        if self._comm_worker is not None:
            self._comm_worker.close()
            self._comm_worker = None
        super().teardown()

    # ------------------------------------------------------------------ per-step logic
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.quantize_master:
            project_master_weights(self._fsdp_modules, self.weight_codec, self.comm_state, self.min_quant_numel)
        self.comm_state.step += 1
        return out

    # ------------------------------------------------------------------ checkpoints
    def qsdp_state_dict(self) -> dict[str, Any]:
        """What continuing training needs besides weights and optimizer: the RNG step (identical on all ranks)."""
        return {"rng_step": self.comm_state.step, "seed": self.comm_state.seed}

    def load_qsdp_state_dict(self, state: Mapping[str, Any]) -> None:
        self.comm_state.step = int(state["rng_step"])
        if int(state.get("seed", self.seed)) != self.seed:
            log.warning("QSDP: checkpoint seed %s differs from this strategy's seed %s", state["seed"], self.seed)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        checkpoint[CHECKPOINT_KEY] = self.qsdp_state_dict()
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
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


class _FullStateLauncher(_MultiProcessingLauncher):
    """Multiprocessing launcher that hands the main process a *full* state dict: Lightning's default pickles
    ``state_dict()`` of the sharded module (DTensors), which the main process cannot load."""

    def _collect_rank_zero_results(self, trainer: Any, results: Any) -> Any:
        import os
        import tempfile

        from lightning.pytorch.strategies.launchers.multiprocessing import _WorkerOutput
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        cb = trainer.checkpoint_callback
        best_model_path = getattr(cb, "best_model_path", None) if cb else None
        full = get_model_state_dict(  # collective: every rank takes part
            trainer.lightning_module, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if self._strategy.local_rank != 0:
            return None
        weights_path = None
        if trainer.state.fn == TrainerFn.FITTING:
            weights_path = os.path.join(tempfile.mkdtemp(), ".temp.ckpt")
            self._strategy.checkpoint_io.save_checkpoint(full, weights_path)
        return _WorkerOutput(best_model_path, weights_path, trainer.state, results, self.get_extra_results(trainer))


def register_qsdp_strategies(registry: Any) -> None:
    """Register "qsdp", "qsdp_w8g8", "qsdp_w4g4" (skipping names already present, so it is idempotent)."""
    for name, (description, init_params) in PRESETS.items():
        if name not in registry:
            registry.register(name, QSDPStrategy, description=description, **init_params)
