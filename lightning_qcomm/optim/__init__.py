"""Optimizers of lightning_qcomm (layer 3; docs/design.md, "Layers and files"): ``OneBitAdam`` (1-bit Adam, Tang et
al. 2021)."""

from lightning_qcomm.optim.onebit_adam import OneBitAdam
from lightning_qcomm.optim.onebit_adam_config import OneBitAdamConfig

__all__ = ["OneBitAdam", "OneBitAdamConfig"]
