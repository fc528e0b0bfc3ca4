"""Lightning Trainer strategies of lightning_qcomm (layer 5; docs/design.md, "Layers and files") and their registry
names (``presets``: one table per family, shared with the Fabric classes of ``lightning_qcomm.fabric``)."""

from typing import Any

from lightning_qcomm.strategies.local_sgd import LocalSGDStrategy, register_local_sgd_strategies
from lightning_qcomm.strategies.presets import register_classes
from lightning_qcomm.strategies.qsdp import QSDPStrategy, register_qsdp_strategies
from lightning_qcomm.strategies.quant_ddp import QuantDDPStrategy, register_quant_ddp_strategies

TRAINER_STRATEGIES = (QSDPStrategy, QuantDDPStrategy, LocalSGDStrategy)


def register_all_strategies(registry: Any) -> None:
    """Register every lowercase strategy name ("qsdp", "quant_ddp", "local_sgd", presets); idempotent."""
    register_classes(registry, TRAINER_STRATEGIES)


__all__ = [
    "TRAINER_STRATEGIES",
    "LocalSGDStrategy",
    "QSDPStrategy",
    "QuantDDPStrategy",
    "register_all_strategies",
    "register_local_sgd_strategies",
    "register_qsdp_strategies",
    "register_quant_ddp_strategies",
]
