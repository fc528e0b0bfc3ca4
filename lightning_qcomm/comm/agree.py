"""The ranks agree on a decision: the max of a few floats or of a flag tensor over a group (comm layer;
docs/design.md, "Layers and files").

One fp64 all-reduce of 8 bytes per element, recorded in the ``CommLedger`` as (``all_reduce``, ``tag``) with a
0-byte baseline (tag ``"control"`` by default, kept apart from ``"momentum"`` and ``"grads"`` so the per-phase
bytes stay clean; it has no fp32 counterpart). A world of one, or torch.distributed not initialised, returns the
values and communicates nothing. A ``NodeGroups`` (a hierarchical sync's groups) decides over the whole world.
Used by 1-bit Adam's auto-freeze, the non-finite policy's verdict and the ``"auto"`` width trial.

Example::

    worst = max_over_ranks_each([t_step, t_comm], group)             # one 16-byte all-reduce
    verdict = max_over_ranks_tensor(flag.double().reshape(1), group)  # stays on the device
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from lightning_qcomm.comm.ledger import get_ledger
from lightning_qcomm.comm.topology import NodeGroups


def max_over_ranks(
    value: float,
    group: dist.ProcessGroup | NodeGroups | None = None,
    device: torch.device | None = None,
    tag: str = "control",
) -> float:
    """max(value) over the ranks of ``group``: one 8-byte fp64 all-reduce on ``device`` (CPU if None).

    Recorded in the ``CommLedger`` as (``all_reduce``, ``tag``) with a 0-byte baseline. A world of one
    (or torch.distributed not initialised) returns ``value`` and communicates nothing.
    """
    return max_over_ranks_each([value], group, device, tag)[0]


def max_over_ranks_each(
    values: Sequence[float],
    group: dist.ProcessGroup | NodeGroups | None = None,
    device: torch.device | None = None,
    tag: str = "control",
) -> list[float]:
    """``max_over_ranks`` of every element of ``values`` in one fp64 all-reduce (8 bytes per element)."""
    if _world(group) == 1:
        return [float(v) for v in values]
    return max_over_ranks_tensor(
        torch.tensor([float(v) for v in values], dtype=torch.float64), group, device, tag
    ).tolist()


def max_over_ranks_tensor(
    t: torch.Tensor,
    group: dist.ProcessGroup | NodeGroups | None = None,
    device: torch.device | None = None,
    tag: str = "control",
) -> torch.Tensor:
    """The element-wise max of the 1-D tensor ``t`` over the ranks of ``group``, as an fp64 tensor on ``device``
    (``t``'s if None): one all-reduce of 8 bytes per element and no read on the host, so a decision on a device
    value (a non-finite flag) costs the one device-to-host copy of its verdict. Ledger as ``max_over_ranks``; a
    world of one returns ``t``.

    Example::

        verdict = max_over_ranks_tensor(flag.double().reshape(1), group)   # then one .cpu() for the decision
    """
    if _world(group) == 1:
        return t
    if isinstance(group, NodeGroups):  # a hierarchical momentum sync's groups: the decision is over the world
        group = None
    t = t.to(device=device or t.device, dtype=torch.float64, copy=True)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    get_ledger().record("all_reduce", t.numel() * t.element_size(), 0, _world(group), tag=tag)
    return t


def _world(group: dist.ProcessGroup | NodeGroups | None) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(None if isinstance(group, NodeGroups) else group)


__all__ = ["max_over_ranks", "max_over_ranks_each", "max_over_ranks_tensor"]
