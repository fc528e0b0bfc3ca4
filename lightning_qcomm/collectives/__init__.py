"""The compressed collectives and their engine (layer 2; docs/design.md: "Layers and files", "Collectives").

By responsibility: ``engine`` (one pipelined two-phase exchange, parameterised by a reducer), ``quantized``
(all-gather, reduce-scatter, all-reduce of a codec), ``sign_collective`` (the 1-bit
all-reduce with worker and server error, one algorithm on every device), ``hierarchical`` (exact inside a node,
compressed across nodes), ``averaging`` (Local SGD's model averaging), ``chunked`` (the chunk layout and
payload coding they share), ``call_check`` (the per-call cross-rank consistency check) and ``wire_bytes``
(the wire-byte formulas). They stand on ``lightning_qcomm.comm`` (transport, ledger, topology).

Example::

    quantized_all_reduce(grad, get_codec("uniform", bits=8), op="avg")
"""

from lightning_qcomm.collectives.engine import Reducer, run_all_gather, run_pipelined, run_reduce_scatter
from lightning_qcomm.collectives.hierarchical import (
    ParamShards,
    hierarchical_all_reduce,
    hierarchical_onebit_all_reduce,
)
from lightning_qcomm.collectives.quantized import (
    DEFAULT_PIECE_NUMEL,
    all_reduce_pieces,
    quantized_all_gather,
    quantized_all_reduce,
    quantized_reduce_scatter,
)
from lightning_qcomm.collectives.sign_collective import (
    DEFAULT_ONEBIT_PIECE_NUMEL,
    onebit_all_reduce,
    onebit_pieces,
    onebit_server_error_numel,
)
from lightning_qcomm.collectives.wire_bytes import wire_bytes_formula

__all__ = [
    "DEFAULT_ONEBIT_PIECE_NUMEL",
    "DEFAULT_PIECE_NUMEL",
    "ParamShards",
    "Reducer",
    "all_reduce_pieces",
    "hierarchical_all_reduce",
    "hierarchical_onebit_all_reduce",
    "onebit_all_reduce",
    "onebit_pieces",
    "onebit_server_error_numel",
    "quantized_all_gather",
    "quantized_all_reduce",
    "quantized_reduce_scatter",
    "run_all_gather",
    "run_pipelined",
    "run_reduce_scatter",
    "wire_bytes_formula",
]
