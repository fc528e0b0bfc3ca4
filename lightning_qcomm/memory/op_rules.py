"""Which saved tensors the activation quantizer stores in low precision, decided by the op that saves them (memory
layer; docs/design.md, "What activation quantization stores").

A tensor autograd saves is classified by the outermost torch function running when it was saved (what a
``TorchFunctionMode`` sees), whichever module calls it:

* **quantized**: a projection's activation operand (``linear``, ``conv*``, ``addmm`` and kin, ``matmul`` with a
  parameter operand), a norm's input, element-wise ops (activation functions, products, the arithmetic of
  hand-written norms), dropout's float mask;
* **exact by rule**: attention (``scaled_dot_product_attention``, ``softmax``, a matmul of two activations) and
  losses (``cross_entropy``, ``log_softmax``, ``*_loss``): their error would not average out;
* **exact, not covered**: every other op (embedding, gather, ...).

Whatever the op, parameters, small tensors, leaves and non-floating tensors stay exact
(``saved_tensors.quantizable_reason``). The full op lists: docs/design.md, "Module notes".

Example::

    rule = rule_for(torch.Tensor.__mul__, (a, b), {})    # OpRule(kind="elementwise", op="mul", ...)
    rule_for(F.scaled_dot_product_attention, (q, k, v), {}).exact   # "attention"
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lightning_qcomm.memory.saved_tensors import is_parameter_like

# ops with a recompute form (``recompute.recompute_from_stored``): the site kind is the op's name
RECOMPUTABLE = frozenset({"layer_norm", "rms_norm", "gelu", "silu"})
# projections whose operands have fixed roles: name -> index of the activation input
_PROJECTIONS = {
    "linear": 0,
    "conv1d": 0,
    "conv2d": 0,
    "conv3d": 0,
    "conv_transpose1d": 0,
    "conv_transpose2d": 0,
    "conv_transpose3d": 0,
    "bilinear": 0,
    "addmm": 1,
    "addbmm": 1,
    "baddbmm": 1,
    "addmv": 1,
}
_MATMULS = frozenset({"matmul", "mm", "bmm", "mv", "einsum", "tensordot", "inner", "dot"})
_NORMS = frozenset({"layer_norm", "rms_norm", "group_norm", "batch_norm", "instance_norm", "local_response_norm"})
ELEMENTWISE = frozenset(
    {
        # activation functions
        "gelu", "silu", "relu", "relu6", "leaky_relu", "elu", "selu", "celu", "mish", "hardswish", "hardsigmoid",
        "hardtanh", "softplus", "softsign", "glu", "logsigmoid", "tanh", "sigmoid", "erf", "erfc", "prelu",
        "rrelu", "threshold", "sin", "cos", "clamp", "clip",
        # products, quotients and the arithmetic of hand-written norms and activations
        "mul", "multiply", "div", "divide", "true_divide", "truediv", "addcmul", "addcdiv", "pow", "square",
        "sqrt", "rsqrt", "exp", "expm1", "log", "log1p", "reciprocal", "var", "std", "var_mean", "std_mean",
        "norm", "abs", "maximum", "minimum", "hypot",
    }
)  # fmt: skip
# dropout's saved mask (on CPU a float tensor of 0 and 1/(1-p)) is a temporary nobody else holds
DROPOUTS = frozenset({"dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout"})
_ATTENTION = frozenset(
    {"scaled_dot_product_attention", "multi_head_attention_forward", "softmax", "softmin", "_softmax"}
)
_LOSSES = frozenset({"cross_entropy", "log_softmax", "nll_loss", "kl_div", "binary_cross_entropy"})
_REVERSED = frozenset({"rmul", "rtruediv", "rdiv", "rpow", "rmatmul", "rsub", "radd"})
_IN_PLACE_DUNDER = frozenset("i" + n for n in ELEMENTWISE | _MATMULS)  # __imul__, __imatmul__, ...


@dataclass(frozen=True)
class OpRule:
    """What to do with the saves of one call.

    ``exact``: None, or why every save stays exact (``"attention"`` / ``"loss"``); ``kind``: the site kind
    (``linear``, ``matmul``, ``norm``, ``elementwise``, ``dropout``, or a recomputable op's name); ``x``: the activation
    input whose saves (and views/casts of it) are quantized, or None for "every activation it saves".
    """

    op: str
    kind: str = ""
    exact: str | None = None
    x: torch.Tensor | None = None


@functools.cache
def op_name(func: Callable) -> str:
    """``torch.Tensor.__rmul__`` -> ``mul``, ``torch.Tensor.mul_`` -> ``mul``, ``F.linear`` -> ``linear``
    (cached per function: it runs for every torch call of a quantized forward)."""
    name = getattr(func, "__name__", "")
    if name.startswith("__") and name.endswith("__"):
        name = name[2:-2]
        if name in _REVERSED or name in _IN_PLACE_DUNDER:
            name = name[1:]
    elif name.endswith("_") and not name.startswith("_"):
        name = name[:-1]
    return name


def _tensors(args) -> list[torch.Tensor]:
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):  # einsum(eq, [a, b])
            out.extend(t for t in a if isinstance(t, torch.Tensor))
    return out


def rule_for(func: Callable, args: tuple, kwargs: dict) -> OpRule | None:
    """The rule for one call (module docstring), or None for an op the quantizer leaves alone."""
    name = op_name(func)
    if name in _ATTENTION:
        return OpRule(name, exact="attention")
    if name in _LOSSES or name.endswith("_loss"):
        return OpRule(name, exact="loss")
    if name in RECOMPUTABLE or name in _NORMS or name in _PROJECTIONS:
        i = _PROJECTIONS.get(name, 0)
        x = args[i] if len(args) > i else kwargs.get("input")
        if not isinstance(x, torch.Tensor):
            return None
        kind = name if name in RECOMPUTABLE else "norm" if name in _NORMS else "linear"
        return OpRule(name, kind=kind, x=x)
    if name in _MATMULS:
        operands = _tensors(args)
        activations = [t for t in operands if t.requires_grad and not is_parameter_like(t)]
        if len(activations) >= 2:  # Q·Kᵀ, P·V: attention written with matmuls
            return OpRule(name, exact="attention")
        if len(activations) == 1 and len(operands) >= 2:
            return OpRule(name, kind="matmul", x=activations[0])
        return None
    if name in ELEMENTWISE:
        return OpRule(name, kind="elementwise")
    if name in DROPOUTS:
        return OpRule(name, kind="dropout")
    return None


__all__ = ["ELEMENTWISE", "RECOMPUTABLE", "OpRule", "op_name", "rule_for"]
