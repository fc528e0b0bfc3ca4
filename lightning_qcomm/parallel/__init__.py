"""Plain-torch entry points (layer 4; docs/design.md, "Layers and files"): QSDP, quantized DDP, Local SGD and 1-bit
Adam on a torch model in a ``torch.distributed`` script, no Lightning Trainer or Fabric needed. Each takes a config
dataclass of typed primitives, checked when it is made; the Trainer and Fabric strategies are thin callers.

Example::

    qsdp = apply_qsdp(model, mesh, QSDPConfig(bits=8))
    state, hook = quant_ddp_hook(QuantDDPConfig(codec="nuqsgd", bits=4), ddp_model, optimizer=optimizer)
    local_sgd = LocalSGD(model, optimizer, LocalSGDConfig(sync="qsr", scope="inter_node", outer_optimizer="nesterov"))
    onebit = onebit_adam_ddp(ddp_model, OneBitAdam(ddp_model.parameters(), freeze_step=100))
"""

from lightning_qcomm.adapters.ddp.config import QuantDDPConfig
from lightning_qcomm.parallel.local_sgd import LocalSGD
from lightning_qcomm.parallel.local_sgd_config import LocalSGDConfig
from lightning_qcomm.parallel.onebit_adam import OneBitAdamDDP, onebit_adam_ddp
from lightning_qcomm.parallel.outer_optim import NesterovOuterOptimizer
from lightning_qcomm.parallel.qsdp import QSDPHandle, apply_qsdp
from lightning_qcomm.parallel.qsdp_config import QSDPConfig
from lightning_qcomm.parallel.quant_ddp import quant_ddp_hook
from lightning_qcomm.parallel.sharding import plan_fsdp_groups

__all__ = [
    "LocalSGD",
    "LocalSGDConfig",
    "NesterovOuterOptimizer",
    "OneBitAdamDDP",
    "QSDPConfig",
    "QSDPHandle",
    "QuantDDPConfig",
    "apply_qsdp",
    "onebit_adam_ddp",
    "plan_fsdp_groups",
    "quant_ddp_hook",
]
