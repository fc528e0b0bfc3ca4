"""QSDP's run state: what continuing a run needs besides weights and optimizer (entry-point layer; docs/design.md,
"QSDP").

One format, written and restored here for ``QSDPHandle`` (plain torch), ``QSDPStrategy`` (Trainer) and
``QSDPFabricStrategy`` (Fabric): the RNG step (identical on all ranks), the seed, the layout it was written on
(``world_size``; ``topology``, None for flat QSDP) and, with an ``"auto"`` width, the trial's state. Restoring
sets the RNG step; a checkpoint of another layout is warned once (``hsdp.another_topology_message``) and its
``auto`` choice measured again; one written with another seed is warned (the codes go on from other seeds).

Example::

    entry = run_state(comm_state, world_size=4, topology=[2, 2])
    load_run_state("QSDPStrategy", comm_state, entry, world_size=2, topology=None)   # warns: another layout
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from lightning_qcomm.adapters.fsdp2.comms import QSDPCommState
from lightning_qcomm.parallel.hsdp import another_topology_message

log = logging.getLogger(__name__)


def run_state(comm_state: QSDPCommState, world_size: int, topology: list[int] | None) -> dict[str, Any]:
    """The run state of ``comm_state`` on a layout of ``world_size`` ranks (``topology``: ``[num_nodes,
    node_size]`` of HSDP, None for flat QSDP)."""
    trial = comm_state.trial
    return {
        "rng_step": comm_state.step,
        "seed": comm_state.seed,
        "world_size": world_size,
        "topology": topology,
        **({} if trial is None else {"auto": trial.state_dict()}),
    }


def load_run_state(
    owner: str,
    comm_state: QSDPCommState,
    state: Mapping[str, Any],
    world_size: int,
    topology: list[int] | None,
    warn: Callable[[str], Any] = warnings.warn,
) -> None:
    """Restore ``run_state`` into ``comm_state`` on this layout: the RNG step; another layout is said through
    ``warn`` (a strategy passes Lightning's ``rank_zero_warn``) and an ``auto`` choice is measured again; another
    seed is logged. A state without ``world_size`` / ``seed`` (an older format) is restored without those checks."""
    comm_state.step = int(state["rng_step"])
    message = another_topology_message(owner, state, world_size, topology)
    if comm_state.trial is not None:  # a choice made on another layout is measured again
        comm_state.trial.load_state_dict(None if message else state.get("auto"), comm_state.step)
    if int(state.get("seed", comm_state.seed)) != comm_state.seed:
        log.warning("QSDP: checkpoint seed %s differs from this strategy's seed %s", state["seed"], comm_state.seed)
    if message is not None:
        warn(message)


__all__ = ["load_run_state", "run_state"]
