"""Wire-byte formulas of the compressed collectives, for benchmarks and docs (collectives layer).

What one call sends per rank, from the same piece and chunk layout the collectives use (so a change
there shows here); the ``CommLedger`` records the same quantities per call.

Example::

    wire_bytes_formula("all_reduce", 1 << 20, 4, get_codec("uniform", bits=8))   # bytes rank r sends
"""

from __future__ import annotations

from lightning_qcomm.codecs import Codec
from lightning_qcomm.collectives.chunked import FP32_BYTES, _chunk_len
from lightning_qcomm.collectives.quantized import DEFAULT_PIECE_NUMEL, all_reduce_pieces
from lightning_qcomm.collectives.sign_collective import DEFAULT_ONEBIT_PIECE_NUMEL, _sign_codec, onebit_pieces


def wire_bytes_formula(
    collective: str,
    numel: int,
    world_size: int,
    codec: Codec | None = None,
    itemsize: int = FP32_BYTES,
    piece_numel: int = DEFAULT_PIECE_NUMEL,
    onebit_piece_numel: int | None = None,
    onebit_block_numel: int | None = None,
) -> float:
    """Ledger wire estimate (bytes this rank sends) of one call, for benchmarks and docs.

    ``collective`` is "all_gather" (numel = shard length), "reduce_scatter" (numel = output length),
    "all_reduce" or "onebit_all_reduce" (numel = d). Excludes the consistency check's 8*8*N bytes. The
    all-reduce is pieced as on CPU; a CUDA tensor goes as one piece (``piece_numel=numel`` gives its bytes), and
    ``OneBitMomentumSync`` sends a CUDA bucket as one piece (``onebit_piece_numel=ceil(numel/N)`` gives its bytes).
    With P = payload bytes of one chunk: all_gather / reduce_scatter (N-1)·P; all_reduce and the 1-bit
    all-reduce 2(N-1)·Σ_k P_k over pieces k; fp32 all_reduce 2(N-1)/N · itemsize · d. ``onebit_block_numel``: the
    1-bit all-reduce's ``block_numel`` (one fp32 scale per that many elements of a chunk; None: one per chunk).

    Example::

        wire_bytes_formula("all_gather", 4096, 2)   # fp32: (2 - 1) * 4 * 4096 = 16384.0
    """
    n = world_size
    if collective == "onebit_all_reduce":
        sign = _sign_codec(onebit_block_numel)
        pieces = onebit_pieces(
            numel, n, DEFAULT_ONEBIT_PIECE_NUMEL if onebit_piece_numel is None else onebit_piece_numel
        )
        return 2 * (n - 1) * sum(sign.nbytes(_chunk_len(length, n)) for _, length in pieces)
    if collective == "all_reduce":
        if codec is None:
            return 2 * (n - 1) * itemsize * numel / n
        pieces = all_reduce_pieces(numel, n, codec, piece_numel)
        return 2 * (n - 1) * sum(codec.nbytes(_chunk_len(length, n)) for _, length in pieces)
    if collective in ("all_gather", "reduce_scatter"):
        per = itemsize * numel if codec is None else codec.nbytes(numel)
        return (n - 1) * per
    raise ValueError(
        f"collective must be all_gather, reduce_scatter, all_reduce or onebit_all_reduce, got {collective!r}"
    )


__all__ = ["wire_bytes_formula"]
