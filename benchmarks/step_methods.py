"""The training steps ``benchmarks/step_launches.py`` counts: one function per method, and who launched what.

Each method function takes the model (``step_launches.gpt2``), the batch, the width factor and the world size, on
an initialised fake process group,, and returns a ``Run``: the step to count, how many steps to run before counting
(the method's first steps check the ranks' agreement, build layouts, or are a warm-up phase) and how many steps
the count spans (a Local SGD period: the amortised cost). Every step is forward, loss, backward, the optimizer's
step and ``zero_grad`` (AdamW with ``foreach=True`` unless the method is an optimizer), fp32.

``Attributed`` counts what ``launch_counts.Launches`` counts (torch launches and collectives; Triton launches are
in the ``cuda_path_on_cpu`` log) and names the caller of each: the innermost frame on the stack that is in
lightning_qcomm (its module, ``lightning_qcomm/collectives/quantized.py``), in Hugging Face's model
(``transformers``), torch's optimizers (``torch.optim``), DDP or FSDP2 (``torch DDP``, ``torch FSDP2``), autograd
(``torch.autograd``: backward and what DDP's reducer runs in it), or outside torch (``file.py:function``).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
from launch_counts import LAUNCH_FREE, Launches

BUCKET_MB = 25.0  # DDP's default bucket_cap_mb
LOCAL_SGD_PERIOD = 8  # LocalSGDConfig's default period (its "constant" rule)
_SEP = os.sep
_LABELS = (  # path part -> caller label, the first one found from the innermost frame out
    (f"{_SEP}transformers{_SEP}", "transformers"),
    (f"torch{_SEP}optim{_SEP}", "torch.optim"),
    (f"torch{_SEP}nn{_SEP}parallel{_SEP}", "torch DDP"),
    (f"torch{_SEP}distributed{_SEP}fsdp{_SEP}", "torch FSDP2"),
    (f"torch{_SEP}autograd{_SEP}", "torch.autograd"),
)


def caller(frame) -> str:
    """The caller label of an op dispatched below ``frame`` (see the module docstring): from the innermost frame
    out, the first one in lightning_qcomm, in a labelled part of torch or transformers, or outside torch."""
    package, kernels = f"lightning_qcomm{_SEP}", f"{_SEP}kernels{_SEP}cuda{_SEP}"  # the kernels: a checkout's top level
    while frame is not None:
        path = frame.f_code.co_filename
        if package in path:
            return "lightning_qcomm/" + path.rsplit(package, 1)[1].replace(_SEP, "/")
        if kernels in path:
            return "lightning_qcomm/kernels/cuda/" + os.path.basename(path)
        label = next((name for part, name in _LABELS if part in path), None)
        if label is not None:
            return label
        if f"{_SEP}torch{_SEP}" not in path and path.endswith(".py") and not path.endswith("launch_counts.py"):
            return f"{os.path.basename(path)}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "unknown"


class Attributed(Launches):
    """``Launches`` with each torch launch and collective also counted by caller (``by_caller``)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_caller: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace != "qcomm" and func.overloadpacket.__name__ not in LAUNCH_FREE:
            self.by_caller[caller(sys._getframe(1))] += 1
        return super().__torch_dispatch__(func, types, args, kwargs)

    def seen_collective(self, name: str) -> None:
        super().seen_collective(name)
        self.by_caller[caller(sys._getframe(2))] += 1


@dataclass
class Run:
    """A method's step: ``warmup`` steps run uncounted (or ``warm()`` instead, where given), then ``steps``
    counted (the figures are per step); ``hook_calls``: the DDP comm hook's buckets of the counted steps, where
    there is a hook."""

    step: Callable[[], None]
    warmup: int = 2
    steps: int = 1
    hook_calls: list[int] | None = None
    warm: Callable[[], None] | None = None


def train_step(model, tokens, opt, forward_context: Callable | None = None) -> Callable[[], None]:
    """forward (inside ``forward_context(step)`` where given), loss, backward, ``opt.step()``, ``zero_grad()``."""
    steps = [0]

    def step() -> None:
        steps[0] += 1
        with contextlib.nullcontext() if forward_context is None else forward_context(step=steps[0]):
            loss = model(tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad()

    return step


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4, foreach=True)


def allreduce_hook(state, bucket):  # no annotation: DDP compares it with the class, not a string
    """DDP's own all-reduce of a bucket as a hook (torch's ``allreduce_hook`` reads a result the fake group does not
    set): the sum in place, then the division by N, as DDP divides."""
    import torch.distributed as dist

    buffer = bucket.buffer()
    dist.all_reduce(buffer)
    buffer.div_(dist.get_world_size())
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(buffer)
    return fut


def ddp(model, scale: float):
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, bucket_cap_mb=BUCKET_MB * scale**2)


def ddp_hooked(model, tokens, scale: float, world: int, hook=None, config=None, forward_context=None) -> Run:
    """DDP and AdamW, the buckets all-reduced by ``hook`` (None: DDP's all-reduce, ``allreduce_hook``) or by
    ``quant_ddp_hook(config)``; ``forward_context``: see ``train_step``."""
    from lightning_qcomm.parallel import quant_ddp_hook

    net = ddp(model, scale)
    opt = adamw(net.parameters())
    state, hook = (None, hook or allreduce_hook) if config is None else quant_ddp_hook(config, net, optimizer=opt)
    calls: list[int] = []

    def counted(state, bucket):
        calls.append(bucket.index())
        return hook(state, bucket)

    net.register_comm_hook(state, counted)
    return Run(train_step(net, tokens, opt, forward_context), hook_calls=calls)


def onebit_adam(model, tokens, scale: float, world: int) -> Run:
    """DDP with ``OneBitAdam`` after its freeze (``onebit_adam_ddp``: no gradient all-reduce, the momentum 1-bit):
    ``freeze_step=2``, ``overlap=False`` (a GPU runs the sync inline), the bucket 32 MB x s², one piece per bucket
    and the batched 1-bit all-reduce (``sign_collective.PATH = "batched"``: the layout and the form the momentum sync
    takes for CUDA tensors); counted after the first compressed step and one more."""
    from unittest import mock

    from lightning_qcomm.collectives import sign_collective
    from lightning_qcomm.optim import OneBitAdam
    from lightning_qcomm.parallel import onebit_adam_ddp

    net = ddp(model, scale)
    opt = OneBitAdam(net.parameters(), lr=1e-4, freeze_step=2, bucket_mb=32.0 * scale**2, overlap=False)
    onebit_adam_ddp(net, opt)
    plain = train_step(net, tokens, opt)

    def step() -> None:
        with mock.patch.object(
            sign_collective, "PATH", "batched"
        ):  # the form CUDA tensors take (CPU ones: piece by piece)
            plain()

    def warm() -> None:  # two warm-up steps, the first compressed one; the CUDA tensors' layout; one more
        for _ in range(3):
            step()
        opt._sync.piece_numel = opt._sync.resolve_piece_numel(torch.device("cuda"))
        step()

    return Run(step, warm=warm)


def local_sgd(model, tokens, scale: float, world: int, averaging: bool = False) -> Run:
    """``LocalSGD`` (constant period H = 8, LocalSGDConfig's default period; fp32 averaging in buckets of its
    default 25 MB x s², the full model's buckets; AdamW): a step without averaging, or (``averaging``) the H steps
    of one period, the last one averaging, per step."""
    from lightning_qcomm.parallel import LocalSGD, LocalSGDConfig

    opt = adamw(model.parameters())
    config = LocalSGDConfig(sync="constant", period=LOCAL_SGD_PERIOD, comm_bucket_mb=BUCKET_MB * scale**2)
    LocalSGD(model, opt, config)
    step = train_step(model, tokens, opt)
    if averaging:  # one whole period first (the first average checks the layout), then one period counted
        return Run(step, warmup=LOCAL_SGD_PERIOD, steps=LOCAL_SGD_PERIOD)
    return Run(step, warmup=LOCAL_SGD_PERIOD + 1)  # the second step of the second period


def fsdp(model, tokens, scale: float, world: int, qsdp: bool = False) -> Run:
    """FSDP2 ``fully_shard`` on QSDP's grouping (``plan_fsdp_groups``: the 12 blocks, then the root's children)
    and AdamW; ``qsdp``: ``apply_qsdp(QSDPConfig(bits=8, overlap_comm=False))`` (W8G8, inline as on a GPU; its
    defaults otherwise: every matrix quantized, as at full width, the vectors raw)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lightning_qcomm.parallel import QSDPConfig, apply_qsdp
    from lightning_qcomm.parallel.sharding import plan_fsdp_groups

    mesh = init_device_mesh("cpu", (world,))
    config = QSDPConfig(bits=8, overlap_comm=False)
    if qsdp:
        handle = apply_qsdp(model, mesh, config, check_ranks=False)
    else:
        for module in plan_fsdp_groups(model, config.layer_class_set, config.min_wrap_numel):
            fully_shard(module, mesh=mesh)
    opt = adamw(model.parameters())
    if qsdp:
        handle.attach(opt)
    return Run(train_step(model, tokens, opt))


def activation_quant(model, tokens, scale: float, world: int) -> Run:
    """DDP and AdamW (DDP's all-reduce) with ``ActivationQuantizer(ActivationQuantConfig(bits=4))`` attached to
    the model, each forward in its ``forward_context`` (backward outside it), as the Lightning callback runs it."""
    from lightning_qcomm.memory import ActivationQuantConfig, ActivationQuantizer

    quantizer = ActivationQuantizer(ActivationQuantConfig(bits=4))
    quantizer.attach(model)
    return ddp_hooked(model, tokens, scale, world, forward_context=quantizer.forward_context)
