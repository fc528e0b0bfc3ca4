"""How one DDP gradient bucket is split for the quantized hook: the (offset, numel) segments of its quantized and
its plain elements, in the canonical order (adapter layer; docs/design.md, "QuantDDP"; ``adapters.ddp.hooks`` builds
and uses them).

Example::

    segments: list[tuple[int, int]] = []
    append_segment(segments, 0, 100); append_segment(segments, 100, 50)   # one segment (0, 150): contiguous
    flat = gather_segments(bucket_buffer, segments)                     # a view when there is one segment
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lightning_qcomm.collectives.hierarchical import ParamShards


@dataclass
class BucketPlan:
    """How one bucket layout is split: (offset, numel) segments of quantized and plain elements."""

    big: list[tuple[int, int]]
    small: list[tuple[int, int]]
    big_names: tuple[str, ...]
    big_numels: tuple[int, ...]
    big_numel: int
    members: tuple[str, ...] = ()  # every parameter of the bucket, in DDP's bucket order
    checked: set[int] = field(default_factory=set)  # widths (32: uncompressed) already cross-rank checked
    shards: ParamShards | None = None  # hierarchical: the quantized elements' shard layout

    @property
    def ef_numels(self) -> tuple[int, ...]:
        """Residual elements per quantized parameter on this rank (its shard's piece when hierarchical)."""
        return self.big_numels if self.shards is None else self.shards.chunks


def append_segment(segments: list[tuple[int, int]], offset: int, numel: int) -> None:
    """Add [offset, offset + numel) to a list of segments, merging with the last one if adjacent."""
    if segments and segments[-1][0] + segments[-1][1] == offset:
        segments[-1] = (segments[-1][0], segments[-1][1] + numel)
    else:
        segments.append((offset, numel))


def gather_segments(buf: torch.Tensor, segments: list[tuple[int, int]]) -> torch.Tensor:
    """The segments of ``buf`` as one flat tensor: a view of ``buf`` for one segment, else a copy."""
    if len(segments) == 1:
        off, n = segments[0]
        return buf[off : off + n]
    return torch.cat([buf[off : off + n] for off, n in segments])


def scatter_segments(buf: torch.Tensor, segments: list[tuple[int, int]], flat: torch.Tensor) -> None:
    """Write ``flat`` back into the segments of ``buf``: buf[off:off+n] <- the next n values of ``flat``, per
    segment in order. One multi-tensor copy (``torch._foreach_copy_``) for all of them, not one per segment (a
    launch each on a GPU); nothing to copy where ``flat`` is a view of them.

    Example::

        scatter_segments(buf, [(0, 5), (7, 3)], flat)   # buf[0:5] = flat[0:5], buf[7:10] = flat[5:8]
    """
    dsts, srcs, pos = [], [], 0
    for off, n in segments:
        dst, src = buf[off : off + n], flat[pos : pos + n]
        if dst.data_ptr() != src.data_ptr():
            dsts.append(dst)
            srcs.append(src)
        pos += n
    if dsts:
        torch._foreach_copy_(dsts, srcs)


__all__ = ["BucketPlan", "append_segment", "gather_segments", "scatter_segments"]
