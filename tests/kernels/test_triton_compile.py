"""The codec kernels compile for a GPU (sm_90, Hopper) ahead of time, with no GPU here, and round as the reference.

The interpreter runs the kernels on CPU tensors with numpy's arithmetic; the GPU runs what Triton compiles. So
every kernel configuration the ops launch (each codec kind; encode, decode from parameters and from the wire
scales, the per-bucket scales kernel; one tensor and the rows forms; int32 and int64 indexing) is compiled to PTX here with
``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))``, and the PTX is checked for the operations
that would break bit-equality with the torch reference: fp32 division that is not correctly rounded
(``div.full`` / ``div.approx``, what Triton emits for ``/`` on fp32), approximate square roots and fused
multiply-adds (``enable_fp_fusion=False``). The element-wise kernels of sign1 and the decode of the fp8 codecs
are compiled too; ``qsgdinf4`` (the QSGD element-wise kernel) only for the scales kernel.
"""

from __future__ import annotations

import re

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from lightning_qcomm.codecs import get_codec  # noqa: E402
from lightning_qcomm.kernels.cuda import codec_kernels, reduce_kernels, wire_params  # noqa: E402

CODECS = {
    "uniform8": ("uniform", 8, {}),
    "uniform3": ("uniform", 3, {"stochastic": False}),
    "qsgd4": ("qsgd", 4, {}),
    "nuqsgd4": ("nuqsgd", 4, {}),
    "sign1": ("sign1", 1, {}),
    "qsgdinf4": ("qsgdinf", 4, {}),
    "fp8_e4m3": ("fp8_e4m3", 8, {}),
    "fp8_e5m2_stochastic": ("fp8_e5m2", 8, {"rounding": "stochastic"}),
}
FORBIDDEN = re.compile(r"\b(div\.full|div\.approx|sqrt\.approx|(fma|mad)(\.\w+)*\.f(32|64))\b")  # float ops only
TARGET = GPUTarget("cuda", 90, 32)


def _compile(fn, signature: dict, constexprs: dict) -> str:
    sig = {**signature, **{k: "constexpr" for k in constexprs}}
    kernel = triton.compile(ASTSource(fn, sig, constexprs), target=TARGET, options={"enable_fp_fusion": False})
    return kernel.asm["ptx"]


def _check(ptx: str) -> None:
    bad = sorted({m.group(0) for m in FORBIDDEN.finditer(ptx)})
    assert not bad, f"PTX holds {bad}"


@pytest.mark.parametrize("rows", [False, True], ids=["flat", "rows"])
@pytest.mark.parametrize("int64", [False, True], ids=["int32", "int64"])
@pytest.mark.parametrize("cid", list(CODECS))
def test_element_kernels_compile_for_sm90(cid, int64, rows):
    name, bits, opts = CODECS[cid]
    codec = get_codec(name, bits, **opts)
    spec = codec_kernels._spec(codec)
    ks = codec.kernel_spec()
    common = {**spec, "GROUPS": codec_kernels.GROUPS_PER_PROGRAM, "INT64_INDEX": int64}
    enc = _compile(
        codec_kernels._encode_kernel,
        {"x_ptr": "*fp32", "params_ptr": "*fp32", "out_ptr": "*u8", "n": "i32", "k1": "i32", "k2": "i32"}
        | {"keys_ptr": "*i32", "out_stride": "i32", "nb_row": "i32"},
        {**common, "P": ks.enc_params, "STOCHASTIC": ks.stochastic, "FMAX": float(ks.fmax), "ROWS": rows},
    )
    _check(enc)
    for wire, p in ((rows, ks.dec_params if not rows else codec.scales_per_bucket), (True, codec.scales_per_bucket)):
        dec = _compile(
            codec_kernels._decode_kernel,
            {"codes_ptr": "*u8", "params_ptr": "*u8" if rows else "*fp32", "out_ptr": "*fp32", "n": "i32"}
            | {"row_stride": "i32", "scale_off": "i32", "out_limit": "i32"},
            {**common, "P": p, "FP8_E4M3FN": ks.fp8_e4m3fn, "WIRE": wire, "ROWS": rows},
        )
        _check(dec)


@pytest.mark.parametrize("wire", [False, True], ids=["scales", "wire"])
@pytest.mark.parametrize("int64", [False, True], ids=["int32", "int64"])
@pytest.mark.parametrize("cid", list(CODECS) + ["qsgdinf4"])
def test_scales_kernel_compiles_for_sm90(cid, int64, wire):
    name, bits, opts = CODECS[cid]
    codec = get_codec(name, bits, **opts)
    ks = codec.kernel_spec()
    assert wire_params.fused_scales(codec, 4096)
    ptx = _compile(
        wire_params._wire_kernel,
        {
            "x_ptr": "*fp32",
            "scales_ptr": "*fp32",
            "params_ptr": "*fp32",
            "wire_ptr": "*u8",
            "nb": "i32",
            "row_len": "i32",
            "nb_row": "i32",
            "wire_stride": "i32",
            "scale_off": "i32",
        },
        {
            "KIND": int(ks.kind),
            "BUCKET": 512,
            "BLOCK": 512,
            "ROWS": wire_params.ROWS_ELEMENTS // 512,
            "LEVELS": ks.levels,
            "FMAX": float(ks.fmax),
            "INT64_INDEX": int64,
            "LOG2": 9,
            "NORM_L2": getattr(codec, "scale_statistic", None) is None,
            "DIVISOR": float(getattr(codec, "_divisor", 1)),
            "OUT_MAX": 65504.0,
            "REDO_FLOOR": wire_params.redo_floor(512),
            "WIRE": wire,
            "S": codec.scales_per_bucket,
            "P": ks.enc_params,
        },
    )
    _check(ptx)
    assert "div.rn.f32" in ptx  # the correctly rounded division the reference does


@pytest.mark.parametrize("rank_order", [False, True], ids=["torch_order", "rank_order"])
@pytest.mark.parametrize("r", [2, 3, 8])
@pytest.mark.parametrize(
    "cid", ["uniform8", "uniform3", "qsgd4", "nuqsgd4", "fp8_e4m3", "fp8_e5m2_stochastic", "sign1"]
)
def test_decode_sum_kernel_compiles_for_sm90(cid, r, rank_order):
    """The server step's decode-and-sum (torch's CUDA order, and rank order: a loop over the rows): no FMA (each
    add and the times fl(1/R) rounded as the eager ops)."""
    name, bits, opts = CODECS[cid]
    codec = get_codec(name, bits, **opts)
    ptx = _compile(
        reduce_kernels._decode_sum_kernel,
        {"wire_ptr": "*u8", "out_ptr": "*fp32", "n": "i32", "row_stride": "i32", "scale_off": "i32", "inv": "fp32"},
        {**codec_kernels._spec(codec), "R": r, "AVG": True, "RANK_ORDER": rank_order, "P": codec.scales_per_bucket}
        | {
            "FP8_E4M3FN": codec.kernel_spec().fp8_e4m3fn,
            "GROUPS": codec_kernels.GROUPS_PER_PROGRAM,
            "INT64_INDEX": False,
        },
    )
    _check(ptx)


@pytest.mark.parametrize("held", [0, 1, 2], ids=["fp32", "bf16", "fp16"])
def test_feedback_kernel_compiles_for_sm90(held):
    """The error-feedback tail: (S - held) * k, then the add, each rounded (no FMA)."""
    ptx = _compile(
        reduce_kernels._feedback_kernel,
        {"y_ptr": "*fp32", "dec_ptr": "*fp32", "red_ptr": "*fp32", "held_ptr": "*fp32", "err_ptr": "*fp32"}
        | {"n": "i32", "start": "i32", "c": "i32", "k": "fp32"},
        {"HELD": held, "BLOCK": 1024},
    )
    _check(ptx)


@pytest.mark.parametrize("held", [0, 1, 2], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("cid", ["uniform8", "uniform3", "qsgd4", "nuqsgd4", "sign1", "fp8_e4m3"])
def test_feedback_rows_kernel_compiles_for_sm90(cid, held):
    """The error-feedback tail decoding the payloads in registers: the decode's and the tail's operations each
    rounded (no FMA)."""
    name, bits, opts = CODECS[cid]
    codec = get_codec(name, bits, **opts)
    ptx = _compile(
        reduce_kernels._feedback_rows_kernel,
        {"wire_ptr": "*u8", "y_ptr": "*fp32", "red_ptr": "*fp32", "held_ptr": "*fp32", "err_ptr": "*fp32"}
        | {"n": "i32", "m": "i32", "row_stride": "i32", "scale_off": "i32", "start": "i32", "c": "i32", "k": "fp32"},
        {"HELD": held, **codec_kernels._spec(codec), "P": codec.scales_per_bucket}
        | {"FP8_E4M3FN": codec.kernel_spec().fp8_e4m3fn, "GROUPS": codec_kernels.GROUPS_PER_PROGRAM},
    )
    _check(ptx)


@pytest.mark.parametrize(
    "module", [codec_kernels, wire_params, reduce_kernels], ids=lambda m: m.__name__.rsplit(".")[-1]
)
def test_kernel_globals_equal_themselves(module):
    """Triton checks at every launch that each global a kernel reads still equals (==) its value at compile time:
    a NaN global (NaN != NaN) would fail every launch after the first compile, on a GPU only."""
    kernels = [v for v in vars(module).values() if isinstance(v, triton.runtime.jit.JITFunction)]
    assert kernels
    for k in kernels:
        _ = k.cache_key  # collects the globals the kernel and its callees read
        changed = [name for (name, _), (val, _g) in k.used_global_vals.items() if val != val]
        assert not changed, (k.fn.__name__, changed)
