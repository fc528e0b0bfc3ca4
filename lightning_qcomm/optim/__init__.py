"""Optimizers of lightning_qcomm (docs/design.md, "Architecture"): ``OneBitAdam`` (1-bit Adam, Tang et al. 2021)."""

from lightning_qcomm.optim.onebit_adam import OneBitAdam
from lightning_qcomm.optim.onebit_adam_config import OneBitAdamConfig

__all__ = ["OneBitAdam", "OneBitAdamConfig"]
