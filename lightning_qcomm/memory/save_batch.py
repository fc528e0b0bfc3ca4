"""Saved activations encoded a layer at a time: one launch set for many saves (memory adapters; docs/design.md,
"Activation quantization").

On a GPU each quantized save alone costs an encode of two launches and, in backward, a decode of one: a GPT-2
step's 122 saves are 366 launches, 27% more than the whole DDP step. ``PendingSaves`` holds a layer's saves as
they come and encodes them together when the layer's forward ends (``flush``): one copy of the saves into a
staging row, then the codec layer's segment ops (``codecs.rows_segments``): every save a quantized segment with
its own seed, so each save's codes are ``codec.encode(t, seed)``'s bit for bit. In backward the first restore of
a batch decodes all of its saves in one launch into one buffer and hands out views; the buffer is held until
every save of the batch has been restored once, then lives while a view does (a later restore decodes again).

Memory: a layer's saves stay in full precision until its forward ends (the staging copy is freed after the
encode), and in backward its decoded saves live together while any is in use: at most one layer's activations
in full precision at a time, beside every other layer's quantized ones. ``ActivationQuantConfig(batch_saves=False)``
encodes each save at once instead. The quantizer batches only where the segment kernels apply (CUDA; elsewhere
a batch gives no launch back) and only in a model with layers to end its batches: the children of its
``nn.ModuleList``s (a transformer's blocks). A batch also ends at ``MAX_PENDING`` saves and with the forward.

Example::

    pending = PendingSaves()
    stored = pending.add(t, codec, seed)     # a BatchedActivation; t is held until the flush
    pending.flush()                          # every pending save encoded: four launches per (codec, dtype)
    stored.restore()                         # t's values as codec.decode(codec.encode(t, seed)) gives them
"""

from __future__ import annotations

import weakref

import torch

from lightning_qcomm.codecs import Codec, segments_kernel
from lightning_qcomm.codecs.rows_segments import decode_segments_into, encode_segments, wire_nbytes

MAX_PENDING = 32  # saves held at most before a flush, whatever the layers (a bound on the held memory)


def in_strides(dense: torch.Tensor, stride: tuple[int, ...]) -> torch.Tensor:
    """``dense`` itself where it has the saved tensor's ``stride``, else a copy of it laid out in that stride."""
    if dense.stride() == stride:
        return dense
    return torch.empty_strided(dense.shape, stride, dtype=dense.dtype, device=dense.device).copy_(dense)


def batchable(t: torch.Tensor, codec: Codec) -> bool:
    """Whether ``t``'s save may wait for a batch: the segment kernels take its codec, dtype and device."""
    return segments_kernel(codec, t, [t.numel()], [True], 1, t.dtype)


class _Batch:
    """The wire row of one flush's saves of one (codec, dtype, device) and the decoded buffer while it is used."""

    def __init__(self, codec: Codec, numels: list[int], wire: torch.Tensor, dtype: torch.dtype) -> None:
        self.codec, self.numels, self.wire, self.dtype = codec, numels, wire, dtype
        self._dense: weakref.ref | None = None
        self._held: torch.Tensor | None = None  # the decoded buffer, until every save has been restored once
        self._unread: set[int] = set(range(len(numels)))

    def values(self, k: int) -> torch.Tensor:
        """Every save decoded, (1, sum of numels) in the saves' dtype, for save ``k``'s restore: held until each
        save has been restored once, then while a view of it lives; decoded again after that."""
        dense = self._dense() if self._dense is not None else None
        if dense is None:
            dense = torch.empty(1, sum(self.numels), dtype=self.dtype, device=self.wire.device)
            decode_segments_into(self.codec, self.wire, self.numels, [True] * len(self.numels), self.dtype, dense)
            self._dense = weakref.ref(dense)
            self._held = dense if self._unread else None
        self._unread.discard(k)
        if not self._unread:
            self._held = None
        return dense


class BatchedActivation:
    """One save of a batch: its tensor until the flush, then its place in the batch's wire row."""

    def __init__(self, owner: PendingSaves, t: torch.Tensor, codec: Codec, seed: int) -> None:
        self.owner, self.codec, self.seed = owner, codec, seed
        self.tensor: torch.Tensor | None = t.detach()
        self.shape, self.stride, self.numel = tuple(t.shape), tuple(t.stride()), t.numel()
        self.batch: _Batch | None = None
        self.offset = self.index = 0

    @property
    def nbytes(self) -> int:
        """Bytes held once encoded: the codec's payload of this save (codes and scales)."""
        return self.codec.nbytes(self.numel)

    def restore(self) -> torch.Tensor:
        """The decoded save in its shape, dtype and strides (a view of the batch's buffer where they allow)."""
        if self.batch is None:
            self.owner.flush()
        return in_strides(
            self.batch.values(self.index)[0, self.offset : self.offset + self.numel].view(self.shape), self.stride
        )


class PendingSaves:
    """The saves waiting for a batch (module docstring)."""

    def __init__(self) -> None:
        self._pending: list[BatchedActivation] = []

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, t: torch.Tensor, codec: Codec, seed: int) -> BatchedActivation:
        item = BatchedActivation(self, t, codec, seed)
        self._pending.append(item)
        if len(self._pending) >= MAX_PENDING:
            self.flush()
        return item

    def flush(self) -> None:
        """Encode every pending save, one batch per (codec, dtype, device), and drop their tensors."""
        groups: dict[tuple, list[BatchedActivation]] = {}
        for item in self._pending:
            groups.setdefault((id(item.codec), item.tensor.dtype, item.tensor.device), []).append(item)
        self._pending = []
        for items in groups.values():
            _encode(items)


def _encode(items: list[BatchedActivation]) -> None:
    codec, dtype, device = items[0].codec, items[0].tensor.dtype, items[0].tensor.device
    numels = [it.numel for it in items]
    row = torch.cat([it.tensor.reshape(-1) for it in items]).view(1, -1)
    wire = torch.empty(1, wire_nbytes(codec, numels, [True] * len(items), dtype), dtype=torch.uint8, device=device)
    encode_segments(codec, row, numels, [True] * len(items), [it.seed for it in items], wire)
    batch = _Batch(codec, numels, wire, dtype)
    offset = 0
    for k, it in enumerate(items):
        it.batch, it.offset, it.index, it.tensor = batch, offset, k, None
        offset += it.numel


__all__ = ["MAX_PENDING", "BatchedActivation", "PendingSaves", "batchable", "in_strides"]
