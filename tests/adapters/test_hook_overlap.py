"""The DDP hooks hand DDP a future at once and complete it when their collective is done.

On CPU the overlapped path queues the job on the comm worker: the hook must return before the job has run
(the rest of backward continues) and the future must complete with the bucket afterwards. The CUDA path
(a side stream and a CUDA-aware future) is checked in tests/cuda/test_cuda_comms.py.
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist
from _launch import FakeBucket
from torch.testing._internal.distributed.fake_pg import FakeStore

from lightning_qcomm.adapters.ddp.config import QuantDDPConfig
from lightning_qcomm.adapters.ddp.hooks import QuantDDPHookState, quant_ddp_comm_hook
from lightning_qcomm.adapters.onebit.sync import OneBitGradHookState, onebit_adam_grad_hook
from lightning_qcomm.comm.comm_worker import CommWorker


def test_overlapped_hook_returns_before_its_collective_runs():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        worker = CommWorker("test-overlap")
        gate = threading.Event()
        worker.submit(gate.wait)  # the worker is busy: whatever the hook queues cannot have run yet
        ps = [torch.nn.Parameter(torch.zeros(3000)) for _ in range(2)]
        for p in ps:
            p.grad = torch.randn(3000)
        state = QuantDDPHookState(
            QuantDDPConfig("uniform", 8, 512, True, 0), {p: f"p{i}" for i, p in enumerate(ps)}, worker=worker
        )
        bucket = FakeBucket(0, ps)
        fut = quant_ddp_comm_hook(state, bucket)
        assert not fut.done(), "the hook ran its collective before returning"
        gate.set()
        assert fut.wait().data_ptr() == bucket.buffer().data_ptr()
        assert any(t.abs().sum() > 0 for t in state.ef_state_dict().values())  # the job ran: residuals exist
        worker.close()
    finally:
        dist.destroy_process_group()


def test_warm_up_hook_cpu_returns_the_averaged_bucket():
    ps = [torch.nn.Parameter(torch.zeros(10))]
    ps[0].grad = torch.arange(10.0)
    bucket = FakeBucket(0, ps)
    state = OneBitGradHookState()
    assert torch.equal(onebit_adam_grad_hook(state, bucket).wait(), torch.arange(10.0))  # a world of one
    state.compressing = True
    assert onebit_adam_grad_hook(state, bucket).done()
