"""The segment ops (``codecs.rows_segments``: QSDP's wire rows of quantized and raw segments).

On CPU: the ops' reference equals ``RowCodec``'s own row loop bit for bit (encode, decode, and the reduce-scatter's
rank-order sum with the own row exact), and bad layouts are refused. Under Triton's interpreter (a fresh process,
``_interpreted.py``), on the CUDA path: the segment kernels give the reference's bytes and values (NaN equal
to NaN) for every codec kind, fp32 and bf16 rows, one and three rows, in two launches to encode and one to decode
or sum; and a QSDP training step on them equals the same step on the per-segment row loop, bit for bit, at no more
than 1.15x FSDP2's launches.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import pytest
import torch

from lightning_qcomm.adapters.fsdp2.row_codec import RowCodec, Segment
from lightning_qcomm.codecs import get_codec
from lightning_qcomm.codecs.rows_segments import (
    decode_segments_into,
    decode_segments_sum,
    encode_segments,
    wire_nbytes,
)

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
CODECS = [
    ("uniform", 8, 1024, {}),
    ("uniform", 4, 128, {}),
    ("uniform", 3, 64, {"stochastic": False}),
    ("fp8_e4m3", 8, 256, {}),
    ("qsgd", 4, 128, {}),
    ("nuqsgd", 4, 64, {}),
    ("sign1", 1, 128, {}),
]
# (numel, quantized) runs: raw first and last, a segment not a whole number of buckets, one shorter than 8
LAYOUTS = {
    "mixed": [(96, False), (2048, True), (40, False), (1000, True), (16, False), (384, True)],
    "edges": [(1030, True), (5, False), (130, True)],
    "raw": [(77, False)],
}


def _rows(r: int, layout, dtype, seed: int) -> torch.Tensor:
    s = sum(n for n, _ in layout)
    x = torch.randn(r, s, generator=torch.Generator().manual_seed(seed)) * 3
    x[0, min(100, s - 1)], x[-1, s // 2], x[0, 5], x[-1, s - 3] = float("nan"), float("inf"), -0.0, 1e-41
    return x.to(dtype)


def _plan(layout):
    return [n for n, _ in layout], [q for _, q in layout]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit, any NaN equal to any NaN."""
    a, b = a.float(), b.float()
    nan = a.isnan()
    return bool(torch.equal(nan, b.isnan()) and torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32)))


def _row_codec(layout, codec) -> RowCodec:
    return RowCodec([Segment(n, q) for n, q in layout], codec)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("r", [1, 3])
@pytest.mark.parametrize("name", ["mixed", "edges"])
@pytest.mark.parametrize("cid", range(len(CODECS)))
def test_reference_is_the_row_codec_loop(cid, name, r, dtype):
    """Encode, decode (row 1 skipped) and the rank-order sum of the ops' reference equal RowCodec's loop."""
    cname, bits, bucket, opts = CODECS[cid]
    codec, layout = get_codec(cname, bits, bucket, **opts), LAYOUTS[name]
    rc, (numels, quantized) = _row_codec(layout, codec), _plan(layout)
    rows = _rows(r, layout, dtype, seed=cid)
    legacy = rc.encode(rows, seed=5)
    wire = torch.zeros(r, wire_nbytes(codec, numels, quantized, dtype), dtype=torch.uint8)
    assert torch.equal(encode_segments(codec, rows, numels, quantized, rc._seeds(5), wire), legacy)
    skip = 1 if r > 1 else None
    want = rc.decode(legacy, torch.full(rows.shape, 7.0), skip_row=skip, wire_dtype=dtype)
    got = decode_segments_into(codec, wire, numels, quantized, dtype, torch.full(rows.shape, 7.0), skip_row=skip)
    assert _same(got, want)
    own = r - 1
    each = [rc.decode(legacy[j : j + 1], torch.empty(1, rows.shape[1]), wire_dtype=dtype)[0] for j in range(r)]
    each[own] = rows[own].float()  # the own row enters exact
    expect = each[0].clone()
    for j in range(1, r):
        expect += each[j]
    total = decode_segments_sum(codec, wire, rows, own, numels, quantized, torch.empty(rows.shape[1]))
    assert _same(total, expect)


def test_bad_layouts_are_refused():
    codec = get_codec("uniform", 8, 64)
    rows = torch.randn(2, 100)
    wire = torch.empty(2, wire_nbytes(codec, [60, 40], [True, False], torch.float32), dtype=torch.uint8)
    with pytest.raises(ValueError, match="must sum to the row's 100 elements"):
        encode_segments(codec, rows, [60, 30], [True, False], [1], wire)
    with pytest.raises(ValueError, match="need as many seeds"):
        encode_segments(codec, rows, [60, 40], [True, False], [1, 2], wire)
    with pytest.raises(ValueError, match="one quantized flag each"):
        decode_segments_into(codec, wire, [60, 40], [True], torch.float32, torch.empty(2, 100))


def test_opcheck_segment_ops():
    codec = get_codec("uniform", 8, 64)
    rows = torch.randn(3, 300, generator=torch.Generator().manual_seed(4))
    numels, quantized = [100, 50, 150], [True, False, True]
    wire = torch.empty(3, wire_nbytes(codec, numels, quantized, torch.float32), dtype=torch.uint8)
    encode_segments(codec, rows, numels, quantized, [1, 2], wire)
    for op, args in (
        (torch.ops.qcomm.encode_segments.default, (rows, numels, quantized, [1, 2], *codec.op_args(), wire.clone())),
        (
            torch.ops.qcomm.decode_segments_into.default,
            (wire, numels, quantized, *codec.op_args(), torch.float32, 1, torch.empty(3, 300)),
        ),
        (
            torch.ops.qcomm.decode_segments_sum.default,
            (wire, rows, 2, numels, quantized, *codec.op_args(), torch.empty(300)),
        ),
    ):
        result = torch.library.opcheck(op, args)
        assert set(result.values()) == {"SUCCESS"}, (op, result)


# ---------------------------------------------------------------------------------------------- interpreted
def _kernel_cases() -> dict:
    from launch_counts import cuda_path_on_cpu

    from lightning_qcomm.codecs import cuda_segments, rows_segments

    out = {}
    for cid, (cname, bits, bucket, opts) in enumerate(CODECS):
        codec = get_codec(cname, bits, bucket, **opts)
        for name, layout in LAYOUTS.items():
            numels, quantized = _plan(layout)
            for dtype in (torch.float32, torch.bfloat16):
                for r in (1, 3):
                    key = f"{cname}{bits}-{bucket}_{name}_{str(dtype)[6:]}_r{r}"
                    rows = _rows(r, layout, dtype, seed=cid + r)
                    p = wire_nbytes(codec, numels, quantized, dtype)
                    want = torch.zeros(r, p, dtype=torch.uint8)
                    rows_segments.encode_segments_body(
                        codec, rows, numels, quantized, [3, 4, 5][: sum(quantized)], want
                    )
                    skip = r - 1 if r > 1 else -1
                    refs = {}  # the references on the CPU kernels, as the encode's (not the CUDA ones interpreted)
                    for od in (torch.float32, torch.bfloat16):
                        ref = torch.full(rows.shape, 7.0, dtype=od)
                        rows_segments.decode_segments_body(codec, want, numels, quantized, dtype, skip, ref)
                        ref_sum = torch.empty(rows.shape[1], dtype=od)
                        rows_segments.sum_segments_body(codec, want, rows, 0, numels, quantized, ref_sum)
                        refs[od] = ref, ref_sum
                    with cuda_path_on_cpu() as log:
                        assert cuda_segments.segments_kernel(codec, rows, numels, quantized, r, dtype)
                        log.clear()  # the first-use check may launch
                        got = encode_segments(
                            codec, rows, numels, quantized, [3, 4, 5][: sum(quantized)], torch.zeros_like(want)
                        )
                        out[f"encode_{key}"] = torch.equal(got, want) and log == (
                            ["wire", "encode"] if any(quantized) else ["encode"]
                        )
                        for od, (ref, ref_sum) in refs.items():
                            log.clear()
                            dec = decode_segments_into(
                                codec,
                                want,
                                numels,
                                quantized,
                                dtype,
                                torch.full(rows.shape, 7.0, dtype=od),
                                skip if skip >= 0 else None,
                            )
                            out[f"decode_{key}_to_{str(od)[6:]}"] = _same(dec, ref) and log == ["decode"]
                            log.clear()
                            total = decode_segments_sum(
                                codec, want, rows, 0, numels, quantized, torch.empty(rows.shape[1], dtype=od)
                            )
                            out[f"sum_{key}_to_{str(od)[6:]}"] = _same(total, ref_sum) and log == ["decode"]
    return out


def _qsdp_cases() -> dict:
    """A QSDP W8G8 step of GPT-2's tensors (x 0.02, matrices of 128 elements and more quantized: every block's
    but the attention output's; 2 fake ranks, mirrored collectives) on the segment ops and on the per-segment row
    loop: the same parameters after two steps; and its launches against FSDP2's. The segment ops' two steps are
    the two uncounted warm-up steps of ``count_step("qsdp-w8g8")`` (the same model, tokens, group and config), so
    they are interpreted once."""
    import functools
    from unittest import mock

    import step_launches as sl
    import step_methods as sm
    import torch.distributed as dist
    from launch_counts import cuda_path_on_cpu, mirrored_collectives
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import lightning_qcomm.parallel as parallel

    def local_params(model) -> list[torch.Tensor]:
        return [p.detach().to_local().clone() for p in model.parameters()]

    def loop_params_after_steps() -> list[torch.Tensor]:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
        model = sl.gpt2(0.02)
        tokens = torch.randint(0, model.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(1))
        with mock.patch.object(RowCodec, "fused", return_value=False):
            run = sm.fsdp(model, tokens, 0.02, 2, qsdp=True)
            for _ in range(2):
                run.step()
        got = local_params(model)
        dist.destroy_process_group()
        return got

    fused: list[torch.Tensor] = []

    def keep_params_after_two_steps(model, tokens, scale, world):
        run = sm.fsdp(model, tokens, scale, world, qsdp=True)  # METHODS["qsdp-w8g8"]'s builder
        assert run.warm is None and run.warmup == 2, "the two steps compared are count_step's warm-up steps"
        step, done = run.step, [0]

        def step_then_keep():
            step()
            done[0] += 1
            if done[0] == 2:  # the last warm-up step: before the counted one
                fused.extend(local_params(model))

        run.step = step_then_keep
        return run

    out = {}
    config = functools.partial(parallel.QSDPConfig, min_quant_numel=128)
    with cuda_path_on_cpu() as log, mirrored_collectives(), mock.patch.object(parallel, "QSDPConfig", config):
        legacy = loop_params_after_steps()
        base = sl.count_step("fsdp2", 0.02, 2, log)
        qsdp = sl.count_step("qsdp-w8g8", 0.02, 2, log, build=keep_params_after_two_steps)
    out["step_same_parameters"] = len(legacy) == len(fused) > 0 and all(_same(a, b) for a, b in zip(legacy, fused))
    # each collective: scales and codes, then the decode or the sum (the non-finite check's all-reduce has none)
    out["step_uses_segment_kernels"] = 0 < qsdp["triton"] <= 3 * qsdp["collectives"]
    out["step_launches_ratio"] = qsdp["total"] / base["total"]
    out["step_counts"] = [base["total"], qsdp["total"], qsdp["collectives"], qsdp["triton"]]
    return out


def _sync_cases() -> dict:
    """QSDP's all-gather and reduce-scatter on the segment kernels under the host-sync guard (4 fake ranks)."""
    import torch.distributed as dist
    from _sync_guard import NoHostSync
    from launch_counts import cuda_path_on_cpu
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from lightning_qcomm.adapters.fsdp2.comms import QSDPCommState, QuantizedAllGather, QuantizedReduceScatter
    from lightning_qcomm.adapters.fsdp2.shim import ParamShard

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    params = [
        ParamShard(1500, 1500, 6000, 2, True),
        ParamShard(17, 17, 68, 1, True),
        ParamShard(900, 899, 3599, 2, True),
    ]
    s = sum(p.padded_shard_numel for p in params)
    codec, state = get_codec("uniform", bits=8, bucket_size=256), QSDPCommState(seed=1)
    ag, rs = QuantizedAllGather(codec, state, 0, params, 1024), QuantizedReduceScatter(codec, state, 0, params, 1024)
    group, out = dist.group.WORLD, torch.empty(4 * s)
    result = {}
    with cuda_path_on_cpu() as log:
        for guard in (contextlib.nullcontext, NoHostSync):  # the first call uploads the layout's table
            log.clear()
            try:
                with guard():
                    ag(out, out[s : 2 * s].normal_(), group)
                    rs(torch.empty(s), torch.randn(4 * s), group)
                launches = ["wire", "encode", "decode", "wire", "encode", "decode"]  # the first call may probe
                result[f"sync_free_{guard.__name__}"] = guard is contextlib.nullcontext or log == launches
            except Exception as e:  # the guard's refusal
                result[f"sync_free_{guard.__name__}"] = repr(e)[:300]
    dist.destroy_process_group()
    return result


@pytest.fixture(scope="module")
def report() -> dict:
    pytest.importorskip("triton")
    from _interpreted import run_interpreted

    return run_interpreted(__file__, 1500)


@pytest.mark.parametrize("kind", ["encode", "decode", "sum"])
def test_segment_kernels_under_the_interpreter(report, kind):
    cases = {k: v for k, v in report.items() if k.startswith(kind + "_")}
    assert len(cases) >= 40, kind
    assert all(cases.values()), [k for k, v in cases.items() if not v]


def test_qsdp_comms_on_the_segment_kernels_wait_for_nothing(report):
    """Three launches per collective (scales, codes; the decode or the sum) and no host sync."""
    cases = {k: v for k, v in report.items() if k.startswith("sync_free_")}
    assert cases and all(v is True for v in cases.values()), cases


def test_qsdp_step_on_the_segment_kernels(report):
    pytest.importorskip("transformers")
    assert report["step_uses_segment_kernels"], report["step_counts"]
    assert report["step_same_parameters"]


def test_qsdp_step_launches_within_fsdp2s(report):
    """A QSDP W8G8 step within 1.15x FSDP2's launches (the per-segment loop launched 2.1x)."""
    pytest.importorskip("transformers")
    assert report["step_launches_ratio"] <= 1.15, report["step_counts"]


if __name__ == "__main__":
    sys.path[:0] = [str(BENCHMARKS), str(Path(__file__).resolve().parents[1] / "_helpers")]
    try:
        import transformers  # noqa: F401

        qsdp = _qsdp_cases()
    except ImportError:
        qsdp = {}
    print(json.dumps({**_kernel_cases(), **_sync_cases(), **qsdp}))
