"""OneBitAdam's per-parameter arithmetic (optim layer; the math is in ``optim.onebit_adam``'s module doc).

Three functions of one parameter p, its state (``step``, ``exp_avg`` = m, ``exp_avg_sq`` = v or the frozen v̂) and
its param group (lr η, betas (β1, β2), eps ε, weight decay λ, ``decoupled_weight_decay``):

* ``adamw_update_``: the warm-up step, exactly torch's AdamW/Adam (``torch.optim.adam._single_tensor_adam``'s
  operations in its order, so fp32 parameters match it bit for bit);
* ``momentum_grad``: the gradient that enters m after the freeze, in m's dtype (g + λp when not decoupled);
* ``momentum_candidates``: a bucket's new momenta, out of place (overlap: m must stay as it is until the step);
* ``frozen_update_``: the compression-phase update with the averaged m, p <- p(1 - ηλ) - η/(1-β1^t) m/(√v̂ + ε).

The compression phase's m <- β1 m + (1-β1) g is ``m.lerp_(g, 1 - β1)`` inline, or ``torch.lerp(m, g, 1 - β1)`` when
the new m must not overwrite the old one yet (overlap): the same kernel, the same values.

Example::

    adamw_update_(p, p.grad, optimizer.state[p], group)
"""

from __future__ import annotations

from typing import Any

import torch


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


def momentum_candidates(
    params: list[torch.Tensor], state: dict[torch.Tensor, dict[str, Any]], group_of: dict[torch.Tensor, dict[str, Any]]
) -> torch.Tensor:
    """The new momenta β1 m + (1-β1) g of ``params`` (m as it is for one with ``requires_grad=False``), concatenated
    in a new fp32 tensor, without writing m: what the inline step's ``m.lerp_`` followed by the fused bucket copy
    would hold (fp32 momenta are written straight into their slice: one pass fewer)."""
    flat = torch.empty(sum(p.numel() for p in params), dtype=torch.float32, device=params[0].device)
    offset = 0
    for p in params:
        m = state[p]["exp_avg"].detach()
        out = flat[offset : offset + p.numel()].view_as(m)
        offset += p.numel()
        if not p.requires_grad:
            out.copy_(m)
            continue
        group = group_of[p]
        grad = momentum_grad(p, m, group)
        if m.dtype == torch.float32:
            torch.lerp(m, grad, 1 - group["betas"][0], out=out)
        else:
            out.copy_(torch.lerp(m, grad, 1 - group["betas"][0]))
    return flat


def frozen_update_(p: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
    """The compression-phase update of ``p`` with its (averaged) m and frozen v̂; counts the step."""
    beta1 = group["betas"][0]
    lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
    state["step"] += 1
    if wd != 0 and group["decoupled_weight_decay"]:
        p.mul_(1 - lr * wd)
    # recomputed each step (two cheap passes) rather than cached: a cache would cost another d floats
    denom = state["exp_avg_sq"].sqrt().add_(eps)
    p.addcdiv_(state["exp_avg"], denom, value=-lr / (1 - beta1 ** state["step"].item()))


__all__ = ["adamw_update_", "frozen_update_", "momentum_candidates", "momentum_grad"]
