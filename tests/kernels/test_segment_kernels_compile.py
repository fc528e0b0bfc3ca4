"""The segment kernels (``kernels/cuda/segment_kernels.py``: QSDP's wire rows, every segment in one launch) compile
for sm_90 with no GPU here, and keep the reference's rounding: no approximate division or square root, no fused
multiply-add in the PTX (``test_triton_compile``'s check), for every codec kind, fp32 and bf16 rows."""

from __future__ import annotations

import pytest
from _siblings import from_test_file

triton = pytest.importorskip("triton")

from lightning_qcomm.codecs import get_codec  # noqa: E402
from lightning_qcomm.codecs.qsgd import redo_floor  # noqa: E402
from lightning_qcomm.kernels.cuda import codec_kernels, segment_kernels, wire_params  # noqa: E402

CODECS, _check, _compile = from_test_file("kernels/test_triton_compile", "CODECS", "_check", "_compile")

KINDS = ["uniform8", "uniform3", "qsgd4", "nuqsgd4", "sign1", "fp8_e4m3", "fp8_e5m2_stochastic"]
COMMON = {"table_ptr": "*i32", "K": "i32", "x_stride": "i64", "wire_stride": "i64", "nbt": "i32"}


def _codec(cid):
    name, bits, opts = CODECS[cid]
    return get_codec(name, bits, bucket_size=512, **opts)


@pytest.mark.parametrize("xk", [0, 1], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cid", KINDS)
def test_segment_scales_kernel_compiles_for_sm90(cid, xk):
    codec = _codec(cid)
    ks = codec.kernel_spec()
    ptx = _compile(
        segment_kernels._wire_kernel,
        {"x_ptr": "*i32" if xk == 0 else "*i16", "keys_ptr": "*i32", "params_ptr": "*fp32", "wire_ptr": "*u8"} | COMMON,
        {"KP2": 16, "XK": xk, "KIND": int(ks.kind), "BUCKET": 512, "BLOCK": 512, "ROWS": 8, "LEVELS": ks.levels}
        | {"FMAX": float(ks.fmax), "LOG2": 9, "NORM_L2": getattr(codec, "scale_statistic", None) is None}
        | {"DIVISOR": float(getattr(codec, "_divisor", 1)), "OUT_MAX": 65504.0, "REDO_FLOOR": redo_floor(512)}
        | {"S": codec.scales_per_bucket, "P": ks.enc_params},
    )
    _check(ptx)
    assert "div.rn.f32" in ptx


@pytest.mark.parametrize("xk", [0, 1], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cid", KINDS)
def test_segment_encode_kernel_compiles_for_sm90(cid, xk):
    codec = _codec(cid)
    ks = codec.kernel_spec()
    ptx = _compile(
        segment_kernels._encode_kernel,
        {"x_ptr": "*i32" if xk == 0 else "*i16", "keys_ptr": "*i32", "params_ptr": "*fp32", "wire_ptr": "*u8"} | COMMON,
        {**codec_kernels._spec(codec), "KP2": 16, "XK": xk, "XES": 4 if xk == 0 else 2, "P": ks.enc_params}
        | {"STOCHASTIC": ks.stochastic, "FMAX": float(ks.fmax), "GROUPS": codec_kernels.GROUPS_PER_PROGRAM},
    )
    _check(ptx)


@pytest.mark.parametrize("total", [False, True], ids=["rows", "sum"])
@pytest.mark.parametrize("ok", [0, 1], ids=["to_fp32", "to_bf16"])
@pytest.mark.parametrize("cid", KINDS)
def test_segment_decode_kernel_compiles_for_sm90(cid, ok, total):
    codec = _codec(cid)
    ptx = _compile(
        segment_kernels._decode_kernel,
        {"wire_ptr": "*u8", "table_ptr": "*i32", "x_ptr": "*i16", "out_ptr": "*i32" if ok == 0 else "*i16"}
        | {"K": "i32", "own": "i32", "wire_stride": "i64", "x_stride": "i64", "out_stride": "i64"},
        {**codec_kernels._spec(codec), "R": 4 if total else 1, "KP2": 16, "WK": 1, "WES": 2, "OK": ok, "SUM": total}
        | {"P": codec.scales_per_bucket, "FP8_E4M3FN": codec.kernel_spec().fp8_e4m3fn}
        | {"GROUPS": codec_kernels.GROUPS_PER_PROGRAM},
    )
    _check(ptx)


def test_segment_kernel_globals_equal_themselves():
    """No NaN global (it would fail every launch after the first compile, on a GPU only)."""
    kernels = [v for v in vars(segment_kernels).values() if isinstance(v, triton.runtime.jit.JITFunction)]
    assert kernels
    for k in kernels:
        _ = k.cache_key
        assert not [name for (name, _), (val, _g) in k.used_global_vals.items() if val != val], k.fn.__name__
    assert wire_params.MAX_BUCKET >= 512
