"""The all-reduce's server step and error-feedback tail as ops (``codecs.rows_reduce``):
``qcomm::decode_rows_sum`` (torch's order, and ``rank_order``), ``qcomm::feedback_update`` and
``qcomm::feedback_rows``, and the flat form of ``decode_rows_into`` the final decode writes the output with.

CPU: the ops are the eager ops they replaced, bit for bit (``decode_rows(...).sum(dim=0)``, ``/= N``; the residual
and ``new - new == 0`` select); ``torch.library.opcheck`` checks schemas, fakes and AOT dispatch. CUDA (the Triton
kernels, run under Triton's interpreter in a fresh process): the decode-and-sum adds a column's N <= 8 values as
torch's CUDA ``sum(dim=0)`` does (four running sums, row r into r % 4, then ((s0 + s1) + s2) + s3: rank order for
N <= 4, where it equals torch's CPU sum) and ``avg`` multiplies by fl(1/N) (CUDA's ``/=`` by a Python number); its
``rank_order`` mode is the loop ``rows[0] + rows[1] + ...`` at any N (up to 12 here); the tail equals the eager
ops bit for bit (held fp32 / bf16 / fp16, NaN and Inf, the chunk clipped or past the end), and so does the tail
that decodes the payloads in its registers (``feedback_rows``: one launch, no decode launch).
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest
import torch

from lightning_qcomm.codecs import (
    decode_rows,
    decode_rows_into,
    decode_rows_sum,
    derive_seed,
    encode_rows,
    feedback_rows,
    feedback_update,
    get_codec,
)

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
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
NO_KERNELS = [("eden", 2, 64, {})]  # codecs that run the reference on every device (no kernels to compare)


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
@pytest.mark.parametrize(
    ("name", "bits", "bucket", "opts"), CODECS + NO_KERNELS, ids=IDS + [f"{c[0]}-{c[1]}-{c[2]}" for c in NO_KERNELS]
)
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


def _rank_order_sum(rows: torch.Tensor) -> torch.Tensor:
    """``rows[0] + rows[1] + ... + rows[R-1]``, one addition at a time (the 1-bit reference's server sum)."""
    acc = rows[0].clone()
    for r in range(1, rows.shape[0]):
        acc += rows[r]
    return acc


RANK_ORDER_CODECS = [("sign1", 1, None, {}), ("sign1", 1, 40, {}), ("uniform", 4, 64, {})]


@pytest.mark.parametrize(("name", "bits", "bucket", "opts"), RANK_ORDER_CODECS)
def test_decode_rows_sum_rank_order_on_cpu(name, bits, bucket, opts):
    codec = get_codec(name, bits, bucket, **opts)
    for r in (1, 2, 3, 5, 8, 12):
        for n in (1, 13, 1037):
            wire = _wire(codec, r, n)
            want = _rank_order_sum(decode_rows(codec, wire, n))
            assert _same(decode_rows_sum(codec, wire, n, rank_order=True), want), (r, n)
            want /= r
            assert _same(decode_rows_sum(codec, wire.view(-1), n, avg=True, rank_order=True), want), (r, n)


def _feedback_rows_case(codec, r: int, n: int, m: int, seed: int):
    """Payloads of R rows of n (NaN, Inf, subnormal: ``_wire``) and y, held, err of m elements with NaN, Inf,
    -0.0 and subnormals."""
    g = torch.Generator().manual_seed(seed)
    wire = _wire(codec, r, n, seed)
    y, held, err = (torch.randn(m, generator=g) * 3 for _ in range(3))
    y[0], y[min(1, m - 1)], y[min(4, m - 1)] = -0.0, 1e-41, float("inf")
    y[m // 2], held[m - 1] = float("nan"), -1e-39
    return wire, y, held, err


FEEDBACK_ROWS = [(1, 13, 13), (3, 13, 39), (3, 13, 27), (4, 1037, 4 * 1037 - 5), (2, 300, 301)]


@pytest.mark.parametrize(("r", "n", "m"), FEEDBACK_ROWS)
@pytest.mark.parametrize(("name", "bits", "bucket", "opts"), RANK_ORDER_CODECS + [("qsgd", 4, 128, {})])
def test_feedback_rows_is_decode_then_feedback_on_cpu(r, n, m, name, bits, bucket, opts):
    codec = get_codec(name, bits, bucket, **opts)
    wire, y, held, err = _feedback_rows_case(codec, r, n, m, r + n + m)
    dec = decode_rows(codec, wire, n).view(-1)[:m]
    for reduced, start, k, held_dtype in (
        (y[:0], 0, 1.0, torch.float32),
        (y[: n // 2 + 1], m // 3, 4.0, torch.bfloat16),
    ):
        want, got = err.clone(), err.clone()
        feedback_update(y, dec, reduced, held, start, k, held_dtype, want)
        assert feedback_rows(codec, y, wire, n, reduced, held, start, k, held_dtype, got) is got
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (start, held_dtype)
    with pytest.raises(ValueError, match="feedback_rows"):
        feedback_rows(
            codec, y[: (r - 1) * n], wire, n, y[:0], held[: (r - 1) * n], 0, 1.0, torch.float32, err[: (r - 1) * n]
        )


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
        (torch.ops.qcomm.decode_rows_sum.default, (wire, 300, *codec.op_args(), True, True)),
        (torch.ops.qcomm.feedback_update.default, (y, dec, reduced, held, 100, 3.0, torch.bfloat16, err)),
        (
            torch.ops.qcomm.feedback_rows.default,
            (y[:250], wire[:1], 300, *codec.op_args(), reduced, held[:250], 100, 3.0, torch.bfloat16, err[:250]),
        ),
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

    from lightning_qcomm.codecs import cuda, feedback_update, rows_reduce

    out = {}
    for name, bits, bucket, opts in CODECS + [("sign1", 1, 256, {})]:
        codec = get_codec(name, bits, bucket, **opts)
        for r in range(1, 9):
            for n in (5, 1037):
                wire = _wire(codec, r, n, seed=3)
                rows = decode_rows(codec, wire, n)  # the CPU reference, bit for bit each row's own decode
                with cuda_path_on_cpu() as log:
                    assert cuda.rows_kernel(codec, wire, encode=False)  # the first-use check may launch: then cleared
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
                rows_reduce.feedback_update_body(y, dec, reduced, held, start, k, held_dtype, want)
                with cuda_path_on_cpu() as log:
                    feedback_update(y, dec, reduced, held, start, k, held_dtype, err)
                    assert log[-1:] == ["feedback"], log
                out[f"feedback_{n}_{c}_{start}_{held_dtype}_{k}"] = torch.equal(
                    err.view(torch.int32), want.view(torch.int32)
                )
    for name, bits, bucket, opts in RANK_ORDER_CODECS + [CODECS[0], CODECS[3]]:
        codec = get_codec(name, bits, bucket, **opts)
        key = f"{name}-{bits}-{bucket}"
        for r in (1, 2, 3, 5, 8, 12):
            for n in (1, 13, 1037):
                wire = _wire(codec, r, n, seed=7)
                want = _rank_order_sum(decode_rows(codec, wire, n))
                with cuda_path_on_cpu() as log:
                    assert cuda.rows_kernel(codec, wire, encode=False)
                    log.clear()
                    got = {avg: decode_rows_sum(codec, wire, n, avg=avg, rank_order=True) for avg in (False, True)}
                    launches = log == ["sum", "sum"]
                inv = struct.unpack("f", struct.pack("f", 1.0 / r))[0]
                out[f"rank_order_{key}_r{r}_n{n}"] = (
                    launches and _same(got[False], want) and _same(got[True], want * inv)
                )
                if r in (1, 2, 4, 8):  # fl(1/R) exact: the reference's true division too
                    out[f"rank_order_div_{key}_r{r}_n{n}"] = _same(got[True], want / r)
        for r, n, m in FEEDBACK_ROWS:
            wire, y, held, err = _feedback_rows_case(codec, r, n, m, 5 * m + r)
            dec = decode_rows(codec, wire, n).view(-1)[:m]
            for reduced, start, k, held_dtype in (
                (y[:0], 0, 1.0, torch.float32),
                (y[: n // 2 + 1], m // 3, 4.0, torch.bfloat16),
                (y[:5], m - 2, 2.0, torch.float16),
            ):
                want, got = err.clone(), err.clone()
                rows_reduce.feedback_update_body(y, dec, reduced, held, start, k, held_dtype, want)
                with cuda_path_on_cpu() as log:
                    feedback_rows(codec, y, wire, n, reduced, held, start, k, held_dtype, got)
                    log.clear()
                    feedback_rows(codec, y, wire, n, reduced, held, start, k, held_dtype, got)
                same = torch.equal(got.view(torch.int32), want.view(torch.int32))
                out[f"feedback_rows_{key}_{r}_{n}_{m}_{start}_{held_dtype}"] = same and log == ["feedback"]
    for name, bits, bucket, opts in CODECS:
        codec = get_codec(name, bits, bucket, **opts)
        wire = _wire(codec, 3, 1037, seed=5)
        want = decode_rows(codec, wire, 1037).view(-1)
        row = torch.randn(1, 1037, generator=torch.Generator().manual_seed(9))
        want_row = codec.encode(row[0], seed=derive_seed(2, 7)).to_bytes()
        with cuda_path_on_cpu() as log:
            assert cuda.rows_kernel(codec, row) and cuda.rows_kernel(codec, wire, encode=False)
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


KINDS = ["model", "cpu_sum", "div", "nonfinite", "feedback", "into", "one_row", "rank_order", "feedback_rows"]


@pytest.mark.parametrize("kind", KINDS)
def test_kernels_under_the_interpreter(report, kind):
    from _interpreted import assert_kind_passed

    assert_kind_passed(report, kind)


if __name__ == "__main__":
    sys.path[:0] = [str(BENCHMARKS), str(Path(__file__).resolve().parents[1] / "_helpers")]
    print(json.dumps(_worker()))
