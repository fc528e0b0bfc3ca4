"""Lightning callbacks of lightning_qcomm (layer 5; docs/design.md, "Layers and files").

Importing this package makes the callbacks resolvable by short class name in LightningCLI configs
(``--trainer.callbacks+=CommVolumeLogger``).

Example::

    Trainer(strategy="ddp", callbacks=[OneBitAdamCallback(freeze_step=100), CommVolumeLogger()])
"""

from lightning_qcomm.callbacks.activation_quant import ActivationQuantization
from lightning_qcomm.callbacks.comm_logger import CommVolumeLogger
from lightning_qcomm.callbacks.onebit_adam import OneBitAdamCallback

__all__ = ["ActivationQuantization", "CommVolumeLogger", "OneBitAdamCallback"]
