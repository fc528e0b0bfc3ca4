"""The codec layer as torch ops (``torch.ops.qcomm.*``) and the codec registry.

- the ops exist, with a CPU kernel (C), a CUDA kernel (Triton) and a default kernel (the torch reference),
  and the dispatcher picks them (the C kernels once the library is loaded);
- ``torch.compile(fullgraph=True)`` of a function calling ``codec.encode`` / ``decode`` traces without a
  graph break (the fake kernels give the shapes) and returns the eager bits, on the reference (small
  tensors) and the fused C path (large ones);
- the sign ops' default kernels (torch) give the C kernels' bits;
- every allowed-values list and error message of the codec layer comes from the registry: a codec
  registered in a test shows up in ``get_codec``, ``codec_names`` and the messages, and the one spelling
  of "no compression" is the ``"none"`` entry.
"""

from __future__ import annotations

import pytest
import torch

from lightning_qcomm.codecs import derive_seed, get_codec

OPS = ("encode", "decode", "decode_into", "sign_encode_err", "sign_server_sum", "sign_decode")
C_OPS = ("c_encode_codes", "c_decode_codes", "c_bucket_stats", "c_uniform_encode", "c_uniform_decode")
COMPILE_CONFIGS = [
    ("uniform", 4, {}),
    ("uniform", 3, {"stochastic": False}),
    ("qsgd", 4, {}),
    ("qsgdinf", 3, {}),
    ("nuqsgd", 3, {}),
    ("sign1", 1, {}),
    ("fp8_e4m3", 8, {"rounding": "stochastic"}),
    ("fp8_e5m2", 8, {}),
]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32) if t.dtype == torch.float32 else t


def _has_kernel(op: str, key: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"qcomm::{op}", key)


# ---------------------------------------------------------------------------------------------- the ops
def test_ops_exist_with_cpu_cuda_and_default_kernels():
    from lightning_qcomm.codecs import native

    for op in OPS:
        assert hasattr(torch.ops.qcomm, op), op
    for op in ("encode", "decode", "decode_into"):
        for key in ("CPU", "CUDA", "CompositeExplicitAutograd"):
            assert _has_kernel(op, key), (op, key)
    for op in ("sign_encode_err", "sign_server_sum", "sign_decode"):
        assert _has_kernel(op, "CompositeExplicitAutograd"), op
    assert native.load() is not None, native.load_error()
    for op in (*C_OPS, "sign_encode_err", "sign_server_sum", "sign_decode"):  # the C kernels, once loaded
        assert _has_kernel(op, "CPU"), op


@pytest.mark.parametrize("n", [3000, 1 << 15], ids=["reference", "fused"])
@pytest.mark.parametrize(
    "cfg", COMPILE_CONFIGS, ids=lambda c: f"{c[0]}-{c[1]}" + "".join(f"-{v}" for v in c[2].values())
)
def test_compile_fullgraph_encode_decode(cfg, n):
    """No graph break through ``codec.encode`` / ``decode`` (fullgraph=True raises on one), the fake kernels
    trace under AOT autograd, and the compiled function returns the eager codes, scales and decoded bits."""
    import torch._dynamo

    name, bits, opts = cfg
    codec = get_codec(name, bits, 37 if name != "sign1" else None, **opts)
    seed = derive_seed(5, 1)

    def roundtrip(x: torch.Tensor):
        p = codec.encode(x, seed=seed)
        return codec.decode(p), p.codes, p.scales

    g = torch.Generator().manual_seed(n)
    x = (torch.randn(n, generator=g) * 3).reshape(-1, 1)
    x[7] = float("nan")
    torch._dynamo.reset()
    compiled = torch.compile(roundtrip, fullgraph=True, backend="aot_eager")
    got = compiled(x)
    want = roundtrip(x)
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert torch.equal(_bits(a), _bits(b))
    explained = torch._dynamo.explain(roundtrip)(x)
    assert explained.graph_break_count == 0 and explained.graph_count == 1


def test_fake_kernels_give_the_real_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    for name, bits, opts in COMPILE_CONFIGS:
        for n, bucket in ((1, 37), (1000, 37), (1000, None), (4099, 512)):
            codec = get_codec(name, bits, bucket, **opts)
            x = torch.randn(n).to(torch.bfloat16)
            args = codec.op_args()
            codes, scales = torch.ops.qcomm.encode(x, *args, 3)
            with FakeTensorMode() as mode:
                fx = mode.from_tensor(x)
                fcodes, fscales = torch.ops.qcomm.encode(fx, *args, 3)
                fout = torch.ops.qcomm.decode(mode.from_tensor(codes), mode.from_tensor(scales), n, *args)
            assert (
                (fcodes.shape, fcodes.dtype)
                == (codes.shape, codes.dtype)
                == ((codec.nbytes(n) - scales.numel() * 4,), torch.uint8)
            )
            assert (fscales.shape, fscales.dtype) == (scales.shape, scales.dtype)
            assert fout.shape == (n,) and fout.dtype == torch.float32


def test_opcheck_schemas_fakes_and_aot():
    """torch.library.opcheck: the schemas' mutation annotations, the fake kernels (static and dynamic shapes)
    and AOT dispatch agree with what the kernels do, on the reference and the C paths."""
    from lightning_qcomm.codecs import cpu_fused, native, sign_ops

    assert native.load() is not None, native.load_error()
    for name, bits, opts in (("uniform", 3, {}), ("nuqsgd", 4, {}), ("fp8_e4m3", 8, {}), ("sign1", 1, {})):
        codec = get_codec(name, bits, 37 if name != "sign1" else None, **opts)
        for n in (1000, cpu_fused.FUSED_MIN_NUMEL + 5):
            x, args = torch.randn(n), codec.op_args()
            codes, scales = torch.ops.qcomm.encode(x, *args, 5)
            for op, op_args in (
                (torch.ops.qcomm.encode.default, (x, *args, 5)),
                (torch.ops.qcomm.decode.default, (codes, scales, n, *args)),
                (torch.ops.qcomm.decode_into.default, (codes, scales, *args, torch.bfloat16, torch.empty(n))),
            ):
                result = torch.library.opcheck(op, op_args)
                assert set(result.values()) == {"SUCCESS"}, (name, n, op, result)
    y = torch.randn(100)
    payload = torch.zeros(17, dtype=torch.uint8)
    for op, op_args in (
        (torch.ops.qcomm.sign_encode_err.default, (y, sign_ops.sign_scale(y), payload, torch.zeros(100), 60, 100)),
        (torch.ops.qcomm.sign_server_sum.default, (torch.cat([payload, payload]), 2, 100, y, 60, torch.zeros(100))),
        (torch.ops.qcomm.sign_decode.default, (payload, 100, torch.zeros(50))),
    ):
        result = torch.library.opcheck(op, op_args)
        assert set(result.values()) == {"SUCCESS"}, (op, result)


def test_dispatcher_picks_the_c_kernel_on_cpu(monkeypatch):
    """The C kernel of an element-wise op runs for CPU tensors once loaded, not the default (reference) one."""
    from lightning_qcomm.codecs import cpu_fused, native

    assert native.load() is not None, native.load_error()
    codec = get_codec("uniform", 4, 64)
    x = torch.randn(cpu_fused.FUSED_MIN_NUMEL)
    ran = []
    real = codec.encode_reference
    monkeypatch.setattr(type(codec), "encode_reference", lambda self, *a: ran.append(1) or real(*a))
    p = codec.encode(x, seed=1)  # fused: stats, codes in C
    assert ran == []
    monkeypatch.setenv(cpu_fused.ENV_SWITCH, "0")
    ref = codec.encode(x, seed=1)
    assert ran == [1] and torch.equal(p.codes, ref.codes)


# ---------------------------------------------------------------------------------------------- sign ops
def _sign_cases():
    g = torch.Generator().manual_seed(3)
    for c in (1, 7, 8, 29, 1000):
        y = torch.randn(c, generator=g) * 4
        y[c // 2] = -0.0
        for valid in sorted({0, c // 3, c}):
            yield y, c, valid


def test_sign_ops_default_kernels_equal_the_c_kernels():
    """The torch default kernels of the 1-bit ops give the C kernels' bits (payload, residual, server sum,
    decode), NaN scales and short valid ranges included."""
    from lightning_qcomm.codecs import native, sign_ops

    assert native.load() is not None, native.load_error()
    for y, c, valid in _sign_cases():
        p = (c + 7) // 8 + 4
        for scale in (sign_ops.sign_scale(y), float("nan"), 0.3):
            outs = {}
            for path, fn in (("c", torch.ops.qcomm.sign_encode_err), ("torch", sign_ops.sign_encode_err_reference)):
                payload = torch.full((p,), 0xAB, dtype=torch.uint8)
                err = torch.full((c,), 9.0)
                fn(y, scale, payload, err, valid, c)
                outs[path] = (payload, err)
            assert torch.equal(outs["c"][0], outs["torch"][0]), (c, valid, scale)
            assert torch.equal(_bits(outs["c"][1]), _bits(outs["torch"][1])), (c, valid, scale)
        for world in (1, 2, 3):
            buf = torch.cat([_payload(y * (r + 1) - r) for r in range(world)])
            es = torch.randn(c, generator=torch.Generator().manual_seed(c))
            z_c, z_t = torch.full((c,), 5.0), torch.full((c,), 5.0)
            torch.ops.qcomm.sign_server_sum(buf, world, c, es, valid, z_c)
            sign_ops.sign_server_sum_reference(buf, world, c, es, valid, z_t)
            assert torch.equal(_bits(z_c), _bits(z_t)), (c, world, valid)
        for length in sorted({0, 1, c // 2, c}):
            o_c, o_t = torch.zeros(length), torch.zeros(length)
            torch.ops.qcomm.sign_decode(_payload(y), c, o_c)
            sign_ops.sign_decode_reference(_payload(y), c, o_t)
            assert torch.equal(_bits(o_c), _bits(o_t)), (c, length)


def _payload(y: torch.Tensor) -> torch.Tensor:
    return get_codec("sign1").encode(y).to_bytes()


# ---------------------------------------------------------------------------------------------- registry
def test_registry_lists_every_codec_once():
    from lightning_qcomm.codecs import CODEC_NAMES, codec_names, codec_spec

    assert codec_names() == CODEC_NAMES == (
        "uniform", "qsgd", "qsgdinf", "nuqsgd", "sign1", "fp8_e4m3", "fp8_e5m2", "eden"
    )  # fmt: skip
    assert codec_names(with_none=True) == (*CODEC_NAMES, "none")
    assert codec_names(family="quantizer") == ("uniform", "qsgd", "qsgdinf", "nuqsgd", "fp8_e4m3", "fp8_e5m2", "eden")
    assert codec_names(family="sign") == ("sign1",)
    assert codec_spec("uniform").bits == range(1, 9) and codec_spec("qsgd").bits == range(2, 9)
    assert codec_spec("sign1").bits == range(1, 2) and codec_spec("fp8_e5m2").bits == range(8, 9)
    assert dict(codec_spec("uniform").options) == {"stochastic": (True, False)}
    assert dict(codec_spec("fp8_e4m3").options) == {"rounding": ("nearest", "stochastic")}
    assert codec_spec("sign1").default_bucket_size is None and codec_spec("qsgd").default_bucket_size == 512
    for name in CODEC_NAMES:  # the class's own bit range check is the registry's
        spec = codec_spec(name)
        assert get_codec(name).bits == spec.default_bits
        for bits in (spec.bits.start - 1, spec.bits.stop):
            with pytest.raises(ValueError, match=f"allowed {spec.bits.start}..{spec.bits.stop - 1}"):
                get_codec(name, bits)
    with pytest.raises(ValueError, match="unknown codec name 'topk'; allowed: uniform, qsgd, .*fp8_e5m2, eden"):
        codec_spec("topk")


def test_qsgd_defaults_to_buckets_of_128_at_4_bits_or_fewer():
    """QSGD's bound min(B/s^2, sqrt(B)/s) with s = 2^(b-1) - 1: at 4 bits B = 512 gives 3.2, B = 128 gives 1.6; from
    5 bits B = 512 is at <= 1.5. The default bucket follows it, in get_codec and in every config that leaves
    bucket_size unset; an explicit bucket_size wins; the other codecs keep 512."""
    from lightning_qcomm import QuantDDPConfig
    from lightning_qcomm.codecs import QSGDCodec, codec_spec, register_codec
    from lightning_qcomm.parallel import LocalSGDConfig

    for bits in range(2, 9):
        expected = 128 if bits <= 4 else 512
        assert codec_spec("qsgd").default_bucket(bits) == get_codec("qsgd", bits).bucket_size == expected
        assert QuantDDPConfig(codec="qsgd", bits=bits).build_codec().bucket_size == expected
        assert LocalSGDConfig(codec="qsgd", bits=bits).build_codec().bucket_size == expected
        assert bits < 4 or QSGDCodec(bits).variance_bound(expected) <= 1.63  # 2, 3 bits: still above, but halved
        for other in ("uniform", "qsgdinf", "nuqsgd"):
            assert get_codec(other, bits).bucket_size == 512
    assert QSGDCodec(4).variance_bound(512) > 3.2
    assert get_codec("qsgd", 4, bucket_size=512).bucket_size == 512
    assert QuantDDPConfig(codec="qsgd", bits=4, bucket_size=1024).build_codec().bucket_size == 1024
    assert QuantDDPConfig().build_codec().bucket_size == 512  # the default width, 8
    with pytest.raises(ValueError, match=r"bucket_size_by_bits has widths \[9\] outside bits range\(2, 9\)"):
        register_codec("qsgd_wide", bits=range(2, 9), bucket_size_by_bits={9: 64})


def test_no_compression_is_the_none_entry():
    from lightning_qcomm.codecs import NO_COMPRESSION, codec_spec, resolve_codec

    assert NO_COMPRESSION == "none" and codec_spec("none").bits == range(32, 33) and codec_spec("none").cls is None
    assert resolve_codec("none") is None and resolve_codec("NONE", bits=32, bucket_size=128) is None
    with pytest.raises(ValueError, match="bits=8.*'none'.*allowed 32"):
        resolve_codec("none", bits=8)
    assert resolve_codec("qsgd", bits=4).config() == get_codec("qsgd", 4).config()
    with pytest.raises(ValueError, match="'none' means no compression"):
        get_codec("none")


def test_op_args_rebuild_every_registered_codec():
    """The ops carry a codec as (name, bits, bucket_size, stochastic); that rebuilds it exactly, one bucket
    (``bucket_size=None`` on the class) included: the registry's default bucket must not replace it."""
    import itertools

    from lightning_qcomm.codecs import codec_names, codec_spec, registry

    for name in codec_names():
        spec = codec_spec(name)
        for values in itertools.product(*spec.options.values()):
            for bits in spec.bits:
                opts = dict(zip(spec.options, values))
                if name == "eden":  # buckets are rotation blocks: a power of two, never one per tensor
                    codecs = (get_codec(name, bits, 128, **opts),)
                else:
                    codecs = (get_codec(name, bits, 100, **opts), spec.cls(bits, None, **spec.fixed, **opts))
                for codec in codecs:
                    assert registry.codec_for_op(*codec.op_args()).config() == codec.config()


@pytest.mark.parametrize("n", [3000, 1 << 15], ids=["reference", "fused"])
def test_a_one_bucket_codec_encodes_one_scale_row(n):
    from lightning_qcomm.codecs import UniformCodec

    codec = UniformCodec(bits=8, bucket_size=None)
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    packed = codec.encode(x, seed=1)
    assert codec.num_buckets(n) == 1
    assert packed.scales.shape[0] == 1
    lo, hi = float(x.min()), float(x.max())
    err = (codec.decode(packed) - x).abs().max()
    assert err <= (hi - lo) / 255 * (1 + 1e-5)  # one grid over the whole range: at most one step off


def test_a_registered_codec_shows_up_everywhere():
    """Registering a codec is all it takes: get_codec builds it, codec_names and the messages list it, the
    ops carry it (default kernel: the reference, since it has no native kernel), and removing it undoes that."""
    from lightning_qcomm.codecs import codec_names, register_codec, registry
    from lightning_qcomm.codecs.uniform import UniformCodec

    @register_codec("halfrange_test", bits=range(2, 5), default_bits=2, options={"stochastic": (False, True)})
    class HalfRange(UniformCodec):
        name = "halfrange_test"

        def __init__(self, bits: int = 2, bucket_size: int | None = 512, stochastic: bool = False) -> None:
            super().__init__(bits, bucket_size, stochastic)

    try:
        assert "halfrange_test" in codec_names(family="quantizer")
        codec = get_codec("halfrange_test")
        assert type(codec) is HalfRange and codec.bits == 2 and codec.stochastic is False
        with pytest.raises(ValueError, match="allowed 2..4"):
            get_codec("halfrange_test", 5)
        with pytest.raises(TypeError, match=r"unexpected option\(s\) \['rounding'\]; allowed: \['stochastic'\]"):
            get_codec("halfrange_test", rounding="nearest")
        with pytest.raises(ValueError, match="halfrange_test"):
            get_codec("nosuch")
        x = torch.randn(1 << 15)
        p = codec.encode(x, seed=2)
        ref = UniformCodec(2, 512, stochastic=False).encode(x, seed=2)  # same math
        assert torch.equal(p.codes, ref.codes) and torch.equal(codec.decode(p), UniformCodec(2, 512, False).decode(ref))
    finally:
        registry.unregister("halfrange_test")
    assert "halfrange_test" not in codec_names()
    with pytest.raises(ValueError, match="unknown codec name 'halfrange_test'"):
        get_codec("halfrange_test")
