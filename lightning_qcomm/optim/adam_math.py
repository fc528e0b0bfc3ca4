"""OneBitAdam's per-parameter arithmetic (optim layer; the math is in ``optim.onebit_adam``'s module doc).

Functions of one parameter p, its state (``step``, ``exp_avg`` = m, ``exp_avg_sq`` = v or the frozen v̂) and
its param group (lr η, betas (β1, β2), eps ε, weight decay λ, ``decoupled_weight_decay``):

* ``adamw_update_``: the warm-up step, exactly torch's AdamW/Adam (``torch.optim.adam._single_tensor_adam``'s
  operations in its order, so fp32 parameters match it bit for bit);
* ``momentum_grad``: the gradient that enters m after the freeze, in m's dtype (g + λp when not decoupled);
* ``frozen_weight``: the frozen preconditioner w = 1/(√v̂ + ε), 0 where √v̂ <= ε (no usable variance);
* ``momentum_candidates``: a bucket's new preconditioned momenta u = clip((β1 m + (1-β1) g) · w, ±b), b =
  ``adam_step_bound``, out of place (m stays as it is until the step, which the overlapped sync needs), the vector
  the 1-bit average compresses;
* ``frozen_update_``: the compression-phase update from the averaged u: m <- u (√v̂ + ε),
  p <- p(1 - ηλ) - η/(1-β1^t) u -- AdamW's update with v frozen, p - η m̂/(√v̂ + ε).

Example::

    adamw_update_(p, p.grad, optimizer.state[p], group)
"""

from __future__ import annotations

import math
from typing import Any

import torch


def moment_dtype(p: torch.Tensor) -> torch.dtype:
    """fp32 moments for fp16/bf16 parameters (a variance frozen from fp16 statistics would be coarse or zero), else
    the parameter's dtype."""
    return torch.float32 if p.dtype in (torch.float16, torch.bfloat16) else p.dtype


def adamw_update_(p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
    """One warm-up AdamW (Adam with L2 when not decoupled) step of ``p`` on ``grad``, in place."""
    beta1, beta2 = group["betas"]
    lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
    exp_avg, exp_avg_sq, step_t = state["exp_avg"], state["exp_avg_sq"], state["step"]
    grad = grad.to(exp_avg.dtype)
    step_t += 1
    if wd != 0:
        if group["decoupled_weight_decay"]:
            p.mul_(1 - lr * wd)
        else:
            grad = grad.add(p.to(grad.dtype), alpha=wd)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    step = step_t.item()
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    denom = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(eps)
    p.addcdiv_(exp_avg, denom, value=-step_size)


def momentum_grad(p: torch.Tensor, m: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
    """The gradient that enters m after the freeze: p's gradient (zeros without one: every rank must take part in
    the collective) in m's dtype, plus λp under L2 weight decay. ValueError for a sparse gradient."""
    if p.grad is not None and p.grad.is_sparse:
        raise ValueError("OneBitAdam: sparse gradients are not supported; allowed: dense gradients")
    grad = p.grad if p.grad is not None else torch.zeros_like(p)
    grad = grad.to(m.dtype)
    if group["weight_decay"] != 0 and not group["decoupled_weight_decay"]:
        grad = grad.add(p.to(m.dtype), alpha=group["weight_decay"])
    return grad


def frozen_weight(state: dict[str, Any], group: dict[str, Any]) -> torch.Tensor:
    """w = 1/(√v̂ + ε) where √v̂ > ε, else 0, in v̂'s dtype: the frozen preconditioner of the compression phase.

    A coordinate with √v̂ <= ε (no gradient, or one below ε, through all of the warm-up: a vocabulary row never seen,
    an attention key bias whose gradient is zero up to rounding) has no usable variance; w = 0 leaves it out of the
    1-bit average and keeps it where it is (DeepSpeed's ``exp_avg_mask``, chosen from v̂ itself)."""
    return weight_from_root(state["exp_avg_sq"].sqrt(), group["eps"])


def weight_from_root(root: torch.Tensor, eps: float) -> torch.Tensor:
    """``frozen_weight`` from √v̂ (any shape): 1/(√v̂ + ε) where √v̂ > ε, else 0."""
    return torch.where(root > eps, (root + eps).reciprocal_(), 0.0)


def weight_from_root_(root: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight_from_root`` in ``root``'s own buffer (returned; bit for bit the same values): one mask of bools besides
    it, where the out-of-place form holds two more copies of the root at once."""
    unusable = (root > eps).logical_not_()  # NaN included, as where(root > eps, ..., 0) has it
    return root.add_(eps).reciprocal_().masked_fill_(unusable, 0.0)


def usable_root(root: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight_from_root(root, eps) != 0`` as bools, without forming w: √v̂ > ε and 1/(√v̂ + ε) != 0, that is
    √v̂ > ε and finite (√v̂ <= √max of the dtype keeps 1/(√v̂ + ε) above its smallest normal)."""
    return (root > eps).logical_and_(root != torch.inf)


def adam_step_bound(group: dict[str, Any]) -> float:
    """The largest abs(m̂/√v̂) Adam's own update reaches (Kingma & Ba 2015, §2.1): (1-β1)/√(1-β2) when that exceeds 1
    (a gradient after a long silence), else 1. After the freeze u = m/(√v̂ + ε) is clipped to it: a coordinate
    whose gradient outgrew its frozen v̂ takes at most the step Adam would, and cannot inflate its chunk's scale."""
    beta1, beta2 = group["betas"]
    return max(1.0, (1 - beta1) / math.sqrt(1 - beta2))


def momentum_candidates(
    params: list[torch.Tensor], state: dict[torch.Tensor, dict[str, Any]], group_of: dict[torch.Tensor, dict[str, Any]]
) -> torch.Tensor:
    """The preconditioned new momenta u = clip((β1 m + (1-β1) g) · w, ±``adam_step_bound``) of ``params`` (m as it is
    for one with ``requires_grad=False``; w = ``frozen_weight``), concatenated in a new fp32 tensor, without writing
    m: what the 1-bit average compresses (a bucket, in layout order)."""
    flat = torch.empty(sum(p.numel() for p in params), dtype=torch.float32, device=params[0].device)
    offset = 0
    for p in params:
        st, group = state[p], group_of[p]
        m = st["exp_avg"].detach()
        out = flat[offset : offset + p.numel()].view_as(m)
        offset += p.numel()
        new_m = m if not p.requires_grad else torch.lerp(m, momentum_grad(p, m, group), 1 - group["betas"][0])
        if m.dtype == torch.float32:
            torch.mul(new_m, frozen_weight(st, group), out=out)
        else:
            out.copy_(new_m * frozen_weight(st, group))
        bound = adam_step_bound(group)
        out.copy_(torch.where(out.isfinite(), out.clamp(-bound, bound), out))  # non-finite stays non-finite
    return flat


def frozen_update_(p: torch.Tensor, state: dict[str, Any], group: dict[str, Any], u: torch.Tensor) -> None:
    """The compression-phase update of ``p`` from its averaged preconditioned momentum ``u`` (any shape of p's size);
    counts the step. Where w = 0 (``frozen_weight``) u is set to 0. Then m <- u · (√v̂ + ε) (0 there) and
    p <- p (1 - ηλ) - η/(1-β1^t) · u, i.e. AdamW's p - η m̂ / (√v̂ + ε) with v frozen."""
    beta1 = group["betas"][0]
    lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
    m = state["exp_avg"]
    u = u.view_as(m)
    state["step"] += 1
    w = frozen_weight(state, group)
    u.mul_(w != 0)  # 0 there (a non-finite u stays non-finite)
    torch.mul(u, state["exp_avg_sq"].sqrt().add_(eps), out=m)
    if wd != 0 and group["decoupled_weight_decay"]:
        p.mul_(1 - lr * wd)
    p.add_(u.to(p.dtype), alpha=-lr / (1 - beta1 ** state["step"].item()))


__all__ = [
    "adam_step_bound",
    "adamw_update_",
    "moment_dtype",
    "frozen_update_",
    "frozen_weight",
    "momentum_candidates",
    "momentum_grad",
    "usable_root",
    "weight_from_root",
    "weight_from_root_",
]
