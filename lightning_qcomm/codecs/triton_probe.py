"""Whether the Triton kernels work for a codec on a device: checked once, by running them (codec layer).

"Triton imports" is not "Triton works": a driver, a PTX version or a GPU generation the installed Triton does
not support fails only when a kernel first compiles or runs. So before a codec's first CUDA encode, its Triton
encode and decode run once on a small tensor of awkward length (two full buckets and a tail, NaN and ±inf
included) next to the torch reference; unless both succeed and agree bit for bit, that codec uses the
reference on that device from then on, with one warning naming the codec, the device and the error (for a
disagreement: which output, how many positions, the first one with both values and their bits; ``failure``
returns it). Agreement is per bit, except that any NaN equals any NaN: a NaN's sign and payload bits depend on
the operations and the hardware that made it (a GPU's canonical NaN is 0x7fffffff, an x86 CPU's 0xffc00000),
and only that it is NaN is part of a codec's contract. The answer is cached per (codec configuration, device);
the check makes its host syncs once, at first use.

Example::

    if triton_works(codec, x.device):
        codes, scales = kernels.encode_codec(codec, xf, seed, out_max)
"""

from __future__ import annotations

import contextlib
import logging

import torch

from lightning_qcomm.codecs import scaling

log = logging.getLogger(__name__)
_verdicts: dict[tuple, bool] = {}
_failures: dict[tuple, str] = {}


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
    kernels = triton_kernels()
    x = _probe_input(codec, device)
    out_max = scaling.output_max(x.dtype)
    with on_device(device):
        ref_codes, ref_scales = codec.encode_torch(x, 5, out_max)
        codes, scales = kernels.encode_codec(codec, x, 5, out_max)  # what the ops' CUDA kernels run
        ref_out = codec.decode_reference(codes, codec._decode_params(scales), x.numel())
        out = kernels.decode_codec(codec, codes, scales, x.numel())
    outputs = (("encode", "codes", ref_codes, codes), ("encode", "scales", ref_scales, scales))
    for what, label, want, got in (*outputs, ("decode", "values", ref_out, out)):
        difference = _difference(label, want, got)
        if difference:
            raise RuntimeError(f"the Triton {what} differs from the torch reference: {difference}")


def triton_kernels():
    """``lightning_qcomm.kernels``, imported at first use: it imports Triton (seconds), which a CPU run never needs."""
    from lightning_qcomm import kernels

    return kernels


def _key(codec, device: torch.device) -> tuple:
    return (tuple(sorted(codec.config().items())), str(device))


def failure(codec, device: torch.device) -> str | None:
    """Why ``codec``'s Triton kernels are not used on ``device`` (the first-use check's error), or None when they
    are or were not checked yet."""
    return _failures.get(_key(codec, device))


def _difference(label: str, want: torch.Tensor, got: torch.Tensor) -> str | None:
    """None when ``got`` equals ``want`` bit for bit, any NaN equal to any NaN; else which positions differ, the
    first with both values (and the bits of floats)."""
    if want.shape != got.shape or want.dtype != got.dtype:
        return f"shape/dtype {tuple(got.shape)} {got.dtype}, reference {tuple(want.shape)} {want.dtype}"
    floating = want.is_floating_point()
    if floating:  # the bits, every NaN as 0 and where the NaNs are apart (torch.equal: host reads, once)
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[want.element_size()]
        wb, gb = (torch.where(t.isnan(), 0, t.view(bits)) for t in (want, got))
        if torch.equal(want.isnan(), got.isnan()) and torch.equal(wb, gb):
            return None
        differ = (wb != gb) | (want.isnan() != got.isnan())
    elif torch.equal(want, got):
        return None
    else:
        differ = want != got
    where = differ.reshape(-1).nonzero()  # the details, on the way to an error only
    i = int(where[0])
    w, g = want.reshape(-1)[i], got.reshape(-1)[i]
    if floating:
        mask, width = (1 << 8 * want.element_size()) - 1, 2 * want.element_size()
        wv = f"{w.item()!r} (0x{w.view(bits).item() & mask:0{width}x})"
        gv = f"{g.item()!r} (0x{g.view(bits).item() & mask:0{width}x})"
    else:
        wv, gv = str(w.item()), str(g.item())
    return f"{where.numel()} of {want.numel()} {label} differ, the first at {i}: reference {wv}, Triton {gv}"


def triton_works(codec, device: torch.device) -> bool:
    """True when the Triton kernels of ``codec`` ran on ``device`` and matched the reference (checked once)."""
    what = f"the Triton kernels of codec {codec.config()}"
    return first_use(
        _key(codec, device),
        what,
        device,
        lambda: _check(codec, device),
        "this codec uses the torch reference codecs there",
    )


def first_use(key: tuple, what: str, device: torch.device, check, fallback: str) -> bool:
    """Whether ``check()`` (a kernel run next to what it replaces, raising where it fails or disagrees) passed for
    ``key``: run once, cached; a failure is recorded (``failure``) and warned once, naming ``what``, the device,
    the error and ``fallback`` (what runs instead). The codecs' kernels and the collectives' (``codecs.rows_reduce``)
    are checked through it."""
    verdict = _verdicts.get(key)
    if verdict is None:
        try:
            check()
            verdict = True
        except Exception as e:  # any failure of a kernel's compile or launch means: use what it replaces
            _failures[key] = f"{type(e).__name__}: {e}"
            log.warning(
                "lightning_qcomm: %s failed their first-use check on %s (%s: %s); %s",
                what,
                device,
                type(e).__name__,
                e,
                fallback,
            )
            verdict = False
        _verdicts[key] = verdict
    return verdict
