"""Installing the QSDP comms on an FSDP2 model (adapter layer; docs/design.md, "QSDP").

``install_qsdp_comms`` puts a ``QuantizedAllGather`` and a ``QuantizedReduceScatter`` (``adapters.fsdp2.comms``) on every
``FSDPModule`` that owns parameters, with the codecs, thresholds and ledger scope of a ``QSDPCommConfig``, and
makes FSDP2 pass SUM and divide by N itself.

Example::

    modules = install_qsdp_comms(model, QSDPCommConfig(weight_codec, grad_codec), QSDPCommState(seed=0))
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lightning_qcomm.adapters.fsdp2.comms import QSDPCommState, QuantizedAllGather, QuantizedReduceScatter
from lightning_qcomm.adapters.fsdp2.deferred import deferrable
from lightning_qcomm.adapters.fsdp2.shim import (
    check_fsdp_module_internals,
    check_torch_fsdp_api,
    fsdp_param_shards,
    install_requires_grad_sync,
    live_requires_grad,
)
from lightning_qcomm.codecs import Codec
from lightning_qcomm.comm.comm_worker import CommWorker


@dataclass(frozen=True)
class QSDPCommConfig:
    """What to install: codecs (None = unquantized; a mapping: one per width, see the module docstring), the
    small-tensor threshold, and the ledger tags' scope suffix (``""``: the group spans the world; ``"@intra"``: it
    is one node's, as under HSDP)."""

    weight_codec: Codec | None | Mapping[int, Codec | None]
    grad_codec: Codec | None | Mapping[int, Codec | None]
    min_quant_numel: int = 1024
    scope: str = ""


def _live_requires_grad(module: torch.nn.Module) -> Callable[[], list[bool]]:
    def flags() -> list[bool]:
        return live_requires_grad(module)

    return flags


def install_qsdp_comms(
    root: torch.nn.Module,
    config: QSDPCommConfig,
    state: QSDPCommState,
    worker: CommWorker | None = None,
    worker_group: dist.ProcessGroup | None = None,
) -> list[torch.nn.Module]:
    """Install quantized comms on every ``FSDPModule`` under ``root`` (``root`` included) that owns params.

    Group ids follow ``root.modules()`` order, identical on every rank. Returns the modules, in group-id order.
    ``worker`` / ``worker_group``: run CPU weight all-gathers on that thread and group (see
    ``QuantizedAllGather``), and the reduce-scatters whose output FSDP2 only takes views of, finished at the end of
    backward (``adapters.fsdp2.deferred``).
    Installing again (a later Trainer stage, another strategy) replaces the comms and the hooks.
    Refuses (RuntimeError naming torch's version) a torch whose FSDP2 lacks an internal these comms read.
    """
    from torch.distributed.fsdp import FSDPModule

    check_torch_fsdp_api()
    root_group = root if isinstance(root, FSDPModule) and fsdp_param_shards(root) else None
    installed = []
    for module in root.modules():
        if not isinstance(module, FSDPModule):
            continue
        check_fsdp_module_internals(module)
        params = fsdp_param_shards(module)
        if not params:
            continue
        gid = len(installed)
        module.set_custom_all_gather(
            QuantizedAllGather(
                config.weight_codec,
                state,
                gid,
                params,
                config.min_quant_numel,
                config.scope,
                worker=worker,
                worker_group=worker_group,
            )
        )
        module.set_custom_reduce_scatter(
            QuantizedReduceScatter(
                config.grad_codec,
                state,
                gid,
                params,
                config.min_quant_numel,
                config.scope,
                live_requires_grad=_live_requires_grad(module),
                worker=worker,
                worker_group=worker_group,
                deferrable=deferrable(module) if worker is not None else None,
            )
        )
        module.set_force_sum_reduction_for_comms(True)
        install_requires_grad_sync(module, root_group)
        installed.append(module)
    return installed


__all__ = ["QSDPCommConfig", "install_qsdp_comms"]
