"""How QSDP splits a model into FSDP2 groups when nobody called ``fully_shard`` on it (entry-point layer;
docs/design.md, "QSDP").

``plan_fsdp_groups(root, layer_classes, min_wrap_numel)`` returns the modules to ``fully_shard``, inner before
outer, the root last:

1. **Layer groups.** Every module whose class name is in ``layer_classes``; if none is given, every element of an
   ``nn.ModuleList`` that holds parameters; if there is none, a size policy like FSDP1's: children first, a module
   becomes a group when the parameters in it that no inner group took number at least ``min_wrap_numel``.
2. **Children of the root** that still hold parameters outside every group (embeddings, final norms and heads).
3. **The root** when parameters remain (those it holds directly, tied parameters shared across its children).

Invariants: a module is never a group when a parameter under it is also held by a module outside it, so a tied
parameter (``head.weight = tok_emb.weight``) lands in the smallest group that holds every user and stays one
parameter; containers that are never called (``nn.ModuleList`` / ``ModuleDict``) are never groups, since FSDP2
gathers a group in its module's forward.

Example::

    plan = plan_fsdp_groups(model, layer_classes=None, min_wrap_numel=1_000_000)
    for module in plan:
        fully_shard(module, mesh=mesh)
"""

from __future__ import annotations

from collections import defaultdict

from lightning_utilities.core.rank_zero import rank_zero_warn
from torch import nn


def _has_forward(module: nn.Module) -> bool:
    """Containers that are never called cannot be groups: FSDP2 gathers a group in its module's forward."""
    return not isinstance(module, (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict))


def _common_prefix(paths: list[str]) -> str:
    parts = [p.split(".") if p else [] for p in paths]
    common = []
    for names in zip(*parts):
        if len(set(names)) > 1:
            break
        common.append(names[0])
    return ".".join(common)


def untieable_modules(root: nn.Module) -> set[nn.Module]:
    """Modules that must not be a group of their own: a parameter under them is also held outside them,
    or the module itself is registered at more than one path."""
    paths: dict[nn.Module, list[str]] = defaultdict(list)
    holders: dict[int, list[str]] = defaultdict(list)
    for path, module in root.named_modules(remove_duplicate=False):
        paths[module].append(path)
        for _, p in module.named_parameters(recurse=False):
            holders[id(p)].append(path)
    blocked_paths: set[str] = set()
    for held_at in holders.values():
        if len(held_at) < 2:
            continue
        lca = _common_prefix(held_at)
        for path in held_at:  # every module strictly below the common ancestor, down to each holder
            names = path.split(".")
            for depth in range(len(lca.split(".")) if lca else 0, len(names)):
                blocked_paths.add(".".join(names[: depth + 1]))
    return {m for m, ps in paths.items() if len(ps) > 1 or any(p in blocked_paths for p in ps)}


def _layer_targets(root: nn.Module, layer_classes: set[str] | None) -> list[nn.Module]:
    if layer_classes is not None:
        found = {type(m).__name__ for m in root.modules()}
        missing = layer_classes - found
        if missing:
            raise ValueError(
                f"layer_classes names {sorted(missing)} that are not in the model; module classes present: "
                f"{sorted(found)}"
            )
        return [m for m in root.modules() if m is not root and type(m).__name__ in layer_classes]
    return [c for m in root.modules() if isinstance(m, nn.ModuleList) for c in m if any(True for _ in c.parameters())]


def _size_targets(root: nn.Module, min_wrap_numel: int, blocked: set[nn.Module]) -> list[nn.Module]:
    """Children-first: a module whose parameters not yet in a group reach ``min_wrap_numel`` elements."""
    plan: list[nn.Module] = []
    grouped: set[int] = set()

    def visit(module: nn.Module) -> None:
        for child in module.children():
            visit(child)
        if module is root or module in blocked or not _has_forward(module):
            return
        left = [p for p in module.parameters() if id(p) not in grouped]
        if left and sum(p.numel() for p in left) >= min_wrap_numel:
            plan.append(module)
            grouped.update(id(p) for p in left)

    visit(root)
    return plan


def plan_fsdp_groups(root: nn.Module, layer_classes: set[str] | str | None, min_wrap_numel: int) -> list[nn.Module]:
    """The modules to ``fully_shard``, inner before outer, ``root`` last if it keeps parameters (see the module
    docstring for the rules). ``layer_classes``: class names (a set, or a comma-separated string).

    Example::

        groups = plan_fsdp_groups(model, "TransformerBlock", min_wrap_numel=100_000)   # modules to shard
    """
    if isinstance(layer_classes, str):
        layer_classes = {c.strip() for c in layer_classes.split(",") if c.strip()}
    blocked = untieable_modules(root)
    depth = {m: n.count(".") + 1 if n else 0 for n, m in root.named_modules()}
    targets = _layer_targets(root, layer_classes)
    skipped = [m for m in targets if m in blocked]
    if skipped and layer_classes is not None:
        names = {m: n for n, m in root.named_modules()}
        rank_zero_warn(
            f"QSDP: layer_classes modules {[names[m] for m in skipped]} hold a tied parameter also used outside "
            "them; they join their parent's FSDP group so the parameter stays one parameter"
        )
    targets = [m for m in targets if m not in blocked and _has_forward(m)]
    if targets:
        plan = sorted(dict.fromkeys(targets), key=lambda m: -depth[m])  # stable: module order within a depth
    else:
        plan = _size_targets(root, min_wrap_numel, blocked)
    grouped = {id(p) for m in plan for p in m.parameters()}
    for child in root.children():
        if child in blocked or not _has_forward(child):
            continue
        if any(id(p) not in grouped for p in child.parameters()):
            plan.append(child)
            grouped.update(id(p) for p in child.parameters())
    if any(id(p) not in grouped for p in root.parameters()):
        plan.append(root)
    return plan
