"""What the chunked collectives share: argument checks, the chunk layout, payload coding of rows, and
writing results and residuals back in place (collectives layer).

Notation (docs/design.md, "Collectives"): d = elements of the logical tensor, N = world size, r = this rank.
A flat tensor is split into N chunks of c = ceil(d / N) elements, the tail zero-padded; padding travels (and
is counted in the ledger) but is never written to the output. A payload is the flat uint8 buffer
``Packed.to_bytes()`` of one chunk, ``codec.nbytes(c)`` bytes: a pure function of the length, so no rank
ever exchanges sizes. N payloads of one phase are coded in one pass (``codecs.rows``: the rows ops).

Example::

    send = _encode_rows(codec, y.view(world, c), seeds)    # N payloads, row j for rank j
    rows = _decode_rows(codec, send, world, c)             # (N, c) fp32, the values each payload stands for
"""

from __future__ import annotations

import torch

from lightning_qcomm.codecs import Codec, decode_rows, encode_rows
from lightning_qcomm.codecs.base import FLOAT_DTYPES

REDUCE_OPS = ("sum", "avg")
FP32_BYTES = 4


# ------------------------------------------------------------------ argument checks
def _check_tensor(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be a floating tensor ({', '.join(map(str, FLOAT_DTYPES))}), got {t.dtype}")
    if t.numel() == 0:
        raise ValueError(f"{name} must be non-empty, got shape {tuple(t.shape)}")


def _check_codec(codec: Codec | None) -> None:
    if codec is not None and not isinstance(codec, Codec):
        raise TypeError(f"codec must be a Codec from get_codec(...) or None, got {type(codec).__name__}")


def _check_reduce_op(op: str) -> None:
    if op not in REDUCE_OPS:
        raise ValueError(f"op must be one of {REDUCE_OPS}, got {op!r}")


def _check_piece_numel(piece_numel: int) -> None:
    if not isinstance(piece_numel, int) or isinstance(piece_numel, bool) or piece_numel < 1:
        raise ValueError(f"piece_numel must be a positive int (elements per rank per piece), got {piece_numel!r}")


# ------------------------------------------------------------------ chunks and payloads
def _chunk_len(numel: int, world: int) -> int:
    return -(-numel // world)


def _encode_bytes(codec: Codec, x: torch.Tensor, seed: int) -> torch.Tensor:
    return codec.encode(x, seed=seed).to_bytes()


def _decode_rows(codec: Codec, buf: torch.Tensor, rows: int, numel: int) -> torch.Tensor:
    """Decode ``rows`` consecutive payloads of ``numel`` elements each into a (rows, numel) fp32 tensor, in one
    codec call (``codecs.decode_rows``)."""
    return decode_rows(codec, buf, numel).view(rows, numel)


def _encode_rows(codec: Codec, rows: torch.Tensor, seeds: list[int]) -> torch.Tensor:
    """The flat concatenation of ``codec.encode(rows[j], seeds[j]).to_bytes()``, in one pass (``codecs.encode_rows``)."""
    return encode_rows(codec, rows, seeds).view(-1)


def _payload(nbytes: int, world: int) -> int:
    """Bytes handed to torch.distributed (none when a world of one skips the call)."""
    return nbytes if world > 1 else 0


# ------------------------------------------------------------------ results and residuals in place
def _fp32_output(x: torch.Tensor) -> torch.Tensor:
    """Where a collective decodes its result: x's own flat view when x is contiguous fp32 (callers read
    all of x in phase 1 before phase 3 writes), else a new fp32 buffer for ``_copy_back``."""
    if x.dtype == torch.float32 and x.is_contiguous():
        return x.view(-1)
    return torch.empty(x.numel(), dtype=torch.float32, device=x.device)


def _copy_back(x: torch.Tensor, out_flat: torch.Tensor) -> None:
    """x <- out_flat unless out_flat already is x's storage (see ``_fp32_output``)."""
    if out_flat.data_ptr() != x.data_ptr():
        x.copy_(out_flat.view(x.shape))
