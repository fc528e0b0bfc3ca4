"""OneBitAdam's arithmetic over many parameters at once (optim layer; docs/design.md, "1-bit Adam"): what
``OneBitAdam.step`` runs.

``optim.adam_math`` states the math one parameter at a time and is the reference; this module computes the same
numbers in a number of ops that does not grow with the number of parameters: ``warmup_step_`` (torch's AdamW step
as ``torch._foreach_*`` ops, in the same order), ``bucket_candidates`` (``adam_math.momentum_candidates`` of a
bucket) and ``bucket_update_`` (``adam_math.frozen_update_`` of every trainable member of a bucket).

**Bit for bit.** An op that rounds once (``mul``, ``add``, ``sqrt``, ``reciprocal``, a conversion) or not at all
(``where``, ``clamp``, comparisons, copies) gives each element the same result wherever it sits, so those run on
the flat vector of a run of members. An op that rounds twice (``lerp``, ``add`` with ``alpha``, ``addcmul``,
``addcdiv``) may be contracted into an FMA in a vectorised loop but not in its scalar tail, so it runs per tensor,
as ``_foreach`` ops. A run is a stretch of consecutive members of one param group with fp32 moments; a member with
other moments takes the reference. Lists are split by parameter dtype where an op writes parameters.

Example::

    flat = bucket_candidates(params, optimizer.state, group_of)   # what the 1-bit average compresses
    bucket_update_(params, optimizer.state, group_of, averaged)    # m and p from the average
"""

from __future__ import annotations

from collections import defaultdict
from itertools import groupby
from typing import Any

import torch

from lightning_qcomm.optim.adam_math import (
    adam_step_bound,
    frozen_update_,
    momentum_candidates,
    usable_root,
    weight_from_root_,
)

State = dict[torch.Tensor, dict[str, Any]]


def _runs(params: list[torch.Tensor], state: State, group_of: dict) -> list[tuple[dict | None, list[torch.Tensor]]]:
    """Consecutive members of one group with fp32 moments as (group, members); other members as (None, [p])."""
    runs: list[tuple[dict | None, list[torch.Tensor]]] = []
    for (_, fp32), members in groupby(
        params, key=lambda p: (id(group_of[p]), state[p]["exp_avg"].dtype == torch.float32)
    ):
        members = list(members)
        if fp32:
            runs.append((group_of[members[0]], members))
        else:
            runs.extend((None, [p]) for p in members)
    return runs


def _run_slices(params: list[torch.Tensor], state: State, group_of: dict, flat: torch.Tensor):
    """(group, members, the members' slice of the flat bucket ``flat``) for each of ``_runs``."""
    offset = 0
    for group, members in _runs(params, state, group_of):
        n = sum(p.numel() for p in members)
        yield group, members, flat[offset : offset + n]
        offset += n


def _in_dtype(tensors: list[torch.Tensor], like: list[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors[i]`` in ``like[i]``'s dtype: those that differ converted by one ``_foreach_copy_`` into a new buffer."""
    todo = [i for i, (t, ref) in enumerate(zip(tensors, like)) if t.dtype != ref.dtype]
    if not todo:
        return list(tensors)
    out = list(tensors)
    for dtype in {like[i].dtype for i in todo}:
        idx = [i for i in todo if like[i].dtype == dtype]
        buf = torch.empty(sum(tensors[i].numel() for i in idx), dtype=dtype, device=tensors[idx[0]].device)
        views = [v.view(tensors[i].shape) for i, v in zip(idx, buf.split([tensors[i].numel() for i in idx]))]
        torch._foreach_copy_(views, [tensors[i] for i in idx])
        for i, v in zip(idx, views):
            out[i] = v
    return out


def _grads(params: list[torch.Tensor], moments: list[torch.Tensor], group: dict[str, Any]) -> list[torch.Tensor]:
    """``adam_math.momentum_grad`` of each parameter: its gradient (zeros without one) in its moment's dtype, plus
    λp under L2 weight decay."""
    grads = []
    for p, m in zip(params, moments):
        if p.grad is not None and p.grad.is_sparse:
            raise ValueError("OneBitAdam: sparse gradients are not supported; allowed: dense gradients")
        grads.append(p.grad if p.grad is not None else torch.zeros_like(m))
    grads = _in_dtype(grads, moments)
    if group["weight_decay"] != 0 and not group["decoupled_weight_decay"]:
        grads = torch._foreach_add(grads, _in_dtype(list(params), moments), alpha=group["weight_decay"])
    return grads


def _flat(tensors: list[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """The tensors' elements in logical order, one after the other (one ``cat``)."""
    flat = [t.reshape(-1) for t in tensors]
    return torch.cat(flat) if out is None else torch.cat(flat, out=out)


def _split_as(flat: torch.Tensor, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [v.view(t.shape) for v, t in zip(flat.split([t.numel() for t in tensors]), tensors)]


# ---------------------------------------------------------------------------------------------- warm-up
@torch.no_grad()
def warmup_step_(params: list[torch.Tensor], state: State, group: dict[str, Any]) -> None:
    """One AdamW (Adam with L2 when not decoupled) step of every parameter of ``params`` (one param group, each
    with a gradient and an initialised state), ``adam_math.adamw_update_`` in multi-tensor form."""
    by_dtype: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for p in params:
        by_dtype[(p.device, p.dtype)].append(p)
    for ps in by_dtype.values():
        _warmup_(ps, state, group)


def _warmup_(params: list[torch.Tensor], state: State, group: dict[str, Any]) -> None:
    beta1, beta2 = group["betas"]
    lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
    ms = [state[p]["exp_avg"] for p in params]
    vs = [state[p]["exp_avg_sq"] for p in params]
    steps = [state[p]["step"] for p in params]
    grads = _in_dtype([p.grad for p in params], ms)
    torch._foreach_add_(steps, 1)
    if wd != 0:
        if group["decoupled_weight_decay"]:
            torch._foreach_mul_(params, 1 - lr * wd)
        else:
            grads = torch._foreach_add(grads, _in_dtype(list(params), ms), alpha=wd)
    torch._foreach_lerp_(ms, grads, 1 - beta1)
    torch._foreach_mul_(vs, beta2)
    torch._foreach_addcmul_(vs, grads, grads, value=1 - beta2)
    counts = torch.stack(steps).tolist()  # CPU step counters, as torch's Adam keeps them: no device wait
    denom = torch._foreach_sqrt(vs)
    torch._foreach_div_(denom, [(1 - beta2**t) ** 0.5 for t in counts])
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, ms, denom, [-(lr / (1 - beta1**t)) for t in counts])


# ---------------------------------------------------------------------------------------------- compression phase
@torch.no_grad()
def bucket_candidates(params: list[torch.Tensor], state: State, group_of: dict) -> torch.Tensor:
    """``adam_math.momentum_candidates(params, state, group_of)``, bit for bit, in ops per run of members (not per
    member): the new fp32 tensor of the preconditioned, clipped new momenta, in layout order; m stays."""
    flat = torch.empty(sum(p.numel() for p in params), dtype=torch.float32, device=params[0].device)
    for group, members, out in _run_slices(params, state, group_of, flat):
        if group is None:
            out.copy_(momentum_candidates(members, state, group_of))
            continue
        ms = [state[p]["exp_avg"] for p in members]
        train = [i for i, p in enumerate(members) if p.requires_grad]
        _flat(ms, out=out)  # a run's moments are fp32 (``_runs``): m' is formed in the output, no second copy
        if train:
            views = _split_as(out, members)
            tms = [views[i] for i in train]
            torch._foreach_lerp_(tms, _grads([members[i] for i in train], tms, group), 1 - group["betas"][0])
        out.mul_(weight_from_root_(_flat([state[p]["exp_avg_sq"] for p in members]).sqrt_(), group["eps"]))
        bound = adam_step_bound(group)
        torch.where(out - out == 0, out.clamp(-bound, bound), out, out=out)  # non-finite (x - x != 0) stays
    return flat


@torch.no_grad()
def bucket_update_(params: list[torch.Tensor], state: State, group_of: dict, flat: torch.Tensor) -> None:
    """``adam_math.frozen_update_`` of every member of ``params`` with ``requires_grad`` from its slice of ``flat``
    (the averaged preconditioned momenta, layout order; zeroed in place where w = 0), bit for bit, in ops per run:
    m <- u (√v̂ + ε), p <- p (1 - ηλ) - η/(1-β1^t) u, t <- t + 1."""
    for group, members, u in _run_slices(params, state, group_of, flat):
        if group is None:
            for p, up in zip(members, u.split([p.numel() for p in members])):
                if p.requires_grad:
                    frozen_update_(p, state[p], group_of[p], up)
            continue
        _run_update_(members, state, group, u)


def _run_update_(members: list[torch.Tensor], state: State, group: dict[str, Any], u: torch.Tensor) -> None:
    train = [i for i, p in enumerate(members) if p.requires_grad]
    if not train:
        return
    beta1, lr, wd, eps = group["betas"][0], group["lr"], group["weight_decay"], group["eps"]
    root = _flat([state[p]["exp_avg_sq"] for p in members]).sqrt_()
    u.mul_(usable_root(root, eps))  # 0 where w = 0 (a non-finite u stays non-finite)
    new_m = root.add_(eps).mul_(u)  # u (√v̂ + ε), in the root's buffer
    ps = [members[i] for i in train]
    new_views = _split_as(new_m, members)
    torch._foreach_copy_([state[p]["exp_avg"] for p in ps], [new_views[i] for i in train])
    steps = [state[p]["step"] for p in ps]
    torch._foreach_add_(steps, 1)
    counts = torch.stack(steps).tolist()  # CPU step counters: no device wait
    views = _split_as(u, members)
    by_update: dict[tuple, list[int]] = defaultdict(list)
    for i, t in zip(train, counts):
        by_update[(members[i].dtype, t)].append(i)
    converted: dict[torch.dtype, list[torch.Tensor]] = {}
    for (dtype, t), idx in by_update.items():
        if dtype != u.dtype and dtype not in converted:
            converted[dtype] = _split_as(u.to(dtype), members)
        src = converted.get(dtype, views)
        targets = [members[i] for i in idx]
        if wd != 0 and group["decoupled_weight_decay"]:
            torch._foreach_mul_(targets, 1 - lr * wd)
        torch._foreach_add_(targets, [src[i] for i in idx], alpha=-lr / (1 - beta1**t))


__all__ = ["bucket_candidates", "bucket_update_", "warmup_step_"]
