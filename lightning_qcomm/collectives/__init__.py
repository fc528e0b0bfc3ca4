"""The compressed collectives' engine: one pipelined two-phase exchange, parameterised by a reducer
(``collectives.engine``)."""

from lightning_qcomm.collectives.engine import Reducer, run_pipelined

__all__ = ["Reducer", "run_pipelined"]
