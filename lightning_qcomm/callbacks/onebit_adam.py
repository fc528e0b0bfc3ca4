"""OneBitAdamCallback: 1-bit Adam for an existing Lightning project (Lightning layer; docs/design.md, "1-bit Adam").

At fit start the single Adam/AdamW optimizer is replaced by a ``OneBitAdam`` with the same param groups (LR
schedulers re-pointed, nested ones too; a user's ``OneBitAdam`` is kept and must agree with the callback's set
arguments). The gradient side is ``parallel.onebit_adam.OneBitAdamDDP``: an fp32 warm-up average through
``adapters.onebit.sync.onebit_adam_grad_hook`` (or the model's own hook), then DDP's gradient sync switched off
once the variance is frozen, the momentum travelling 1-bit. Each rank's 1-bit error buffers go to its side file
(``parallel.rank_files``); another world size or topology restarts them at zero (logged); the optimizer state is
kept. ``hierarchical=True``: exact inside a node, 1-bit across nodes.

Requirements (ValueError at setup otherwise): automatic optimization, exactly one optimizer, a DDP-wrapped model
when more than one process trains, no fp16 ``GradScaler``. The full rules: docs/design.md, "Module notes".

Example::

    Trainer(strategy="ddp", callbacks=[OneBitAdamCallback(freeze_step=100)])
"""

from __future__ import annotations

import dataclasses
import logging
from functools import wraps
from typing import Any
from weakref import ref

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.nn.parallel import DistributedDataParallel

from lightning_qcomm._checks import check_bool, check_int
from lightning_qcomm.adapters.onebit.sync import OneBitGradHookState
from lightning_qcomm.comm.consistency import check_same_config, presence_timeout
from lightning_qcomm.comm.process_group import destroy_gloo_group_at_exit
from lightning_qcomm.comm.topology import NodeGroups, Topology, hierarchical_topology, node_groups
from lightning_qcomm.optim.onebit_adam import OneBitAdam, OneBitAdamConfig
from lightning_qcomm.parallel import rank_files
from lightning_qcomm.parallel.onebit_adam import OneBitAdamDDP

log = logging.getLogger(__name__)

CHECKPOINT_KEY = "onebit_adam"
_UNHONOURED = ("foreach", "fused", "capturable", "differentiable")  # Adam group keys OneBitAdam does not implement


class OneBitAdamCallback(pl.Callback):
    """Train with 1-bit Adam: AdamW warm-up, then frozen variance and 1-bit momentum all-reduce.

    An argument left None means OneBitAdam's default, or the value of a OneBitAdam returned by
    ``configure_optimizers``.

    Args:
        freeze_step: warm-up optimizer steps (>= 1; default 100). Rule of thumb (DeepSpeed): 15-25% of training.
        auto_freeze_threshold: freeze earlier once the relative change of the bias-corrected variance
            over ``auto_freeze_interval`` steps stays below this (0 < τ < 1) for ``auto_freeze_patience``
            checks; ``freeze_step`` remains the upper bound. None: off.
        auto_freeze_interval: steps between auto-freeze checks (>= 1; default 10).
        auto_freeze_patience: consecutive checks below the threshold (>= 1; default 3).
        bucket_mb: size of one flat fused momentum bucket in MiB of fp32 (> 0; default 32).
        nonfinite: a step with a NaN/Inf gradient on any rank: "skip" (default; on every rank, logged and
            counted), "raise" (FloatingPointError) or "propagate".
        overlap: start each momentum bucket's 1-bit average during backward (default True). With
            ``accumulate_grad_batches`` > 1 or ``gradient_clip_val`` it runs after backward (logged once).
        scale_block: elements per 1-bit scale after the freeze (an int >= 8, or 0 for one scale per chunk; default
            OneBitAdam's, see ``OneBitAdamConfig``).
        variance_refresh: optimizer steps between two refreshes of the frozen variance after the freeze (an int >= 1,
            or 0 to keep it frozen; default OneBitAdam's, see ``OneBitAdamConfig``).
        hierarchical: 1-bit momentum only across nodes, exact inside a node (see the module doc).
        node_size: ranks per node for ``hierarchical`` (None: Lightning's devices per node).

    Example::

        Trainer(num_nodes=2, devices=8, strategy="ddp", callbacks=[OneBitAdamCallback(freeze_step=100, hierarchical=True)])
    """

    def __init__(
        self,
        freeze_step: int | None = None,
        auto_freeze_threshold: float | None = None,
        auto_freeze_interval: int | None = None,
        auto_freeze_patience: int | None = None,
        bucket_mb: float | None = None,
        nonfinite: str | None = None,
        overlap: bool | None = None,
        scale_block: int | None = None,
        variance_refresh: int | None = None,
        hierarchical: bool = False,
        node_size: int | None = None,
    ) -> None:
        self.hierarchical = check_bool("OneBitAdamCallback", "hierarchical", hierarchical)
        self.node_size = check_int("OneBitAdamCallback", "node_size", node_size, minimum=1, optional=True)
        if node_size is not None and not hierarchical:
            rank_zero_warn(
                f"OneBitAdamCallback(node_size={node_size}, hierarchical=False): node_size has no effect without "
                "hierarchical=True"
            )
        given = dict(
            freeze_step=freeze_step,
            auto_freeze_threshold=auto_freeze_threshold,
            auto_freeze_interval=auto_freeze_interval,
            auto_freeze_patience=auto_freeze_patience,
            bucket_mb=bucket_mb,
            nonfinite=nonfinite,
            overlap=overlap,
            scale_block=scale_block,
            variance_refresh=variance_refresh,
        )
        self.settings = {k: v for k, v in given.items() if v is not None}
        try:
            self.config = OneBitAdamConfig(**self.settings)  # validates now, not at fit time
        except ValueError as err:
            raise ValueError(str(err).replace("OneBitAdam(", "OneBitAdamCallback(", 1)) from None
        self.optimizer: OneBitAdam | None = None
        self.hook_state: OneBitGradHookState | None = None
        self._ddp: OneBitAdamDDP | None = None
        self._loaded: dict | None = None
        self._topology: Topology | None = None  # resolved at setup; None: flat
        self._node_groups: NodeGroups | None = None  # made once (collective), reused by later fits

    # ------------------------------------------------------------------ setup
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._loaded = None  # runs before a checkpoint is restored: no buffers from an earlier fit/validate
        destroy_gloo_group_at_exit()  # Lightning's DDPStrategy never destroys its group: a rank could abort at exit
        rank_files.attach(trainer.strategy)  # each rank's error buffers in its own side file, any strategy
        if not pl_module.automatic_optimization:
            raise ValueError(
                "OneBitAdamCallback: LightningModule.automatic_optimization=False; allowed: True (under manual "
                "optimization Lightning re-enables DDP's gradient sync after every forward, which would bring the "
                "gradient all-reduce back after the freeze)"
            )
        if getattr(trainer.precision_plugin, "scaler", None) is not None:
            raise ValueError(
                f"OneBitAdamCallback: precision={trainer.precision!r} uses a GradScaler, whose per-rank inf check "
                "desynchronises ranks once gradients are local; allowed precisions: 32-true, bf16-mixed, bf16-true, 16-true"
            )
        # every rank must run the callback with the same schedule (one without it would wait in DDP's all-reduce
        # while the others send 1-bit momenta)
        self._topology = None
        if self.hierarchical:
            per_node = getattr(trainer.strategy, "num_processes", None)
            self._topology = hierarchical_topology("OneBitAdamCallback", trainer.world_size, self.node_size, per_node)
        resolved = None if self._topology is None else self._topology.node_size
        timeout = getattr(trainer.strategy, "_timeout", None)
        check_same_config(
            "OneBitAdamCallback",
            {**dataclasses.asdict(self.config), "hierarchical": self.hierarchical, "resolved_node_size": resolved},
            timeout=presence_timeout(timeout),
        )
        if self._topology is not None and (self._node_groups is None or self._node_groups.topology != self._topology):
            self._node_groups = node_groups(
                self._topology, timeout=timeout, device_type=trainer.strategy.root_device.type
            )

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        if len(strategy.optimizers) != 1:
            raise ValueError(
                f"OneBitAdamCallback: configure_optimizers returned {len(strategy.optimizers)} optimizers; "
                "allowed: exactly one (torch.optim.Adam, torch.optim.AdamW or OneBitAdam)"
            )
        opt = strategy.optimizers[0]
        if isinstance(opt, OneBitAdam):
            self._check_agrees(opt)
        else:
            opt = self._replace(trainer, opt)
        self.optimizer = opt
        self._inline_if_needed(trainer, opt)
        model = strategy.model
        if isinstance(model, DistributedDataParallel):
            groups = self._node_groups if self._topology is not None else None
            self._ddp = OneBitAdamDDP(model, opt, register_hooks=False, node_groups=groups)  # switched per batch
            self.hook_state = self._ddp.hook_state
            if self._ddp.existing_hook:
                rank_zero_info(
                    "OneBitAdamCallback: warm-up gradients travel through the existing DDP comm hook "
                    f"{self._ddp.existing_hook!r}; after the freeze DDP's gradient sync is switched off"
                )
        elif trainer.world_size > 1:
            raise ValueError(
                f"OneBitAdamCallback: {type(strategy).__name__} does not wrap the model in DistributedDataParallel; "
                "allowed strategies: ddp (and its variants, e.g. ddp_spawn) and quant_ddp"
            )
        else:
            self._ddp = None
            self.hook_state = None

    def _inline_if_needed(self, trainer: pl.Trainer, opt: OneBitAdam) -> None:
        """The overlapped sync takes each gradient as backward leaves it, once per step: with accumulation (several
        backward passes) or clipping (after backward) the momentum is averaged after backward instead."""
        if trainer.accumulate_grad_batches > 1:
            opt.disable_overlap(
                f"accumulate_grad_batches={trainer.accumulate_grad_batches}: several backward passes per step"
            )
        elif trainer.gradient_clip_val:
            opt.disable_overlap(f"gradient_clip_val={trainer.gradient_clip_val}: gradients are clipped after backward")

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and self.optimizer is not None:
            self.optimizer.close_overlap()  # no gradient hooks left on the module after fit

    def _check_agrees(self, opt: OneBitAdam) -> None:
        clash = {k: (v, getattr(opt.config, k)) for k, v in self.settings.items() if getattr(opt.config, k) != v}
        if clash:
            desc = ", ".join(f"{k}={a!r} vs the optimizer's {b!r}" for k, (a, b) in clash.items())
            raise ValueError(
                f"OneBitAdamCallback: {desc}; configure_optimizers returned a OneBitAdam with other settings. "
                "Set them in one place (leave the callback's arguments unset to use the optimizer's)."
            )
        rank_zero_info(f"OneBitAdamCallback: using the OneBitAdam from configure_optimizers ({opt.config})")

    def _replace(self, trainer: pl.Trainer, old: torch.optim.Optimizer) -> OneBitAdam:
        if not isinstance(old, torch.optim.Adam):  # AdamW subclasses Adam
            raise ValueError(
                f"OneBitAdamCallback: configure_optimizers returned {type(old).__module__}.{type(old).__qualname__}; "
                "allowed: torch.optim.Adam, torch.optim.AdamW or lightning_qcomm.optim.OneBitAdam"
            )
        groups = []
        unhonoured: set[str] = set()
        for i, g in enumerate(old.param_groups):
            if g.get("amsgrad") or g.get("maximize"):
                raise ValueError(
                    f"OneBitAdamCallback: {type(old).__name__} param_groups[{i}] has amsgrad={g.get('amsgrad')}, "
                    f"maximize={g.get('maximize')}; allowed: both False"
                )
            unhonoured.update(k for k in _UNHONOURED if g.get(k))
            group = {k: v for k, v in g.items() if k not in ("amsgrad", "maximize", *_UNHONOURED)}
            group["decoupled_weight_decay"] = bool(g.get("decoupled_weight_decay", isinstance(old, torch.optim.AdamW)))
            for k in ("lr", "eps", "weight_decay"):
                if isinstance(group[k], torch.Tensor):
                    group[k] = float(group[k])
            group["betas"] = tuple(float(b) for b in group["betas"])
            groups.append(group)
        d = old.defaults
        new = OneBitAdam(
            groups,
            lr=float(d["lr"]),
            betas=tuple(float(b) for b in d["betas"]),
            eps=d["eps"],
            weight_decay=d["weight_decay"],
            decoupled_weight_decay=bool(d.get("decoupled_weight_decay", isinstance(old, torch.optim.AdamW))),
            **self.settings,
        )
        if old.state:  # e.g. a second fit of the same module: keep what the old optimizer learned
            new.load_state_dict(old.state_dict())
        strategy = trainer.strategy
        for cfg in strategy.lr_scheduler_configs:
            if _repoint_scheduler(cfg.scheduler, old, new):
                _track_step_called(new)
        strategy.optimizers = [new]
        rank_zero_info(
            f"OneBitAdamCallback: replaced {type(old).__name__} by OneBitAdam with the same {len(groups)} param "
            f"group(s) and hyperparameters ({new.config})"
        )
        if unhonoured:
            rank_zero_warn(
                f"OneBitAdamCallback: {type(old).__name__} asked for {'/'.join(sorted(unhonoured))}=True; OneBitAdam "
                "has one implementation (a per-tensor loop), which is used instead"
            )
        return new

    # ------------------------------------------------------------------ the switch
    def _switch_if_frozen(self) -> None:
        if self._ddp is not None:
            self._ddp.switch_if_frozen()  # the plain-torch recipe's switch (parallel.onebit_adam)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # after Lightning restored the optimizer state: apply this rank's error buffers
        if self._loaded is not None and self.optimizer is not None:
            saved, self._loaded = self._loaded, None
            topology = self._topology_entry()
            if saved["world_size"] == trainer.world_size and saved.get("topology") == topology:
                per_rank = saved.get("per_rank")  # a checkpoint of an earlier version: every rank's in one file
                own = saved["own"] if per_rank is None else per_rank[trainer.global_rank]
                self.optimizer.load_rank_state_dict(own)
            elif saved["world_size"] == trainer.world_size:
                rank_zero_warn(
                    f"OneBitAdamCallback: the checkpoint's 1-bit error buffers belong to the topology "
                    f"{saved.get('topology') or 'flat'}, now {topology or 'flat'} ([nodes, ranks per node]); "
                    "they restart at zero"
                )
            else:
                rank_zero_warn(
                    f"OneBitAdamCallback: the checkpoint's 1-bit error buffers were written by {saved['world_size']} "
                    f"ranks, now {trainer.world_size}; they restart at zero"
                )
        self._switch_if_frozen()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        self._switch_if_frozen()  # before the forward that would prepare DDP's gradient reduction

    # ------------------------------------------------------------------ checkpoint (per rank)
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        if self.optimizer is None:
            return
        checkpoint[CHECKPOINT_KEY] = {"world_size": trainer.world_size, "topology": self._topology_entry()}
        rank_files.stash(checkpoint, CHECKPOINT_KEY, self.optimizer.rank_state_dict())  # this rank's own

    def _topology_entry(self) -> list[int] | None:
        """[num_nodes, node_size] the error buffers belong to; None when flat."""
        t = self._topology
        return None if t is None else [t.num_nodes, t.node_size]

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        if trainer.state.fn != TrainerFn.FITTING:  # validate/test/predict(ckpt_path=...): no optimizer to feed
            return
        saved = checkpoint.get(CHECKPOINT_KEY)
        if saved is None:
            rank_zero_warn(
                f"OneBitAdamCallback: the checkpoint has no {CHECKPOINT_KEY!r} entry; 1-bit error buffers start at zero"
            )
        self._loaded = None if saved is None else {**saved, "own": rank_files.own_entry(checkpoint, CHECKPOINT_KEY)}


def _repoint_scheduler(sched: Any, old: torch.optim.Optimizer, new: torch.optim.Optimizer) -> bool:
    """Make ``sched`` (and the inner schedulers of SequentialLR/ChainedScheduler) drive ``new`` instead of ``old``.

    Returns whether anything was re-pointed. ValueError if an attribute other than ``optimizer`` /
    ``_schedulers`` still refers to ``old`` afterwards (a scheduler type this swap does not understand).
    """
    moved = False
    if getattr(sched, "optimizer", None) is old:
        sched.optimizer = new
        moved = True
    for inner in getattr(sched, "_schedulers", None) or ():
        moved = _repoint_scheduler(inner, old, new) or moved
    stale = [k for k, v in vars(sched).items() if v is old] if hasattr(sched, "__dict__") else []
    if stale:
        raise ValueError(
            f"OneBitAdamCallback: the LR scheduler {type(sched).__qualname__} holds the replaced optimizer in "
            f"{', '.join(stale)}; allowed: schedulers that reach it only through .optimizer (and ._schedulers), "
            "or return OneBitAdam from configure_optimizers so nothing needs re-pointing"
        )
    return moved


def _track_step_called(optimizer: torch.optim.Optimizer) -> None:
    """Wrap ``optimizer.step`` like ``LRScheduler.__init__`` does, so torch's order check sees the new optimizer."""
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return
    opt_ref = ref(optimizer)
    func = optimizer.step.__func__

    @wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        opt = opt_ref()
        opt._opt_called = True
        return func.__get__(opt, opt.__class__)(*args, **kwargs)

    wrapper._wrapped_by_lr_sched = True
    optimizer.step = wrapper
    optimizer._opt_called = getattr(optimizer, "_opt_called", False)


__all__ = ["CHECKPOINT_KEY", "OneBitAdamCallback"]
