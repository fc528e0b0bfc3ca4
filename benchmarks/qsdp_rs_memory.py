"""Peak extra CPU memory of one QSDP gradient reduce-scatter, against the world size.

``python benchmarks/qsdp_rs_memory.py`` runs ``adapters.fsdp2.comms.QuantizedReduceScatter`` on torch's fake process group
(no peers: the all-to-all moves nothing, every allocation of the real path still happens) at N = 2, 4, 8,
under ``torch.profiler`` with ``profile_memory=True``: the running sum of every allocation and free during the
call (the input and the output existed before) gives the peak. The fake group completes an exchange at once;
gloo holds an async exchange's tensors until it is waited on, so ``all_to_all_single`` is wrapped to do the
same (``gloo_lifetimes``). Reported per shard (fp32 bytes of the output): the peak, the wire buffers (send +
receive, N rows of the payload each: inherent to an all-to-all of encoded rows), what is left beyond
them, and, measured alone, the temporaries of encoding the N rows into a send buffer allocated beforehand. Three layouts of a 200K-element shard: two 100K parameters (not a whole number of
buckets: per-row seeds), two 102400-element ones plus a 4096-element bias that travels raw (whole buckets: one
flat encode per segment), and sixteen 12500-element ones (below the fused C path's row size). Writes
``benchmarks/results/qsdp_rs_memory.md``.

tests/adapters/test_qsdp_rs_memory.py asserts the bound (rest <= 2 shards) with the same measurement.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile
from torch.testing._internal.distributed.fake_pg import FakeStore

from lightning_qcomm.adapters.fsdp2.comms import QSDPCommState, QuantizedReduceScatter
from lightning_qcomm.adapters.fsdp2.shim import ParamShard
from lightning_qcomm.codecs import Codec, get_codec
from lightning_qcomm.comm.transport import PieceLayout

OUT = Path(__file__).resolve().parent / "results" / "qsdp_rs_memory.md"
WORLDS = (2, 4, 8)
# (elements, quantized) per parameter of one rank's row; each sums to a 200K-element shard
LAYOUTS = {
    "2 x 100000": ((100_000, True), (100_000, True)),
    "2 x 102400 + 4096 raw": ((102_400, True), (102_400, True), (4_096, False)),
    "16 x 12500": ((12_500, True),) * 16,
}
CODECS = {
    "uniform-8": dict(name="uniform", bits=8, bucket_size=1024),
    "qsgd-8": dict(name="qsgd", bits=8, bucket_size=1024),
}


def peak_bytes(fn) -> int:
    """Peak of the running sum of allocations minus frees while ``fn`` runs (CPU allocator, via the profiler)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    points = []
    for e in prof.events():
        b = e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage
        if b:
            points.append((e.time_range.start, b))
    cur = peak = 0
    for _, b in sorted(points):
        cur += b
        peak = max(peak, cur)
    return peak


class _HeldWork:
    """A completed work that keeps the exchange's tensors alive until ``wait``, as gloo does."""

    def __init__(self, work, tensors) -> None:
        self._work, self._tensors = work, tensors

    def wait(self, *args, **kwargs):
        self._tensors = None
        return self._work.wait(*args, **kwargs)


@contextlib.contextmanager
def gloo_lifetimes():
    """Wrap ``dist.all_to_all_single`` so an async call holds its input and output until it is waited on."""
    original = dist.all_to_all_single

    def held(output, input, *args, async_op: bool = False, **kwargs):
        work = original(output, input, *args, async_op=async_op, **kwargs)
        return _HeldWork(work, (output, input)) if async_op else work

    dist.all_to_all_single = held
    try:
        yield
    finally:
        dist.all_to_all_single = original


def fake_world(world: int) -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=world)


def measure(world: int, codec: Codec, layout, dtype: torch.dtype = torch.float32) -> dict[str, float]:
    """Peak, wire buffers and the rest, in fp32 shards, of one reduce-scatter on a fake group of ``world``
    (initialised here) with rows of ``layout`` ((elements, quantized) per parameter)."""
    fake_world(world)
    params = [ParamShard(n, n, world * n, 2 if q else 1, True) for n, q in layout]
    shard_numel = sum(n for n, _ in layout)
    rs = QuantizedReduceScatter(codec, QSDPCommState(seed=1), 0, params, 1024)
    inp = torch.randn(world * shard_numel).to(dtype)
    out = torch.empty(shard_numel, dtype=dtype)
    group = dist.group.WORLD
    with gloo_lifetimes():
        rs(out, inp, group)  # warm: caches, first-use work
        peak = peak_bytes(lambda: rs(out, inp, group))
    # the encode alone, into a send buffer allocated beforehand: its own temporaries
    rc = rs._row_codec(shard_numel, dtype, params, rs.codec)
    pieces = PieceLayout.for_rows(world, rc.row_nbytes(dtype), inp.device)
    send, rows = pieces.empty(inp.device), inp.view(world, shard_numel)
    encode = peak_bytes(lambda: rc.encode(rows, 5, send, pieces))
    shard, wire = 4 * shard_numel, 2 * send.numel()
    return {"peak": peak / shard, "wire": wire / shard, "rest": (peak - wire) / shard, "encode": encode / shard}


def main() -> None:
    rows = [
        "| layout | N | codec | peak / shard | wire buffers / shard | rest / shard | encode's temporaries / shard |",
        "|---|---|---|---|---|---|---|",
    ]
    for layout_name, layout in LAYOUTS.items():
        for world in WORLDS:
            for name, kwargs in CODECS.items():
                m = measure(world, get_codec(**kwargs), layout)
                rows.append(
                    f"| {layout_name} | {world} | {name} | {m['peak']:.2f} | {m['wire']:.2f} | {m['rest']:.2f} "
                    f"| {m['encode']:.2f} |"
                )
    dist.destroy_process_group()
    text = "# Peak extra memory of one QSDP reduce-scatter\n\n`python benchmarks/qsdp_rs_memory.py`\n\n"
    text += "\n".join(rows) + "\n"
    OUT.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
