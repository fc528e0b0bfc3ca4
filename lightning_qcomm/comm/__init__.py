"""Compressed collectives over torch.distributed and the CommLedger (docs/design.md: "Collectives", "Byte accounting").

The collectives by responsibility: ``transport`` (byte all-to-all / all-gather, torch version shims),
``call_check`` (the per-call cross-rank consistency check), ``chunked`` (chunk layout and payload coding
they share), ``quantized`` (all-gather, reduce-scatter, all-reduce), ``sign_collective`` (the 1-bit
all-reduce), ``wire_bytes`` (the wire-byte formulas) and ``buckets`` (the flat-bucket planner).
"""

from lightning_qcomm.comm.ledger import (
    CommLedger,
    CommRecord,
    NullLedger,
    OpTotals,
    ensure_ledger,
    get_ledger,
    set_ledger,
)
from lightning_qcomm.comm.quantized import (
    DEFAULT_PIECE_NUMEL,
    all_reduce_pieces,
    quantized_all_gather,
    quantized_all_reduce,
    quantized_reduce_scatter,
)
from lightning_qcomm.comm.sign_collective import (
    DEFAULT_ONEBIT_PIECE_NUMEL,
    onebit_all_reduce,
    onebit_pieces,
    onebit_server_error_numel,
)
from lightning_qcomm.comm.transport import TRANSFER_PIECE_BYTES, all_gather_bytes, all_to_all_bytes
from lightning_qcomm.comm.wire_bytes import wire_bytes_formula

__all__ = [
    "DEFAULT_ONEBIT_PIECE_NUMEL",
    "DEFAULT_PIECE_NUMEL",
    "TRANSFER_PIECE_BYTES",
    "CommLedger",
    "CommRecord",
    "NullLedger",
    "OpTotals",
    "all_gather_bytes",
    "all_reduce_pieces",
    "all_to_all_bytes",
    "ensure_ledger",
    "get_ledger",
    "onebit_all_reduce",
    "onebit_pieces",
    "onebit_server_error_numel",
    "quantized_all_gather",
    "quantized_all_reduce",
    "quantized_reduce_scatter",
    "set_ledger",
    "wire_bytes_formula",
]
