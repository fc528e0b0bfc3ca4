"""The one door to FSDP2's private state: every read of torch's ``_fully_shard`` internals QSDP needs, one small,
feature-detected branch per torch release (adapter layer; docs/design.md, "The FSDP2 shim").

QSDP installs itself through FSDP2's public hooks (``set_custom_all_gather`` / ``set_custom_reduce_scatter`` /
``set_all_reduce_hook`` / ``set_force_sum_reduction_for_comms``, the same in torch 2.11 to 2.15). What no public
API gives is read here and nowhere else (tests/adapters/test_fsdp_shim.py holds that): the per-parameter layout of a param
group's flat buffers, the unsharded parameter, the shard rank, the root states, the post-divide after the
all-reduce hook, and whether a reduce-scatter's output is only viewed afterwards (``adapters.fsdp2.deferred``).
What moves between releases (param groups one or a list; ``foreach_reduce``'s cast; ``reset_iter_state`` from
2.13) is listed in docs/design.md, "The FSDP2 shim".

Invariants: a torch whose ``foreach_reduce`` is none of the reviewed shapes runs the deferred reduce-scatters
inline (logged once); a torch without what a feature needs refuses that feature at setup, naming it, the running
torch and the first release that has it (``require``).

Example::

    check_torch_fsdp_api()                       # RuntimeError naming torch's version if anything is missing
    shards = fsdp_param_shards(fsdp_module)      # [ParamShard(padded_shard_numel=..., ...), ...]
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass

import torch

from lightning_qcomm._checks import SUPPORTED_TORCH

try:  # the comm interfaces QSDP implements; a torch without them is refused by check_torch_fsdp_api
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
except ImportError:  # pragma: no cover - depends on the installed torch
    AllGather = ReduceScatter = object

log = logging.getLogger(__name__)

# methods of FSDPModule the strategy and the comms call (public since 2.11)
FSDP_MODULE_API = (
    "_get_fsdp_state",
    "set_custom_all_gather",
    "set_custom_reduce_scatter",
    "set_all_reduce_hook",
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
# FSDPModule features newer than the range's oldest release: name -> first release with it
FIRST_RELEASE = {"reset_iter_state": "2.13"}
# foreach_reduce's parameters, per reviewed release: the order adapters.fsdp2.deferred relies on holds for these
_FOREACH_REDUCE_2_11 = (  # torch 2.11 to 2.14: one cast of the whole output to the group's _orig_dtype
    "fsdp_params unsharded_grads reduce_scatter_group reduce_scatter_stream reduce_scatter_comm orig_dtype "
    "reduce_dtype device gradient_divide_factor all_reduce_group all_reduce_stream all_reduce_grads "
    "partial_reduce_output all_reduce_hook force_sum_reduction_for_comms"
).split()
_FOREACH_REDUCE_2_15 = (  # torch 2.15: per-parameter cast to FSDPParam.sharded_grad_dtype
    "fsdp_params unsharded_grads reduce_scatter_group reduce_scatter_stream reduce_scatter_comm reduce_dtype device "
    "gradient_divide_factor all_reduce_group all_reduce_stream all_reduce_grads partial_reduce_output "
    "all_reduce_hook force_sum_reduction_for_comms prepare_reduce_scatter_inputs"
).split()


def _refuse(missing: list[str]) -> None:
    raise RuntimeError(
        f"QSDP needs FSDP2 internals that torch {torch.__version__} does not have: {', '.join(missing)}. "
        f"lightning_qcomm supports torch{SUPPORTED_TORCH}"
    )


def require(feature: str, owner: str) -> None:
    """Refuse ``owner``'s ``feature`` (a key of ``FIRST_RELEASE``) on a torch that lacks it: RuntimeError naming the
    feature, the running torch and the first release that has it."""
    from torch.distributed.fsdp import FSDPModule

    if not hasattr(FSDPModule, feature):
        raise RuntimeError(
            f"{owner}.{feature} needs FSDPModule.{feature}, which torch {torch.__version__} does not have; "
            f"it is in torch>={FIRST_RELEASE[feature]}"
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
    if AllGather is object:
        missing.append("torch.distributed.fsdp._fully_shard._fsdp_api.AllGather / ReduceScatter")
    if missing:
        _refuse(missing)


def check_fsdp_param_internals(fp: object) -> None:
    """Raise RuntimeError unless ``fp`` (an ``FSDPParam``) has every attribute the comms read."""
    missing = [f"FSDPParam.{a}" for a in FSDP_PARAM_ATTRS if not hasattr(fp, a)]
    if not missing and not hasattr(fp.fsdp_placement, "dim"):
        missing.append("FSDPParam.fsdp_placement.dim")
    if missing:
        _refuse(missing)


def _param_groups(state) -> list:
    if hasattr(state, "_fsdp_param_groups"):  # torch 2.12+: a list (per-param meshes)
        return list(state._fsdp_param_groups)
    if hasattr(state, "_fsdp_param_group"):  # torch 2.11: one group or None
        return [] if state._fsdp_param_group is None else [state._fsdp_param_group]
    _refuse(["FSDPState._fsdp_param_groups (2.12+) or FSDPState._fsdp_param_group (2.11)"])


def _group(module: torch.nn.Module):
    """The (single) FSDP param group of ``module``; None if it owns no params."""
    groups = _param_groups(module._get_fsdp_state())
    if len(groups) > 1:
        raise ValueError(
            f"module {type(module).__name__} has {len(groups)} FSDP param groups (shard_placement_fn with "
            "per-param meshes); QSDP comms support one group per fully_shard call"
        )
    return groups[0] if groups else None


def check_fsdp_module_internals(module: torch.nn.Module) -> None:
    """``check_fsdp_param_internals`` on every param of an ``FSDPModule``, and the state it is reached by."""
    for group in _param_groups(module._get_fsdp_state()):
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
    group = _group(module)
    return [] if group is None else list(group.fsdp_params)


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


def padded_shard_data(module: torch.nn.Module) -> list[tuple[ParamShard, torch.Tensor]]:
    """(layout, this rank's padded 1-D shard storage) of each parameter of ``module``'s group, in buffer order:
    writing into the tensor writes the sharded parameter (the master weights)."""
    return [(param_shard(fp), fp._sharded_param_data) for fp in fsdp_params(module)]


def live_requires_grad(module: torch.nn.Module) -> list[bool]:
    """The sharded parameters' current ``requires_grad`` flags, in buffer order."""
    return [fp.sharded_param.requires_grad for fp in fsdp_params(module)]


def shard_rank(module: torch.nn.Module) -> int:
    """This rank's index in the mesh ``module``'s FSDP param group shards over."""
    return _group(module).mesh_info.shard_mesh_rank


def post_divide_factor(module: torch.nn.Module, reduce_dtype: torch.dtype) -> float | None:
    """The factor FSDP2 divides ``module``'s reduce-scattered gradient by after its all-reduce hook (None: not
    divided), as its ``foreach_reduce`` computes it for a 1-D (``FSDPMeshInfo``) param group on CPU: torch's own
    ``_get_gradient_divide_factors`` (same signature 2.11 to 2.15) over the group's reduce-scatter group, divide
    factor and forced-SUM flag."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_gradient_divide_factors

    group = _group(module)
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


def is_root(module: torch.nn.Module) -> bool:
    """Whether FSDP2's lazy init (the first forward) made ``module`` a root."""
    return bool(module._get_fsdp_state()._is_root)


def installed_comms(module: torch.nn.Module) -> tuple:
    """(all-gather, reduce-scatter) comm objects FSDP2 runs for ``module``'s param group (its defaults, or what
    ``set_custom_all_gather`` / ``set_custom_reduce_scatter`` installed)."""
    group = _group(module)
    return group._all_gather_comm, group._reduce_scatter_comm


def all_reduce_hook(module: torch.nn.Module):
    """The all-reduce hook set on ``module``'s param group (``FSDPModule.set_all_reduce_hook``), or None."""
    return getattr(_group(module), "_all_reduce_hook", None)


# --------------------------------------------------------------------------- foreach_reduce's order
_contract_cache: list[str | None] = []


def reduce_contract() -> str | None:
    """The reviewed ``foreach_reduce`` this torch runs (``"2.11"``: one cast to ``_orig_dtype``, as 2.11 to 2.14;
    ``"2.15"``: per-parameter cast), or None (a shape not reviewed: deferred reduce-scatters run inline)."""
    if not _contract_cache:
        try:
            from torch.distributed.fsdp._fully_shard._fsdp_collectives import foreach_reduce

            names = list(inspect.signature(foreach_reduce).parameters)
        except (ImportError, TypeError, ValueError):
            names = []
        found = {tuple(_FOREACH_REDUCE_2_11): "2.11", tuple(_FOREACH_REDUCE_2_15): "2.15"}.get(tuple(names))
        if found is None:
            log.warning(
                "QSDP: torch %s's FSDP2 foreach_reduce is not one reviewed for overlap (torch 2.11 to 2.15); "
                "its reduce-scatters and all-reduce hooks run inline (no overlap with the rest of backward)",
                torch.__version__,
            )
        _contract_cache.append(found)
    return _contract_cache[0]


def output_only_viewed(module: torch.nn.Module, dtype: torch.dtype, in_all_reduce_hook: bool) -> bool:
    """Whether, after ``module``'s reduce-scatter (or, ``in_all_reduce_hook``, its all-reduce hook) returns, FSDP2
    only divides its output in place and takes views of it (adapters.fsdp2.deferred's contract): a reviewed
    ``foreach_reduce``, a 1-D mesh (no HSDP all-reduce), no custom divide factor, no all-reduce hook (unless asked
    by it), no cast of the output, no gradient to accumulate into and no post-accumulate-grad hook."""
    contract = reduce_contract()
    group = _group(module)
    if contract is None or group is None:
        return False
    if getattr(group, "gradient_divide_factor", None) is not None:
        return False
    if getattr(group, "_all_reduce_hook", None) is not None and not in_all_reduce_hook:
        return False
    if type(getattr(group, "mesh_info", None)).__name__ != "FSDPMeshInfo":  # HSDP's all-reduce reads it
        return False
    if contract == "2.11":  # torch 2.11-2.14: the whole output is cast to the group's original dtype
        if getattr(group, "_orig_dtype", None) not in (None, dtype):
            return False
    else:  # torch 2.15: each parameter's gradient is cast to its sharded_grad_dtype
        if any(getattr(fp, "sharded_grad_dtype", None) not in (None, dtype) for fp in group.fsdp_params):
            return False
    return all(
        fp.sharded_param.grad is None and not getattr(fp.sharded_param, "_post_accumulate_grad_hooks", None)
        for fp in group.fsdp_params
    )


# --------------------------------------------------------------------------- unsharded requires_grad
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
