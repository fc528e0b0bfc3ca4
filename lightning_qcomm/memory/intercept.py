"""How the activation quantizer intercepts torch functions, and how it reads their arguments (memory adapters).

``_QuantMode`` (a ``TorchFunctionMode``) asks ``op_rules.rule_for`` about every call while a forward runs,
routes the calls that have a rule to the quantizer's ``_handle`` and lets every other call through;
``_bind`` gives the recompute form (fn, params) of a norm or activation call, and ``_norm_r2`` the
norm's r² for the budget policy (``bit_allocation.norm_r2``).

Example::

    with _QuantMode(quantizer):   # inside ActivationQuantizer.begin() ... end()
        y = F.linear(x, w)        # -> quantizer._handle(OpRule("linear", "linear", x=x), F.linear, (x, w), {})
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from lightning_qcomm.memory import bit_allocation as alloc
from lightning_qcomm.memory.op_rules import rule_for
from lightning_qcomm.memory.recompute import activation_fn, bypass_active, layer_norm_fn, rms_norm_fn

if TYPE_CHECKING:
    from lightning_qcomm.memory.quantizer import ActivationQuantizer

_NORMS = ("layer_norm", "rms_norm")
_SIG_LAYER_NORM = inspect.signature(F.layer_norm)
_SIG_RMS_NORM = inspect.signature(F.rms_norm)
_SIG_SILU = inspect.signature(F.silu)


class _QuantMode(TorchFunctionMode):
    """Routes the intercepted ops of ``_KINDS`` to the quantizer; everything else runs unchanged."""

    def __init__(self, owner: ActivationQuantizer) -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if bypass_active() or not torch.is_grad_enabled():
            return func(*args, **kwargs)
        rule = rule_for(func, args, kwargs)
        if rule is None:
            return func(*args, **kwargs)
        return self.owner._handle(rule, func, args, kwargs)


def _bind(kind: str, func, args: tuple, kwargs: dict):
    """(fn, params) for the recompute path of a norm / activation call, or None when it cannot recompute."""
    if kind == "layer_norm":
        a = _SIG_LAYER_NORM.bind(*args, **kwargs)
        a.apply_defaults()
        p = a.arguments
        return layer_norm_fn(p["normalized_shape"], p["eps"]), (p["weight"], p["bias"])
    if kind == "rms_norm":
        a = _SIG_RMS_NORM.bind(*args, **kwargs)
        a.apply_defaults()
        p = a.arguments
        return rms_norm_fn(p["normalized_shape"], p["eps"]), (p["weight"],)
    if kind == "silu":
        a = _SIG_SILU.bind(*args, **kwargs)
        a.apply_defaults()
        return None if a.arguments["inplace"] else (activation_fn(F.silu), ())
    if kind == "gelu":
        rest = {k: v for k, v in kwargs.items() if k != "input"}
        return activation_fn(F.gelu, *args[1:], **rest), ()
    return None


def _norm_r2(kind: str, x: torch.Tensor, args: tuple, kwargs: dict) -> float:
    """``alloc.norm_r2`` with the call's normalized_shape and eps (RMS norm's default eps: the dtype's); 1 for
    other ops."""
    if kind not in _NORMS:
        return 1.0
    sig = _SIG_LAYER_NORM if kind == "layer_norm" else _SIG_RMS_NORM
    a = sig.bind(*args, **kwargs)
    a.apply_defaults()
    eps = a.arguments["eps"]
    if eps is None:
        eps = torch.finfo(x.dtype).eps
    return alloc.norm_r2(x, len(a.arguments["normalized_shape"]), eps, rms=kind == "rms_norm")


__all__: list[str] = []
