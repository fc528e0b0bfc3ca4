"""Lightning Fabric strategies of lightning_qcomm (layer 5; docs/design.md, "Layers and files"): the same QSDP,
QuantDDP and Local SGD as the Trainer strategies, over the same plain-torch entry points
(``lightning_qcomm.parallel``), and the same registry names (``strategies.presets``), registered in Fabric's registry
at import.

A Trainer strategy (``QSDPStrategy``, ...) is not a Fabric strategy: ``Fabric(strategy=QSDPStrategy(...))`` is
refused by Fabric itself ("must be ... an instance of lightning.fabric.strategies.Strategy"); use the class
here with the same arguments, or the registered name.

Example::

    Fabric(accelerator="cpu", devices=2, strategy="qsdp")                         # QSDPFabricStrategy()
    Fabric(accelerator="cpu", devices=2, strategy=QuantDDPFabricStrategy(codec="nuqsgd", bits=4))
"""

from typing import Any

from lightning_qcomm.fabric.local_sgd import LocalSGDFabricStrategy
from lightning_qcomm.fabric.qsdp import QSDPFabricStrategy
from lightning_qcomm.fabric.quant_ddp import QuantDDPFabricStrategy
from lightning_qcomm.strategies.presets import register_classes

FABRIC_STRATEGIES = (QSDPFabricStrategy, QuantDDPFabricStrategy, LocalSGDFabricStrategy)


def register_fabric_strategies(registry: Any) -> None:
    """Register every lowercase name ("qsdp", "quant_ddp", "local_sgd", presets) in a Fabric registry; idempotent."""
    register_classes(registry, FABRIC_STRATEGIES)


__all__ = [
    "FABRIC_STRATEGIES",
    "LocalSGDFabricStrategy",
    "QSDPFabricStrategy",
    "QuantDDPFabricStrategy",
    "register_fabric_strategies",
]
