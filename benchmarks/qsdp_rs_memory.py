"""Peak extra CPU memory of one QSDP gradient reduce-scatter, against the world size (issue 19 item 6).

``python benchmarks/qsdp_rs_memory.py`` runs ``comm.fsdp.QuantizedReduceScatter`` on torch's fake process group
(no peers: the all-to-all moves nothing, every allocation of the real path still happens) for a 200K-element
shard at N = 2, 4, 8, under ``torch.profiler`` with ``profile_memory=True``: the running sum of every
allocation and free during the call (the input and the output existed before) gives the peak. Reported per
shard (fp32 bytes of the output): the peak, the wire buffers (send + receive, N rows of the 8-bit payload
each), and what is left, the codec's temporaries. Writes ``benchmarks/results/qsdp_rs_memory.md``.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile
from torch.testing._internal.distributed.fake_pg import FakeStore

from lightning_qcomm.codecs import get_codec
from lightning_qcomm.comm.fsdp import QSDPCommState, QuantizedReduceScatter
from lightning_qcomm.comm.fsdp_internals import ParamShard

SHARD = 200_000
OUT = Path(__file__).resolve().parent / "results" / "qsdp_rs_memory.md"


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


def main() -> None:
    rows = ["| N | codec | peak / shard | wire buffers / shard | rest / shard |", "|---|---|---|---|---|"]
    for world in (2, 4, 8):
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=world)
        half = SHARD // 2
        params = [ParamShard(half, half, world * half, 2, True), ParamShard(half, half, world * half, 2, True)]
        for name in ("uniform", "qsgd"):
            codec = get_codec(name, bits=8, bucket_size=1024)
            rs = QuantizedReduceScatter(codec, QSDPCommState(seed=1), 0, params, 1024)
            inp, out = torch.randn(world * SHARD), torch.empty(SHARD)
            rs(out, inp, dist.group.WORLD)  # warm: caches, first-use work
            peak = peak_bytes(lambda rs=rs, out=out, inp=inp: rs(out, inp, dist.group.WORLD))
            wire = 2 * world * codec.nbytes(SHARD)
            shard = 4 * SHARD
            rows.append(
                f"| {world} | {name}-8 | {peak / shard:.2f} | {wire / shard:.2f} | {(peak - wire) / shard:.2f} |"
            )
    dist.destroy_process_group()
    text = "# Peak extra memory of one QSDP reduce-scatter\n\n`python benchmarks/qsdp_rs_memory.py`\n\n"
    text += "\n".join(rows) + "\n"
    OUT.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
