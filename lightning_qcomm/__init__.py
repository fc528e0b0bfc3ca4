"""lightning_qcomm: communication- and memory-compressed distributed training for PyTorch Lightning.

Public API (re-exported here): codecs (``get_codec``; the registry: ``register_codec``, ``codec_names``,
``codec_spec``, ``resolve_codec``), compressed collectives and the ``CommLedger``
(``lightning_qcomm.comm``), the plain-torch entry points ``apply_qsdp``, ``quant_ddp_hook``, ``LocalSGD`` and
``onebit_adam_ddp`` with their configs ``QSDPConfig``, ``QuantDDPConfig``, ``LocalSGDConfig``
(``lightning_qcomm.parallel``), the Trainer strategies ``QSDPStrategy``, ``QuantDDPStrategy`` and
``LocalSGDStrategy`` and the Fabric strategies ``QSDPFabricStrategy``, ``QuantDDPFabricStrategy`` and
``LocalSGDFabricStrategy`` (their names registered lowercase in Lightning's and Fabric's registries at
import, so ``Trainer(strategy="qsdp")`` and ``Fabric(strategy="qsdp")`` work), the callbacks ``CommVolumeLogger``, ``OneBitAdamCallback`` and
``ActivationQuantization``, the optimizer ``OneBitAdam`` (1-bit Adam), the activation quantizer
underneath the callback (``lightning_qcomm.memory``), and ``consolidate_checkpoint`` (a sharded QSDP
checkpoint folder -> one file; also ``python -m lightning_qcomm.consolidate IN OUT``). The layers and the file map:
docs/design.md, "Layers and files".
"""

import torch

from lightning_qcomm._checks import check_torch_version

check_torch_version(torch.__version__)  # before anything reads torch's internals: torch>=2.11,<2.16

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from lightning_qcomm.callbacks import ActivationQuantization, CommVolumeLogger, OneBitAdamCallback
from lightning_qcomm.codecs import (
    CODEC_NAMES,
    Codec,
    Packed,
    codec_names,
    codec_spec,
    derive_seed,
    get_codec,
    register_codec,
    resolve_codec,
)
from lightning_qcomm.collectives import (
    hierarchical_all_reduce,
    hierarchical_onebit_all_reduce,
    onebit_all_reduce,
    quantized_all_gather,
    quantized_all_reduce,
    quantized_reduce_scatter,
)
from lightning_qcomm.comm import CommLedger, ensure_ledger, get_ledger, set_ledger
from lightning_qcomm.consolidate import consolidate_checkpoint
from lightning_qcomm.fabric import (
    LocalSGDFabricStrategy,
    QSDPFabricStrategy,
    QuantDDPFabricStrategy,
    register_fabric_strategies,
)
from lightning_qcomm.memory import ActivationQuantConfig, ActivationQuantizer, count_saved_tensors
from lightning_qcomm.optim import OneBitAdam
from lightning_qcomm.parallel import (
    LocalSGD,
    LocalSGDConfig,
    NesterovOuterOptimizer,
    QSDPConfig,
    QuantDDPConfig,
    apply_qsdp,
    onebit_adam_ddp,
    quant_ddp_hook,
)
from lightning_qcomm.strategies import LocalSGDStrategy, QSDPStrategy, QuantDDPStrategy, register_all_strategies

__version__ = "0.1.0"

# Idempotent: names already present (a second import, a user's own registration) are left alone.
register_all_strategies(StrategyRegistry)
register_fabric_strategies(FABRIC_STRATEGY_REGISTRY)

__all__ = [
    "ActivationQuantConfig",
    "ActivationQuantization",
    "ActivationQuantizer",
    "CODEC_NAMES",
    "Codec",
    "CommLedger",
    "CommVolumeLogger",
    "LocalSGD",
    "LocalSGDConfig",
    "NesterovOuterOptimizer",
    "LocalSGDFabricStrategy",
    "LocalSGDStrategy",
    "OneBitAdam",
    "OneBitAdamCallback",
    "Packed",
    "QSDPConfig",
    "QSDPFabricStrategy",
    "QSDPStrategy",
    "QuantDDPConfig",
    "QuantDDPFabricStrategy",
    "QuantDDPStrategy",
    "__version__",
    "apply_qsdp",
    "codec_names",
    "codec_spec",
    "consolidate_checkpoint",
    "count_saved_tensors",
    "derive_seed",
    "ensure_ledger",
    "get_codec",
    "get_ledger",
    "hierarchical_all_reduce",
    "hierarchical_onebit_all_reduce",
    "onebit_adam_ddp",
    "onebit_all_reduce",
    "quant_ddp_hook",
    "quantized_all_gather",
    "quantized_all_reduce",
    "quantized_reduce_scatter",
    "register_codec",
    "resolve_codec",
    "set_ledger",
]
