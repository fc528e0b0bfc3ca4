"""The cross-rank consistency check of one collective call (collectives layer).

Before moving data, the ranks all-gather one int64 row of what defines the call (op, numel, dtype, codec
fingerprint, reduce op, world size, an op-specific integer, format version); if the rows differ every rank
raises the same ``ValueError`` naming each differing field per rank, instead of hanging or garbling memory.
It costs one tiny all_gather (one network latency); hot paths whose shapes are fixed by construction (DDP
buckets, FSDP shards) pass ``check=False``. Its bytes are recorded in the ledger as an ``all_gather`` with
the call's tag and a zero fp32 baseline (the uncompressed collective would not send them).

(Configuration agreed once at setup, over the store rather than a collective, is ``comm.consistency``.)

Example::

    _check_consistent("all_reduce", group, world, "grads", numel=x.numel(), dtype=x.dtype, codec=codec,
                      device=x.device)   # ValueError on every rank if any rank passed something else
"""

from __future__ import annotations

import json
import zlib

import torch
import torch.distributed as dist

from lightning_qcomm.codecs import Codec
from lightning_qcomm.collectives.chunked import REDUCE_OPS
from lightning_qcomm.comm.ledger import get_ledger
from lightning_qcomm.comm.transport import _all_gather_single

_DTYPE_CODES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.float64: 4}
_OP_CODES = {"all_gather": 1, "reduce_scatter": 2, "all_reduce": 3, "onebit_all_reduce": 4}
_META_FIELDS = ("collective", "numel", "dtype", "codec", "reduce_op", "world_size", "aux", "version")
_META_VERSION = 1


def _codec_code(codec: Codec | None) -> int:
    """A 32-bit fingerprint of every option that defines the codes (``Codec.config``); 0 for fp32."""
    if codec is None:
        return 0
    return zlib.crc32(json.dumps(codec.config(), sort_keys=True, default=str).encode()) + 1


def _check_consistent(
    collective: str,
    group: dist.ProcessGroup | None,
    world: int,
    tag: str,
    *,
    numel: int,
    dtype: torch.dtype,
    codec: Codec | None,
    reduce_op: str = "sum",
    aux: int = 0,
    device: torch.device,
) -> None:
    """All-gather one int64 row of metadata and raise the same ValueError on every rank if rows differ."""
    row = torch.tensor(
        [
            _OP_CODES[collective],
            numel,
            _DTYPE_CODES[dtype],
            _codec_code(codec),
            REDUCE_OPS.index(reduce_op),
            world,
            aux,
            _META_VERSION,
        ],
        dtype=torch.int64,
        device=device,
    )
    rows = torch.empty(world * row.numel(), dtype=torch.int64, device=device)
    _all_gather_single(rows, row, group)
    get_ledger().record("all_gather", rows.numel() * 8, 0, world, payload_bytes=row.numel() * 8, tag=tag)
    table = rows.view(world, -1).cpu()
    if bool((table == table[0]).all()):
        return
    diffs = [
        f"{field}: " + ", ".join(f"rank{r}={int(table[r, i])}" for r in range(world))
        for i, field in enumerate(_META_FIELDS)
        if not bool((table[:, i] == table[0, i]).all())
    ]
    raise ValueError(
        f"{collective}: ranks disagree on the input ({'; '.join(diffs)}); every rank must pass the same "
        f"numel, dtype, codec and op (dtype codes {dict((str(k), v) for k, v in _DTYPE_CODES.items())})"
    )
