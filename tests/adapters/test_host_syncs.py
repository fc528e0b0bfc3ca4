"""The comm hot paths make the host wait for the device nowhere.

Each path runs under ``NoHostSync`` (tests/_helpers/_sync_guard.py: raises on ``aten._local_scalar_dense`` -- what
``.item()``, ``bool(t)`` and ``float(t)`` dispatch to -- and on data-dependent shapes) on torch's ``fake``
process group with 4 ranks. The one-off cross-rank consistency check is a host decision by design and
stays off (``check=False``, as the DDP hook and FSDP comms pass after their first call). The codec layer runs in
its accelerator form and gets no exemption; tensors made from Python data (``aten.lift_fresh``) are refused too.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _launch import FakeBucket
from _sync_guard import NoHostSync
from torch.testing._internal.distributed.fake_pg import FakeStore

from lightning_qcomm.adapters.ddp.config import QuantDDPConfig
from lightning_qcomm.adapters.ddp.hooks import QuantDDPHookState, quant_ddp_comm_hook
from lightning_qcomm.adapters.fsdp2.comms import QSDPCommState, QuantizedAllGather, QuantizedReduceScatter
from lightning_qcomm.adapters.fsdp2.shim import ParamShard
from lightning_qcomm.adapters.onebit.sync import OneBitMomentumSync
from lightning_qcomm.codecs import get_codec
from lightning_qcomm.collectives import (
    onebit_all_reduce,
    onebit_server_error_numel,
    quantized_all_gather,
    quantized_all_reduce,
    quantized_reduce_scatter,
)

WORLD = 4
D = 5003


@pytest.fixture(autouse=True)
def accelerator_form(monkeypatch):
    """The codec layer in the form it runs on an accelerator (no host branch on values; on CPU tensors it may read
    values, which waits for nothing), so the guard checks what a GPU step runs, codec layer included."""
    from lightning_qcomm.codecs import scaling

    monkeypatch.setattr(scaling, "_HOST_BRANCHES", False)


@pytest.fixture(autouse=True)
def fake_world():
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=WORLD)
    yield
    dist.destroy_process_group()


def _ops_of(fn) -> list[str]:
    """The aten ops ``fn`` dispatches (by name), with no guard."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with Record():
        fn()
    return seen


def test_the_guard_catches_item_bool_and_nonzero():
    t = torch.ones(3)

    def set_number():
        t[0] = 2.0

    checks = [lambda: t.sum().item(), lambda: bool(t.any()), lambda: t.nonzero(), lambda: t[t > 0]]
    checks.append(lambda: torch.tensor([1.0, 2.0]))  # a tensor made from Python data
    if "lift_fresh" in _ops_of(set_number):  # torch <= 2.14 makes a tensor of the number; 2.15 calls fill_
        checks.append(set_number)
    for fn in checks:
        with pytest.raises(AssertionError, match="host sync"), NoHostSync():
            fn()


@pytest.mark.parametrize("name", ["uniform", "qsgd", "fp8_e4m3", None])
def test_all_reduce_with_error_feedback(name):
    codec = None if name is None else get_codec(name, bits=8 if name != "qsgd" else 4, bucket_size=256)
    x = torch.randn(D)
    x[7] = float("nan")  # a non-finite step: the residual update keeps the old value there
    ef = torch.randn(D)
    with NoHostSync():
        quantized_all_reduce(x, codec, op="avg", error_feedback=ef, seed=2, check=False, piece_numel=512)
        quantized_all_reduce(x.bfloat16(), codec, op="sum", error_feedback=ef, seed=3, check=False)


def test_reduce_scatter_and_all_gather():
    codec = get_codec("uniform", bits=4, bucket_size=128)
    s = 1001
    with NoHostSync():
        quantized_reduce_scatter(torch.empty(s), torch.randn(WORLD * s), codec, op="avg", check=False)
        quantized_all_gather(torch.empty(WORLD * s), torch.randn(s), codec, check=False)


def test_onebit_all_reduce_and_momentum_sync():
    x = torch.randn(D)
    ew = torch.zeros(D)
    es = torch.zeros(onebit_server_error_numel(D))
    sync = OneBitMomentumSync([3000, 2003], bucket_numel=4000)
    momenta = [torch.randn(3000), torch.randn(2003)]
    with NoHostSync():
        onebit_all_reduce(x, ew, es, check=False, piece_numel=300)
        sync._checked = [True] * len(sync.buckets)
        sync.sync_(momenta)


@pytest.mark.parametrize("block", [None, 64])
def test_onebit_all_reduce_batched_accelerator_form(monkeypatch, block):
    """The form a GPU runs (``collectives.sign_collective``: every piece in one batch), forced on CPU tensors: full pieces,
    a short last piece with padding, fp16 input, a NaN, the momentum sync's buckets."""
    from lightning_qcomm.collectives import sign_collective

    monkeypatch.setattr(sign_collective, "PATH", "batched")
    x = torch.randn(D)
    x[11] = float("nan")
    ew = torch.zeros(D)
    es = torch.zeros(onebit_server_error_numel(D))
    sync = OneBitMomentumSync([3000, 2003], bucket_numel=4000, piece_numel=256, block_numel=block)
    momenta = [torch.randn(3000), torch.randn(2003)]
    sync._checked = [True] * len(sync.buckets)
    with NoHostSync():
        onebit_all_reduce(x, ew, es, check=False, piece_numel=300, block_numel=block)
        onebit_all_reduce(x.half(), ew, es, check=False, piece_numel=300, block_numel=block)
        sync.sync_(momenta)


def test_ddp_hook_with_error_feedback_and_loss_scale():
    ps = [torch.nn.Parameter(torch.randn(n)) for n in (3000, 10, 2000)]
    scale = torch.tensor(1024.0)
    state = QuantDDPHookState(
        QuantDDPConfig("qsgd", 4, 256, True, 100), {p: f"p{i}" for i, p in enumerate(ps)}, loss_scale=lambda: scale
    )
    for p in ps:
        p.grad = torch.randn(p.shape) * 1024
    quant_ddp_comm_hook(state, FakeBucket(0, ps)).wait()  # first call: the one-off consistency check
    with NoHostSync():
        quant_ddp_comm_hook(state, FakeBucket(0, ps)).wait()


def test_qsdp_all_gather_and_reduce_scatter():
    params = [
        ParamShard(1500, 1500, 6000, 2, True),
        ParamShard(17, 17, 68, 1, True),
        ParamShard(900, 899, 3599, 2, True),
    ]
    codec = get_codec("uniform", bits=8, bucket_size=256)
    state = QSDPCommState(seed=1)
    s = sum(p.padded_shard_numel for p in params)
    ag = QuantizedAllGather(codec, state, 0, params, 1024)
    rs = QuantizedReduceScatter(codec, state, 0, params, 1024)
    group = dist.group.WORLD
    with NoHostSync():
        out = torch.empty(WORLD * s)
        ag(out, out[s : 2 * s].normal_(), group)
        rs(torch.empty(s), torch.randn(WORLD * s), group)


def test_activation_quantizer_forward_and_backward():
    """The uniform policy's whole path: every kind of quantized save (projection, addmm, recomputed norm and
    GELU, a hand-written RMS norm and tanh-GELU, a gated product, dropout), a shared save, attention and the
    loss kept exact, and the restores in backward."""
    import torch.nn.functional as F

    from lightning_qcomm.memory import ActivationQuantConfig, ActivationQuantizer

    torch.manual_seed(0)
    d = 64
    w = [torch.nn.Parameter(torch.randn(d, d) / d**0.5) for _ in range(4)]
    norm_w = torch.nn.Parameter(torch.ones(d))
    x0 = torch.randn(4, 32, d, requires_grad=True)
    q = ActivationQuantizer(ActivationQuantConfig(bits=4))

    def step():
        with q.forward_context(step=1):
            h = F.layer_norm(x0 * 1.0, (d,))
            qkv = [F.linear(h, wi).view(4, 32, 4, 16).transpose(1, 2) for wi in w[:3]]
            a = F.scaled_dot_product_attention(*qkv, is_causal=True).transpose(1, 2).reshape(4, 32, d)
            r = a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_w
            g = torch.addmm(torch.zeros(d), r.view(-1, d), w[3]).view(4, 32, d)
            act = 0.5 * g * (1.0 + torch.tanh(0.79788456 * (g + 0.044715 * torch.pow(g, 3.0))))
            y = F.dropout(F.gelu(act) * r, 0.1)
            loss = F.cross_entropy(y.flatten(0, 1), torch.zeros(128, dtype=torch.long))
        loss.backward()

    step()  # the first call may set things up
    assert q.stats.quantized_tensors >= 8
    with NoHostSync():
        step()
