"""Compressed collectives on real gloo process groups (2 ranks, and 3 where chunking depends on N).

One spawn per world size runs every check; each check's outcome (ok / traceback) is written per rank
to a JSON file and turned into one pytest case per (world size, check). Oracles recompute the math in
a single process from every rank's inputs, which each rank regenerates from the per-rank seeds.
"""

from __future__ import annotations

import datetime
import os
import time
import traceback

import pytest
import torch
import torch.distributed as dist
from _launch import free_port, rank_results, spawn, write_rank_result

from lightning_qcomm.codecs import derive_seed, get_codec
from lightning_qcomm.collectives import (
    all_reduce_pieces,
    onebit_all_reduce,
    onebit_pieces,
    onebit_server_error_numel,
    quantized_all_gather,
    quantized_all_reduce,
    quantized_reduce_scatter,
    wire_bytes_formula,
)
from lightning_qcomm.comm import CommLedger, all_gather_bytes, all_to_all_bytes, get_ledger, set_ledger

COLLECTIVE_TIMEOUT_S = 60
D = 1001  # not divisible by 2, 3, the bucket (64) or 8
BUCKET = 64


def make_input(case: int, rank: int, numel: int = D, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * case + rank)
    return torch.randn(numel, generator=g) * scale


def uniform_unit(x: torch.Tensor, bits: int) -> float:
    """Upper bound of every bucket's quantization step (global range / levels)."""
    return float(x.max() - x.min()) / (2**bits - 1)


# ------------------------------------------------------------------------------------------ oracles
def oracle_all_reduce(codec, inputs: list[torch.Tensor], seed: int, op: str, piece: int | None = None) -> torch.Tensor:
    """The documented algorithm on one process; ``piece``: elements per rank per piece (None: one piece)."""
    n, d = len(inputs), inputs[0].numel()
    if piece is not None and d > n * piece:
        step = n * piece  # piece is a multiple of the bucket here, so no rounding up
        parts = []
        for k, o in enumerate(range(0, d, step)):
            s_k = seed if k == 0 else derive_seed(seed, 3, k)
            parts.append(oracle_all_reduce(codec, [x[o : o + step] for x in inputs], s_k, op))
        return torch.cat(parts)
    c = -(-d // n)
    padded = [torch.nn.functional.pad(x, (0, n * c - d)).view(n, c) for x in inputs]
    out = []
    for j in range(n):
        parts = [codec.roundtrip(padded[r][j], derive_seed(seed, 1, r, j)) for r in range(n)]
        s = torch.stack(parts).sum(dim=0)
        if op == "avg":
            s = s / n
        out.append(codec.roundtrip(s, derive_seed(seed, 2, j)))
    return torch.cat(out)[:d]


def sign_c(v: torch.Tensor) -> torch.Tensor:
    """1-bit Adam's C(v) = ||v||_2 / sqrt(len v) * sign(v), sign(0) = +1, written independently of the codec."""
    scale = torch.linalg.vector_norm(v) / (v.numel() ** 0.5)
    return torch.where(v < 0, -scale, scale)


def sign_c_blocks(v: torch.Tensor, block: int | None) -> torch.Tensor:
    """``sign_c`` of every block of ``block`` consecutive elements of v (the last one shorter); None: of v whole."""
    if block is None:
        return sign_c(v)
    return torch.cat([sign_c(v[i : i + block]) for i in range(0, v.numel(), block)])


def oracle_onebit(xs, ews, ess, block=None):
    """One step of the worker/server math for all ranks; returns (out, new e_w per rank, new e_s per rank).
    ``block``: one scale per block of that many elements of each chunk (``onebit_all_reduce(block_numel=...)``)."""
    n, d = len(xs), xs[0].numel()
    c = -(-d // n)
    ys = [torch.nn.functional.pad(x + e, (0, n * c - d)) for x, e in zip(xs, ews)]
    cys = [torch.cat([sign_c_blocks(y[j * c : (j + 1) * c], block) for j in range(n)]) for y in ys]
    new_ew = [(y - cy)[:d] for y, cy in zip(ys, cys)]
    out, new_es = [], []
    for j in range(n):
        z = torch.stack([cy[j * c : (j + 1) * c] for cy in cys]).sum(dim=0) / n + ess[j]
        valid = max(min(c, d - j * c), 0)
        z[valid:] = 0.0
        cz = sign_c_blocks(z, block)
        es = z - cz
        es[valid:] = 0.0
        out.append(cz)
        new_es.append(es)
    return torch.cat(out)[:d], new_ew, new_es


# ------------------------------------------------------------------------------------------ helpers
def gather_all(t: torch.Tensor) -> list[torch.Tensor]:
    """Exact fp32 all_gather of a tensor (to compare results across ranks)."""
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def _all_gather(out, inp):
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, inp)


def _reduce_scatter(out, inp, op):
    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, inp, op=op)


def assert_close(a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float, msg: str = "") -> None:
    """|a - b| <= atol + rtol * |b| element-wise (torch.testing.assert_close costs seconds of imports)."""
    assert a.shape == b.shape, (msg, a.shape, b.shape)
    bad = (a - b).abs() > atol + rtol * b.abs()
    assert not bad.any(), f"{msg}: {int(bad.sum())} elements differ, max |a-b| = {float((a - b).abs().max())}"


def assert_same_on_all_ranks(t: torch.Tensor) -> None:
    for r, other in enumerate(gather_all(t)):
        assert torch.equal(other, t), f"rank {r} holds a different result"


class CountingDist:
    """Wraps the torch.distributed calls the collectives use and sums the input bytes handed to them."""

    NAMES = {
        "all_to_all_single": 1,
        "all_gather_single": 1,
        "all_gather_into_tensor": 1,
        "all_reduce": 0,
        "reduce_scatter_single": 1,
        "reduce_scatter_tensor": 1,
    }

    def __init__(self):
        self.bytes = 0
        self.calls = 0
        self._orig = {}

    def __enter__(self):
        for name, arg in self.NAMES.items():
            orig = getattr(dist, name, None)
            if orig is None:
                continue
            self._orig[name] = orig

            def wrapped(*args, _orig=orig, _arg=arg, **kw):
                t = args[_arg]
                self.bytes += t.numel() * t.element_size()
                self.calls += 1
                return _orig(*args, **kw)

            setattr(dist, name, wrapped)
        return self

    def __exit__(self, *exc):
        for name, orig in self._orig.items():
            setattr(dist, name, orig)


# ------------------------------------------------------------------------------------------ checks
def check_fp32_equals_torch(rank, n):
    x = make_input(1, rank)
    for op, red in (("sum", dist.ReduceOp.SUM), ("avg", dist.ReduceOp.AVG)):
        ref = x.clone()
        dist.all_reduce(ref, op=red)
        got = quantized_all_reduce(x.clone(), None, op=op)
        assert torch.equal(got, ref), f"all_reduce {op}"
        inp = make_input(2, rank, n * 37)
        ref = torch.empty(37)
        _reduce_scatter(ref, inp.clone(), op=red)
        got = quantized_reduce_scatter(torch.empty(37), inp, None, op=op)
        assert torch.equal(got, ref), f"reduce_scatter {op}"
    ref = torch.empty(n * D)
    _all_gather(ref, x)
    got = quantized_all_gather(torch.empty(n * D), x, None)
    assert torch.equal(got, ref), "all_gather"
    # error feedback with codec=None: x + e is reduced, e is emptied
    e = make_input(3, rank)
    ref = x + e
    dist.all_reduce(ref)
    got = quantized_all_reduce(x.clone(), None, error_feedback=e)
    assert torch.equal(got, ref) and not e.any()


def check_all_gather_codec(rank, n):
    for name, bits in (("uniform", 4), ("qsgd", 8)):
        codec = get_codec(name, bits, BUCKET)
        shards = [make_input(4, r) for r in range(n)]
        out = quantized_all_gather(torch.empty(n * D), shards[rank], codec, seed=7)
        assert_same_on_all_ranks(out)
        expect = torch.cat([codec.roundtrip(s, derive_seed(7, r)) for r, s in enumerate(shards)])
        assert torch.equal(out, expect), f"{name}: differs from the single-process oracle"
        if name == "uniform":
            for r in range(n):
                err = (out[r * D : (r + 1) * D] - shards[r]).abs().max()
                assert err <= uniform_unit(shards[r], bits) * (1 + 1e-5), f"error {err} beyond one step"
    # bf16 output, own slice decoded like the others
    out = quantized_all_gather(torch.empty(n * D, dtype=torch.bfloat16), make_input(4, rank), get_codec("uniform", 8))
    assert_same_on_all_ranks(out.float())


def check_reduce_scatter_codec(rank, n):
    codec = get_codec("uniform", 4, BUCKET)
    s = 333
    inputs = [make_input(5, r, n * s) for r in range(n)]
    for op in ("sum", "avg"):
        out = quantized_reduce_scatter(torch.empty(s), inputs[rank], codec, op=op, seed=3)
        rows = [codec.roundtrip(inputs[r][rank * s : (rank + 1) * s], derive_seed(3, 1, r, rank)) for r in range(n)]
        expect = torch.stack(rows).sum(dim=0) / (n if op == "avg" else 1)
        assert torch.equal(out, expect), f"{op}: differs from the oracle"
        exact = sum(inputs[r][rank * s : (rank + 1) * s] for r in range(n)) / (n if op == "avg" else 1)
        bound = sum(uniform_unit(inputs[r], 4) for r in range(n)) / (n if op == "avg" else 1)
        assert (out - exact).abs().max() <= bound * (1 + 1e-5)


def check_all_reduce_codec(rank, n):
    for name, bits, op in (("uniform", 4, "sum"), ("uniform", 8, "avg"), ("nuqsgd", 4, "avg"), ("fp8_e4m3", 8, "sum")):
        codec = get_codec(name, bits, BUCKET)
        inputs = [make_input(6, r) for r in range(n)]
        out = quantized_all_reduce(inputs[rank].clone(), codec, op=op, seed=11)
        assert_same_on_all_ranks(out)
        expect = oracle_all_reduce(codec, inputs, 11, op)
        assert torch.equal(out, expect), f"{name}{bits} {op}: differs from the oracle"
        if name == "uniform":
            k = n if op == "avg" else 1
            exact = sum(inputs) / k
            # phase 1: one step of each rank's input; phase 2: one step of the reduced values' range
            b1 = sum(uniform_unit(x, bits) for x in inputs) / k
            b2 = (float(exact.max() - exact.min()) + b1 * 2) / (2**bits - 1)
            assert (out - exact).abs().max() <= (b1 + b2) * (1 + 1e-5)
    # pipelined pieces (2 * 128 elements each, the last one shorter) against the same oracle per piece
    for name, bits, op in (("uniform", 4, "sum"), ("qsgd", 8, "avg")):
        codec = get_codec(name, bits, BUCKET)
        inputs = [make_input(8, r) for r in range(n)]
        assert len(all_reduce_pieces(D, n, codec, piece_numel=2 * BUCKET)) == -(-D // (n * 2 * BUCKET))
        out = quantized_all_reduce(inputs[rank].clone(), codec, op=op, seed=5, piece_numel=2 * BUCKET)
        assert_same_on_all_ranks(out)
        expect = oracle_all_reduce(codec, inputs, 5, op, piece=2 * BUCKET)
        assert torch.equal(out, expect), f"{name}{bits} {op} pieced: differs from the oracle"
    # fp16 input, shape kept, in place
    x = make_input(6, rank).half().view(7, 143)
    y = quantized_all_reduce(x, get_codec("uniform", 8))
    assert y is x and x.dtype == torch.float16 and x.shape == (7, 143)
    assert_same_on_all_ranks(x.float())


def _assert_onebit_step(t, out, outs, expect, errors, oracle_errors, y_max):
    """One step of ``onebit_all_reduce`` against the oracle: the ranks agree, the output matches, and so do the
    worker and server errors (e = y - C(y) is a difference of operands of size <= max abs(y): a few fp32 ulps)."""
    atol = 8 * torch.finfo(torch.float32).eps * max(y_max, 1.0)
    assert all(torch.equal(o, out) for o in outs), f"step {t}: ranks disagree"
    assert_close(out, expect, rtol=1e-6, atol=1e-7, msg=f"step {t}: output")
    for got, want, what in zip(errors, oracle_errors, ("worker", "server")):
        assert_close(got, want, rtol=1e-6, atol=atol, msg=f"step {t}: {what} error")


def check_onebit_oracle(rank, n):
    c = onebit_server_error_numel(D)
    assert c == -(-D // n)
    xs_all = [[make_input(20 + t, r, scale=0.1 + t) for r in range(n)] for t in range(5)]
    ew, es = torch.zeros(D), torch.zeros(c)
    o_ew, o_es = [torch.zeros(D) for _ in range(n)], [torch.zeros(c) for _ in range(n)]
    failures = []  # asserted after the loop, so a mismatch on one rank does not leave the others waiting
    for t, xs in enumerate(xs_all):
        y_max = float((xs[rank] + ew).abs().max())
        out = onebit_all_reduce(xs[rank].clone(), ew, es)
        outs = gather_all(out)
        expect, o_ew, o_es = oracle_onebit(xs, o_ew, o_es)
        try:
            _assert_onebit_step(t, out, outs, expect, (ew, es), (o_ew[rank], o_es[rank]), y_max)
        except AssertionError as exc:
            failures.append(str(exc))
    assert not failures, failures
    # pipelined pieces of n * 96 elements: each piece is the oracle on its own slice, with this rank's
    # server error laid out as its chunk of every piece, in piece order
    m = 96
    step = n * m
    pieces = [(o, min(step, D - o)) for o in range(0, D, step)]
    assert onebit_pieces(D, n, m) == pieces
    chunks = [-(-length // n) for _, length in pieces]
    assert sum(chunks) == c
    ew, es = torch.zeros(D), torch.zeros(c)
    o_ew, o_es = [torch.zeros(D) for _ in range(n)], [torch.zeros(c) for _ in range(n)]
    for t, xs in enumerate(xs_all[:3]):
        y_max = float((xs[rank] + ew).abs().max())
        out = onebit_all_reduce(xs[rank].clone(), ew, es, piece_numel=m)
        expect = torch.empty(D)
        e_off = 0
        for (o, length), ck in zip(pieces, chunks):
            sl = slice(o, o + length)
            es_sl = slice(e_off, e_off + ck)
            exp_k, ew_k, es_k = oracle_onebit([x[sl] for x in xs], [e[sl] for e in o_ew], [e[es_sl] for e in o_es])
            expect[sl] = exp_k
            for r in range(n):
                o_ew[r][sl], o_es[r][es_sl] = ew_k[r], es_k[r]
            e_off += ck
        atol = 8 * torch.finfo(torch.float32).eps * max(y_max, 1.0)
        try:
            assert_close(out, expect, rtol=1e-6, atol=1e-7, msg=f"pieced step {t}: output")
            assert_close(ew, o_ew[rank], rtol=1e-6, atol=atol, msg=f"pieced step {t}: worker error")
            assert_close(es, o_es[rank], rtol=1e-6, atol=atol, msg=f"pieced step {t}: server error")
        except AssertionError as exc:
            failures.append(str(exc))
    assert not failures, failures
    # wrong server_error length names the expected size
    try:
        onebit_all_reduce(torch.ones(D), torch.zeros(D), torch.zeros(c + 1))
    except ValueError as exc:
        assert "server_error" in str(exc) and str(c) in str(exc)
    else:
        raise AssertionError("wrong server_error size accepted")


def check_onebit_block_oracle(rank, n):
    """``block_numel`` = B: every block of B elements of a chunk carries its own scale (worker and server), the
    oracle's math; the ledger counts 4 bytes of scale per block; the ranks must agree on B."""
    block = 48  # chunks of ceil(1001 / n) elements: several blocks, the last one shorter
    c = onebit_server_error_numel(D)
    xs_all = [[make_input(40 + t, r, scale=0.1 + t) for r in range(n)] for t in range(3)]
    # two scales of magnitude inside one chunk: a per-chunk scale would give the small block the large one's step
    xs_all = [[torch.cat([x[:block] * 1e-3, x[block:]]) for x in xs] for xs in xs_all]
    ew, es = torch.zeros(D), torch.zeros(c)
    o_ew, o_es = [torch.zeros(D) for _ in range(n)], [torch.zeros(c) for _ in range(n)]
    failures = []
    ledger = CommLedger()
    set_ledger(ledger)
    try:
        for t, xs in enumerate(xs_all):
            y_max = float((xs[rank] + ew).abs().max())
            out = onebit_all_reduce(xs[rank].clone(), ew, es, block_numel=block, check=t == 0)
            outs = gather_all(out)
            expect, o_ew, o_es = oracle_onebit(xs, o_ew, o_es, block=block)
            try:
                _assert_onebit_step(t, out, outs, expect, (ew, es), (o_ew[rank], o_es[rank]), y_max)
                assert float(out[:block].abs().max()) < 1e-2 * float(out[block : 2 * block].abs().min())
            except AssertionError as exc:
                failures.append(str(exc))
        main = ledger.cumulative[("all_reduce", "momentum")]
        per_call = 2 * (n - 1) * ((c + 7) // 8 + 4 * -(-c // block))  # signs + one fp32 scale per block of a chunk
        if main.calls != 3 or main.wire_bytes != 3 * per_call:
            failures.append(f"ledger: {main} vs {per_call} wire bytes per call")
        if wire_bytes_formula("onebit_all_reduce", D, n, onebit_block_numel=block) != per_call:
            failures.append("wire_bytes_formula disagrees with the ledger")
    finally:
        set_ledger(None)
    assert not failures, failures
    try:
        onebit_all_reduce(torch.ones(D), torch.zeros(D), torch.zeros(c), block_numel=4)
    except ValueError as exc:
        assert "block_numel=4" in str(exc)
    else:
        raise AssertionError("block_numel=4 accepted")


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical fp32 values, NaN positions equal (a NaN's payload bits are not compared)."""
    nan = torch.isnan(a)
    if not torch.equal(nan, torch.isnan(b)):
        return False
    return torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32))


def check_onebit_fused_matches_reference(rank, n):
    """The fused CPU sign path (sign_ops.sign_*) gives the sign1 codec path's bits: outputs and both error
    buffers, over steps, with pieces whose last chunks are short or empty on some ranks, a NaN step, and
    fp16 input. The fused threshold is lowered so these small tensors take it; a spy proves which path ran."""
    from lightning_qcomm.codecs import cpu_fused, sign_ops

    m = 96
    sizes = (D, 2 * n * m + 4)  # a 4-element last piece: rank 2 of 3 owns no real element of it
    calls = []
    real_encode = sign_ops.sign_encode_err

    def spy(*args, **kwargs):
        calls.append(1)
        return real_encode(*args, **kwargs)

    saved_min, saved_env = cpu_fused.FUSED_MIN_NUMEL, os.environ.get(cpu_fused.ENV_SWITCH)
    cpu_fused.FUSED_MIN_NUMEL = 1
    sign_ops.sign_encode_err = spy
    failures = []
    try:
        for d in sizes:
            c = onebit_server_error_numel(d)
            for piece in (m, 1 << 21):
                errs = {path: (torch.zeros(d), torch.zeros(c)) for path in ("fused", "reference")}
                for t in range(4):
                    x = make_input(60 + t, rank, numel=d, scale=0.5 + t)
                    if t == 2 and rank == 0:
                        x[5] = float("nan")
                    outs = {}
                    for path in ("fused", "reference"):
                        ew, es = errs[path]
                        calls.clear()
                        if path == "reference":
                            os.environ[cpu_fused.ENV_SWITCH] = "0"
                        xin = x.clone() if t != 3 else x.half()  # fp16 input: decoded into a copy
                        outs[path] = onebit_all_reduce(xin, ew, es, piece_numel=piece).float()
                        os.environ.pop(cpu_fused.ENV_SWITCH, None)
                        ran_fused = bool(calls)
                        if ran_fused != (path == "fused"):
                            failures.append(f"d={d} piece={piece} step {t}: {path} run took the other path")
                    for name, a, b in (
                        ("output", outs["fused"], outs["reference"]),
                        ("worker error", errs["fused"][0], errs["reference"][0]),
                        ("server error", errs["fused"][1], errs["reference"][1]),
                    ):
                        if not _same_values(a, b):
                            failures.append(f"d={d} piece={piece} step {t}: {name} differs")
                    if t == 2 and not bool(torch.isnan(outs["fused"]).any()):
                        failures.append(f"d={d} piece={piece}: the NaN step gave a finite output")
    finally:
        cpu_fused.FUSED_MIN_NUMEL = saved_min
        sign_ops.sign_encode_err = real_encode
        if saved_env is None:
            os.environ.pop(cpu_fused.ENV_SWITCH, None)
        else:
            os.environ[cpu_fused.ENV_SWITCH] = saved_env
    assert not failures, failures


def check_error_feedback(rank, n):
    """Deterministic 2-bit rounding (biased): with EF the running sum tracks the inputs exactly up to the
    residual, the residual stays within one quantization step per phase, and without EF the bias accumulates."""
    bits, steps = 2, 100
    codec = get_codec("uniform", bits, BUCKET, stochastic=False)
    e = torch.zeros(D)
    failures = []
    sum_in_all = torch.zeros(D)
    sum_out = torch.zeros(D, dtype=torch.float64)
    sum_out_noef = torch.zeros(D, dtype=torch.float64)
    for t in range(steps):
        # a persistent component (make_input(30, r)) is rounded the same way every step: a bias without EF
        xs = [make_input(30, r) + 0.05 * make_input(100 + t, r) for r in range(n)]
        sum_in_all += sum(xs)
        y = xs[rank] + e
        # pieces of 3 buckets per rank: the residual identity must hold across piece boundaries too
        out = quantized_all_reduce(xs[rank].clone(), codec, op="avg", error_feedback=e, seed=t, piece_numel=3 * BUCKET)
        sum_out += out.double()
        sum_out_noef += quantized_all_reduce(xs[rank].clone(), codec, op="avg", seed=t).double()
        # |y - D(Q(y))| <= unit1 / 2, and N * |S - D(Q(S))| <= N * unit2 / 2 with unit2 <= range(out) / (2^b - 2)
        bound = uniform_unit(y, bits) / 2 + n * float(out.max() - out.min()) / (2 * (2**bits - 2))
        if not e.abs().max() <= bound * (1 + 1e-5):
            failures.append(f"step {t}: residual {float(e.abs().max())} > {bound}")
    assert not failures, failures  # after the loop: every rank runs all 100 steps' collectives
    sum_e = sum(gather_all(e))
    # k * sum_t out_t = sum_t sum_r x_r,t - sum_r e_r,T   (k = N for avg), up to fp32 rounding
    identity = (n * sum_out - sum_in_all.double() + sum_e.double()).abs().max()
    assert identity <= 1e-3 * float(sum_in_all.abs().max()), f"telescoping identity off by {identity}"
    drift_ef = (n * sum_out - sum_in_all.double()).abs().mean()
    drift_noef = (n * sum_out_noef - sum_in_all.double()).abs().mean()
    assert drift_ef * 10 < drift_noef, f"EF drift {drift_ef} not well below no-EF drift {drift_noef}"


def check_error_feedback_low_precision_input(rank, n):
    """bf16/fp16 gradients with an fp32 residual: the residual also carries the rounding of the output to
    the input's dtype, so the telescoping identity holds to fp32 rounding, not to bf16's 2^-9.

    Tolerance: each step adds O(10) fp32 roundings of magnitude <= 2^-24 * max|y| per element and rank
    (y = x + e, the residuals, the fp32 sum), so |identity| <= 16 * T * N * 2^-24 * max_t max|y_t|.
    Without the output-rounding term the error is a random walk of T bf16 roundings, ~ sqrt(T) * 2^-9 |out|.
    """
    steps = 50
    for dtype in (torch.bfloat16, torch.float16):
        codec = get_codec("uniform", 4, BUCKET)
        e = torch.zeros(D)  # fp32, as the DDP hook keeps it
        sum_in_all = torch.zeros(D, dtype=torch.float64)
        sum_out = torch.zeros(D, dtype=torch.float64)
        y_max = 0.0
        for t in range(steps):
            xs = [(make_input(40 + t, r) * 0.1).to(dtype) for r in range(n)]
            sum_in_all += sum(x.double() for x in xs)
            y_max = max(y_max, float((xs[rank].float() + e).abs().max()))
            out = quantized_all_reduce(xs[rank].clone(), codec, op="avg", error_feedback=e, seed=t)
            assert out.dtype == dtype
            sum_out += out.double()
        sum_e = sum(t.double() for t in gather_all(e))
        y_max = max(gather_all(torch.tensor([y_max])))
        identity = float((n * sum_out - sum_in_all + sum_e).abs().max())
        tol = 16 * steps * n * 2**-24 * float(y_max)
        assert identity <= tol, f"{dtype}: telescoping identity off by {identity:.3g} > {tol:.3g}"


def check_pieced_transfers(rank, n):
    """all_to_all_bytes / all_gather_bytes in concurrent pieces move exactly what one torch call moves."""
    row = 1000  # not a multiple of the piece
    g = torch.Generator().manual_seed(50 + rank)
    send = torch.randint(0, 256, (n * row,), dtype=torch.uint8, generator=g)
    expect = torch.empty_like(send)
    dist.all_to_all_single(expect, send)
    with CountingDist() as counter:
        got = torch.empty_like(send)
        all_to_all_bytes(got, send, piece_bytes=64)
    assert torch.equal(got, expect), "pieced all-to-all differs from all_to_all_single"
    assert counter.calls == -(-row // 64) and counter.bytes == send.numel(), (counter.calls, counter.bytes)
    mine = send[:row].clone()
    expect = torch.empty(n * row, dtype=torch.uint8)
    _all_gather(expect, mine)
    with CountingDist() as counter:
        got = torch.empty_like(expect)
        all_gather_bytes(got, mine, piece_bytes=64)
    assert torch.equal(got, expect), "pieced all-gather differs from all_gather_single"
    assert counter.calls == -(-row // 64) and counter.bytes == row, (counter.calls, counter.bytes)


def check_ledger_bytes(rank, n):
    codec = get_codec("qsgd", 4, BUCKET)
    ledger = CommLedger(keep_records=True)
    prev = set_ledger(ledger)
    s = 250
    calls = [
        ("all_reduce", D, codec, lambda k: quantized_all_reduce(make_input(7, rank), codec, seed=1, check=k)),
        ("all_reduce", D, None, lambda k: quantized_all_reduce(make_input(7, rank), None, check=k)),
        (
            "all_gather",
            s,
            codec,
            lambda k: quantized_all_gather(torch.empty(n * s), make_input(8, rank, s), codec, check=k),
        ),
        (
            "all_gather",
            s,
            None,
            lambda k: quantized_all_gather(torch.empty(n * s), make_input(8, rank, s), None, check=k),
        ),
        (
            "reduce_scatter",
            s,
            codec,
            lambda k: quantized_reduce_scatter(torch.empty(s), make_input(9, rank, n * s), codec, check=k),
        ),
        (
            "reduce_scatter",
            s,
            None,
            lambda k: quantized_reduce_scatter(torch.empty(s), make_input(9, rank, n * s), None, check=k),
        ),
        (
            "onebit_all_reduce",
            D,
            None,
            lambda k: onebit_all_reduce(make_input(7, rank), torch.zeros(D), torch.zeros(-(-D // n)), check=k),
        ),
    ]
    try:
        for kind, numel, cod, fn in calls:
            for check in (True, False):
                ledger.next_step()
                with CountingDist() as counter:
                    fn(check)
                recs = ledger.records
                assert sum(r.payload_bytes for r in recs) == counter.bytes, (kind, cod, check, recs, counter.bytes)
                meta = [r for r in recs if r.baseline_bytes == 0]  # the consistency check's metadata row
                main = [r for r in recs if r.baseline_bytes > 0]
                assert main[0].op == ("all_reduce" if kind == "onebit_all_reduce" else kind)
                assert len(main) == 1 and len(meta) == (1 if check else 0), (kind, recs)
                # the formula, written out: bytes of one chunk's payload times the per-op factor
                if kind == "onebit_all_reduce":
                    chunk = -(-D // n)
                    expect_wire = 2 * (n - 1) * (-(-chunk // 8) + 4)
                elif kind == "all_reduce":
                    expect_wire = 2 * (n - 1) * (cod.nbytes(-(-D // n)) if cod else 4 * D / n)
                else:
                    expect_wire = (n - 1) * (cod.nbytes(s) if cod else 4 * s)
                assert main[0].wire_bytes == pytest.approx(expect_wire, rel=1e-12), (kind, cod, main[0])
                assert wire_bytes_formula(kind, numel, n, cod) == pytest.approx(expect_wire, rel=1e-12)
                logical = numel * (n if kind in ("all_gather", "reduce_scatter") else 1)
                factor = 2 * (n - 1) / n if kind.endswith("all_reduce") else (n - 1) / n
                assert main[0].baseline_bytes == pytest.approx(factor * 4 * logical, rel=1e-12)
                if check:
                    assert meta[0].op == "all_gather" and meta[0].payload_bytes == 64 and meta[0].baseline_bytes == 0
        # pipelined pieces: pieces of n * 128 elements (the last one shorter), each chunked and padded on its own
        step = n * 2 * BUCKET
        lengths = [step] * (D // step) + ([D % step] if D % step else [])
        expect_wire = 2 * (n - 1) * sum(codec.nbytes(-(-length // n)) for length in lengths)
        ledger.next_step()
        with CountingDist() as counter:
            quantized_all_reduce(make_input(7, rank), codec, seed=1, check=False, piece_numel=2 * BUCKET)
        (rec,) = ledger.records
        assert rec.payload_bytes == counter.bytes == (n + 1) * expect_wire / (2 * (n - 1))
        assert rec.wire_bytes == pytest.approx(expect_wire, rel=1e-12)
        assert wire_bytes_formula("all_reduce", D, n, codec, piece_numel=2 * BUCKET) == pytest.approx(expect_wire)
    finally:
        set_ledger(prev)


def _expect_error_everywhere(fn, words):
    try:
        fn()
    except ValueError as exc:
        msg = str(exc)
        assert all(w in msg for w in words), msg
    else:
        raise AssertionError("mismatched input was accepted")


def check_bad_input(rank, n):
    codec = get_codec("uniform", 4)
    bad_len = D + rank
    _expect_error_everywhere(lambda: quantized_all_reduce(torch.ones(bad_len), codec), ["numel", "rank0", "rank1"])
    _expect_error_everywhere(lambda: quantized_all_reduce(torch.ones(bad_len), None), ["numel"])
    dtype = torch.float32 if rank == 0 else torch.float16
    _expect_error_everywhere(
        lambda: quantized_all_gather(torch.empty(n * 5), torch.ones(5, dtype=dtype), codec), ["dtype"]
    )
    other = codec if rank == 0 else get_codec("uniform", 8)
    _expect_error_everywhere(lambda: quantized_reduce_scatter(torch.empty(5), torch.ones(5 * n), other), ["codec"])
    op = "sum" if rank == 0 else "avg"
    _expect_error_everywhere(lambda: quantized_all_reduce(torch.ones(D), codec, op=op), ["reduce_op"])
    # codecs that differ only in an option (same name, bits, bucket and payload size) are caught too
    for a, b in (
        (get_codec("uniform", 4, stochastic=True), get_codec("uniform", 4, stochastic=False)),
        (get_codec("fp8_e4m3", 8, rounding="nearest"), get_codec("fp8_e4m3", 8, rounding="stochastic")),
        (get_codec("qsgd", 4), get_codec("nuqsgd", 4)),
    ):
        mine = a if rank == 0 else b
        _expect_error_everywhere(lambda mine=mine: quantized_all_reduce(torch.ones(D), mine), ["codec"])
    _expect_error_everywhere(
        lambda: onebit_all_reduce(torch.ones(bad_len), torch.zeros(bad_len), torch.zeros(-(-bad_len // n))), ["numel"]
    )
    # the group still works after the errors
    t = torch.ones(3)
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((3,), float(n)))
    # local argument errors name the argument
    for fn, word in (
        (lambda: quantized_all_reduce(torch.ones(4), codec, op="max"), "op"),
        (lambda: quantized_all_reduce(torch.ones(4), codec, error_feedback=torch.zeros(3)), "error_feedback"),
        (lambda: quantized_all_gather(torch.empty(3), torch.ones(2), codec), "out"),
        (lambda: quantized_reduce_scatter(torch.empty(2), torch.ones(3), codec), "inp"),
    ):
        try:
            fn()
        except ValueError as exc:
            assert word in str(exc), str(exc)
        else:
            raise AssertionError(f"bad {word} accepted")
    try:
        quantized_all_reduce(torch.ones(4, dtype=torch.int32), codec)
    except TypeError as exc:
        assert "x" in str(exc)
    else:
        raise AssertionError("int tensor accepted")


def check_nan(rank, n):
    codec = get_codec("uniform", 4, BUCKET)
    x = make_input(40, rank)
    if rank == 0:
        x[5] = float("nan")
        x[D - 1] = float("inf")
    for cod in (codec, None):
        e = torch.full((D,), 0.25)  # where this step's residual is not finite, e keeps this value
        out = quantized_all_reduce(x.clone(), cod, error_feedback=e)
        assert not torch.isfinite(out[:BUCKET]).all() and not torch.isfinite(out[-1])
        assert torch.isfinite(e).all(), "error feedback poisoned"
        if rank == 0 and cod is not None:  # y = x + e is NaN / inf there: its residual is not finite
            assert e[5] == 0.25 and e[D - 1] == 0.25, (e[5], e[D - 1])
            assert (e != 0.25).any(), "no residual written"
    out = quantized_all_gather(torch.empty(n * D), x, codec)
    assert not torch.isfinite(out[5]) and torch.isfinite(out[D + 5])
    # reduce_scatter: a non-finite value in every row of rank 0
    inp = make_input(41, rank, n * 10)
    if rank == 0:
        inp[::10] = float("nan")
    out = quantized_reduce_scatter(torch.empty(10), inp, codec)
    assert not torch.isfinite(out).all()
    ew, es = torch.zeros(D), torch.zeros(-(-D // n))
    out = onebit_all_reduce(x.clone(), ew, es)
    c = -(-D // n)
    assert not torch.isfinite(out[:c]).any() and not torch.isfinite(out[-1]), "NaN chunk decoded as finite"
    assert torch.isfinite(ew).all() and torch.isfinite(es).all(), "1-bit error buffers poisoned"


def check_strided_error_feedback(rank, n):
    """An error-feedback buffer that is a strided view (written in place) or a non-contiguous 2-D tensor (written
    back once) ends bit for bit as a contiguous one, and so does the result."""
    codec = get_codec("uniform", 4, BUCKET)
    x = make_input(42, rank, 7 * 143)
    want_e = make_input(43, rank, 7 * 143, 0.01)
    want = quantized_all_reduce(x.clone(), codec, error_feedback=want_e)
    strided = torch.zeros(7 * 143, 2)
    strided[:, 0] = make_input(43, rank, 7 * 143, 0.01)
    got = quantized_all_reduce(x.clone(), codec, error_feedback=strided[:, 0])
    assert torch.equal(got, want) and torch.equal(strided[:, 0], want_e) and not strided[:, 1].any()
    x2 = x.view(7, 143).t()  # a non-contiguous input and error buffer of the same shape
    e2 = make_input(43, rank, 7 * 143, 0.01).view(7, 143).t()
    want_e2 = e2.contiguous()
    want2 = quantized_all_reduce(x2.contiguous(), codec, error_feedback=want_e2)
    got2 = quantized_all_reduce(x2.clone(), codec, error_feedback=e2)
    assert not e2.is_contiguous() and not x2.clone().is_contiguous()
    assert torch.equal(got2, want2) and torch.equal(e2, want_e2)
    assert not torch.equal(want_e2, make_input(43, rank, 7 * 143, 0.01).view(7, 143).t())  # e was updated


CHECKS_2 = [
    check_fp32_equals_torch,
    check_all_gather_codec,
    check_reduce_scatter_codec,
    check_all_reduce_codec,
    check_onebit_oracle,
    check_onebit_block_oracle,
    check_onebit_fused_matches_reference,
    check_error_feedback,
    check_error_feedback_low_precision_input,
    check_pieced_transfers,
    check_ledger_bytes,
    check_bad_input,
    check_nan,
    check_strided_error_feedback,
]
CHECKS_3 = [
    check_fp32_equals_torch,
    check_all_gather_codec,
    check_reduce_scatter_codec,
    check_all_reduce_codec,
    check_onebit_oracle,
    check_onebit_block_oracle,
    check_onebit_fused_matches_reference,
    check_pieced_transfers,
    check_ledger_bytes,
    check_bad_input,
]


def _worker(rank: int, world: int, port: int, outdir: str, names: list[str]) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    # a check failing on one rank only leaves the others in a collective: time out instead of hanging
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    results = {}
    checks = {fn.__name__: fn for fn in CHECKS_2 + CHECKS_3}
    try:
        for name in names:
            t0 = time.perf_counter()
            try:
                checks[name](rank, world)
                results[name] = "ok"
            except Exception:
                results[name] = traceback.format_exc()
            results[f"{name}_seconds"] = time.perf_counter() - t0
            try:
                dist.barrier()
            except Exception:
                results[name] += "\nbarrier after this check failed (ranks out of step):\n" + traceback.format_exc()
                break
    finally:
        write_rank_result(outdir, rank, results)
    try:
        dist.destroy_process_group()
    except Exception:
        pass


def _run(world: int, checks, tmp_path_factory) -> dict:
    outdir = str(tmp_path_factory.mktemp(f"coll{world}"))
    names = [fn.__name__ for fn in checks]
    spawn(_worker, world, free_port(), outdir, names, nprocs=world)
    per_rank = rank_results(outdir, world)
    print(f"world {world}: " + ", ".join(f"{n} {per_rank[0].get(n + '_seconds', 0):.1f}s" for n in names))
    return {name: [res.get(name, "not run") for res in per_rank] for name in names}


@pytest.fixture(scope="module")
def results2(tmp_path_factory):
    return _run(2, CHECKS_2, tmp_path_factory)


@pytest.fixture(scope="module")
def results3(tmp_path_factory):
    return _run(3, CHECKS_3, tmp_path_factory)


def _assert_ok(outcomes: list[str]) -> None:
    bad = [f"rank {r}:\n{o}" for r, o in enumerate(outcomes) if o != "ok"]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("name", [fn.__name__ for fn in CHECKS_2])
def test_two_ranks(results2, name):
    _assert_ok(results2[name])


@pytest.mark.parametrize("name", [fn.__name__ for fn in CHECKS_3])
def test_three_ranks(results3, name):
    _assert_ok(results3[name])


# ------------------------------------------------------------------------------------------ world of one
def test_world_one_without_process_group():
    """No process group: exactly the quantized round trips, no wire bytes."""
    assert not dist.is_initialized()
    ledger = CommLedger(keep_records=True)
    prev = set_ledger(ledger)
    try:
        codec = get_codec("uniform", 4, BUCKET)
        x = make_input(50, 0)
        assert torch.equal(quantized_all_reduce(x.clone(), None), x)
        assert torch.equal(quantized_all_reduce(x.clone(), codec, seed=5), oracle_all_reduce(codec, [x], 5, "sum"))
        out = quantized_all_gather(torch.empty(D), x, codec, seed=2)
        assert torch.equal(out, codec.roundtrip(x, derive_seed(2, 0)))
        ew, es = torch.zeros(D), torch.zeros(D)
        expect, _, _ = oracle_onebit([x], [torch.zeros(D)], [torch.zeros(D)])
        assert_close(onebit_all_reduce(x.clone(), ew, es), expect, rtol=1e-6, atol=1e-7)
        assert all(r.wire_bytes == 0 and r.payload_bytes == 0 for r in ledger.records)
        assert len(ledger.records) == 4
    finally:
        set_ledger(prev)
    assert get_ledger() is prev
