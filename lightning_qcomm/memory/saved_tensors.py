"""Saved-tensor storage for activation quantization: the quantized container and the eligibility rules.

What this file owns:

* ``QuantizedActivation``: one saved activation stored as a codec ``Packed`` (b-bit codes + per-block
  scales) plus the layout needed to rebuild it. ``restore()`` is ``codec.decode`` written back into the
  original strides, so autograd's backward formulas see a tensor of the same shape, dtype and layout.
  With the uniform codec (per block of B elements: lo = min, unit = (max - min)/(2^b - 1), stochastic
  rounding), ``E[restore()] = x`` and ``|restore() - x| < unit`` element-wise; a block holding NaN/Inf
  decodes to NaN everywhere, so a non-finite activation stays non-finite in backward.
* ``is_parameter_like``: a saved tensor is never quantized when it is a ``Parameter``, a view of one
  (``t._base`` is a Parameter: under FSDP2 ``nn.Linear`` saves ``weight.t()`` of the unsharded parameter),
  or a chain of view/cast autograd nodes ending at a parameter's ``AccumulateGrad`` (the autocast weight
  cast). Quantizing those would pin a second copy of the weight and perturb dX = dY W.
* ``derives_from``: whether a save of an intercepted op is that op's input (the only save it quantizes).
* ``quantizable_reason``: the other rules (floating dtype, ``numel >= min_numel``, an intermediate of the
  autograd graph, a dense layout), returning why a tensor is kept, or None when it may be quantized.
* ``SaveRecord``: one save seen by the quantizer and the decision taken (``ActivationQuantizer.records``).
* ``SavedBytes`` and ``count_saved_tensors``: byte accounting of what autograd saves (each save counted
  once at its own dtype; parameters excluded: they are not activations and are held by the module anyway).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from lightning_qcomm.codecs import Codec, Packed
from lightning_qcomm.codecs.base import FLOAT_DTYPES
from lightning_qcomm.memory.save_batch import BatchedActivation, in_strides

# autograd nodes that only re-view or re-type their single input (a parameter seen through them is still it)
_VIEW_OR_CAST_NODES = (
    "TBackward",
    "ViewBackward",
    "UnsafeViewBackward",
    "TransposeBackward",
    "PermuteBackward",
    "ExpandBackward",
    "UnsqueezeBackward",
    "SqueezeBackward",
    "ReshapeAliasBackward",
    "AliasBackward",
    "ToCopyBackward",
    "AsStridedBackward",
    "SliceBackward",
    "SelectBackward",
    "CloneBackward",
)
_MAX_NODE_WALK = 6


@dataclass(frozen=True)
class SaveRecord:
    """One tensor autograd saved while the quantizer was active, and what was done with it."""

    site: int | None  # quantized site index, None when kept
    module: str  # innermost running module (qualified name, or class name for the root)
    op: str  # intercepted op name, or "other"
    shape: tuple[int, ...]
    dtype: torch.dtype
    action: str  # "quantized" | "kept"
    reason: str  # why kept ("parameter", "attention", "small", ...), or the op kind when quantized
    bits: int | None = None
    parameter: bool = False


def tensor_nbytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s elements at its own dtype (what autograd holds when it saves ``t``)."""
    return t.numel() * t.element_size()


def _view_or_cast_origin(t: torch.Tensor, stop=None):
    """Follow ``t.grad_fn`` through view/cast nodes with a single input (at most ``_MAX_NODE_WALK``).

    Returns the node ``stop`` if the walk meets it, the ``AccumulateGrad`` node of a leaf if it ends at one,
    else None (a computing node, several inputs, no ``grad_fn``, or too long a chain).
    """
    node = t.grad_fn
    for _ in range(_MAX_NODE_WALK):
        if node is None:
            return None
        if stop is not None and node is stop:
            return node
        name = type(node).__name__
        if name == "AccumulateGrad":
            return node
        if not name.startswith(_VIEW_OR_CAST_NODES):
            return None
        parents = [n for n, _ in node.next_functions if n is not None]
        if len(parents) != 1:
            return None
        node = parents[0]
    return None


def is_parameter_like(t: torch.Tensor) -> bool:
    """True if ``t`` is a parameter, a view of one, or a view/cast chain of one (see module docstring)."""
    if isinstance(t, nn.Parameter):
        return True
    base = t._base
    if base is not None and isinstance(base, nn.Parameter):
        return True
    origin = _view_or_cast_origin(t)
    return origin is not None and isinstance(origin.variable, nn.Parameter)


def derives_from(t: torch.Tensor, x: torch.Tensor) -> bool:
    """True if the saved tensor ``t`` is ``x`` itself, shares ``x``'s storage (a view), or reaches ``x``
    through view/cast autograd nodes only (a reshape copy, an autocast cast).

    This is how an op's *input* is told apart from its other saves of the same size: a computed weight
    (``weight_norm``, a merged LoRA ``W + BA``, a masked weight) has its own storage and a computing node.
    """
    if t is x:
        return True
    plain = type(t) is type(x) is torch.Tensor and t.layout == x.layout == torch.strided and t.device == x.device
    if plain and t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
        return True
    origin = _view_or_cast_origin(t, stop=x.grad_fn)
    if origin is None:
        return False
    if x.grad_fn is not None:
        return origin is x.grad_fn
    return type(origin).__name__ == "AccumulateGrad" and origin.variable is x


def is_dense(t: torch.Tensor) -> bool:
    """True if ``t``'s elements fill its memory span without gaps or overlaps (any dim order)."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def quantizable_reason(t: torch.Tensor, min_numel: int, temporary: bool = False) -> str | None:
    """Why ``t`` must stay in full precision, or None if it may be quantized.

    Rules: a parameter (or a view / cast of one) is never quantized; nor a non-floating tensor (indices,
    masks), a tensor with fewer than ``min_numel`` elements, a tensor that is not an intermediate of the
    autograd graph (no ``grad_fn``, or a view of a tensor without one: inputs, buffers and leaves are held
    by their owners anyway, so a quantized copy would only add memory), or a tensor whose layout overlaps (expanded views).
    ``temporary``: the save is known to be held by autograd alone (dropout's mask), so the leaf rule is skipped.
    """
    if is_parameter_like(t):
        return "parameter"
    if t.dtype not in FLOAT_DTYPES:
        return "not floating"
    if t.numel() < min_numel:
        return "small"
    if not temporary and (t.grad_fn is None or (t._base is not None and t._base.grad_fn is None)):  # a leaf or its view
        return "not an autograd intermediate"
    if not is_dense(t):
        return "overlapping layout"
    return None


@dataclass(eq=False)
class QuantizedActivation:
    """A saved activation held as b-bit codes plus per-block scales; ``restore()`` rebuilds it."""

    packed: Packed
    codec: Codec
    stride: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Bytes held: packed codes (with padding) + fp32 scales."""
        return self.packed.nbytes

    @property
    def original_nbytes(self) -> int:
        return self.packed.numel * torch.empty((), dtype=self.packed.dtype).element_size()

    def restore(self) -> torch.Tensor:
        """``codec.decode`` in the original shape, dtype and strides."""
        return in_strides(self.codec.decode(self.packed), self.stride)


def quantize_activation(t: torch.Tensor, codec: Codec, seed: int) -> QuantizedActivation:
    """Encode ``t`` (dense, floating) with ``codec`` under the counter-based ``seed``."""
    return QuantizedActivation(packed=codec.encode(t.detach(), seed=seed), codec=codec, stride=tuple(t.stride()))


def restore(saved: QuantizedActivation | BatchedActivation | torch.Tensor) -> torch.Tensor:
    """The tensor a saved-tensor hook hands back to autograd (full-precision tensors pass through)."""
    return saved.restore() if isinstance(saved, (QuantizedActivation, BatchedActivation)) else saved


class SharedSaves:
    """One forward's quantized saves by tensor identity, so a tensor saved by several ops (the input of the
    Q, K and V projections; a hand-written RMS norm's ``x.pow(2)`` and ``x * rsqrt(...)``) is stored once.

    A save is looked up by its base tensor (``t._base`` for a view, else ``t``; held by weak reference, so a
    freed tensor whose memory is reused never matches), the base's version counter (an in-place write in
    between makes a new entry) and the view's offset, shape and strides.

    Example::

        cache = SharedSaves()
        cache.put(x, stored)
        assert cache.get(x.view(-1, x.shape[-1])) is None   # another view of x: its own entry
        assert cache.get(x) is stored
    """

    def __init__(self) -> None:
        self._entries: dict[tuple, tuple] = {}

    @staticmethod
    def _key(t: torch.Tensor) -> tuple[torch.Tensor, tuple]:
        base = t._base if t._base is not None else t
        return base, (id(base), base._version, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)

    def get(self, t: torch.Tensor):
        base, key = self._key(t)
        entry = self._entries.get(key)
        return entry[1] if entry is not None and entry[0]() is base else None

    def put(self, t: torch.Tensor, value) -> None:
        base, key = self._key(t)
        self._entries[key] = (weakref.ref(base), value)

    def clear(self) -> None:
        self._entries.clear()


@dataclass
class SavedBytes:
    """Bytes of saved activations in one forward pass (parameters excluded).

    ``baseline``: what autograd would hold without quantization (each save at its own dtype);
    ``stored``: what it holds with it. ``quantized_*``: the same two numbers over the quantized tensors
    only, whose ratio is the codec's ``nbytes / (4 * numel)`` for fp32 activations.
    """

    baseline: int = 0
    stored: int = 0
    quantized_baseline: int = 0
    quantized_stored: int = 0
    quantized_tensors: int = 0
    kept_tensors: int = 0
    quantized_numel: int = 0
    quantized_code_bits: int = 0  # Σ numel · bits over the quantized tensors
    exact_by_rule: int = 0  # bytes kept exact because attention or a loss saved them (op_rules)

    @property
    def avg_bits(self) -> float:
        """Element-weighted mean code width of the quantized tensors (0 when none)."""
        return self.quantized_code_bits / self.quantized_numel if self.quantized_numel else 0.0

    @property
    def ratio(self) -> float:
        """stored / baseline (1.0 when nothing was saved)."""
        return self.stored / self.baseline if self.baseline else 1.0

    @property
    def coverage(self) -> float:
        """Share of the saved bytes outside attention and losses that is quantized (1.0 when there are none):
        quantized_baseline / (baseline - exact_by_rule)."""
        eligible = self.baseline - self.exact_by_rule
        return self.quantized_baseline / eligible if eligible else 1.0

    @property
    def quantized_ratio(self) -> float:
        return self.quantized_stored / self.quantized_baseline if self.quantized_baseline else 1.0

    def add_kept(self, nbytes: int, by_rule: bool = False) -> None:
        self.exact_by_rule += nbytes if by_rule else 0
        self.baseline += nbytes
        self.stored += nbytes
        self.kept_tensors += 1

    def add_quantized(self, original_nbytes: int, stored_nbytes: int, numel: int, bits: int) -> None:
        self.quantized_numel += numel
        self.quantized_code_bits += numel * bits
        self.baseline += original_nbytes
        self.stored += stored_nbytes
        self.quantized_baseline += original_nbytes
        self.quantized_stored += stored_nbytes
        self.quantized_tensors += 1


@contextmanager
def count_saved_tensors() -> Iterator[SavedBytes]:
    """Count the bytes autograd saves inside the block without changing anything (a measurement baseline).

    A tensor saved by several ops is counted once (``SharedSaves``), as autograd holds it once.

    Example::

        with count_saved_tensors() as saved:
            loss = model(x).sum()
        saved.baseline        # bytes autograd holds for backward
    """
    stats = SavedBytes()
    seen = SharedSaves()

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not is_parameter_like(t) and seen.get(t) is None:
            seen.put(t, True)
            stats.add_kept(tensor_nbytes(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, _identity):
        yield stats


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t
