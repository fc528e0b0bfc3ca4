"""Parameter averaging for Local SGD: flatten tensors into buckets and average them over ranks.

``TensorAverager`` owns a fixed, ordered list of same-role tensors (parameters, floating buffers or
optimizer-state tensors). ``average(round_idx)`` packs them into flat buckets of at most
``bucket_numel`` elements per (dtype, device), averages each bucket with
``collectives.quantized_all_reduce(..., op="avg", tag=tag)`` and writes the result back:

    x_i <- (1/N) * sum_r x_i^(r)                                  (codec None: fp32 all-reduce)
    x_i <- a_i + D(Q(1/N * sum_r D(Q(x_i^(r) - a_i))))            (codec set, ``delta=True``)

With a codec the values sent are the *changes since the last average* (``delta=True``, the default
with a codec): the anchor a_i is the averaged value from the previous round, identical on all ranks,
kept as one fp32 copy per bucket. Deltas are small and centred, so a b-bit bucket quantizer resolves
them far better than the raw weights (the same reason DiLoCo and torchft average pseudo-gradients).
``delta=False`` quantizes the values themselves. Either way every rank ends with identical tensors
(``quantized_all_reduce`` decodes the same bytes everywhere). Every call records into the ledger.

With ``node_groups`` (``comm.topology``) each bucket is averaged over the world by
``collectives.hierarchical.hierarchical_all_reduce``: exact fp32 inside a node, the codec only across nodes, each
buffer crossing the slow links once (1/node_size of it from each rank of a node); ledger tags
``f"{tag}@intra"`` / ``f"{tag}@inter"``. Local SGD across nodes uses it for tensors that are already equal
inside a node, so the intra-node sum is exact and the result is the mean over nodes.

No Lightning here: the strategy decides *when*, this module decides *how*.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lightning_qcomm.codecs import Codec, derive_seed
from lightning_qcomm.collectives.hierarchical import hierarchical_all_reduce
from lightning_qcomm.collectives.quantized import quantized_all_reduce
from lightning_qcomm.comm.buckets import bucket_layout
from lightning_qcomm.comm.topology import NodeGroups

DEFAULT_BUCKET_NUMEL = 25 * 1024 * 1024 // 4  # 25 MiB of fp32 per flat bucket, like DDP's bucket_cap_mb


@dataclass
class _Bucket:
    tensors: list[torch.Tensor]
    numel: int
    anchor: torch.Tensor | None = None  # fp32 flat copy of the last average (delta mode)


def _plan_buckets(tensors: Sequence[torch.Tensor], bucket_numel: int) -> list[_Bucket]:
    """Group the non-empty tensors (in order) into buckets of one dtype and device, each <= bucket_numel
    elements unless a single tensor is larger (``comm.buckets.bucket_layout``)."""
    live = [t for t in tensors if t.numel() > 0]
    layout = bucket_layout([t.numel() for t in live], bucket_numel, keys=[(t.dtype, t.device) for t in live])
    return [_Bucket([live[i] for i in members], sum(live[i].numel() for i in members)) for members in layout]


class TensorAverager:
    """Averages a fixed list of tensors in place over ``group`` (see module docstring).

    Args:
        tensors: the tensors to average; their number, order and shapes must be the same on every rank.
        codec: None for a plain fp32 all-reduce, else the codec for ``quantized_all_reduce``.
        group: process group (None = world).
        bucket_numel: maximum elements per flat bucket (> 0).
        seed: base seed; round r, bucket k use ``derive_seed(seed, r, k)``.
        tag: ledger tag ("param_average", "buffers", ...).
        delta: with a codec, quantize the change since the last average instead of the values.
        node_groups: average over the world hierarchically (``group`` must then be None).
    """

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        codec: Codec | None = None,
        group: dist.ProcessGroup | None = None,
        bucket_numel: int = DEFAULT_BUCKET_NUMEL,
        seed: int = 0,
        tag: str = "param_average",
        delta: bool = True,
        node_groups: NodeGroups | None = None,
    ) -> None:
        if isinstance(bucket_numel, bool) or not isinstance(bucket_numel, int) or bucket_numel < 1:
            raise ValueError(f"bucket_numel must be an int >= 1, got {bucket_numel!r}")
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"tensors[{i}] must be a torch.Tensor, got {type(t).__name__}")
            if not t.is_floating_point():
                raise TypeError(f"tensors[{i}] must be floating point to be averaged, got dtype {t.dtype}")
        if node_groups is not None and group is not None:
            raise ValueError("TensorAverager: give group or node_groups, not both")
        self.codec = codec
        self.group = group
        self.node_groups = node_groups
        self.seed = int(seed)
        self.tag = tag
        self.delta = bool(delta) and codec is not None
        self._buckets = _plan_buckets(list(tensors), bucket_numel)
        self._checked = False
        if self.delta:
            self.reset_anchor()

    @property
    def numel(self) -> int:
        return sum(b.numel for b in self._buckets)

    @property
    def num_buckets(self) -> int:
        return len(self._buckets)

    @staticmethod
    def _flatten(b: _Bucket) -> torch.Tensor:
        return torch.cat([t.detach().reshape(-1) for t in b.tensors])

    @staticmethod
    def _unflatten(b: _Bucket, flat: torch.Tensor) -> None:
        """The bucket's tensors <- their spans of ``flat``, in one multi-tensor copy (``torch._foreach_copy_``, cast
        to each tensor's dtype), not one copy, and on a GPU one launch, per tensor."""
        srcs, offset = [], 0
        for t in b.tensors:
            srcs.append(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
        with torch.no_grad():
            torch._foreach_copy_(b.tensors, srcs)

    def reset_anchor(self) -> None:
        """Take the current values as the common reference point (they must be equal on all ranks,
        e.g. right after the rank-0 broadcast at setup or after loading a checkpoint)."""
        if self.codec is None:
            return
        for b in self._buckets:
            b.anchor = self._flatten(b).to(torch.float32)

    def _all_reduce(self, flat: torch.Tensor, seed: int, check: bool) -> None:
        if self.node_groups is not None:
            hierarchical_all_reduce(flat, self.codec, self.node_groups, op="avg", seed=seed, tag=self.tag, check=check)
        else:
            quantized_all_reduce(flat, self.codec, group=self.group, op="avg", seed=seed, tag=self.tag, check=check)

    def snapshot(self) -> list[torch.Tensor]:
        """A flat copy of each bucket's current values (in the tensors' dtype), in bucket order."""
        return [self._flatten(b) for b in self._buckets]

    def write(self, flats: Sequence[torch.Tensor]) -> None:
        """Copy one flat tensor per bucket (``snapshot``'s layout) into the tensors."""
        for b, flat in zip(self._buckets, flats, strict=True):
            self._unflatten(b, flat)

    def _reduce_bucket(self, k: int, flat: torch.Tensor, round_idx: int, check: bool) -> torch.Tensor:
        b = self._buckets[k]
        seed = derive_seed(self.seed, round_idx, k)
        if self.codec is None:
            self._all_reduce(flat, seed, check)
            return flat
        if self.delta:
            assert b.anchor is not None
            diff = flat.to(torch.float32) - b.anchor
            self._all_reduce(diff, seed, check)
            b.anchor.add_(diff)
            return b.anchor
        vals = flat.to(torch.float32)
        self._all_reduce(vals, seed, check)
        return vals

    @torch.no_grad()
    def reduce_flats(
        self, flats: Sequence[torch.Tensor], round_idx: int = 0, check: bool | None = None
    ) -> list[torch.Tensor]:
        """The average over the group of ``snapshot``-shaped flats, without touching the tensors: with no codec
        ``flats`` are all-reduced in place and returned; with a codec fp32 results are returned (in delta mode the
        anchors themselves, which move to the average). Collective; may run on a ``CommWorker`` thread while the
        tensors train on (nothing else may use the anchors meanwhile)."""
        check = not self._checked if check is None else check
        if len(flats) != len(self._buckets):
            raise ValueError(f"reduce_flats: {len(flats)} flats for {len(self._buckets)} buckets")
        out = [self._reduce_bucket(k, flat, round_idx, check) for k, flat in enumerate(flats)]
        self._checked = True
        return out

    @torch.no_grad()
    def average(self, round_idx: int = 0, check: bool | None = None) -> None:
        """Average every tensor over the group, in place; identical results on all ranks.

        ``check``: run ``quantized_all_reduce``'s cross-rank layout check (one small all-gather per
        bucket); None = on this averager's first call only, since its layout is fixed. One bucket's flat copy
        at a time.
        """
        check = not self._checked if check is None else check
        for k, b in enumerate(self._buckets):
            self._unflatten(b, self._reduce_bucket(k, self._flatten(b), round_idx, check))
        self._checked = True
