"""FP8 storage of accumulated gradients between micro-batches (AGoQ QuanGrad, local accumulation).

With gradient accumulation over k micro-batches, ``p.grad`` normally stays in fp32 from the first backward
to the optimizer step, i.e. through the next micro-batches' forwards, where activation memory peaks.
``FP8GradientStore`` holds it blockwise in FP8 instead (per block: s = amax / fmax, code = fp8(g / s); see
``codecs.fp8``), and accumulates in high precision, as AGoQ does:

    after a non-final backward:   G ← Q(p.grad);  p.grad ← None          (1 byte + 4/B per element)
    before the next backward:     p.grad ← D(G)   (fp32), and autograd adds the new micro-batch in fp32

so the sum is never formed in FP8. Each requantization adds |D(Q(g)) - g| <= 2^-(m+1) · max(|g|, s·2^emin)
element-wise (round to nearest; e4m3: m = 3, emin = -6). The last backward runs on the restored fp32 grad,
so DDP reduces the accumulated sum as usual. A block holding NaN/Inf decodes to NaN (never finite).

Only plain dense gradients with at least ``min_numel`` elements are stored (FSDP2's sharded DTensor grads and
sparse grads stay as they are).
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_qcomm.codecs import Codec, Packed


class FP8GradientStore:
    """Hold ``p.grad`` of many parameters as FP8 ``Packed`` between backward passes."""

    def __init__(self, codec: Codec, min_numel: int = 1) -> None:
        self.codec = codec
        self.min_numel = min_numel
        self._stored: list[tuple[nn.Parameter, Packed]] = []

    @property
    def holding(self) -> bool:
        return bool(self._stored)

    @property
    def nbytes(self) -> int:
        """Bytes held now (codes + scales)."""
        return sum(p.nbytes for _, p in self._stored)

    @property
    def original_nbytes(self) -> int:
        """Bytes the same gradients take as ``p.grad`` tensors."""
        return sum(g.numel * torch.empty((), dtype=g.dtype).element_size() for _, g in self._stored)

    def _eligible(self, p: nn.Parameter) -> bool:
        g = p.grad
        return (
            g is not None
            and type(g) is torch.Tensor
            and g.layout == torch.strided
            and g.is_floating_point()
            and g.numel() >= self.min_numel
        )

    def compress(self, params) -> None:
        """Replace every eligible ``p.grad`` by its FP8 encoding (``p.grad`` becomes None)."""
        if self._stored:
            raise RuntimeError("FP8GradientStore.compress() called while still holding gradients; restore() first")
        for p in params:
            if self._eligible(p):
                self._stored.append((p, self.codec.encode(p.grad)))
                p.grad = None

    def restore(self) -> None:
        """Put the decoded fp32 (grad dtype) gradients back into ``p.grad``."""
        for p, packed in self._stored:
            g = self.codec.decode(packed)
            p.grad = g if p.grad is None else p.grad.add_(g)
        self._stored = []
