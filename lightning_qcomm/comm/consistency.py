"""Cross-rank agreement on configuration, checked once at setup (comm layer).

Every strategy and callback of this package publishes its full configuration (every option that changes
what is communicated or computed) under its name, and checks that every rank published the same. Ranks
that disagree (a codec, a period, a freeze step, one rank without the callback) would otherwise hang in
mismatched collectives or train on silently inconsistent data; with this check every rank that runs the
component raises the same ``ValueError``, naming each differing field and its value on each rank.

The exchange goes through the default process group's key-value store, not a collective: a rank that
lacks the component (so never calls this) cannot pair a collective of ours with an unrelated one of its
own. Waiting for such a rank times out (``timeout``) with an error naming the missing ranks; it is
called right after the process group's rendezvous, when every rank arrives within moments.

Keys are ``lightning_qcomm/config/<component>/<k>/<rank>``, with ``k`` counting this process's checks of
that component (several fits in one process check again; ranks run the same sequence).

Example::

    check_same_config("QuantDDPStrategy", {"codec": "uniform", "bits": 8}, timeout=timedelta(seconds=60))
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch.distributed as dist

KEY_PREFIX = "lightning_qcomm/config"
DEFAULT_TIMEOUT = timedelta(minutes=5)

_calls: dict[str, int] = defaultdict(int)


def _canonical(config: Mapping[str, Any]) -> str:
    return json.dumps({str(k): config[k] for k in config}, sort_keys=True, default=repr)


def _store():
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def presence_timeout(strategy_timeout: timedelta | None) -> timedelta:
    """How long to wait for the other ranks' configs: the strategy's timeout, at most ``DEFAULT_TIMEOUT``."""
    if strategy_timeout is None:
        return DEFAULT_TIMEOUT
    return min(strategy_timeout, DEFAULT_TIMEOUT)


def check_same_config(component: str, config: Mapping[str, Any], timeout: timedelta | None = None) -> None:
    """Raise ``ValueError`` on every participating rank unless all ranks of the world have ``config``.

    No-op without an initialised process group or in a world of one. ``config`` values must be JSON-like
    (anything else is compared by ``repr``).
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    k = _calls[component]
    _calls[component] += 1
    base = f"{KEY_PREFIX}/{component}/{k}"
    store = _store()
    store.set(f"{base}/{rank}", _canonical(config))
    keys = [f"{base}/{r}" for r in range(world)]
    wait = timeout if timeout is not None else DEFAULT_TIMEOUT
    try:
        store.wait(keys, wait)
    except Exception as err:  # DistStoreError / RuntimeError on timeout, depending on the store
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        raise ValueError(
            f"{component}: ranks {missing} did not publish their configuration within {wait} (rank {rank} did): "
            f"every rank must use {component} with the same settings (is it missing from their Trainer?)"
        ) from err
    configs = [json.loads(store.get(key)) for key in keys]
    if all(c == configs[0] for c in configs):
        return
    fields = sorted({f for c in configs for f in c})
    diffs = [
        f"{f}: " + ", ".join(f"rank{r}={c.get(f, '<absent>')!r}" for r, c in enumerate(configs))
        for f in fields
        if any(c.get(f, "<absent>") != configs[0].get(f, "<absent>") for c in configs)
    ]
    raise ValueError(
        f"{component}: ranks disagree on its configuration ({'; '.join(diffs)}); use the same on every rank"
    )


__all__ = ["check_same_config", "presence_timeout"]
