"""lightning_qcomm: communication- and memory-compressed distributed training for PyTorch Lightning.

Public API (re-exported here): codecs (``get_codec``), compressed collectives and the ``CommLedger``
(``lightning_qcomm.comm``), the strategies ``QSDPStrategy``, ``QuantDDPStrategy``,
``LocalSGDStrategy`` (registered lowercase with Lightning's strategy registry at import), and the
callbacks ``OneBitAdamCallback``, ``ActivationQuantization``, ``CommVolumeLogger``.
"""

from lightning_qcomm.codecs import CODEC_NAMES, Codec, Packed, derive_seed, get_codec

__version__ = "0.1.0"

__all__ = ["CODEC_NAMES", "Codec", "Packed", "__version__", "derive_seed", "get_codec"]
