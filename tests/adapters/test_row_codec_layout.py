"""RowCodec.encode writing rows in place keeps the wire bytes of its definition, bit for bit.

The definition (adapters/fsdp2/row_codec.py): a raw segment is its bytes; a quantized segment of whole byte-aligned
buckets is ``codec.encode(rows[:, seg].reshape(-1), seg_seed)`` cut into rows (one flat tensor, one seed);
any other quantized segment is ``codec.encode(rows[j, seg], derive_seed(seg_seed, j)).to_bytes()`` per row.
Checked on fused-size segments (coded row by row by the C pass, the flat ones with a counter offset), small
ones (all rows at once), for rows stored plainly and in a ``PieceLayout`` whose pieces cut through segments,
on data with non-finite values, signed zeros, subnormals and huge values, in fp32 and bf16, with one and two
torch threads. And ``codecs.cpu.encode_flat_row_into`` on its own: row j of a flat encode of rows of whole
buckets from row j alone (the C pass's counter offset; the min-max codec's scales of a row's last bucket,
which a flat tensor does not end on, on rows whose last bucket holds +0 and -0).
"""

from __future__ import annotations

import pytest
import torch

from lightning_qcomm.adapters.fsdp2.row_codec import RowCodec, Segment
from lightning_qcomm.codecs import cpu_fused, derive_seed, get_codec
from lightning_qcomm.codecs.cpu import encode_flat_row_into
from lightning_qcomm.codecs.rows import encode_flat
from lightning_qcomm.comm.transport import PieceLayout

FUSED = cpu_fused.FUSED_MIN_NUMEL
CODECS = [
    dict(name="uniform", bits=8, bucket_size=1024),
    dict(name="uniform", bits=3, bucket_size=512, stochastic=False),
    dict(name="qsgd", bits=4, bucket_size=1024),
    dict(name="qsgdinf", bits=8, bucket_size=512),
    dict(name="nuqsgd", bits=4, bucket_size=1024),
    dict(name="fp8_e4m3", bits=8, bucket_size=1024, rounding="stochastic"),
    dict(name="sign1", bits=1, bucket_size=1024),
]
# (elements, quantized): fused-size whole buckets, fused-size not whole, small whole, small not whole, raw
SEGMENTS = [(2 * FUSED, True), (FUSED + 999, True), (2048, True), (1500, True), (37, False)]


def _ids(cfg: dict) -> str:
    return "-".join(str(v) for v in cfg.values())


def _rows(world: int, numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(world, numel, generator=g) * 3
    x[0, 5] = float("nan")
    x[1, 3000] = float("inf")
    x[:, 4096:5120] = 0.0  # a bucket of signed zeros: min and max are zeros
    x[:, 4096:5120:3] = -0.0
    end = 2 * FUSED  # the first segment's (a row's) last bucket, which a flat encode of all rows does not end on
    x[:, end - 1024 : end] = x[:, 4096:5120]
    x[:, end + 8192 : end + 9216] = x[:, 4096:5120][:, : max(0, min(1024, numel - end - 8192))]
    x[-1, 6000:6100] = 1e-40  # subnormal
    x[0, 9000:9010] = 3e38  # near fp32's max: the pre-scaled buckets
    return x.to(dtype)


def _reference(rc: RowCodec, rows: torch.Tensor, seed: int) -> torch.Tensor:
    """The wire rows by the definition, from public codec calls only."""
    r_count, parts, off = rows.shape[0], [], 0
    for k, s in enumerate(rc.segments):
        x = rows[:, off : off + s.numel]
        off += s.numel
        if not s.quantize:
            parts.append(x.contiguous().view(torch.uint8))
            continue
        seg_seed = derive_seed(seed, k)
        if s.numel % rc.codec.bucket_size == 0 and s.numel % 8 == 0:
            p = rc.codec.encode(x.reshape(-1), seed=seg_seed)
            parts += [p.codes.view(r_count, -1), p.scales.reshape(r_count, -1).view(torch.uint8)]
        else:
            parts.append(
                torch.stack([rc.codec.encode(x[j], derive_seed(seg_seed, j)).to_bytes() for j in range(r_count)])
            )
    return torch.cat(parts, dim=1)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cfg", CODECS, ids=_ids)
def test_encode_in_place_equals_the_definition(cfg, dtype, threads):
    codec = get_codec(**cfg)
    rc = RowCodec([Segment(n, q) for n, q in SEGMENTS], codec)
    world, seed = 3, 11
    rows = _rows(world, rc.row_numel, dtype, seed=len(cfg))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        want = _reference(rc, rows, seed)
        assert torch.equal(rc.encode(rows, seed), want)  # plain (R, P) rows
        nbytes = rc.row_nbytes(dtype)
        layout = PieceLayout.for_rows(world, nbytes, rows.device, piece_bytes=nbytes // 5 + 3)  # odd cuts
        assert layout.pieced
        buf = rc.encode(rows, seed, layout.empty(rows.device), layout)
        scratch = torch.empty(nbytes, dtype=torch.uint8)
        for j in range(world):
            assert torch.equal(layout.read_row(buf, j, scratch), want[j]), f"row {j}"
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("cfg", CODECS, ids=_ids)
def test_a_row_of_the_flat_encode_from_that_row_alone(cfg):
    codec = get_codec(**cfg)
    n, r_count = 2 * FUSED, 3
    x = _rows(r_count, n, torch.float32, seed=5)
    want = torch.cat(encode_flat(codec, x, seed=7), dim=1)
    out = torch.empty(codec.nbytes(n), dtype=torch.uint8)
    for j in range(r_count):
        assert torch.equal(encode_flat_row_into(codec, x, j, 7, out), want[j]), f"row {j}"


@pytest.mark.parametrize("bits", [8, 3])
def test_a_flat_row_whose_last_bucket_is_special(bits):
    """Row j's last bucket (not the flat tensor's last) holding a NaN, an Inf, +0 and -0 as its min or as its
    max, or a zero among ordinary values: the row alone gives the flat encode's bytes."""
    codec = get_codec("uniform", bits=bits, bucket_size=512)
    n = 2 * FUSED
    cases = 6
    g = torch.Generator().manual_seed(3)
    x = torch.randn(cases + 1, n, generator=g)
    last = slice(n - 512, n)
    x[0, n - 7] = float("nan")
    x[1, n - 9] = -float("inf")
    x[2, last] = x[2, last].abs()  # min is a zero of either sign
    x[2, n - 100], x[2, n - 50] = -0.0, 0.0
    x[3, last] = -x[3, last].abs()  # max is a zero of either sign
    x[3, n - 100], x[3, n - 50] = 0.0, -0.0
    x[4, last] = 0.0  # all zeros, both signs
    x[4, n - 512 :: 3] = -0.0
    x[5, n - 3] = 0.0  # a zero that is neither min nor max
    want = torch.cat(encode_flat(codec, x, seed=9), dim=1)
    out = torch.empty(codec.nbytes(n), dtype=torch.uint8)
    for j in range(cases):
        assert torch.equal(encode_flat_row_into(codec, x, j, 9, out), want[j]), f"row {j}"


def test_a_flat_row_without_the_c_pass_is_refused(monkeypatch):
    monkeypatch.setenv(cpu_fused.ENV_SWITCH, "0")
    codec = get_codec("uniform", bits=8, bucket_size=512)
    x = torch.randn(2, 1024)
    with pytest.raises(ValueError, match="c_pass_available"):
        encode_flat_row_into(codec, x, 0, 1, torch.empty(codec.nbytes(1024), dtype=torch.uint8))
