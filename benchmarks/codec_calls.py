"""Per-call time of the codec entry points QSDP and QuantDDP call many times a step (CPU, one thread).

Throughput (``benchmarks/codecs.py``) is measured on 16M elements, where a call's fixed cost vanishes; a QSDP
step instead makes ~100 codec calls on segments of 10^4-10^5 elements, where it does not. This times, per
call: the public ``Codec.encode`` and ``Codec.decode_into``, and where the checkout has them the row paths of
the QSDP collectives (``codecs.rows.decode_rows_into``, formerly ``comm.row_batch``, of two rows into a strided output, as the weight
all-gather decodes; ``encode_flat_row_into``, as the gradient reduce-scatter encodes). Each figure is the
minimum over interleaved rounds (the least disturbed), in microseconds. It imports ``lightning_qcomm`` from
the current directory, so it times any checkout::

    OMP_NUM_THREADS=1 taskset -c 0 python benchmarks/codec_calls.py              # this checkout
    OMP_NUM_THREADS=1 taskset -c 0 python benchmarks/codec_calls.py --quant-ddp  # QuantDDP's 4-bit row calls
    cd ../other-checkout && OMP_NUM_THREADS=1 taskset -c 0 python /path/to/benchmarks/codec_calls.py
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.getcwd())

import torch  # noqa: E402

import lightning_qcomm  # noqa: E402
from lightning_qcomm.codecs import get_codec  # noqa: E402

try:
    from lightning_qcomm.codecs import rows as row_batch
except ImportError:  # before the rows ops: the comm layer's module
    try:
        from lightning_qcomm.comm import row_batch
    except ImportError:  # an older checkout without the row paths: only the public calls
        row_batch = None
try:  # the CPU backend's row form (in codecs.rows before it)
    from lightning_qcomm.codecs import cpu as cpu_rows
except ImportError:
    cpu_rows = None


def calls(bits: int, n: int) -> dict:
    codec = get_codec("uniform", bits=bits)
    x = torch.randn(2, n)
    payload = codec.encode(x[0], seed=1)
    out = torch.empty(n)
    fns = {
        "encode": lambda: codec.encode(x[0], seed=1),
        "decode_into": lambda: codec.decode_into(payload, out),
    }
    flat_row_into = getattr(row_batch, "encode_flat_row_into", None) or getattr(cpu_rows, "encode_flat_row_into", None)
    if row_batch is not None and flat_row_into is not None:
        wire = torch.stack([payload.to_bytes(), payload.to_bytes()])
        rows = torch.empty(2, n + 8)[:, :n]  # strided rows, as a column slice of the gathered buffer
        buf = torch.empty(codec.nbytes(n), dtype=torch.uint8)
        fns["decode_rows_into(2 rows)"] = lambda: row_batch.decode_rows_into(codec, wire, n, rows)
        fns["encode_flat_row_into"] = lambda: flat_row_into(codec, x, 0, 5, buf)
    return {f"uniform-{bits} n={n} {k}": f for k, f in fns.items()}


def quant_ddp_calls(name: str, bits: int, n: int = 103424) -> dict:
    """The calls one piece of ``quantized_all_reduce`` makes per row for an L2-norm codec (n: the chunk of the
    benchmark model's pieces over 2 ranks), and the parts of one row's encode: the C pass alone, and the
    scales and params built in torch ops before it (``cpu_fused._plain_scales_params``)."""
    from lightning_qcomm.codecs import cpu_fused
    from lightning_qcomm.collectives.chunked import _decode_rows, _encode_rows

    codec = get_codec(name, bits=bits)
    x = torch.randn(2, n) * 1e-3
    row = x[0].contiguous()
    wire = _encode_rows(codec, x, [1, 2])
    out = torch.empty(n, dtype=torch.uint8)
    _, params = cpu_fused._plain_scales_params(codec, row, cpu_fused.FLT_MAX)
    params = params.contiguous()
    spec = cpu_fused._c_spec_args(codec)
    fns = {
        "encode_rows(2 rows)": lambda: _encode_rows(codec, x, [1, 2]),
        "decode_rows(2 rows)": lambda: _decode_rows(codec, wire, 2, n),
        "one row: C encode pass alone": lambda: torch.ops.qcomm.c_encode_codes.default(
            row, params, 1, 2, *spec, out, 0
        ),
        "one row: scales + params (torch ops)": lambda: cpu_fused._plain_scales_params(codec, row, cpu_fused.FLT_MAX),
    }
    return {f"{name}-{bits} n={n} {k}": f for k, f in fns.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=25, help="interleaved rounds (the minimum is reported)")
    p.add_argument("--calls", type=int, default=100, help="calls per round")
    p.add_argument("--quant-ddp", action="store_true", help="instead: QuantDDP's 4-bit row calls (nuqsgd, qsgd)")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    fns = {}
    if args.quant_ddp:
        for name in ("nuqsgd", "qsgd"):
            fns.update(quant_ddp_calls(name, 4))
    else:
        for bits in (4, 8):
            for n in (16384, 65536, 262144):
                fns.update(calls(bits, n))
    best = dict.fromkeys(fns, float("inf"))
    for f in fns.values():
        for _ in range(20):
            f()
    for _ in range(args.rounds):
        for k, f in fns.items():
            t0 = time.perf_counter()
            for _ in range(args.calls):
                f()
            best[k] = min(best[k], (time.perf_counter() - t0) / args.calls)
    print(f"# {lightning_qcomm.__file__}")
    print("| call | µs |\n|---|---:|")
    for k, v in best.items():
        print(f"| {k} | {v * 1e6:.1f} |")


if __name__ == "__main__":
    main()
