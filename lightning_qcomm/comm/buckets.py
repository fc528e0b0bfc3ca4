"""The greedy bucket planner shared by the flat-bucket averagers (Local SGD's ``TensorAverager``, 1-bit
Adam's ``OneBitMomentumSync``; comm layer).

Tensors are laid out in order into buckets of at most ``bucket_numel`` elements; a tensor larger than that
gets a bucket of its own. With ``keys`` (e.g. (dtype, device)), each key has its own open bucket, so a
bucket never mixes keys. A pure function of its input: every rank computes the same layout, so all ranks
issue the same collectives.

Example::

    bucket_layout([3, 3, 3, 10, 1], 6)   # [[0, 1], [2], [3], [4]]
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence


def bucket_layout(numels: Sequence[int], bucket_numel: int, keys: Sequence[Hashable] | None = None) -> list[list[int]]:
    """Greedy, order-preserving split of tensor indices into buckets of <= ``bucket_numel`` elements.

    A tensor with more elements than ``bucket_numel`` forms a bucket alone. A new bucket opens for tensor i
    when the open bucket of its key (``keys[i]``; one key for all when None) would exceed ``bucket_numel``;
    buckets are listed in the order they open. Same input, same output on every rank.

    Example::

        bucket_layout([2, 2, 2], 4, keys=["a", "b", "a"])   # [[0, 2], [1]]
    """
    if not isinstance(bucket_numel, int) or bucket_numel < 1:
        raise ValueError(f"bucket_numel must be an int >= 1, got {bucket_numel!r}")
    if keys is not None and len(keys) != len(numels):
        raise ValueError(f"keys has {len(keys)} entries; allowed: one per tensor ({len(numels)})")
    buckets: list[list[int]] = []
    sizes: list[int] = []
    open_by_key: dict[Hashable, int] = {}  # key -> index of its open bucket
    for i, n in enumerate(numels):
        if n < 1:
            raise ValueError(f"numels[{i}] must be >= 1, got {n}")
        key = None if keys is None else keys[i]
        b = open_by_key.get(key)
        if b is None or sizes[b] + n > bucket_numel:
            b = open_by_key[key] = len(buckets)
            buckets.append([])
            sizes.append(0)
        buckets[b].append(i)
        sizes[b] += n
    return buckets


__all__ = ["bucket_layout"]
