"""Compressed collectives over torch.distributed and the CommLedger (DESIGN §1, §3)."""

from lightning_qcomm.comm.ledger import (
    CommLedger,
    CommRecord,
    NullLedger,
    OpTotals,
    ensure_ledger,
    get_ledger,
    set_ledger,
)

__all__ = ["CommLedger", "CommRecord", "NullLedger", "OpTotals", "ensure_ledger", "get_ledger", "set_ledger"]
