"""Say a thing once per process (layer 0, like ``_checks``: it imports nothing of the package; docs/design.md,
"Layers and files").

A fallback, a missing backend, a buffer sent unquantized: each is logged the first time it happens, under a key,
on the logger of the module that says it (so ``caplog`` and logging filters still see that module's name). The
same key on two loggers is said twice. Tests that must see a message again replace ``_said`` with an empty set.

Example::

    log_once(log, "no-triton", "lightning_qcomm: Triton is not available; CUDA tensors use the reference codecs")
"""

from __future__ import annotations

import logging

_said: set[tuple[str, str]] = set()


def log_once(log: logging.Logger, key: str, message: str) -> None:
    """``log.warning(message)`` the first time ``key`` is said on ``log`` in this process; nothing after."""
    if (log.name, key) not in _said:
        _said.add((log.name, key))
        log.warning(message)


__all__ = ["log_once"]
