"""QSDP's master-weight projection (``quantize_master=True``): the sharded fp32 master weights rounded onto the
weight codec's lattice after each optimizer step, the variant the QSDP paper analyses (adapter layer; docs/design.md,
"QSDP").

Example::

    project_master_weights(handle.modules, get_codec("uniform", bits=8), handle.comm_state, min_quant_numel=1024)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightning_qcomm.adapters.fsdp2.comms import SEED_MASTER, QSDPCommState
from lightning_qcomm.adapters.fsdp2.row_codec import is_quantized_param
from lightning_qcomm.adapters.fsdp2.shim import padded_shard_data, shard_rank
from lightning_qcomm.codecs import Codec, derive_seed
from lightning_qcomm.codecs.base import FLOAT_DTYPES


@torch.no_grad()
def project_master_weights(
    modules: Sequence[torch.nn.Module], codec: Codec, state: QSDPCommState, min_quant_numel: int
) -> None:
    """Project each large parameter's sharded master weights onto the codec's lattice (QSDP's analysed variant).

    ``modules`` in group-id order (as returned by ``install_qsdp_comms``). Each rank rounds its own padded
    shard exactly as the all-gather segments it (one segment per parameter, buckets starting at the segment
    start), then writes back only the real elements (padding stays zero). For the min-max codec the bucket
    extremes map to themselves, so the next all-gather of a projected shard is exact up to fp rounding.
    """
    for gid, module in enumerate(modules):
        shards = padded_shard_data(module)
        if not shards:
            continue
        rank = shard_rank(module)
        for k, (info, data) in enumerate(shards):
            if info.shard_numel == 0 or not is_quantized_param(info, min_quant_numel) or data.dtype not in FLOAT_DTYPES:
                continue
            seed = derive_seed(state.seed, SEED_MASTER, state.step, gid, rank, k)
            q = codec.roundtrip(data, seed)
            data[: info.shard_numel].copy_(q[: info.shard_numel])


__all__ = ["project_master_weights"]
