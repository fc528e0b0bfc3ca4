"""The codecs' torch form, as it runs on an accelerator, makes no host sync and equals the CPU form bit for bit.

On the CPU the codec layer may branch on values (``codecs.scaling.may_branch_on``: reading a CPU value waits for
nothing) and works in cache-sized pieces; on a CUDA tensor (the Triton kernels' torch half, or the reference when
Triton is missing) it must do neither. Setting ``scaling._HOST_BRANCHES = False`` and ``base._PIECE`` to
"everything" runs exactly that form on CPU tensors, under ``NoHostSync()``, which raises on
``.item()``/``bool(t)``/``nonzero`` anywhere, codec layer included.
"""

from __future__ import annotations

import pytest
import torch
from _sync_guard import NoHostSync

from lightning_qcomm.codecs import base, codec_names, codec_spec, get_codec, scaling

FLT_MAX = torch.finfo(torch.float32).max


def _inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    n = 3 * 512 + 77  # full buckets and a tail
    plain = torch.randn(n, generator=g)
    extreme = plain.clone()
    extreme[:512] *= 1e-30  # a bucket of subnormal-range values (the norm's rescale path)
    extreme[512:1024] *= 1e25  # squares overflow fp32
    extreme[1024:1100] = 0.0  # zeros in a bucket
    extreme[5] = float("nan")
    extreme[600] = float("inf")
    extreme[1500] = -FLT_MAX
    return {"plain": plain, "extreme": extreme}


def _codecs():
    for name in codec_names():
        spec = codec_spec(name)
        for bits in sorted({min(spec.bits), spec.default_bits}):
            yield pytest.param(name, bits, id=f"{name}-{bits}")


def _roundtrip(codec, x: torch.Tensor):
    out_max = scaling.output_max(x.dtype)
    codes, scales = codec.encode_torch(x, 11, out_max)
    dec = codec.decode_reference(codes, codec._decode_params(scales), x.numel())
    return codes, scales, dec


@pytest.mark.parametrize(("name", "bits"), list(_codecs()))
@pytest.mark.parametrize("data", ["plain", "extreme"])
def test_accelerator_form_is_sync_free_and_identical(name, bits, data, monkeypatch):
    x = _inputs()[data]
    codec = get_codec(name, bits=bits)
    want = _roundtrip(codec, x)  # the CPU form: host branches, 64K pieces

    monkeypatch.setattr(scaling, "_HOST_BRANCHES", False)
    monkeypatch.setattr(base, "_PIECE", 1 << 40)
    with NoHostSync():
        got = _roundtrip(codec, x)
    for w, g, what in zip(want, got, ("codes", "scales", "decoded")):
        assert torch.equal(w.view(torch.uint8), g.view(torch.uint8)), f"{name}-{bits} {data}: {what} differ"


def test_strict_guard_catches_a_codec_layer_sync():
    # The guard is able to fail: the CPU form of the QSGD norm branches on the host.
    x = _inputs()["extreme"]
    with pytest.raises(AssertionError, match="host sync"), NoHostSync():
        _roundtrip(get_codec("qsgd", bits=4), x)
