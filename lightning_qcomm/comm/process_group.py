"""Process-group lifecycle: destroy a gloo default group before the interpreter finalizes (process layer).

A process that exits with a gloo process group still alive can abort during interpreter finalization
("terminate called without an active exception", SIGABRT): gloo's C++ worker threads may still hold work
objects whose tensors need the GIL, which is being torn down (pytorch/pytorch#179291). Lightning's launchers
never destroy the group, so a spawned rank that finished training correctly can still exit with an abort,
which the launcher reports as a failure. ``destroy_gloo_group_at_exit`` registers, once per process, an
``atexit`` handler that destroys the default group while the interpreter is still whole. Only gloo: NCCL's
destroy may wait on peers that have already gone.
"""

from __future__ import annotations

import atexit
import logging

import torch.distributed as dist

log = logging.getLogger(__name__)

_registered = False


def _destroy_if_gloo() -> None:
    if not (dist.is_available() and dist.is_initialized()):
        return
    if dist.get_backend() != "gloo":
        return
    try:
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 -- at exit, a failed cleanup must not mask the real exit status
        log.debug("lightning_qcomm: destroy_process_group at exit failed: %s", exc)


def destroy_gloo_group_at_exit() -> None:
    """Register (idempotently) the at-exit destruction of a gloo default process group."""
    global _registered
    if not _registered:
        atexit.register(_destroy_if_gloo)
        _registered = True


__all__ = ["destroy_gloo_group_at_exit"]
