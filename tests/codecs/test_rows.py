"""codecs.rows (formerly comm.row_batch): R rows coded in one pass equal R separate codec calls, bit for bit.

Every codec and width at awkward row lengths (odd, shorter than a bucket, bucket remainders, multiples of
the bucket and of 8), one bucket per row (bucket_size=None), fp32/bf16 rows, and rows holding NaN/Inf,
signed zeros, subnormals and values near FLT_MAX. The reference is the codec's public API called per row.
"""

from __future__ import annotations

import pytest
import torch
import torch.utils._python_dispatch
from _sync_guard import OPENED_OPS, run_opened

from lightning_qcomm.codecs import derive_seed, get_codec
from lightning_qcomm.codecs.rows import decode_rows, decode_rows_into, encode_rows

CODECS = [
    ("uniform", 8, {}),
    ("uniform", 4, {}),
    ("uniform", 1, {}),
    ("uniform", 3, {"stochastic": False}),
    ("qsgd", 8, {}),
    ("qsgd", 2, {}),
    ("qsgdinf", 5, {}),
    ("nuqsgd", 4, {}),
    ("nuqsgd", 7, {}),
    ("fp8_e4m3", 8, {}),
    ("fp8_e5m2", 8, {"rounding": "stochastic"}),
    ("sign1", 1, {}),
]
SHAPES = [(2, 1), (3, 7), (4, 63), (2, 64), (3, 65), (5, 200), (2, 256), (3, 501), (8, 130)]


def _rows(r: int, n: int, kind: str, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(r * 1000 + n)
    x = torch.randn(r, n, generator=g) * torch.logspace(-3, 3, r)[:, None]
    if kind == "special" and n >= 8:
        x[0, 1] = float("nan")
        x[-1, -1] = float("inf")
        x[r // 2, : n // 2] = 0.0
        x[r // 2, 0] = -0.0  # a bucket whose minimum is a zero of either sign
        if r > 2:
            x[1] = 1e-41 * torch.randn(n, generator=g)  # subnormals
            x[2, ::3] = 3.0e38  # near FLT_MAX: pre-scaled buckets
    return x.to(dtype)


def _per_row(codec, rows, seeds):
    return torch.stack([codec.encode(rows[j], seed=s).to_bytes() for j, s in enumerate(seeds)])


@pytest.mark.parametrize(
    "name,bits,opts", CODECS, ids=[f"{n}{b}{'-' + '-'.join(o) if o else ''}" for n, b, o in CODECS]
)
@pytest.mark.parametrize("bucket", [64, None])
def test_rows_encode_and_decode_like_one_call_per_row(name, bits, opts, bucket):
    codec = get_codec(name, bits=bits, bucket_size=bucket, **opts)
    for r, n in SHAPES:
        for kind in ("plain", "special"):
            rows = _rows(r, n, kind)
            seeds = [derive_seed(11, 1, 3, j) for j in range(r)]
            want = _per_row(codec, rows, seeds)
            got = encode_rows(codec, rows, seeds)
            assert got.dtype == torch.uint8 and got.shape == want.shape, (r, n, kind)
            assert torch.equal(got, want), f"{codec}: rows {r}x{n} ({kind}) encode differently"
            dec = decode_rows(codec, want, n)
            ref = torch.stack([codec.decode(codec.from_bytes(want[j], (n,), torch.float32)) for j in range(r)])
            assert torch.equal(dec.isnan(), ref.isnan()), (r, n, kind)
            assert torch.equal(dec.nan_to_num(), ref.nan_to_num()), f"{codec}: rows {r}x{n} ({kind}) decode differently"
            assert torch.equal(dec.signbit(), ref.signbit()), (r, n, kind)


@pytest.mark.parametrize("name", ["uniform", "qsgd", "fp8_e4m3"])
def test_low_precision_rows_keep_their_output_limit(name):
    """bf16 rows: the codec caps decodes at bf16's maximum, as Codec.encode of a bf16 tensor does."""
    codec = get_codec(name, bits=8, bucket_size=32)
    rows = _rows(4, 100, "special", torch.bfloat16)
    seeds = [7, 8, 9, 10]
    assert torch.equal(encode_rows(codec, rows, seeds), _per_row(codec, rows, seeds))


def test_large_cpu_rows_use_the_fused_path_and_still_match():
    """Rows above the fused CPU threshold: one compiled call per row, same bytes; decode in one call."""
    codec = get_codec("uniform", bits=4, bucket_size=512)
    rows = _rows(2, 20_001, "plain")
    seeds = [1, 2]
    want = _per_row(codec, rows, seeds)
    assert torch.equal(encode_rows(codec, rows, seeds), want)
    ref = torch.stack([codec.decode(codec.from_bytes(want[j], (20_001,), torch.float32)) for j in range(2)])
    assert torch.equal(decode_rows(codec, want, 20_001), ref)


class _BigCopies(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the aten ops that write at least ``limit`` elements into a new or existing tensor by copying."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit, self.seen = limit, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "qcomm" and func.overloadpacket.__name__ in OPENED_OPS:
            return run_opened(self, func, args, kwargs)  # the rows ops: see the copies their kernel makes
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket)
        copies = ("aten.copy_", "aten.clone", "aten._to_copy", "aten.constant_pad_nd", "aten.cat", "aten.stack")
        if name in copies and isinstance(out, torch.Tensor) and out.numel() >= self.limit:
            self.seen.append((name, out.numel()))
        return out


@pytest.mark.parametrize("name", ["uniform", "nuqsgd"])
def test_large_cpu_rows_decode_into_out_without_full_size_copies(name):
    """Rows above the fused threshold whose length is not a whole number of buckets (QSDP's weight shards):
    ``decode_rows_into`` writes each row straight into a contiguous fp32 ``out`` (one compiled decode per row,
    as ``encode_rows`` encodes them), with no repacked or padded copy of the rows, and the same bits."""
    codec = get_codec(name, bits=8 if name == "uniform" else 4, bucket_size=512)
    n = 20_001
    wire = encode_rows(codec, _rows(4, n, "plain"), [1, 2, 3, 4])
    ref = torch.stack([codec.decode(codec.from_bytes(wire[j], (n,), torch.float32)) for j in range(4)])
    out = torch.empty(4, n)
    with _BigCopies(n) as seen:
        decode_rows_into(codec, wire, n, out)
    assert seen.seen == [], seen.seen
    assert torch.equal(out.view(torch.int32), ref.view(torch.int32))
    assert torch.equal(decode_rows(codec, wire, n).view(torch.int32), ref.view(torch.int32))


def test_bad_arguments():
    codec = get_codec("uniform", bits=8)
    with pytest.raises(ValueError, match="one seed per row"):
        encode_rows(codec, torch.zeros(3, 10), [1, 2])
    with pytest.raises(ValueError, match="2-D"):
        encode_rows(codec, torch.zeros(10), [1])
    with pytest.raises(ValueError, match="multiple of codec.nbytes"):
        decode_rows(codec, torch.zeros(codec.nbytes(10) + 1, dtype=torch.uint8), 10)
