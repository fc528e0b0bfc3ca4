"""The compressed collectives' engine: one pipelined two-phase exchange, parameterised by a reducer
(``collectives.engine``)."""

from lightning_qcomm.collectives.engine import Reducer, run_all_gather, run_pipelined, run_reduce_scatter

__all__ = ["Reducer", "run_all_gather", "run_pipelined", "run_reduce_scatter"]
