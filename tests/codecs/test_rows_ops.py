"""The rows ops ``qcomm::encode_rows`` / ``decode_rows`` / ``decode_rows_into`` (``codecs.rows``): what the
collectives code their rows with.

``torch.library.opcheck`` checks the schemas' mutation annotations, the fake kernels (static and dynamic shapes)
and AOT dispatch against the kernels, on the batched torch hooks (rows below the fused size, repacked rows) and
the C pass per row (rows of the fused path's size); under ``FakeTensorMode`` the ops give the real outputs'
shapes and dtypes without running a kernel; and the op is the same function as the public door
(``codecs.encode_rows`` = row by row ``Codec.encode``, bit for bit).
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from lightning_qcomm.codecs import decode_rows, derive_seed, encode_rows, get_codec, rng

CASES = [
    ("uniform", 3, 37, {}),
    ("qsgd", 4, 128, {}),
    ("nuqsgd", 4, 37, {}),
    ("fp8_e4m3", 8, 64, {"rounding": "stochastic"}),
    ("sign1", 1, None, {}),
]


def _case(name: str, bits: int, bucket: int | None, opts: dict, n: int, r: int = 3):
    codec = get_codec(name, bits, bucket, **opts)
    rows = torch.randn(r, n, generator=torch.Generator().manual_seed(n))
    seeds = [rng.signed_seed(derive_seed(4, j)) for j in range(r)]
    return codec, rows, seeds


@pytest.mark.parametrize(("name", "bits", "bucket", "opts"), CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("n", [300, (1 << 14) + 5])  # (1 << 14) + 5: rows of the fused C size, a C pass each
def test_opcheck_rows_ops(name, bits, bucket, opts, n):
    codec, rows, seeds = _case(name, bits, bucket, opts, n)
    args = codec.op_args()
    wire = torch.ops.qcomm.encode_rows(rows, seeds, *args)
    for op, op_args in (
        (torch.ops.qcomm.encode_rows.default, (rows, seeds, *args)),
        (torch.ops.qcomm.decode_rows.default, (wire, n, *args)),
        (torch.ops.qcomm.decode_rows_into.default, (wire, n, *args, torch.empty(3, n))),
    ):
        result = torch.library.opcheck(op, op_args)
        assert set(result.values()) == {"SUCCESS"}, (name, n, op, result)


@pytest.mark.parametrize(("name", "bits", "bucket", "opts"), CASES[:2] + CASES[4:], ids=["uniform", "qsgd", "sign1"])
def test_fake_kernels_give_the_real_shapes(name, bits, bucket, opts):
    n = 1037
    codec, rows, seeds = _case(name, bits, bucket, opts, n, r=5)
    args = codec.op_args()
    wire = torch.ops.qcomm.encode_rows(rows, seeds, *args)
    values = torch.ops.qcomm.decode_rows(wire, n, *args)
    flat, short = wire.view(-1), wire.view(-1)[1:]
    with FakeTensorMode() as mode:
        fwire = torch.ops.qcomm.encode_rows(mode.from_tensor(rows), seeds, *args)
        fvalues = torch.ops.qcomm.decode_rows(mode.from_tensor(flat), n, *args)  # flat wire: R from its bytes
    assert (fwire.shape, fwire.dtype) == (wire.shape, wire.dtype) == ((5, codec.nbytes(n)), torch.uint8)
    assert (fvalues.shape, fvalues.dtype) == (values.shape, values.dtype) == ((5, n), torch.float32)
    with pytest.raises(ValueError, match="not a multiple of codec.nbytes"), FakeTensorMode() as mode:
        torch.ops.qcomm.decode_rows(mode.from_tensor(short), n, *args)


@pytest.mark.parametrize(("name", "bits", "bucket", "opts"), CASES, ids=[c[0] for c in CASES])
def test_door_is_each_rows_own_codec_call(name, bits, bucket, opts):
    """``codecs.encode_rows`` / ``decode_rows`` (the op) equal one codec call per row, bit for bit, with 64-bit
    seeds above 2^63 (carried as int64 by the op)."""
    n = 300
    codec, rows, _ = _case(name, bits, bucket, opts, n, r=4)
    seeds = [derive_seed(4, j) | (1 << 63) for j in range(4)]
    want = torch.stack([codec.encode(rows[j], seed=s).to_bytes() for j, s in enumerate(seeds)])
    wire = encode_rows(codec, rows, seeds)
    assert torch.equal(wire, want)
    got = decode_rows(codec, wire, n)
    ref = torch.stack([codec.decode(codec.from_bytes(w, (n,), torch.float32)) for w in want])
    assert torch.equal(got.view(torch.int32), ref.view(torch.int32))
