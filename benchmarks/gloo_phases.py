"""Raw gloo collectives on a shaped two-namespace link: why two-phase compressed collectives lose time.

Times, on a 100 Mbit/s veth (benchmarks/netns.py), a plain fp32 all_reduce and the two phases a
quantized all-reduce uses (all_to_all_single, then all_gather_into_tensor) at the byte sizes of an 8-bit
all-reduce of the same tensor: each phase alone, back to back (blocking), and pipelined the way
``quantized_all_reduce`` issues them (the payload cut into K pieces, every all-to-all issued
asynchronously, each piece's all-gather issued as its all-to-all completes). With the namespaces'
``net.ipv4.tcp_slow_start_after_idle`` at 1 (Linux default) and 0. Root only. Usage::

    sudo python benchmarks/gloo_phases.py [--rate 100] [--mbytes 4.26]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

WORKER = "worker"


def _worker(rank: int, addr: str, iface: str, nbytes: int) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR=addr, MASTER_PORT="29611", GLOO_SOCKET_IFNAME=iface)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)

    def median_s(fn, reps: int = 5) -> float:
        fn()
        times = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2]

    x = torch.zeros(nbytes // 4)  # fp32 tensor of nbytes
    half = nbytes // 8 // 64 * 64  # an 8-bit code of the same tensor is nbytes/4; each phase moves half of it per rank
    a2a_in = torch.zeros(2 * half, dtype=torch.uint8)
    a2a_out = torch.empty_like(a2a_in)
    ag_in = torch.zeros(half, dtype=torch.uint8)
    ag_out = torch.empty(2 * half, dtype=torch.uint8)
    rows = {
        f"fp32 all_reduce ({nbytes / 1e6:.2f} MB tensor)": lambda: dist.all_reduce(x),
        f"all_to_all_single ({half / 1e6:.2f} MB sent)": lambda: dist.all_to_all_single(a2a_out, a2a_in),
        f"all_gather_into_tensor ({half / 1e6:.2f} MB sent)": lambda: dist.all_gather_into_tensor(ag_out, ag_in),
        "all_to_all_single then all_gather": lambda: (
            dist.all_to_all_single(a2a_out, a2a_in),
            dist.all_gather_into_tensor(ag_out, ag_in),
        ),
    }

    def concurrent(fn_name: str, inp: torch.Tensor, out: torch.Tensor, pieces: int = 8):
        """One phase as ``pieces`` concurrent calls on contiguous slices (what all_to_all_bytes /
        all_gather_bytes do; their column re-layout is a local copy, left out here)."""
        ins, outs = inp.chunk(pieces), out.chunk(pieces)
        fn = getattr(dist, fn_name)

        def run():
            for work in [fn(o, i, async_op=True) for o, i in zip(outs, ins)]:
                work.wait()

        return run

    rows[f"all_to_all_single as 8 concurrent calls ({half / 1e6:.2f} MB sent)"] = concurrent(
        "all_to_all_single", a2a_in, a2a_out
    )
    rows[f"all_gather_into_tensor as 8 concurrent calls ({half / 1e6:.2f} MB sent)"] = concurrent(
        "all_gather_into_tensor", ag_in, ag_out
    )
    for pieces in (4, 16):
        c = half // pieces
        p_in = [torch.zeros(2 * c, dtype=torch.uint8) for _ in range(pieces)]
        p_out = [torch.empty(2 * c, dtype=torch.uint8) for _ in range(pieces)]
        g_in = [torch.zeros(c, dtype=torch.uint8) for _ in range(pieces)]
        g_out = [torch.empty(2 * c, dtype=torch.uint8) for _ in range(pieces)]

        def pipelined(p_in=p_in, p_out=p_out, g_in=g_in, g_out=g_out, pieces=pieces):
            a2a = [dist.all_to_all_single(p_out[k], p_in[k], async_op=True) for k in range(pieces)]
            gathers = []
            for k in range(pieces):
                a2a[k].wait()
                gathers.append(dist.all_gather_into_tensor(g_out[k], g_in[k], async_op=True))
            for work in gathers:
                work.wait()

        rows[f"the same two phases pipelined in {pieces} pieces"] = pipelined
    results = {name: median_s(fn) for name, fn in rows.items()}
    if rank == 0:
        for name, s in results.items():
            print(f"| {name} | {s * 1000:.1f} |", flush=True)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", type=float, default=100.0, help="link rate, Mbit/s per direction")
    p.add_argument("--mbytes", type=float, default=4.26, help="fp32 tensor size in MB")
    args = p.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from netns import shaped_link

    nbytes = int(args.mbytes * 1e6) // 8 * 8
    ideal_ms = nbytes / 8 * 8 / (args.rate * 1e6) * 1000
    print(f"link {args.rate:g} Mbit/s; one phase's ideal transfer time: {ideal_ms:.1f} ms")
    for slow_start_after_idle in ("1", "0"):
        with shaped_link(args.rate, prefix="lqg", subnet="10.79.0") as link:
            for ns in (link.ns0, link.ns1):
                sysctl = f"net.ipv4.tcp_slow_start_after_idle={slow_start_after_idle}"
                subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-qw", sysctl], check=True)
            print(f"\ntcp_slow_start_after_idle={slow_start_after_idle}\n\n| collective | median ms |\n|---|---|")
            sys.stdout.flush()
            procs = [
                subprocess.Popen(
                    ["ip", "netns", "exec", ns, "env", "OMP_NUM_THREADS=1", sys.executable, __file__, WORKER]
                    + [str(rank), link.addr0, iface, str(nbytes)],
                    stderr=subprocess.DEVNULL,
                )
                for rank, (ns, iface) in enumerate(((link.ns0, link.iface0), (link.ns1, link.iface1)))
            ]
            for proc in procs:
                proc.wait()


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == WORKER:
        _worker(int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]))
    else:
        main()
