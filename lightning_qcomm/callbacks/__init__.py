"""Lightning callbacks of lightning_qcomm (Lightning layer, docs/design.md).

Importing this package makes the callbacks resolvable by short class name in LightningCLI configs.
The modules of ``OneBitAdamCallback`` and ``ActivationQuantization`` are imported when present (they are
written under other issues); an import error inside a present module is raised, never hidden.
"""

from importlib.util import find_spec

from lightning_qcomm.callbacks.comm_logger import CommVolumeLogger

__all__ = ["CommVolumeLogger"]

if find_spec("lightning_qcomm.callbacks.onebit_adam") is not None:
    from lightning_qcomm.callbacks.onebit_adam import OneBitAdamCallback  # noqa: F401

    __all__.append("OneBitAdamCallback")
if find_spec("lightning_qcomm.callbacks.activation_quant") is not None:
    from lightning_qcomm.callbacks.activation_quant import ActivationQuantization  # noqa: F401

    __all__.append("ActivationQuantization")
