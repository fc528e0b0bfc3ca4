"""Where a QuantDDP step's time goes on one CPU core per rank ("profile first").

Measures, in one process on one thread (no network, nothing else running):

- the compute phases of one training step of the netbench model (``bench_model``, bench preset, 4 x 64 tokens):
  forward + loss (T_fwd), backward (T_bwd), AdamW step + zero_grad (T_opt); T_floor = their sum;
- T_codec, the codec work one rank does per step in ``quantized_all_reduce`` over 2 ranks for the model's
  quantized gradient (parameters of >= 1024 elements, as QuantDDP's default ``min_quant_numel``), on real
  gradients: per pipelined piece, encode the 2 chunks, decode the 2 received chunks and sum, re-encode the
  reduced chunk, decode the 2 gathered chunks -- exactly the calls the collective makes, in its pieces
  (``all_reduce_pieces``), and once more as one piece (what the per-call overhead of the pieces costs).

Then, from a netbench run (``--netbench`` JSON: each variant's measured step and veth tx bytes), three bounds
on a step with T_wire = tx bytes / rate:

    L0 = max(T_floor, T_wire)                             the issue's limit: communication hidden entirely
    L1 = max(T_floor + T_codec, T_fwd + T_opt + T_wire)   synchronous data parallel on one core: the gradient of
                                                          step t is needed before step t's optimizer step, so
                                                          the wire can hide behind backward only, and the codec
                                                          shares the core with the compute
    L2 = T_floor + max(T_codec, T_wire)                   DDP's one bucket (the benchmark model's 12.6 MB of
                                                          gradients fill one 25 MB bucket): nothing starts
                                                          before backward ends; codec and wire pipelined

    OMP_NUM_THREADS=1 python benchmarks/qddp_profile.py --netbench benchmarks/results/netbench_ablations_1203.json

Timings are medians over ``--repeats``; the phases are the one process's, the floor in the bounds is the
netbench run's own (measured in the same run as the steps it bounds), split in the profile's proportions.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_model import GPT, MODEL_PRESETS  # noqa: E402
from lightning_qcomm.codecs import get_codec  # noqa: E402
from lightning_qcomm.collectives.chunked import _chunk_len, _decode_rows, _encode_bytes, _encode_rows  # noqa: E402
from lightning_qcomm.collectives.quantized import all_reduce_pieces  # noqa: E402

WORLD = 2
CODECS = {"qddp_uniform8": ("uniform", 8), "qddp_nuqsgd4": ("nuqsgd", 4), "qddp_qsgd4": ("qsgd", 4)}


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def compute_phases(repeats: int, batch: int) -> tuple[dict[str, float], torch.Tensor]:
    """Median ms of forward+loss, backward, optimizer step; and the flat quantized gradient of the last step."""
    torch.manual_seed(0)
    cfg = MODEL_PRESETS["bench"]
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len))
    y = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len))
    times: dict[str, list[float]] = {"fwd": [], "bwd": [], "opt": []}
    for i in range(repeats + 3):
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(x).reshape(-1, cfg.vocab_size), y.reshape(-1))
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        grad = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.numel() >= 1024])
        t3 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=False)
        t4 = time.perf_counter()
        if i >= 3:
            for k, v in (("fwd", t1 - t0), ("bwd", t2 - t1), ("opt", t4 - t3)):
                times[k].append(v * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}, grad


def codec_step(codec, grad: torch.Tensor, piece_numel: int | None) -> None:
    """One rank's codec calls of ``quantized_all_reduce(grad, codec, op="avg")`` over 2 ranks (the peer's
    codes stand in for what it sends: same shape and statistics). ``piece_numel`` None: the collective's pieces;
    else pieces of that many elements per rank."""
    kw = {} if piece_numel is None else {"piece_numel": piece_numel}
    for k, (o, n) in enumerate(all_reduce_pieces(grad.numel(), WORLD, codec, **kw)):
        c = _chunk_len(n, WORLD)
        y = torch.zeros(WORLD * c)
        y[:n] = grad[o : o + n]
        send = _encode_rows(codec, y.view(WORLD, c), [3 * k, 3 * k + 1])
        reduced = _decode_rows(codec, send, WORLD, c).sum(dim=0) / WORLD
        mine = _encode_bytes(codec, reduced, 3 * k + 2)
        _decode_rows(codec, torch.cat([mine, mine]), WORLD, c)


def bounds(phases: dict[str, float], codec_ms: float, floor_ms: float, step_ms: float, wire_ms: float) -> dict:
    scale = floor_ms / sum(phases.values())  # the run's floor, split in the profile's proportions
    fwd, bwd, opt = (phases[k] * scale for k in ("fwd", "bwd", "opt"))
    codec = codec_ms * scale
    limits = {
        "L0": max(floor_ms, wire_ms),
        "L1": max(floor_ms + codec, fwd + opt + wire_ms),
        "L2": floor_ms + max(codec, wire_ms),
    }
    return {"step": step_ms, "floor": floor_ms, "wire": wire_ms, "codec": codec, **limits}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--netbench", type=Path, help="a netbench JSON whose steps to bound")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--md", type=Path, help="also write the report here")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)

    phases, grad = compute_phases(args.repeats, args.batch_size)
    lines = [
        f"compute (1 thread): forward+loss {phases['fwd']:.1f} ms, backward {phases['bwd']:.1f} ms, "
        f"optimizer {phases['opt']:.1f} ms, floor {sum(phases.values()):.1f} ms; quantized gradient "
        f"{grad.numel()} elements",
        "",
        "| codec | pieces | codec ms per step | as one piece | per-piece overhead ms |",
        "|---|---|---|---|---|",
    ]
    codec_ms = {}
    for name, (codec_name, bits) in CODECS.items():
        codec = get_codec(codec_name, bits=bits)
        pieces = len(all_reduce_pieces(grad.numel(), WORLD, codec))
        t = _median_ms(functools.partial(codec_step, codec, grad, None), args.repeats)
        t1 = _median_ms(functools.partial(codec_step, codec, grad, grad.numel()), args.repeats)
        codec_ms[name] = t
        lines.append(f"| {name} | {pieces} | {t:.1f} | {t1:.1f} | {(t - t1) / max(pieces - 1, 1):.2f} |")
    if args.netbench:
        data = json.loads(args.netbench.read_text())
        lines += ["", f"bounds on the steps of `{args.netbench.name}` (ms):", ""]
        lines += ["| rate | variant | step | floor | T_wire | T_codec | L0 | L1 | L2 | step/L0 | step/L1 | step/L2 |"]
        lines += ["|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for rate, table in data["table"].items():
            rows = table["rows"]
            for name, row in rows.items():
                base = name.split("_cap")[0].removesuffix("_p17")
                if base not in codec_ms:
                    continue
                wire_ms = row["tx_max"] * 8 / (float(rate) * 1e6) * 1e3
                b = bounds(phases, codec_ms[base], table["floor_s"] * 1e3, row["step_mean_s"] * 1e3, wire_ms)
                r = [b["step"] / b[k] for k in ("L0", "L1", "L2")]
                lines.append(
                    f"| {float(rate):g} | {name} | {b['step']:.0f} | {b['floor']:.0f} | {b['wire']:.0f} | "
                    f"{b['codec']:.0f} | {b['L0']:.0f} | {b['L1']:.0f} | {b['L2']:.0f} | "
                    + " | ".join(f"{x:.2f}" for x in r)
                    + " |"
                )
    text = "\n".join(lines)
    print(text)
    if args.md:
        args.md.write_text(f"```bash\n{' '.join(['python', *sys.argv])}\n```\n\n{text}\n")


if __name__ == "__main__":
    main()
