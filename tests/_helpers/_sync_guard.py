"""``NoHostSync``: a dispatch mode that raises on every op which makes the host wait for the device.

On a GPU, ``.item()``, ``bool(t)``, ``float(t)``, ``.tolist()`` of a device tensor, data-dependent shapes
(``nonzero``, boolean indexing, ``masked_select``, ``unique``) and ``torch.equal`` stall the CPU until the
device has caught up, so it can no longer queue work ahead; so does a tensor made from Python data
(``aten.lift_fresh``: ``t[i] = number``, ``torch.tensor([...])``), whose pageable host-to-device copy waits for
the stream. Their aten ops are visible on CPU tensors too, so a CPU test can show a code path is free of them,
the codec layer and the kernels included (run them in their accelerator form: ``scaling._HOST_BRANCHES = False``).

One upload is deliberate and queued, not waited for: the per-row random keys of a batched encode
(``codecs.rows.row_keys``) go through pinned memory with ``non_blocking=True`` on CUDA. ``PINNED_UPLOADS``
names it; nothing else is exempt.

The rows ops (``OPENED_OPS``: ``qcomm::encode_rows`` and friends, what the collectives code their rows with, and
the server's sum and error-feedback ops ``decode_rows_sum``, ``feedback_update`` and ``feedback_rows``, QSDP's
segment ops ``encode_segments``, ``decode_segments_into`` and ``decode_segments_sum``) are opened: their CPU kernel
runs under the guard, so the ops inside them are checked too (a mode does not see into an op's kernel otherwise).
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
    "lift_fresh",
}
PINNED_UPLOADS = {("rows.py", "row_keys")}  # (file, function): uploads through pinned memory, queued
# qcomm ops whose kernel is checked (and, in benchmarks/onebit_step_ops.py, whose launches are counted, not the op)
OPENED_OPS = frozenset(
    {"encode_rows", "decode_rows", "decode_rows_into", "decode_rows_sum", "feedback_update", "feedback_rows"}
    | {"encode_segments", "decode_segments_into", "decode_segments_sum", "hadamard_", "tree_norm", "add_square_sr_"}
)


def run_opened(mode: TorchDispatchMode, func, args, kwargs):
    """Run a ``qcomm`` op of ``OPENED_OPS`` through its CPU kernel under ``mode``, which then sees its ops as a
    call from Python would dispatch them: the autograd keys the dispatcher excluded on its way to the mode are
    included again, so composite ops (``reshape``, ``to``) decompose as they would outside the op."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in (torch._C.DispatchKey.AutogradFunctionality, torch._C.DispatchKey.ADInplaceOrView):
        exclude = exclude.remove(key)
    with mode, torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude):
        return func._op_dk(torch._C.DispatchKey.CPU, *args, **(kwargs or {}))


def _pinned_upload() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if (os.path.basename(frame.f_code.co_filename), frame.f_code.co_name) in PINNED_UPLOADS:
            return True
        frame = frame.f_back
    return False


class NoHostSync(TorchDispatchMode):
    """Raise ``AssertionError`` naming the op; ``uploads`` counts the pinned uploads of ``PINNED_UPLOADS``."""

    def __init__(self) -> None:
        super().__init__()
        self.uploads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if func.namespace == "qcomm" and name in OPENED_OPS:
            return run_opened(self, func, args, kwargs)
        bool_index = name == "index" and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else ()) or ()
        )
        if name in SYNC_OPS or bool_index:
            if name == "lift_fresh" and _pinned_upload():
                self.uploads += 1
            else:
                raise AssertionError(f"host sync: aten.{name}")
        return func(*args, **(kwargs or {}))
