"""Compressed collectives over torch.distributed and the CommLedger (docs/design.md: "Collectives", "Byte accounting")."""

from lightning_qcomm.comm.collectives import (
    DEFAULT_ONEBIT_PIECE_NUMEL,
    DEFAULT_PIECE_NUMEL,
    TRANSFER_PIECE_BYTES,
    all_gather_bytes,
    all_reduce_pieces,
    all_to_all_bytes,
    onebit_all_reduce,
    onebit_pieces,
    onebit_server_error_numel,
    quantized_all_gather,
    quantized_all_reduce,
    quantized_reduce_scatter,
    wire_bytes_formula,
)
from lightning_qcomm.comm.ledger import (
    CommLedger,
    CommRecord,
    NullLedger,
    OpTotals,
    ensure_ledger,
    get_ledger,
    set_ledger,
)

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
