"""lightning_qcomm: communication- and memory-compressed distributed training for PyTorch Lightning.

Public API (re-exported here): codecs (``get_codec``; the registry: ``register_codec``, ``codec_names``,
``codec_spec``, ``resolve_codec``), compressed collectives and the ``CommLedger``
(``lightning_qcomm.comm``), the strategies ``QSDPStrategy``, ``QuantDDPStrategy`` and
``LocalSGDStrategy`` (registered lowercase in Lightning's ``StrategyRegistry`` at import, so
``Trainer(strategy="qsdp")`` works), the callbacks ``CommVolumeLogger``, ``OneBitAdamCallback`` and
``ActivationQuantization``, the optimizer ``OneBitAdam`` (1-bit Adam), the activation quantizer
underneath the callback (``lightning_qcomm.memory``), and ``consolidate_checkpoint`` (a sharded QSDP
checkpoint folder -> one file; also ``python -m lightning_qcomm.consolidate IN OUT``).
"""

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
from lightning_qcomm.comm import (
    CommLedger,
    ensure_ledger,
    get_ledger,
    onebit_all_reduce,
    quantized_all_gather,
    quantized_all_reduce,
    quantized_reduce_scatter,
    set_ledger,
)
from lightning_qcomm.consolidate import consolidate_checkpoint
from lightning_qcomm.memory import ActivationQuantConfig, ActivationQuantizer, count_saved_tensors
from lightning_qcomm.optim import OneBitAdam
from lightning_qcomm.strategies import LocalSGDStrategy, QSDPStrategy, QuantDDPStrategy, register_all_strategies

__version__ = "0.1.0"

# Idempotent: names already present (a second import, a user's own registration) are left alone.
register_all_strategies(StrategyRegistry)

__all__ = [
    "ActivationQuantConfig",
    "ActivationQuantization",
    "ActivationQuantizer",
    "CODEC_NAMES",
    "Codec",
    "CommLedger",
    "CommVolumeLogger",
    "LocalSGDStrategy",
    "OneBitAdam",
    "OneBitAdamCallback",
    "Packed",
    "QSDPStrategy",
    "QuantDDPStrategy",
    "__version__",
    "codec_names",
    "codec_spec",
    "consolidate_checkpoint",
    "count_saved_tensors",
    "derive_seed",
    "ensure_ledger",
    "get_codec",
    "get_ledger",
    "onebit_all_reduce",
    "quantized_all_gather",
    "quantized_all_reduce",
    "quantized_reduce_scatter",
    "register_codec",
    "resolve_codec",
    "set_ledger",
]
