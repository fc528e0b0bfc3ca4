"""Compressed collectives over torch.distributed and the CommLedger (docs/design.md: "Collectives", "Byte accounting").

The collectives by responsibility: ``transport`` (byte all-to-all / all-gather, torch version shims),
``call_check`` (the per-call cross-rank consistency check), ``chunked`` (chunk layout and payload coding
they share), ``quantized`` (all-gather, reduce-scatter, all-reduce), ``sign_collective`` (the 1-bit
all-reduce), ``wire_bytes`` (the wire-byte formulas) and ``buckets`` (the flat-bucket planner).
"""

from lightning_qcomm.comm.hierarchical import ParamShards, hierarchical_all_reduce, hierarchical_onebit_all_reduce
from lightning_qcomm.comm.ledger import (
    SCOPES,
    CommLedger,
    CommRecord,
    NullLedger,
    OpTotals,
    ensure_ledger,
    get_ledger,
    purpose_of,
    scope_of,
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
from lightning_qcomm.comm.topology import NodeGroups, Topology, node_groups
from lightning_qcomm.comm.transport import TRANSFER_PIECE_BYTES, all_gather_bytes, all_to_all_bytes
from lightning_qcomm.comm.wire_bytes import wire_bytes_formula

__all__ = [
    "DEFAULT_ONEBIT_PIECE_NUMEL",
    "DEFAULT_PIECE_NUMEL",
    "SCOPES",
    "TRANSFER_PIECE_BYTES",
    "CommLedger",
    "CommRecord",
    "NodeGroups",
    "NullLedger",
    "OpTotals",
    "ParamShards",
    "Topology",
    "all_gather_bytes",
    "all_reduce_pieces",
    "all_to_all_bytes",
    "ensure_ledger",
    "get_ledger",
    "hierarchical_all_reduce",
    "hierarchical_onebit_all_reduce",
    "node_groups",
    "onebit_all_reduce",
    "onebit_pieces",
    "onebit_server_error_numel",
    "purpose_of",
    "quantized_all_gather",
    "quantized_all_reduce",
    "quantized_reduce_scatter",
    "scope_of",
    "set_ledger",
    "wire_bytes_formula",
]
