"""Whether the Triton kernels work for a codec on a device: checked once, by running them (codec layer).

"Triton imports" is not "Triton works": a driver, a PTX version or a GPU generation the installed Triton does
not support fails only when a kernel first compiles or runs. So before a codec's first CUDA encode, its Triton
encode and decode run once on a small tensor of awkward length (two full buckets and a tail, NaN and ±inf
included) next to the torch reference; unless both succeed and agree bit for bit, that codec uses the
reference on that device from then on, with one warning naming the codec, the device and the error. The
answer is cached per (codec configuration, device); the check makes its host syncs once, at first use.

Example::

    if triton_works(codec, x.device):
        codes, scales = kernels.encode_codec(codec, xf, seed, out_max)
"""

from __future__ import annotations

import contextlib
import logging

import torch

log = logging.getLogger(__name__)
_verdicts: dict[tuple, bool] = {}


def on_device(device: torch.device):
    """The context that makes ``device`` current for a launch (Triton launches on the current CUDA device,
    not on the tensor's)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _probe_input(codec, device: torch.device) -> torch.Tensor:
    n = 2 * codec.bucket_len(1 << 20) + 37 if codec.bucket_size else 1061
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=g)
    x[3], x[4], x[5] = float("nan"), float("inf"), float("-inf")
    return x.to(device)


def _check(codec, device: torch.device) -> None:
    from lightning_qcomm import kernels
    from lightning_qcomm.codecs import scaling

    x = _probe_input(codec, device)
    out_max = scaling.output_max(x.dtype)
    with on_device(device):
        ref_codes, ref_scales = codec.encode_torch(x, 5, out_max)
        codes, scales = kernels.encode_codec(codec, x, 5, out_max)  # what the ops' CUDA kernels run
        ref_out = codec.decode_reference(codes, codec._decode_params(scales), x.numel())
        out = kernels.decode_codec(codec, codes, scales, x.numel())
    if not torch.equal(codes, ref_codes) or not torch.equal(scales.view(torch.int32), ref_scales.view(torch.int32)):
        raise RuntimeError("the Triton encode differs from the torch reference")
    if not torch.equal(out.view(torch.int32), ref_out.view(torch.int32)):
        raise RuntimeError("the Triton decode differs from the torch reference")


def triton_works(codec, device: torch.device) -> bool:
    """True when the Triton kernels of ``codec`` ran on ``device`` and matched the reference (checked once)."""
    key = (tuple(sorted(codec.config().items())), str(device))
    verdict = _verdicts.get(key)
    if verdict is None:
        try:
            _check(codec, device)
            verdict = True
        except Exception as e:  # any failure of a kernel's compile or launch means: use the reference
            log.warning(
                "lightning_qcomm: the Triton kernels of codec %s failed their first-use check on %s (%s: %s); "
                "this codec uses the torch reference codecs there",
                codec.config(),
                device,
                type(e).__name__,
                e,
            )
            verdict = False
        _verdicts[key] = verdict
    return verdict
