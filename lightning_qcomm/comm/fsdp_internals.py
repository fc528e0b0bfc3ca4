"""Everything QSDP reads from FSDP2's private internals, in one place, with a check that they exist.

The QSDP comms (``comm/fsdp.py``) need per-parameter layout of an FSDP param group's flat buffers, which
FSDP2 does not expose publicly: ``FSDPModule._get_fsdp_state()._fsdp_param_groups[0].fsdp_params`` and, per
``FSDPParam``, its padded shard size, real shard size, original size, placement, sharded parameter and
padded shard data, plus the unsharded parameter FSDP2 creates at the first all-gather. These were written
against torch 2.9-2.13 and are tested with torch 2.13. ``check_torch_fsdp_api`` (classes and methods, no
model needed) and ``check_fsdp_param_internals`` (attributes of a live ``FSDPParam``) run at setup and
refuse a torch that lacks any of them with the torch version and the missing names, instead of failing
mid-step.

Example::

    check_torch_fsdp_api()                       # RuntimeError naming torch's version if anything is missing
    shards = fsdp_param_shards(fsdp_module)      # [ParamShard(padded_shard_numel=..., ...), ...]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TESTED_TORCH = "2.13"
# methods of FSDPModule the strategy and the comms call
FSDP_MODULE_API = (
    "_get_fsdp_state",
    "set_custom_all_gather",
    "set_custom_reduce_scatter",
    "set_force_sum_reduction_for_comms",
    "set_modules_to_forward_prefetch",
    "reshard",
    "unshard",
)
# attributes of every FSDPParam the comms read
FSDP_PARAM_ATTRS = (
    "fsdp_placement",
    "padded_sharded_param_size",
    "sharded_size",
    "_orig_size",
    "sharded_param",
    "_sharded_param_data",
)


def _refuse(missing: list[str]) -> None:
    raise RuntimeError(
        f"QSDP needs FSDP2 internals that torch {torch.__version__} does not have: {', '.join(missing)}. "
        f"lightning_qcomm's QSDP is tested with torch {TESTED_TORCH}; install torch>={TESTED_TORCH},<2.14"
    )


def check_torch_fsdp_api() -> None:
    """Raise RuntimeError (naming torch's version and what is missing) unless this torch has the FSDP2
    classes and methods QSDP uses."""
    missing = []
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        _refuse(["torch.distributed.fsdp.FSDPModule"])
    missing += [f"FSDPModule.{name}" for name in FSDP_MODULE_API if not hasattr(FSDPModule, name)]
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_api
    except ImportError:
        missing.append("torch.distributed.fsdp._fully_shard._fsdp_api")
    else:
        missing += [f"_fsdp_api.{name}" for name in ("AllGather", "ReduceScatter") if not hasattr(_fsdp_api, name)]
    if missing:
        _refuse(missing)


def check_fsdp_param_internals(fp: object) -> None:
    """Raise RuntimeError unless ``fp`` (an ``FSDPParam``) has every attribute the comms read."""
    missing = [f"FSDPParam.{a}" for a in FSDP_PARAM_ATTRS if not hasattr(fp, a)]
    if not missing and not hasattr(fp.fsdp_placement, "dim"):
        missing.append("FSDPParam.fsdp_placement.dim")
    if missing:
        _refuse(missing)


def check_fsdp_module_internals(module: torch.nn.Module) -> None:
    """``check_fsdp_param_internals`` on every param of an ``FSDPModule``, and the state it is reached by."""
    state = module._get_fsdp_state()
    if not hasattr(state, "_fsdp_param_groups"):
        _refuse(["FSDPState._fsdp_param_groups"])
    for group in state._fsdp_param_groups:
        missing = [f"FSDPParamGroup.{a}" for a in ("fsdp_params", "mesh_info") if not hasattr(group, a)]
        if missing:
            _refuse(missing)
        for fp in group.fsdp_params:
            check_fsdp_param_internals(fp)


@dataclass(frozen=True)
class ParamShard:
    """What the comms need to know about one parameter of an FSDP param group."""

    padded_shard_numel: int  # elements of this param in one rank's row
    shard_numel: int  # real (unpadded) elements of this rank's shard; a prefix of the padded one
    numel: int  # elements of the whole (unsharded) parameter
    ndim: int
    requires_grad: bool  # when the layout was read (the reduce-scatter reads the live flag, see fsdp.py)


def fsdp_params(module: torch.nn.Module) -> list:
    """The ``FSDPParam`` objects of ``module``'s (single) FSDP param group; [] if it owns no params."""
    groups = module._get_fsdp_state()._fsdp_param_groups
    if not groups:
        return []
    if len(groups) > 1:
        raise ValueError(
            f"module {type(module).__name__} has {len(groups)} FSDP param groups (shard_placement_fn with "
            "per-param meshes); QSDP comms support one group per fully_shard call"
        )
    return list(groups[0].fsdp_params)


def param_shard(fp) -> ParamShard:
    if fp.fsdp_placement.dim != 0:
        raise ValueError(f"QSDP comms need dim-0 sharding, got Shard({fp.fsdp_placement.dim}) for {fp}")
    return ParamShard(
        padded_shard_numel=fp.padded_sharded_param_size.numel(),
        shard_numel=fp.sharded_size.numel(),
        numel=fp._orig_size.numel(),
        ndim=len(fp._orig_size),
        requires_grad=fp.sharded_param.requires_grad,
    )


def fsdp_param_shards(module: torch.nn.Module) -> list[ParamShard]:
    """The per-parameter row layout of ``module``'s FSDP param group, in buffer order."""
    return [param_shard(fp) for fp in fsdp_params(module)]


def gathers_per_step(module: torch.nn.Module, is_root: bool) -> int:
    """Weight all-gathers of ``module``'s FSDP param group per training step: 2 when FSDP2 reshards it after
    forward (gathered again for backward), 1 when it stays unsharded: a group set to
    ``reshard_after_forward=False``, or a root (an FSDP module under no other) left at FSDP2's default, which
    FSDP2 keeps unsharded after forward (its lazy init, at the first forward, clears the root's post-forward
    mesh; before that only the default flag tells)."""
    state = module._get_fsdp_state()
    if is_root and getattr(state, "_auto_reshard_after_forward", False):
        return 1
    return 1 if state._fsdp_param_groups[0].post_forward_mesh_info is None else 2


def param_dtypes(module: torch.nn.Module) -> tuple[torch.dtype, torch.dtype]:
    """(all-gather dtype, reduce-scatter dtype) of ``module``'s FSDP param group: its ``MixedPrecisionPolicy``'s
    ``param_dtype`` / ``reduce_dtype``, else the sharded parameters' own dtype (FSDP2's rule)."""
    group = module._get_fsdp_state()._fsdp_param_groups[0]
    own = group.fsdp_params[0].sharded_param.dtype
    policy = getattr(group, "mp_policy", None)
    gather = getattr(policy, "param_dtype", None) or own
    return gather, getattr(policy, "reduce_dtype", None) or gather


def post_divide_factor(module: torch.nn.Module, reduce_dtype: torch.dtype) -> float | None:
    """The factor FSDP2 divides ``module``'s reduce-scattered gradient by after its all-reduce hook (None: not
    divided), as its ``foreach_reduce`` computes it for a 1-D (``FSDPMeshInfo``) param group on CPU: torch's own
    ``_get_gradient_divide_factors`` over the group's reduce-scatter group, divide factor and forced-SUM flag."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_gradient_divide_factors

    group = module._get_fsdp_state()._fsdp_param_group
    factors = _get_gradient_divide_factors(
        group._reduce_scatter_process_group,
        None,
        reduce_dtype,
        "cpu",
        group.gradient_divide_factor,
        group.force_sum_reduction_for_comms,
    )
    return factors[1]


def fsdp_roots(modules: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """The root FSDP modules of ``modules`` (once a forward has set them): each of the groups when no FSDP module
    holds the others, else the one they share (the module its state was built for)."""
    roots: dict[int, torch.nn.Module] = {}
    for module in modules:
        state = module._get_fsdp_state()
        for candidate in [state, *state._state_ctx.all_states]:
            if candidate._is_root:
                roots[id(candidate)] = candidate._modules[0]
    return list(roots.values())


def shard_rank(module: torch.nn.Module) -> int:
    """This rank's index in the mesh ``module``'s FSDP param group shards over."""
    return module._get_fsdp_state()._fsdp_param_groups[0].mesh_info.shard_mesh_rank


def sync_unsharded_requires_grad(module: torch.nn.Module) -> None:
    """Give each unsharded parameter the ``requires_grad`` of its sharded parameter.

    FSDP2 creates the unsharded parameter once, at the first all-gather, copying ``requires_grad`` then;
    ``LightningModule.toggle_optimizer`` (and any later freeze/unfreeze) changes the sharded parameters that
    the optimizers hold. Run after FSDP's pre-forward unshard, this makes autograd follow the current flags.
    """
    for fp in fsdp_params(module):
        unsharded = getattr(fp, "_unsharded_param", None)
        wanted = fp.sharded_param.requires_grad
        if unsharded is not None and unsharded.requires_grad != wanted:
            unsharded.requires_grad_(wanted)


def install_requires_grad_sync(module: torch.nn.Module, root: torch.nn.Module | None) -> None:
    """After FSDP's pre-forward unshard (its hook is prepended), copy the sharded params' requires_grad onto
    the unsharded ones (see ``sync_unsharded_requires_grad``), for this module and for the FSDP ``root``:
    the root stays gathered through a whole step, in which ``toggle_optimizer`` may change its flags, and
    its own parameters are used alongside the inner groups' forwards. One hook per module however often
    installed."""
    old = getattr(module, "_qsdp_requires_grad_hook", None)
    if old is not None:
        old.remove()
    targets = [module] if root is None or root is module else [module, root]

    def sync(mod, args) -> None:
        for m in targets:
            sync_unsharded_requires_grad(m)

    module._qsdp_requires_grad_hook = module.register_forward_pre_hook(sync)


def install_requires_grad_syncs(root: torch.nn.Module) -> None:
    """``install_requires_grad_sync`` on every FSDP group under ``root`` (``root`` included) that owns parameters,
    with ``root`` as the root group when it owns some: where FSDP2's own collectives run (HSDP inside a node
    without ``intra_node_bits``), ``toggle_optimizer`` must reach autograd as it does under QSDP's comms.

    Example::

        install_requires_grad_syncs(model)   # after fully_shard; a GAN's frozen player then gets no gradient
    """
    from torch.distributed.fsdp import FSDPModule

    root_group = root if isinstance(root, FSDPModule) and fsdp_params(root) else None
    for module in root.modules():
        if isinstance(module, FSDPModule) and fsdp_params(module):
            install_requires_grad_sync(module, root_group)
