"""Choose between the Triton kernels and the torch reference for the element-wise codec work.

CUDA tensors go to ``lightning_qcomm.kernels`` when Triton is importable; everything else (CPU, or a
machine without Triton) uses the torch reference. Falling back when a GPU tensor could have used a
kernel is logged once. ``LIGHTNING_QCOMM_DISABLE_TRITON=1`` forces the reference everywhere.

Large CPU tensors (``numel >= cpu_fused.FUSED_MIN_NUMEL``) go to the fused compiled CPU path of
``codecs.cpu_fused`` (bit-identical to the reference); ``LIGHTNING_QCOMM_CPU_FUSED=0`` disables it, and
if it cannot be built the reference is used and the reason logged once.
"""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger(__name__)
_warned: set[str] = set()


def _log_once(key: str, msg: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(msg)


def triton_available() -> bool:
    try:
        from lightning_qcomm import kernels
    except ImportError:
        return False
    return bool(getattr(kernels, "HAS_TRITON", False))


def use_triton(t: torch.Tensor) -> bool:
    """True when the Triton kernels should handle this tensor."""
    if not t.is_cuda or os.environ.get("LIGHTNING_QCOMM_DISABLE_TRITON") == "1":
        return False
    if not triton_available():
        _log_once("no-triton", "lightning_qcomm: Triton is not available; CUDA tensors use the torch reference codecs")
        return False
    return True


def triton_encode(codec, xf: torch.Tensor, enc_params: torch.Tensor, seed: int) -> torch.Tensor:
    from lightning_qcomm import kernels

    return kernels.encode(codec, xf, enc_params, seed)


def triton_decode(codec, codes: torch.Tensor, dec_params: torch.Tensor, numel: int) -> torch.Tensor:
    from lightning_qcomm import kernels

    return kernels.decode(codec, codes, dec_params, numel)


def use_cpu_fused(codec, t: torch.Tensor, numel: int) -> bool:
    """True when the fused CPU path should do the element-wise work of ``codec`` on ``numel`` elements."""
    from lightning_qcomm.codecs import cpu_fused

    if t.device.type != "cpu" or numel < cpu_fused.FUSED_MIN_NUMEL or not cpu_fused.supports(codec):
        return False
    if os.environ.get(cpu_fused.ENV_SWITCH) == "0":
        return False
    if cpu_fused.load() is None:
        _log_once(
            "no-cpu-fused",
            f"lightning_qcomm: fused CPU codecs unavailable ({cpu_fused.load_error()}); using the torch reference",
        )
        return False
    return True


def cpu_fused_encode(
    codec, xf: torch.Tensor, seed: int, out_max: float = torch.finfo(torch.float32).max
) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed codes, wire scales) of flat fp32 ``xf``, as ``Codec.encode`` computes them."""
    from lightning_qcomm.codecs import cpu_fused

    return cpu_fused.encode_packed(codec, xf, seed, out_max)


def cpu_fused_decode(codec, codes: torch.Tensor, dec_params: torch.Tensor, numel: int) -> torch.Tensor:
    from lightning_qcomm.codecs import cpu_fused

    return cpu_fused.decode(codec, codes, dec_params, numel)
