"""Recompute-from-quantized-input for norms and activation functions (AGoQ: store only the input, b-bit).

For y = f(x, θ) with f one of LayerNorm, RMSNorm, GELU, SiLU, the forward computes y exactly from x and
stores only x̃ = Q(x) (``QuantizedActivation``) plus references to θ (parameters, never quantized). The
backward recomputes f at x̃ under autograd and returns

    dx = J_x f(x̃, θ)ᵀ g,    dθ = J_θ f(x̃, θ)ᵀ g,

i.e. the *exact* gradient of f at the quantized point. torch's own LayerNorm instead caches the mean and
1/σ of the unquantized x; combining those with a quantized x̃ (what a saved-tensor hook alone gives) is
not the gradient at any single point, and AGoQ shows the recomputed form has the tighter error bound.
RMSNorm on CPU is a composite that saves x, x·r and r (three tensors); here only x̃ is held.
For GELU / SiLU torch's kernels already keep just the input, so the hook path and this path give the
same gradient for the same codes; this path is used for them too so that "only the quantized input is
held" is a property of the op, not of the kernel.

``stored`` may also be a plain tensor (no quantization): the backward is then bit-identical to torch's.
Autocast state is captured in forward and re-entered for the recompute. While recomputing,
``bypass()`` is on so the activation quantizer leaves the recompute graph alone (no nested
quantization, no byte counting). ``stored`` lives as long as the graph (autograd frees ``ctx`` with it), so a
second backward through a retained graph (``retain_graph=True``) recomputes again. Double backward
(differentiating the gradient) is not supported.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from lightning_qcomm.memory.saved_tensors import QuantizedActivation, restore

_STATE = threading.local()


def bypass_active() -> bool:
    """True while this thread recomputes (the quantizer must pass every op and save through)."""
    return getattr(_STATE, "bypass", 0) > 0


@contextmanager
def bypass() -> Iterator[None]:
    _STATE.bypass = getattr(_STATE, "bypass", 0) + 1
    try:
        yield
    finally:
        _STATE.bypass -= 1


def _autocast_state(device_type: str) -> tuple[bool, torch.dtype]:
    return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


class _RecomputeFromStored(torch.autograd.Function):
    """forward(fn, stored, x, *params) = fn(x, *params); backward differentiates fn at restore(stored)."""

    @staticmethod
    def forward(ctx, fn, stored, x, *params):  # noqa: D102
        ctx.fn = fn
        ctx.stored = stored
        ctx.device_type = x.device.type
        ctx.autocast = _autocast_state(x.device.type)
        ctx.save_for_backward(*params)
        return fn(x, *params)

    @staticmethod
    def backward(ctx, grad_out):  # noqa: D102
        params = ctx.saved_tensors
        needs = ctx.needs_input_grad[2:]
        x = restore(ctx.stored).detach().requires_grad_(needs[0])
        ps = [p.detach().requires_grad_(n) if p is not None else None for p, n in zip(params, needs[1:])]
        enabled, dtype = ctx.autocast
        with torch.enable_grad(), torch.autocast(ctx.device_type, dtype=dtype, enabled=enabled), bypass():
            y = ctx.fn(x, *ps)
        inputs = [t for t, n in zip([x, *ps], needs) if n and t is not None]
        grads = iter(torch.autograd.grad(y, inputs, grad_out, allow_unused=True)) if inputs else iter(())
        out = [next(grads) if n and t is not None else None for t, n in zip([x, *ps], needs)]
        return (None, None, *out)


def recompute_from_stored(
    fn: Callable[..., torch.Tensor],
    x: torch.Tensor,
    params: tuple[torch.Tensor | None, ...],
    stored: QuantizedActivation | torch.Tensor,
) -> torch.Tensor:
    """``fn(x, *params)`` whose backward uses only ``stored`` (a quantized copy of x, or x itself)."""
    return _RecomputeFromStored.apply(fn, stored, x, *params)


# ---------------------------------------------------------------------------------- op bindings


def layer_norm_fn(normalized_shape, eps: float) -> Callable[..., torch.Tensor]:
    """f(x, w, b) = F.layer_norm(x, normalized_shape, w, b, eps)."""
    return lambda x, w, b: torch.nn.functional.layer_norm(x, normalized_shape, w, b, eps)


def rms_norm_fn(normalized_shape, eps: float | None) -> Callable[..., torch.Tensor]:
    """f(x, w) = F.rms_norm(x, normalized_shape, w, eps)."""
    return lambda x, w: torch.nn.functional.rms_norm(x, normalized_shape, w, eps)


def activation_fn(func: Callable[..., torch.Tensor], *args, **kwargs) -> Callable[..., torch.Tensor]:
    """f(x) = func(x, *args, **kwargs) (GELU with its ``approximate``, SiLU)."""
    return lambda x: func(x, *args, **kwargs)
