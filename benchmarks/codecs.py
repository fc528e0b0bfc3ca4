"""Codec throughput: encode + decode, in GB/s of fp32 input, next to a plain copy of the same tensor.

CPU (default): each codec twice, against ``torch.clone`` of the same tensor in the same run: the eager
torch reference (``LIGHTNING_QCOMM_CPU_FUSED=0``) and the fused compiled CPU path (``codecs.cpu_fused``,
what ``Codec.encode``/``decode`` use for CPU tensors >= 2^18 elements), after checking that the fused codes,
scales and decode are bit-identical to the reference's on the benchmark tensor. The one-off build of the
fused library is timed separately (first use on a machine; later processes load the cached library).
Target: >= 25% of clone bandwidth for uniform-8 and fp8.

    OMP_NUM_THREADS=1 python benchmarks/codecs.py [--numel 16777216] [--repeats 5] [--clock wall|process]

``--cuda``: the Triton kernels on the GPU against a device-to-device copy (goal >= 70%). Two rows per
codec: the kernels alone (``kernels.encode`` + ``kernels.decode`` on precomputed per-bucket params),
and the whole ``codec.encode`` + ``codec.decode`` (which adds torch's per-bucket reductions). Before
timing, each codec's GPU codes and decode are checked bit-identical to the CPU reference on a 1M-element
slice (same per-bucket params).

    python benchmarks/codecs.py --cuda

Timings are medians over ``--repeats`` after one warm-up; GB/s = 4 * numel / seconds (fp32 input bytes).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import datetime  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from lightning_qcomm.codecs import get_codec  # noqa: E402

# (label, name, bits, opts)
CASES = [
    *[(f"uniform-{b}", "uniform", b, {}) for b in (1, 2, 3, 4, 8)],
    *[(f"qsgd-{b}", "qsgd", b, {}) for b in (2, 4, 8)],
    ("qsgdinf-4", "qsgdinf", 4, {}),
    *[(f"nuqsgd-{b}", "nuqsgd", b, {}) for b in (2, 4, 8)],
    ("sign1", "sign1", 1, {}),
    ("fp8_e4m3 nearest", "fp8_e4m3", 8, {"rounding": "nearest"}),
    ("fp8_e4m3 stochastic", "fp8_e4m3", 8, {"rounding": "stochastic"}),
    ("fp8_e5m2 nearest", "fp8_e5m2", 8, {"rounding": "nearest"}),
    ("fp8_e5m2 stochastic", "fp8_e5m2", 8, {"rounding": "stochastic"}),
]
TARGETS = {"uniform-8", "fp8_e4m3 nearest", "fp8_e4m3 stochastic", "fp8_e5m2 nearest", "fp8_e5m2 stochastic"}
CHECK_NUMEL = 1 << 20


def _timer(cuda: bool, clock: str = "wall"):
    """Return ``time_it(fn) -> seconds`` for one call: on CPU the wall clock, or this process's CPU time
    (``clock="process"``: less disturbed when other jobs share the cores); CUDA events on the GPU."""
    if not cuda:
        now = time.perf_counter if clock == "wall" else time.process_time

        def time_it(fn) -> float:
            t0 = now()
            fn()
            return now() - t0

        return time_it

    def time_it(fn) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    return time_it


def _median(time_it, fn, repeats: int) -> float:
    fn()  # warm-up (and Triton compilation)
    return statistics.median(time_it(fn) for _ in range(repeats))


def _gbps(numel: int, seconds: float) -> float:
    return 4 * numel / seconds / 1e9


def _params(codec, x: torch.Tensor):
    """The per-bucket (enc_params, dec_params) that ``Codec.encode`` / ``decode`` hand to the element-wise path."""
    xb, counts = codec._buckets(x)
    scales = codec._scales(xb, counts)
    scales = torch.where(codec._finite_mask(xb), scales, torch.full_like(scales, float("nan")))
    return codec._encode_params(scales), codec._decode_params(scales)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def run_cpu(numel: int, repeats: int, only: list[str] | None, clock: str = "wall") -> list[str]:
    from lightning_qcomm.codecs import cpu_fused, native

    torch.set_flush_denormal(True)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    time_it = _timer(False, clock)
    t0 = time.perf_counter()
    lib = native.load()  # first use: builds the C++ library unless a cached copy exists
    build_s = time.perf_counter() - t0
    if lib is None:
        raise SystemExit(f"fused CPU codecs unavailable: {native.load_error()}")
    t_clone = _median(time_it, lambda: x.clone(), repeats)
    clone_gbps = _gbps(numel, t_clone)
    rows = [
        f"fused library: loaded in {build_s:.2f} s (wall; a cold build when not cached yet)",
        "",
        "| codec | eager enc GB/s | eager dec GB/s | eager enc+dec GB/s | eager % of clone "
        "| fused enc GB/s | fused dec GB/s | fused enc+dec GB/s | fused % of clone | fused == eager |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        f"| torch.clone | | | {clone_gbps:.3f} | 100% | | | {clone_gbps:.3f} | 100% | |",
    ]
    env = cpu_fused.ENV_SWITCH
    saved = os.environ.get(env)
    try:
        for label, name, bits, opts in CASES:
            if only and label not in only:
                continue
            codec = get_codec(name, bits, **opts)
            cells, results = [], {}
            for mode in ("eager", "fused"):
                if mode == "eager":
                    os.environ[env] = "0"
                else:
                    os.environ.pop(env, None)
                assert cpu_fused.use_fused(codec, x, numel) == (mode == "fused")
                packed = codec.encode(x, 0)
                results[mode] = (packed, codec.decode(packed))
                t_enc = _median(time_it, lambda c=codec: c.encode(x, 0), repeats)
                t_dec = _median(time_it, lambda c=codec, p=packed: c.decode(p), repeats)
                both = _gbps(numel, t_enc + t_dec)
                mark = " (target 25%)" if label in TARGETS else ""
                cells += [
                    f"{_gbps(numel, t_enc):.3f}",
                    f"{_gbps(numel, t_dec):.3f}",
                    f"{both:.3f}",
                    f"{100 * both / clone_gbps:.1f}%{mark}",
                ]
            (pe, de), (pf, df) = results["eager"], results["fused"]
            same = torch.equal(pe.codes, pf.codes) and _same_bits(pe.scales, pf.scales) and _same_bits(de, df)
            rows.append(f"| {label} | {' | '.join(cells)} | {'yes' if same else 'NO'} |")
            print(rows[-1], file=sys.stderr, flush=True)
    finally:
        if saved is None:
            os.environ.pop(env, None)
        else:
            os.environ[env] = saved
    return rows


def _check_against_reference(codec, xs: torch.Tensor, xs_cpu: torch.Tensor) -> bool:
    """Kernel codes and decode on this GPU vs the CPU torch reference, bit for bit, given the same
    per-bucket params (computed once on the GPU: a GPU norm may differ from the CPU one in the last bit,
    which is not the kernels' business)."""
    from lightning_qcomm import kernels

    enc_p, dec_p = _params(codec, xs)
    codes = kernels.encode(codec, xs, enc_p, 7)
    ref = codec.encode_reference(xs_cpu, enc_p.cpu(), 7)
    dec = kernels.decode(codec, codes, dec_p, xs.numel()).cpu()
    ref_dec = codec.decode_reference(ref, dec_p.cpu(), xs.numel())
    return torch.equal(codes.cpu(), ref) and bool(torch.isclose(dec, ref_dec, rtol=0, atol=0, equal_nan=True).all())


def run_cuda(numel: int, repeats: int, only: list[str] | None, clock: str = "wall") -> list[str]:
    from lightning_qcomm import kernels
    from lightning_qcomm.codecs import cuda

    if not torch.cuda.is_available():
        raise SystemExit("--cuda needs a CUDA device")
    if not kernels.HAS_TRITON:
        raise SystemExit("--cuda needs triton")
    dev = torch.device("cuda")
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0)).to(dev)
    x_check = x[:CHECK_NUMEL].cpu()
    time_it = _timer(True)
    dst = torch.empty_like(x)
    t_copy = _median(time_it, lambda: dst.copy_(x), repeats)
    copy_gbps = _gbps(numel, t_copy)
    rows = [
        "| codec | codes, decode == CPU reference | kernels enc+dec GB/s | % of copy | codec API enc+dec GB/s | % of copy |",
        "|---|---|---:|---:|---:|---:|",
        f"| device copy | | {copy_gbps:.1f} | 100% | | |",
    ]
    for label, name, bits, opts in CASES:
        if only and label not in only:
            continue
        codec = get_codec(name, bits, **opts)
        assert cuda.triton_for(codec, x.device), "CUDA tensors should dispatch to the Triton kernels"
        same = _check_against_reference(codec, x[:CHECK_NUMEL], x_check)
        enc_p, dec_p = _params(codec, x)
        codes = kernels.encode(codec, x, enc_p, 7)
        t_kernels = _median(time_it, lambda c=codec, e=enc_p: kernels.encode(c, x, e, 7), repeats) + _median(
            time_it, lambda c=codec, k=codes, d=dec_p: kernels.decode(c, k, d, numel), repeats
        )
        packed = codec.encode(x, 7)
        t_api = _median(time_it, lambda c=codec: c.encode(x, 7), repeats) + _median(
            time_it, lambda c=codec, p=packed: c.decode(p), repeats
        )
        k, a = _gbps(numel, t_kernels), _gbps(numel, t_api)
        rows.append(
            f"| {label} | {'yes' if same else 'NO'} | {k:.1f} | {100 * k / copy_gbps:.0f}% | {a:.1f} | "
            f"{100 * a / copy_gbps:.0f}% |"
        )
        print(rows[-1], file=sys.stderr, flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--numel", type=int, default=1 << 24, help="elements of the fp32 test tensor (default 16M)")
    ap.add_argument("--repeats", type=int, default=5, help="timed repeats per measurement (median reported)")
    ap.add_argument("--cuda", action="store_true", help="time the Triton kernels on the GPU vs a device copy")
    ap.add_argument(
        "--clock", choices=("wall", "process"), default="wall", help="CPU timer: wall clock or process CPU time"
    )
    ap.add_argument("--only", nargs="*", default=None, help="codec labels to run (default: all)")
    args = ap.parse_args(argv)
    if args.numel < 1 or args.repeats < 1:
        raise SystemExit("--numel and --repeats must be >= 1")
    rows = (run_cuda if args.cuda else run_cpu)(args.numel, args.repeats, args.only, args.clock)
    device = torch.cuda.get_device_name() if args.cuda else platform.processor() or platform.machine()
    print(f"# codecs benchmark, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    print(
        f"command: `{' '.join(['OMP_NUM_THREADS=' + os.environ.get('OMP_NUM_THREADS', ''), 'python', *sys.argv])}`; "
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {device}, numel {args.numel}, "
        f"median of {args.repeats}, {'CUDA events' if args.cuda else args.clock + ' clock'}, load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    )
    print()
    print("\n".join(rows))


if __name__ == "__main__":
    main()
