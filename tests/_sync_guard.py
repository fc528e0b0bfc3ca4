"""``NoHostSync``: a dispatch mode that raises on every op which makes the host wait for the device.

On a GPU, ``.item()``, ``bool(t)``, ``float(t)``, ``.tolist()`` of a device tensor, data-dependent shapes
(``nonzero``, boolean indexing, ``masked_select``, ``unique``) and ``torch.equal`` stall the CPU until the
device has caught up, so it can no longer queue work ahead. Their aten ops are visible on CPU tensors too,
so a CPU test can show a code path is free of them. Ops called from the codec layer (``lightning_qcomm/codecs``,
``kernels``) are allowed: that layer is being converted to custom ops elsewhere and still has a few
(``l2_norm_rows``' redo branch, ``scaling.none_needed`` on CPU, the fused C path's scalar scale).
"""

from __future__ import annotations

import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SYNC_OPS = {
    "_local_scalar_dense",
    "is_nonzero",
    "item",
    "nonzero",
    "masked_select",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "equal",
    "allclose",
}
_ALLOWED_DIRS = (os.sep + os.path.join("lightning_qcomm", "codecs") + os.sep, os.sep + "kernels" + os.sep)


def _caller_allowed() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if any(d in frame.f_code.co_filename for d in _ALLOWED_DIRS):
            return True
        frame = frame.f_back
    return False


class NoHostSync(TorchDispatchMode):
    """Raise ``AssertionError`` naming the op (and count the allowed codec-layer ones in ``allowed``)."""

    def __init__(self, strict: bool = False) -> None:
        super().__init__()
        self.strict = strict  # strict: the codec layer gets no exemption either
        self.allowed: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        bool_index = name == "index" and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else ()) or ()
        )
        if name in SYNC_OPS or bool_index:
            if self.strict or not _caller_allowed():
                where = "" if self.strict else " outside the codec layer"
                raise AssertionError(f"host sync{where}: aten.{name}")
            self.allowed.append(name)
        return func(*args, **(kwargs or {}))
