"""The aten ops a block of code dispatches, less those that launch nothing (allocations and views): on a GPU one
such op is about one kernel launch.

Example::

    with OpLog() as log:
        scatter_segments(buf, segments, flat)
    assert log.ops == ["_foreach_copy_"]
"""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode

LAUNCH_FREE = {"empty", "empty_strided", "view", "slice", "as_strided", "alias", "detach", "_unsafe_view"}


class OpLog(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in LAUNCH_FREE:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))
