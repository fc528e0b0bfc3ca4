"""The netbench's bf16 baseline hook (``benchmarks/netbench/baseline_hooks.bf16_hook``) on two gloo ranks: the
gradients DDP ends with are the bf16 all-reduce of each rank's gradient cast to bf16 and divided by the world size,
as torch's ``bf16_compress_hook`` computes them (which refuses gloo)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from _launch import free_port, rank_results, spawn, write_rank_result


def _worker(rank: int, port: int, out: str) -> None:
    from benchmarks.netbench.baseline_hooks import bf16_hook

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.Linear(37, 5)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp.register_comm_hook(None, bf16_hook)
    x = torch.randn(8, 37, generator=torch.Generator().manual_seed(rank + 1))
    ddp(x).square().sum().backward()
    local = torch.nn.Linear(37, 5)
    local.load_state_dict(model.state_dict())
    local(x).square().sum().backward()
    write_rank_result(
        out,
        rank,
        {
            "ddp": [p.grad.tolist() for p in model.parameters()],
            "local": [p.grad.tolist() for p in local.parameters()],
        },
    )
    # A barrier first: gloo's barrier waits for the earlier all-reduce, whose Python callback (``decompress``) runs
    # on gloo's thread; destroying the group while that thread still needs the GIL deadlocked once on torch 2.11.
    dist.barrier()
    dist.destroy_process_group()


def test_bf16_hook_is_the_bf16_average(tmp_path):
    spawn(_worker, free_port(), str(tmp_path), nprocs=2)
    r0, r1 = rank_results(str(tmp_path), 2)
    assert r0["ddp"] == r1["ddp"]
    for got, g0, g1 in zip(r0["ddp"], r0["local"], r1["local"]):
        a, b = (torch.tensor(g).to(torch.bfloat16).div_(2) for g in (g0, g1))
        want = (a + b).to(torch.float32)  # two addends: one bf16 rounding, the same in any order
        assert torch.equal(torch.tensor(got), want)
