"""The all-reduce's server step and error-feedback tail as ops (``codecs.rows_reduce``): ``qcomm::decode_rows_sum``
and ``qcomm::feedback_update``, and the flat form of ``decode_rows_into`` the final decode writes the output with.

CPU: the ops are the eager ops they replaced, bit for bit (``decode_rows(...).sum(dim=0)``, ``/= N``; the residual
and ``new - new == 0`` select); ``torch.library.opcheck`` checks schemas, fakes and AOT dispatch. CUDA (the Triton
kernels, run under Triton's interpreter in a fresh process): the decode-and-sum adds a column's N <= 8 values as
torch's CUDA ``sum(dim=0)`` does (four running sums, row r into r % 4, then ((s0 + s1) + s2) + s3: rank order for
N <= 4, where it equals torch's CPU sum) and ``avg`` multiplies by fl(1/N) (CUDA's ``/=`` by a Python number); the
tail equals the eager ops bit for bit (held fp32 / bf16 / fp16, NaN and Inf, the chunk clipped or past the end).
"""

from __future__ import annotations

import json
import os
import struct
import sys
from pathlib import Path

import pytest
import torch

from lightning_qcomm.codecs import decode_rows, decode_rows_into, decode_rows_sum, derive_seed, encode_rows, get_codec

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
CODECS = [
    ("uniform", 8, 512, {}),
    ("uniform", 3, 37, {"stochastic": False}),
    ("uniform", 4, None, {}),
    ("qsgd", 4, 128, {}),
    ("qsgdinf", 4, 512, {}),
    ("nuqsgd", 4, 512, {}),
    ("fp8_e4m3", 8, 512, {}),
    ("fp8_e5m2", 8, 64, {"rounding": "stochastic"}),
]
IDS = [f"{c[0]}-{c[1]}-{c[2]}" for c in CODECS]


def _wire(codec, r: int, n: int, seed: int = 0) -> torch.Tensor:
    """R payloads of n elements; row 0 holds a subnormal, row 1 a NaN and row 2 an Inf (their buckets decode to
    NaN)."""
    rows = torch.randn(r, n, generator=torch.Generator().manual_seed(seed + 100 * r + n)) * 3
    rows[0, n // 2] = 1e-40
    if r > 1:
        rows[1, min(7, n - 1)] = float("nan")
    if r > 2:
        rows[2, n - 1] = float("inf")
    return encode_rows(codec, rows, [derive_seed(seed, 1, j) for j in range(r)])


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, NaN payloads aside; non-finite exactly where non-finite."""
    bits = (a.view(torch.int32) == b.view(torch.int32)) | (a.isnan() & b.isnan())
    return bool(bits.all()) and torch.equal(a.isfinite(), b.isfinite())


# ---------------------------------------------------------------------------------------------- CPU: the eager ops
@pytest.mark.parametrize(("name", "bits", "bucket", "opts"), CODECS, ids=IDS)
def test_decode_rows_sum_is_the_eager_sum_on_cpu(name, bits, bucket, opts):
    codec = get_codec(name, bits, bucket, **opts)
    for r in range(1, 9):
        for n in (5, 1037, (1 << 14) + 3):  # (1 << 14) + 3: rows of the fused C size
            wire = _wire(codec, r, n)
            rows = decode_rows(codec, wire, n)
            want = rows.sum(dim=0)
            assert _same(decode_rows_sum(codec, wire, n), want), (r, n)
            want /= r
            assert _same(decode_rows_sum(codec, wire.view(-1), n, avg=True), want), (r, n)
            assert not decode_rows_sum(codec, wire, n).isfinite().all() or r < 2  # NaN / Inf rows stay non-finite


def test_decode_rows_into_flat_prefix_on_cpu():
    codec = get_codec("qsgd", 4, 128)
    for r, n in ((3, 1037), (4, (1 << 14) + 3), (1, 300)):
        wire = _wire(codec, r, n)
        want = decode_rows(codec, wire, n).view(-1)
        for m in (r * n, r * n - 1, (r - 1) * n + 1):
            out = torch.full((m,), 7.0)
            assert decode_rows_into(codec, wire, n, out) is out
            assert _same(out, want[:m]), (r, n, m)
        if r > 1:
            with pytest.raises(ValueError, match="out must have"):
                decode_rows_into(codec, wire, n, torch.empty((r - 1) * n))


def _feedback_case(n: int, c: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    y, dec, held = (torch.randn(n, generator=g) * 5 for _ in range(3))
    y[2], dec[5], held[min(c, n - 1)] = float("nan"), float("inf"), float("-inf")
    y[min(3, n - 1)], held[0] = 1e-41, -1e-39  # subnormals
    reduced = torch.randn(c, generator=g) * 5
    reduced[1] = float("inf")
    err = torch.randn(n, generator=g)
    return y, dec, reduced, held, err


def _feedback_eager(y, dec, reduced, held, start, k, held_dtype, err):
    """The ops ``collectives.quantized`` ran before the tail was one op: residual, requantization term, select."""
    res = y - dec
    c = reduced.numel()
    pad = torch.zeros(max(start + c, y.numel()) - y.numel())
    res = torch.cat([res, pad])
    h = torch.cat([held, pad])[start : start + c]
    h = h.to(held_dtype).to(torch.float32) if held_dtype != torch.float32 else h
    mine = res[start : start + c]
    mine += (reduced - h).mul_(k)
    new = res[: y.numel()]
    finite = new - new == 0
    return torch.where(finite, new, err.to(torch.float32)).to(err.dtype)


FEEDBACK = [(1037, 260, 0), (1037, 260, 780), (1037, 260, 1040), (6, 2, 4), (1000, 250, 250)]


@pytest.mark.parametrize(("n", "c", "start"), FEEDBACK)
@pytest.mark.parametrize("held_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_feedback_update_is_the_eager_tail_on_cpu(n, c, start, held_dtype):
    from lightning_qcomm.codecs import feedback_update

    for k in (1.0, 4.0):
        for err_dtype in (torch.float32, torch.bfloat16):
            y, dec, reduced, held, err = _feedback_case(n, c, n + c + start)
            err = err.to(err_dtype)
            want = _feedback_eager(y, dec, reduced, held, start, k, held_dtype, err)
            assert feedback_update(y, dec, reduced, held, start, k, held_dtype, err) is err
            assert torch.equal(err.float().view(torch.int32), want.float().view(torch.int32)), (k, err_dtype)


def test_opcheck_reduce_ops():
    """Finite operands (opcheck compares outputs with tolerances, NaN unequal to NaN)."""
    codec = get_codec("uniform", 8, 64)
    g = torch.Generator().manual_seed(4)
    wire = encode_rows(codec, torch.randn(3, 300, generator=g), [1, 2, 3])
    y, dec, held, err = (torch.randn(300, generator=g) for _ in range(4))
    reduced = torch.randn(100, generator=g)
    for op, args in (
        (torch.ops.qcomm.decode_rows_sum.default, (wire, 300, *codec.op_args(), True)),
        (torch.ops.qcomm.decode_rows_sum.default, (wire.view(-1), 300, *codec.op_args(), False)),
        (torch.ops.qcomm.feedback_update.default, (y, dec, reduced, held, 100, 3.0, torch.bfloat16, err)),
        (torch.ops.qcomm.decode_rows_into.default, (wire, 300, *codec.op_args(), torch.empty(899))),
    ):
        result = torch.library.opcheck(op, args)
        assert set(result.values()) == {"SUCCESS"}, (op, result)


# ---------------------------------------------------------------------------------------------- CUDA: the kernels
def _cuda_sum_model(rows: torch.Tensor, avg: bool) -> torch.Tensor:
    """torch's CUDA ``rows.sum(dim=0)`` for R <= 8 (one thread per column: row r into running sum r % 4, each from
    +0.0, then ((s0 + s1) + s2) + s3) and its ``/= R`` (times fl(1/R))."""
    s = [torch.zeros(rows.shape[1]) for _ in range(4)]
    for r in range(rows.shape[0]):
        s[r % 4] = s[r % 4] + rows[r]
    acc = ((s[0] + s[1]) + s[2]) + s[3]
    if avg:
        acc = acc * struct.unpack("f", struct.pack("f", 1.0 / rows.shape[0]))[0]
    return acc


def _worker() -> dict:
    from launch_counts import cuda_path_on_cpu

    from lightning_qcomm.codecs import feedback_update, ops, rows_reduce

    out = {}
    for name, bits, bucket, opts in CODECS + [("sign1", 1, 256, {})]:
        codec = get_codec(name, bits, bucket, **opts)
        for r in range(1, 9):
            for n in (5, 1037):
                wire = _wire(codec, r, n, seed=3)
                rows = decode_rows(codec, wire, n)  # the CPU reference, bit for bit each row's own decode
                with cuda_path_on_cpu() as log:
                    assert ops.rows_kernel(codec, wire, encode=False)  # the first-use check may launch: then cleared
                    log.clear()
                    got = {avg: decode_rows_sum(codec, wire, n, avg=avg) for avg in (False, True)}
                    assert log == ["sum", "sum"], log
                key = f"{name}-{bits}-{bucket}_r{r}_n{n}"
                out[f"model_{key}"] = all(_same(got[a], _cuda_sum_model(rows, a)) for a in (False, True))
                if r <= 4:  # rank order: torch's CPU sum too
                    out[f"cpu_sum_{key}"] = _same(got[False], rows.sum(dim=0))
                if r in (1, 2, 4, 8):  # fl(1/R) exact: a true division too
                    out[f"div_{key}"] = _same(got[True], _cuda_sum_model(rows, False) / r)
                out[f"nonfinite_{key}"] = r < 2 or not bool(got[False].isfinite().all())
    for n, c, start in FEEDBACK:
        for held_dtype in (torch.float32, torch.bfloat16, torch.float16):
            for k in (1.0, 8.0):
                y, dec, reduced, held, err = _feedback_case(n, c, 11 * n + start)
                want = err.clone()
                rows_reduce.feedback_update_reference(y, dec, reduced, held, start, k, held_dtype, want)
                with cuda_path_on_cpu() as log:
                    feedback_update(y, dec, reduced, held, start, k, held_dtype, err)
                    assert log[-1:] == ["feedback"], log
                out[f"feedback_{n}_{c}_{start}_{held_dtype}_{k}"] = torch.equal(
                    err.view(torch.int32), want.view(torch.int32)
                )
    for name, bits, bucket, opts in CODECS:
        codec = get_codec(name, bits, bucket, **opts)
        wire = _wire(codec, 3, 1037, seed=5)
        want = decode_rows(codec, wire, 1037).view(-1)
        row = torch.randn(1, 1037, generator=torch.Generator().manual_seed(9))
        want_row = codec.encode(row[0], seed=derive_seed(2, 7)).to_bytes()
        with cuda_path_on_cpu() as log:
            assert ops.rows_kernel(codec, row) and ops.rows_kernel(codec, wire, encode=False)
            log.clear()
            flat = decode_rows_into(codec, wire, 1037, torch.full((3 * 1037 - 4,), 7.0))
            one = encode_rows(codec, row, [derive_seed(2, 7)])
        key = f"{name}-{bits}-{bucket}"
        out[f"into_{key}"] = _same(flat, want[: 3 * 1037 - 4]) and log[0] == "decode"
        out[f"one_row_{key}"] = torch.equal(one.view(-1), want_row) and log[1:] == ["wire", "encode"]
    return out


@pytest.fixture(scope="module")
def report() -> dict:
    pytest.importorskip("triton")
    from _interpreted import run_interpreted

    return run_interpreted(__file__, 900)


@pytest.mark.parametrize("kind", ["model", "cpu_sum", "div", "nonfinite", "feedback", "into", "one_row"])
def test_kernels_under_the_interpreter(report, kind):
    cases = {k: v for k, v in report.items() if k.startswith(kind + "_")}
    assert cases, kind
    assert all(cases.values()), [k for k, v in cases.items() if not v]


if __name__ == "__main__":
    sys.path[:0] = [str(BENCHMARKS), os.path.dirname(os.path.abspath(__file__))]
    print(json.dumps(_worker()))
