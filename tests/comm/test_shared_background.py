"""Background threads' process groups are made once per process (``comm_worker.shared_background``).

An optimizer made per fit (1-bit Adam's momentum overlap) or a plain-torch ``LocalSGD(overlap=True)`` made per run
took a new dedicated process group each time, and groups live until the process ends. Two gloo ranks (spawn):
the second OneBitAdam and the second LocalSGD add no process group, and a group destroyed in between is replaced.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from _launch import free_port, rank_results, spawn, write_rank_result


def _groups() -> int:
    return len(dist.distributed_c10d._world.pg_map)


def _onebit_run(rank: int) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightning_qcomm.optim import OneBitAdam
    from lightning_qcomm.parallel.onebit_adam import onebit_adam_ddp

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    ddp = DDP(model)
    opt = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=1, overlap=True)
    onebit_adam_ddp(ddp, opt)
    g = torch.Generator().manual_seed(rank)
    for _ in range(4):  # the overlap starts after the first compression step
        opt.zero_grad()
        ddp(torch.randn(4, 8, generator=g)).square().mean().backward()
        opt.step()


def _local_sgd_run(rank: int) -> None:
    from lightning_qcomm import LocalSGD, LocalSGDConfig

    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    local_sgd = LocalSGD(model, opt, LocalSGDConfig(sync="constant", period=2, overlap=True), total_steps=5)
    g = torch.Generator().manual_seed(rank)
    for _ in range(5):
        opt.zero_grad()
        model(torch.randn(4, 8, generator=g)).square().mean().backward()
        opt.step()
    local_sgd.close()


def _worker(rank: int, port: int, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    added = {}
    for name, run in (("onebit", _onebit_run), ("local_sgd", _local_sgd_run)):
        counts = []
        for _ in range(2):
            before = _groups()
            run(rank)
            counts.append(_groups() - before)
        added[name] = counts
    # a shared group that was destroyed is not handed out again
    try:
        from lightning_qcomm.comm.comm_worker import shared_background

        _, group = shared_background("lightning_qcomm-local-sgd")
        dist.destroy_process_group(group)
        before = _groups()
        _, again = shared_background("lightning_qcomm-local-sgd")
        added["after_destroy"] = (_groups() - before, again is not group)
    except Exception as err:  # reported by the test after the counts above
        added["after_destroy"] = repr(err)
    write_rank_result(out, rank, added)
    dist.destroy_process_group()


def test_second_optimizer_and_local_sgd_add_no_process_group(tmp_path):
    spawn(_worker, free_port(), str(tmp_path), nprocs=2, timeout_s=300)
    for r in rank_results(tmp_path, 2):
        assert r["onebit"] == [1, 0], r  # the first makes its group, the second reuses it
        assert r["local_sgd"] == [1, 0], r
        assert r["after_destroy"] == [1, True], r
