"""What the compressed collectives stand on (layer 1; docs/design.md: "Layers and files", "Byte accounting").

By responsibility: ``transport`` (byte all-to-all / all-gather, torch version shims), ``ledger`` (the
CommLedger: every collective's logical and wire bytes), ``topology`` (nodes and their process groups),
``process_group`` (groups made here, destroyed at exit), ``buckets`` (the flat-bucket planner),
``nonfinite`` and ``consistency`` (cross-rank checks), ``agree`` (the max over ranks that decisions take),
``auto_trial`` (the timed choice of an ``"auto"`` width), ``side_stream`` and ``comm_worker`` (where a
collective runs). The compressed collectives themselves are in ``lightning_qcomm.collectives``.
"""

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
from lightning_qcomm.comm.topology import NodeGroups, Topology, node_groups
from lightning_qcomm.comm.transport import TRANSFER_PIECE_BYTES, all_gather_bytes, all_to_all_bytes

__all__ = [
    "SCOPES",
    "TRANSFER_PIECE_BYTES",
    "CommLedger",
    "CommRecord",
    "NodeGroups",
    "NullLedger",
    "OpTotals",
    "Topology",
    "all_gather_bytes",
    "all_to_all_bytes",
    "ensure_ledger",
    "get_ledger",
    "node_groups",
    "purpose_of",
    "scope_of",
    "set_ledger",
]
