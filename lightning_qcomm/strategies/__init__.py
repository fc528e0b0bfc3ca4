"""Lightning strategies of lightning_qcomm (Lightning layer, docs/design.md) and their registry names."""

from typing import Any

from lightning_qcomm.strategies.local_sgd import LocalSGDStrategy, register_local_sgd_strategies
from lightning_qcomm.strategies.qsdp import QSDPStrategy, register_qsdp_strategies
from lightning_qcomm.strategies.quant_ddp import QuantDDPStrategy, register_quant_ddp_strategies


def register_all_strategies(registry: Any) -> None:
    """Register every lowercase strategy name ("qsdp", "quant_ddp", "local_sgd", presets); idempotent."""
    register_qsdp_strategies(registry)
    register_quant_ddp_strategies(registry)
    register_local_sgd_strategies(registry)


__all__ = ["LocalSGDStrategy", "QSDPStrategy", "QuantDDPStrategy", "register_all_strategies"]
