"""codecs.eden: the randomized Hadamard rotation with Lloyd-Max levels and EDEN's unbiased scale.

The bounds come from the math (codecs/eden.py): for a uniformly random rotation EDEN's decode is unbiased with NMSE
D_b / (1 - D_b) (0.571 / 0.133 / 0.0359 / 0.0096 at 1 / 2 / 3 / 4 bits), whatever the tails of x; the randomized
Hadamard rotation's residual bias is below 1e-5 of ||x||^2 at B = 4096 (BENCHMARKS.md section 12), far below the
sampling floors used here. Every test that credits the rotation also runs with it switched off
(``EdenCodec.rotation = False`` on the class: the ops rebuild the codec from its arguments) and checks that the bound
then fails.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from _launch import FakeBucket, free_port, rank_results, spawn, write_rank_result

from lightning_qcomm.codecs import EdenCodec, derive_seed, eden, get_codec, registry
from lightning_qcomm.codecs.rows import decode_rows, encode_rows

FLT_MAX = torch.finfo(torch.float32).max


def _student_t(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, generator=g, dtype=torch.float64)
    chi2 = torch.randn(3, n, generator=g, dtype=torch.float64).pow(2).sum(0)
    return (z / (chi2 / 3).sqrt()).float()  # Student t, nu = 3


def _nmse(y: torch.Tensor, x: torch.Tensor) -> float:
    return float((y.double() - x.double()).pow(2).sum() / x.double().pow(2).sum())


# ---------------------------------------------------------------------------------------------- levels
def _phi(t: float) -> float:
    return 0.0 if math.isinf(t) else math.exp(-0.5 * t * t) / math.sqrt(2 * math.pi)


def _Phi(t: float) -> float:
    return 0.5 * (1.0 + math.erf(t / math.sqrt(2)))


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_levels_are_the_lloyd_max_quantizer_of_the_standard_normal(bits):
    """Centroid condition: each level is E[z | z in its cell] for z ~ N(0, 1), the cells cut at the midpoints
    (the nearest-level rule), to 1e-9; and D_b = 1 - sum_i P_i c_i^2 is ``DISTORTION``."""
    half = eden.LLOYD_MAX_HALF[bits]
    c = [-v for v in reversed(half)] + list(half)
    t = [-math.inf] + [(a + b) / 2 for a, b in zip(c, c[1:])] + [math.inf]
    for i, level in enumerate(c):
        centroid = (_phi(t[i]) - _phi(t[i + 1])) / (_Phi(t[i + 1]) - _Phi(t[i]))
        assert abs(centroid - level) < 1e-9, (bits, i, centroid, level)
    dist = 1.0 - sum((_Phi(t[i + 1]) - _Phi(t[i])) * c[i] ** 2 for i in range(len(c)))
    assert abs(dist - eden.DISTORTION[bits]) < 1e-9
    assert torch.equal(EdenCodec(bits).levels, torch.tensor(c, dtype=torch.float32))


# ---------------------------------------------------------------------------------------------- construction
def test_registered_without_kernels_and_bucket_a_power_of_two():
    spec = registry.codec_spec("eden")
    assert spec.bits == range(1, 5) and spec.default_bits == 2 and spec.default_bucket_size == 4096
    assert spec.family == "quantizer" and not spec.kernels
    codec = get_codec("eden")
    assert type(codec) is EdenCodec and codec.bits == 2 and codec.bucket_size == 4096
    assert registry.is_registered(codec) and not registry.has_kernels(codec)
    for bad in (100, 3, 0, None):
        with pytest.raises(ValueError, match=rf"EdenCodec\(bucket_size={bad}\) must be a power of two.*allowed: 1, 2"):
            EdenCodec(2, bad)
    with pytest.raises(ValueError, match="allowed 1..4"):
        get_codec("eden", 5)


@pytest.mark.parametrize("n", [1, 7, 4096, 3 * 4096 + 1001])
def test_wire_bytes_are_bits_per_element_plus_two_words_per_bucket(n):
    codec = get_codec("eden", bits=2)
    p = codec.encode(torch.randn(n), seed=1)
    buckets = -(-n // 4096)
    assert p.scales.shape == (buckets, 2)
    assert p.nbytes == codec.nbytes(n) == -(-n // 8) * 2 + 8 * buckets
    assert p.codes.numel() == -(-n // 8) * 2


# ---------------------------------------------------------------------------------------------- keys and signs
def test_round_trip_is_deterministic_per_seed_and_keys_do_not_depend_on_the_data():
    """Same seed: the same bytes from two instances (two ranks); another seed: other keys. The keys (the second
    word of each bucket) are a function of the seed alone, so two ranks encoding different data with one seed
    rotate with the same signs."""
    x, other = _student_t(3 * 4096 + 500, 1), _student_t(3 * 4096 + 500, 2)
    a, b = EdenCodec(2), EdenCodec(2)
    pa, pb = a.encode(x, seed=9), b.encode(x, seed=9)
    assert torch.equal(pa.to_bytes(), pb.to_bytes())
    assert torch.equal(a.decode(pa), b.decode(pb))
    keys = pa.scales[:, 1].view(torch.int32)
    assert torch.equal(keys, b.encode(other, seed=9).scales[:, 1].view(torch.int32))
    assert not torch.equal(keys, a.encode(x, seed=10).scales[:, 1].view(torch.int32))
    assert len(set(keys.tolist())) == keys.numel()  # one key per bucket
    k = keys & ((1 << 23) - 1)
    s1, s2 = eden.signs(k, 4096), eden.signs(k.clone(), 4096)
    assert torch.equal(s1, s2) and set(s1.unique().tolist()) == {-1.0, 1.0}
    assert abs(float(s1.mean())) < 0.05  # balanced signs


def test_rotation_is_orthogonal_and_inverted_at_every_length():
    """R (a power of two, or the overlapping two blocks of a last bucket) preserves the norm and R^T R = I."""
    for length in (1, 2, 3, 5, 64, 100, 1000, 4096):
        x = torch.randn(4, length, dtype=torch.float32)
        keys = torch.arange(4) * 12345
        y = eden.rotate(x, keys)
        assert torch.allclose(y.norm(dim=1), x.norm(dim=1), rtol=1e-5)
        assert torch.allclose(eden.unrotate(y, keys), x, atol=1e-5), length
        if length > 2:
            assert not torch.allclose(y, x)


# ---------------------------------------------------------------------------------------------- special values
def test_a_non_finite_bucket_decodes_non_finite_and_only_that_bucket():
    codec = EdenCodec(2, 256)
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = torch.randn(5 * 256 + 77)
        x[300] = bad
        x[-3] = bad  # the short last bucket
        y = codec.decode(codec.encode(x, seed=3))
        assert not torch.isfinite(y[256:512]).any() and not torch.isfinite(y[-77:]).any()
        assert torch.isfinite(y[:256]).all() and torch.isfinite(y[512:-77]).all()


@pytest.fixture
def denormals():
    """Subnormal arithmetic kept (the suite flushes denormals, tests/conftest.py)."""
    torch.set_flush_denormal(False)
    yield
    torch.set_flush_denormal(True)


def test_zero_subnormal_and_near_float_max_buckets_decode_finite(denormals):
    codec = EdenCodec(2, 256)
    x = torch.randn(4 * 256 + 40)
    x[:256] = 0.0
    x[256:512] *= 1e-40  # subnormal
    x[512:768] = torch.sign(x[512:768]) * 3.0e38  # near FLT_MAX
    x[768:1024] *= 1e30
    errs = []
    for seed in range(8):
        y = codec.decode(codec.encode(x, seed=seed))
        assert torch.isfinite(y).all()
        assert torch.equal(y[:256], torch.zeros(256))
        assert y.abs().max() <= FLT_MAX
        errs.append([_nmse(y[a : a + 256], x[a : a + 256]) for a in (256, 768, 1024)])
    # the pre-scaling keeps a subnormal or huge bucket's relative error that of an ordinary one
    for col in zip(*errs):
        assert sum(col) / len(col) < 0.25, col


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_buckets_near_the_input_dtypes_max_decode_finite_in_that_dtype(dtype):
    """A finite fp16 / bf16 bucket whose largest values sit at its dtype's max: the decode, R^T (S q), may exceed
    that max (the levels reach 2.73 sigma); it is clamped to it, so the decode cast back to the dtype stays finite
    (an fp32 clamp alone leaves fp16's 65504 or bf16's 3.39e38 to overflow to inf). The clamp touches only values
    past the max: a bucket of ordinary values decodes as the fp32 input's."""
    top = torch.finfo(dtype).max
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(4096 + 700, generator=gen) * 0.3).clamp(-1, 1)
    x = (x / x.abs().max() * top * 0.99).to(dtype)
    ordinary = torch.randn(4096, generator=gen).to(dtype)
    for bits in (1, 2, 4):
        codec = EdenCodec(bits)
        for seed in range(4):
            y = codec.decode(codec.encode(x, seed=seed))
            assert y.dtype == dtype and torch.isfinite(y).all(), (bits, seed)
            assert y.float().abs().max() <= top
            y32 = codec.decode(codec.encode(ordinary.float(), seed=seed))
            assert torch.equal(codec.decode(codec.encode(ordinary, seed=seed)), y32.to(dtype))


def test_a_one_element_tensor_decodes_to_within_fp32_rounding(denormals):
    """L = 1: y = +-x, S = y / q, decode S q: x up to the roundings of S (fp32) and of S q (the EDEN scale makes a
    one-element bucket exact in exact arithmetic)."""
    codec = EdenCodec(2)
    for v in (0.3, -7.0, 1e-30, 3e38):
        x = torch.tensor([v])
        y = codec.decode(codec.encode(x, seed=1))
        assert abs(float(y) - v) <= 2.0**-22 * abs(v), (v, float(y))


# ---------------------------------------------------------------------------------------------- statistics
@pytest.mark.parametrize("bits", [1, 2, 4])
def test_unbiased_over_the_rotation(bits, monkeypatch):
    """Over K independent rotations (seeds) of one heavy-tailed x, the mean decode's squared error is the sampling
    floor NMSE / K of an unbiased estimator, NMSE = D_b / (1 - D_b): chi-square-like over d = 4096 + 1000
    coordinates (relative sd ~ sqrt(2 / d) = 2%), so 1.25 x the floor is a > 10-sigma bound. A biased decode (no
    rotation: deterministic, the mean is one decode) is at its NMSE, K times higher."""
    k = 200
    x = _student_t(4096 + 1000, 5)  # a full bucket and an overlapped short one
    floor = eden.DISTORTION[bits] / (1 - eden.DISTORTION[bits]) / k

    def mean_error(codec) -> float:
        acc = torch.zeros(x.numel(), dtype=torch.float64)
        for s in range(k):
            acc += codec.decode(codec.encode(x, seed=derive_seed(77, s))).double()
        return _nmse((acc / k).float(), x)

    codec = EdenCodec(bits)
    assert mean_error(codec) < 1.25 * floor
    monkeypatch.setattr(EdenCodec, "rotation", False)  # the class: the ops rebuild the codec from its arguments
    assert mean_error(codec) > 10 * floor


def test_nmse_at_2_bits_on_heavy_tails_beats_uniform_at_more_bytes(monkeypatch):
    """Student t (nu = 3), 2 bits: EDEN's NMSE is D_2 / (1 - D_2) = 0.133 (measured 0.131 in BENCHMARKS.md section
    12) at 2.016 bits per element; uniform-2 (buckets of 512, 2.125 bits per element) measures 3.99. Without the
    rotation the same levels and scale are far above the bound."""
    x = _student_t(1 << 16, 11)
    codec, uniform = get_codec("eden", 2), get_codec("uniform", 2)
    assert codec.nbytes(x.numel()) < uniform.nbytes(x.numel())
    e = sum(_nmse(codec.roundtrip(x, seed=s), x) for s in range(4)) / 4
    u = sum(_nmse(uniform.roundtrip(x, seed=s), x) for s in range(4)) / 4
    assert e < 0.15 and e < u / 10, (e, u)
    monkeypatch.setattr(EdenCodec, "rotation", False)
    assert sum(_nmse(codec.roundtrip(x, seed=s), x) for s in range(4)) / 4 > 0.15


# ---------------------------------------------------------------------------------------------- the layers above
@pytest.mark.parametrize("n", [7, 64, 100, 256, 501])
def test_rows_are_one_codec_call_per_row(n):
    """codecs.rows (the collectives' door): rows of whole buckets decode as one flat tensor, others one by one; both
    equal the codec per row, bit for bit, special values included."""
    codec = get_codec("eden", 2, 64)
    rows = torch.randn(3, n) * torch.tensor([[1e-3], [1.0], [1e3]])
    rows[1, n // 2] = float("nan")
    rows[2, 0] = 1e-41
    seeds = [derive_seed(5, j) for j in range(3)]
    wire = encode_rows(codec, rows, seeds)
    assert torch.equal(wire, torch.stack([codec.encode(rows[j], seed=s).to_bytes() for j, s in enumerate(seeds)]))
    dec = decode_rows(codec, wire, n)
    ref = torch.stack([codec.decode(codec.from_bytes(wire[j], (n,), torch.float32)) for j in range(3)])
    assert torch.equal(dec.isnan(), ref.isnan()) and torch.equal(dec.nan_to_num(), ref.nan_to_num())


def test_qsdp_row_codec_round_trips_eden_segments():
    """QSDP's wire rows (adapters.fsdp2.row_codec): quantized segments of whole buckets (one flat call) and of a
    short one (a call per row), a raw segment between them; every quantized segment decodes within EDEN's error."""
    from lightning_qcomm.adapters.fsdp2.row_codec import RowCodec, Segment

    codec = get_codec("eden", 2, 256)
    segs = [Segment(1024, True), Segment(10, False), Segment(700, True)]
    rc = RowCodec(segs, codec)
    rows = torch.stack([_student_t(1734, 20 + r) for r in range(2)])
    wire = rc.encode(rows, seed=4)
    out = torch.empty_like(rows)
    rc.decode(wire, out)
    assert torch.equal(out[:, 1024:1034], rows[:, 1024:1034])
    for a, b in ((0, 1024), (1034, 1734)):
        assert _nmse(out[:, a:b], rows[:, a:b]) < 0.2


def test_quant_ddp_and_qsdp_configs_take_eden():
    from lightning_qcomm import QuantDDPConfig
    from lightning_qcomm.parallel.qsdp_config import CODEC_CHOICES
    from lightning_qcomm.strategies.quant_ddp import CodecName

    assert QuantDDPConfig(codec="eden", bits=2).build_codec().config() == get_codec("eden", 2).config()
    assert "eden" in CODEC_CHOICES and "eden" in CodecName.__args__
    with pytest.raises(ValueError, match="allowed: 1..4"):
        QuantDDPConfig(codec="eden", bits=8)


# ---------------------------------------------------------------------------------------------- two ranks
def _hook_worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from lightning_qcomm import QuantDDPConfig
    from lightning_qcomm.adapters.ddp.hooks import QuantDDPHookState, quant_ddp_comm_hook

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    numels = (5000, 20000, 9000)  # a bucket of three parameters, none a whole number of 4096-buckets
    grads = {r: [_student_t(n, 100 * r + i) for i, n in enumerate(numels)] for r in range(2)}
    exact = torch.cat([(a + b) / 2 for a, b in zip(grads[0], grads[1])])
    res = {}
    for name, codec, rotation in (("eden", "eden", True), ("eden_norot", "eden", False), ("uniform", "uniform", True)):
        EdenCodec.rotation = rotation
        ps = [torch.nn.Parameter(torch.zeros(n)) for n in numels]
        for p, g in zip(ps, grads[rank]):
            p.grad = g.clone()
        state = QuantDDPHookState(QuantDDPConfig(codec, 2, None, False, 0), {p: f"p{i}" for i, p in enumerate(ps)})
        errs = []
        for _ in range(3):
            bucket = FakeBucket(0, ps)
            got = quant_ddp_comm_hook(state, bucket).value()
            errs.append(_nmse(got, exact))
            state.next_step()
        res[name] = errs
    EdenCodec.rotation = True
    dist.destroy_process_group()
    write_rank_result(out, rank, res)


def test_two_ranks_quant_ddp_hook_at_2_bits_beats_uniform(tmp_path):
    """The DDP comm hook (gloo, 2 ranks, avg) with codec="eden" at 2 bits, a kernels=False codec through the ops:
    the averaged gradient's error against the exact all-reduce is under 0.32 (the quantized all-reduce encodes
    twice, each adding D_2 / (1 - D_2) = 0.133 of what it encodes: 0.266 + 0.133^2 = 0.284 for independent
    errors) and below a quarter of uniform-2's; with the rotation switched off it is above 0.32."""
    spawn(_hook_worker, free_port(), str(tmp_path), nprocs=2, timeout_s=120)
    r0, r1 = rank_results(str(tmp_path), 2)
    assert r0 == r1  # identical on both ranks
    for step in range(3):
        e, u, off = r0["eden"][step], r0["uniform"][step], r0["eden_norot"][step]
        assert e < 0.32 and e < u / 4, (step, e, u)
        assert off > 0.32, (step, off)
