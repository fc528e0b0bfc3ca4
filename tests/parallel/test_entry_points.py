"""The plain-torch entry points (``lightning_qcomm.parallel``) and the Fabric strategies (``lightning_qcomm.fabric``)
on 2 CPU ranks (gloo), all in ONE pair of processes.

Each worker first trains with the plain-torch entry points in a bare ``torch.distributed`` script (the process
group made by hand, no Trainer or Fabric object), then with Lightning Fabric: ``Fabric(accelerator="cpu",
devices=2, strategy=...)`` sees ``LOCAL_RANK`` / ``WORLD_SIZE`` (processes created externally) and joins the
same group, so each strategy costs a few dozen steps, not a process launch. The problems, hyperparameters and
bands are the Trainer tests' (tests/strategies/test_quant_ddp.py, test_qsdp.py, test_local_sgd.py, test_onebit_adam.py):

* QuantDDP 8-bit: final loss within 1% of DDP; codec "none": plain DDP bit for bit.
* QSDP W8G8: mean of the last 4 losses within 2% of FSDP2; 32 bits: FSDP2's losses to 1e-5.
* Local SGD: torch's own averagers as the reference (``PeriodicModelAverager``; for post_local, DDP with
  ``post_localSGD_hook`` + ``PostLocalSGDOptimizer``): same parameters to float rounding.
* 1-bit Adam (the ``onebit_adam_ddp`` recipe): final loss within 3% of DDP + AdamW; no gradient bytes after the
  freeze.
* Fabric checkpoints of per-rank state (QuantDDP error feedback, Local SGD mid-round with per-rank optimizer
  state, QSDP's RNG step): a run resumed from ``fabric.load`` continues the uninterrupted one.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from _launch import free_port, rank_results, spawn, write_rank_result
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

from lightning_qcomm.parallel import rank_files

WORLD = 2
MLP_STEPS = 48  # tests/strategies/test_quant_ddp.py: 3 epochs of 16 steps
GPT_STEPS = 16  # tests/strategies/test_qsdp.py: 2 epochs of 8 steps
LOCAL_STEPS = 12
MULTI_BUCKET = {"codec": "uniform", "bits": 2, "min_quant_numel": 0, "error_feedback": True, "bucket_cap_mb": 0.1}


# ---------------------------------------------------------------------------------------------- problems
def _mlp() -> nn.Module:
    from _siblings import from_test_file

    N_CLS, N_FEAT, N_HID = from_test_file("strategies/test_quant_ddp", "N_CLS", "N_FEAT", "N_HID")

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(N_FEAT, N_HID), nn.Tanh(), nn.Linear(N_HID, N_CLS))


def _wide_mlp() -> nn.Module:
    """Layers of 16k-65k elements: with bucket_cap_mb=0.1 DDP makes several buckets (layout replay on resume)."""
    from _siblings import from_test_file

    N_CLS, N_FEAT = from_test_file("strategies/test_quant_ddp", "N_CLS", "N_FEAT")

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(N_FEAT, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, N_CLS))


def _batches(dataset, rank: int, steps: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A permutation per epoch shared by the ranks; rank r takes every WORLD-th sample from r (what
    ``DistributedSampler`` does)."""
    x, y = dataset.tensors
    out, epoch = [], 0
    while len(out) < steps:
        perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch))[rank::WORLD]
        out += [(x[perm[i : i + batch]], y[perm[i : i + batch]]) for i in range(0, len(perm), batch)]
        epoch += 1
    return out[:steps]


def _mlp_batches(rank: int, steps: int = MLP_STEPS):
    from _siblings import from_test_file

    BATCH, _dataset = from_test_file("strategies/test_quant_ddp", "BATCH", "_dataset")

    return _batches(_dataset(), rank, steps, BATCH)


def _full_loss(model: nn.Module, dataset=None) -> float:
    from _siblings import from_test_file

    _dataset = from_test_file("strategies/test_quant_ddp", "_dataset")

    x, y = (dataset or _dataset()).tensors
    with torch.no_grad():
        return float(F.cross_entropy(model(x), y))


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def _train(model, optimizer, batches, backward=None, after_step=None, poison_at=None) -> list[float]:
    """Plain training steps; ``poison_at``: the 1-based step whose loss (so gradient) is made NaN."""
    losses = []
    for i, (x, y) in enumerate(batches):
        loss = F.cross_entropy(model(x), y)
        if i + 1 == poison_at:
            loss = loss * float("nan")
        (backward or torch.Tensor.backward)(loss)
        optimizer.step()
        if after_step is not None:
            after_step(i + 1)  # before zero_grad: torch's model averagers average parameters that have a gradient
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def _gpt():
    from _siblings import from_test_file

    TinyGPT = from_test_file("strategies/test_qsdp", "TinyGPT")

    torch.manual_seed(0)
    return TinyGPT()


def _gpt_losses(
    model, optimizer, rank: int, steps: int = GPT_STEPS, start: int = 0, backward=None, at=None, poison_at=None
):
    """tests/strategies/test_qsdp.py's run: rank r's sequences r, r+2, ... in order, batches of 4, 8 per epoch."""
    from _siblings import from_test_file

    BATCH, VOCAB, token_data = from_test_file("strategies/test_qsdp", "BATCH", "VOCAB", "token_data")

    data = token_data()[rank::WORLD]
    batches = [data[i : i + BATCH] for i in range(0, len(data), BATCH)]
    losses = []
    for step in range(start, start + steps):
        seq = batches[step % len(batches)]
        logits = model(seq[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB).float(), seq[:, 1:].reshape(-1))
        if step + 1 == poison_at:
            loss = loss * float("nan")
        (backward or torch.Tensor.backward)(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
        if at is not None:
            at(step + 1)
    return losses


def _fsdp2(model, mesh):
    from torch.distributed.fsdp import fully_shard

    from lightning_qcomm.parallel import plan_fsdp_groups

    for m in plan_fsdp_groups(model, None, 10**6):  # QSDP's own grouping: the comparison differs in the comms only
        fully_shard(m, mesh=mesh)
    return model


def _identical_across_ranks(t: torch.Tensor) -> bool:
    both = [torch.empty_like(t) for _ in range(WORLD)]
    dist.all_gather(both, t)
    return all(torch.equal(both[0], b) for b in both)


# ---------------------------------------------------------------------------------------------- plain torch
def _plain_quant_ddp(rank: int, out: dict) -> None:
    from _siblings import from_test_file

    LR = from_test_file("strategies/test_quant_ddp", "LR")

    from lightning_qcomm import QuantDDPConfig, quant_ddp_hook

    def run(config):
        ddp = DistributedDataParallel(_mlp())
        opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=0.9)
        state = None
        if config is not None:
            state, hook = quant_ddp_hook(config, ddp, optimizer=opt)  # the optimizer's hooks count the steps
            ddp.register_comm_hook(state, hook)
        _train(ddp, opt, _mlp_batches(rank))
        params = _flat(ddp.module)
        res = {"loss": _full_loss(ddp.module), "params": params, "identical": _identical_across_ranks(params)}
        res["step"] = None if state is None else state.step
        res["chosen"] = None if state is None or state.trial is None else state.trial.chosen
        return res

    out["ddp"] = run(None)
    out["quant_none"] = run(QuantDDPConfig(codec="none"))
    out["quant_uniform8"] = run(QuantDDPConfig(codec="uniform", bits=8, min_quant_numel=0))
    out["quant_auto"] = run(QuantDDPConfig(codec="auto", min_quant_numel=0))


def _plain_qsdp(rank: int, out: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_qcomm import QSDPConfig, apply_qsdp

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("data_parallel",))
    model = _fsdp2(_gpt(), mesh)
    out["fsdp2"] = _gpt_losses(model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0), rank)
    for name, bits in (("qsdp32", 32), ("qsdp8", 8)):
        model = _gpt()
        qsdp = apply_qsdp(model, mesh, QSDPConfig(bits=bits))
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
        qsdp.attach(opt)  # advances the RNG step after every optimizer.step()
        out[name] = {"losses": _gpt_losses(model, opt, rank), "rng_step": qsdp.rng_step, "groups": len(qsdp.modules)}
        qsdp.close()


def _plain_local_sgd(rank: int, out: dict) -> None:
    from _siblings import from_test_file

    LR = from_test_file("strategies/test_quant_ddp", "LR")
    from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer

    from lightning_qcomm import LocalSGD, LocalSGDConfig

    batches = _mlp_batches(rank, LOCAL_STEPS)
    # constant period 3 against PeriodicModelAverager (warmup_steps = period - 1: averages after steps 3, 6, ...)
    ref = _mlp()  # the same start on every rank, as ours (broadcast from rank 0)
    opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=0.9)
    averager = PeriodicModelAverager(period=3, warmup_steps=2)
    _train(ref, opt, batches, after_step=lambda s: averager.average_parameters(list(ref.parameters())))
    out["constant_reference"] = _flat(ref)

    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    local_sgd = LocalSGD(model, opt, LocalSGDConfig(sync="constant", period=3), total_steps=LOCAL_STEPS)
    syncs = []
    _train(model, opt, batches, after_step=lambda s: syncs.append(s) if local_sgd.last_sync_step == s else None)
    out["constant"] = {"params": _flat(model), "syncs": syncs, "identical": _identical_across_ranks(_flat(model))}
    out["init"] = _flat(_mlp())
    # the same with each average applied a round later (overlap=True): the reference for Fabric's below
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    config = LocalSGDConfig(sync="constant", period=3, overlap=True)
    local_sgd = LocalSGD(model, opt, config, total_steps=LOCAL_STEPS)
    _train(model, opt, batches)
    local_sgd.close()
    out["constant_overlap"] = {"params": _flat(model), "identical": _identical_across_ranks(_flat(model))}

    # post_local: switch_step 3 (DDP-style gradient averages), then period 2, against torch's post-local SGD
    switch, period, steps = 3, 2, 9
    batches = _mlp_batches(rank, steps)
    own, _ = dist.new_subgroups(group_size=1)  # after the switch the gradients stay local
    ddp = DistributedDataParallel(_mlp())
    ddp.register_comm_hook(
        PostLocalSGDState(None, own, switch, post_local_gradient_allreduce=False), post_localSGD_hook
    )
    base = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=0.9)
    opt = PostLocalSGDOptimizer(base, PeriodicModelAverager(period=period, warmup_steps=switch + period - 1))
    _train(ddp, opt, batches)
    out["post_local_reference"] = _flat(ddp.module)

    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    config = LocalSGDConfig(sync="post_local", switch_step=switch, period=period)
    local_sgd = LocalSGD(model, opt, config, total_steps=steps)
    syncs = []
    _train(model, opt, batches, after_step=lambda s: syncs.append(s) if local_sgd.last_sync_step == s else None)
    out["post_local"] = {"params": _flat(model), "syncs": syncs}


def _plain_nonfinite(rank: int, out: dict) -> None:
    """A NaN gradient on rank 1 at step 2: the policy of each entry point (default "skip", run from the optimizer's
    step pre-hook) keeps every rank's parameters finite; "propagate" is torch's behaviour (NaN weights)."""
    from _siblings import from_test_file

    LR = from_test_file("strategies/test_quant_ddp", "LR")
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_qcomm import LocalSGD, LocalSGDConfig, QSDPConfig, QuantDDPConfig, apply_qsdp, quant_ddp_hook

    poison_at = 2 if rank == 1 else None
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("data_parallel",))
    for policy in ("skip", "propagate"):
        ddp = DistributedDataParallel(_mlp())
        opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=0.9)
        state, hook = quant_ddp_hook(QuantDDPConfig(codec="uniform", bits=8, nonfinite=policy), ddp, optimizer=opt)
        ddp.register_comm_hook(state, hook)
        _train(ddp, opt, _mlp_batches(rank, 4), poison_at=poison_at)
        out[f"quant_ddp/{policy}"] = bool(torch.isfinite(_flat(ddp.module)).all())

        model = _gpt()
        qsdp = apply_qsdp(model, mesh, QSDPConfig(bits=8, nonfinite=policy))
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
        qsdp.attach(opt)
        losses = _gpt_losses(model, opt, rank, steps=4, poison_at=poison_at)
        out[f"qsdp/{policy}"] = all(torch.isfinite(torch.tensor(losses[2:])).tolist())  # the steps after it
        qsdp.close()

        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        LocalSGD(model, opt, LocalSGDConfig(sync="constant", period=3, nonfinite=policy))
        _train(model, opt, _mlp_batches(rank, 4), poison_at=poison_at)
        out[f"local_sgd/{policy}"] = bool(torch.isfinite(_flat(model)).all())


def _onebit_problem(rank: int, make_optimizer, wrap, backward=None) -> dict:
    """tests/optim/test_onebit_adam.py's problem: two param groups, LambdaLR warm-up over 8 steps, 48 steps."""
    from _siblings import from_test_file

    BATCH, LR, STEPS, _dataset, _net = from_test_file(
        "optim/test_onebit_adam", "BATCH", "LR", "STEPS", "_dataset", "_net"
    )

    from lightning_qcomm.comm.ledger import CommLedger, set_ledger

    ledger = CommLedger()
    set_ledger(ledger)
    torch.manual_seed(0)
    net = _net()
    decay = [p for p in net.parameters() if p.dim() >= 2]
    no_decay = [p for p in net.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}]
    model, opt = wrap(net, make_optimizer(groups, LR))
    torch_opt = getattr(opt, "optimizer", opt)  # Fabric's wrapper holds the torch optimizer
    sched = torch.optim.lr_scheduler.LambdaLR(torch_opt, lambda t: min(1.0, (t + 1) / 8))
    data = _dataset()
    _train(model, opt, _batches(data, rank, STEPS, BATCH), backward=backward, after_step=lambda s: sched.step())
    totals = {k: (v.calls, v.wire_bytes) for k, v in ledger.cumulative.items()}
    set_ledger(CommLedger())
    return {"loss": _full_loss(net, data), "totals": totals, "identical": _identical_across_ranks(_flat(net))}


def _plain_onebit(rank: int, out: dict) -> None:
    from _siblings import from_test_file

    FREEZE = from_test_file("optim/test_onebit_adam", "FREEZE")

    from lightning_qcomm import OneBitAdam, onebit_adam_ddp

    made = []

    def ddp(net, opt):
        made.append(DistributedDataParallel(net))
        if isinstance(opt, OneBitAdam):
            onebit_adam_ddp(made[-1], opt)
        return made[-1], opt

    out["adamw"] = _onebit_problem(rank, lambda g, lr: torch.optim.AdamW(g, lr=lr), ddp)
    out["onebit"] = _onebit_problem(rank, lambda g, lr: OneBitAdam(g, lr=lr, freeze_step=FREEZE), ddp)
    out["onebit"]["grad_sync"] = made[-1].require_backward_grad_sync  # DDP's own gradient reduction is off


# ---------------------------------------------------------------------------------------------- Fabric
def _fabric(strategy):
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=WORLD, strategy=strategy)
    fabric.launch()
    return fabric


def _fabric_quant_ddp(rank: int, outdir: str, out: dict) -> None:
    from _siblings import from_test_file

    LR = from_test_file("strategies/test_quant_ddp", "LR")

    from lightning_qcomm import QuantDDPFabricStrategy

    def run(strategy, make=_mlp, steps=MLP_STEPS, save_at=None, load=None):
        fabric = _fabric(strategy)
        net = make()
        model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9))
        start = 0
        if load is not None:
            fabric.load(load, {"model": model, "optimizer": opt})
            start = save_at
        batches = _mlp_batches(rank, steps)[start:]

        def at(step):
            if save_at is not None and load is None and start + step == save_at:
                fabric.save(os.path.join(outdir, "quant_ddp.ckpt"), {"model": model, "optimizer": opt})

        _train(model, opt, batches, backward=fabric.backward, after_step=at)
        params = _flat(model)
        res = {"loss": _full_loss(model) if make is _mlp else None, "params": params}
        hook_state = getattr(fabric.strategy, "hook_state", None)
        res.update(identical=_identical_across_ranks(params), step=None if hook_state is None else hook_state.step)
        res["chosen"] = getattr(getattr(hook_state, "trial", None), "chosen", None)
        res["type"] = type(fabric.strategy).__name__
        return res

    out["ddp"] = run("ddp")
    out["quant_uniform8"] = run(QuantDDPFabricStrategy(codec="uniform", bits=8, min_quant_numel=0))
    out["quant_ddp_uniform8"] = run("quant_ddp_uniform8")  # the registered name (min_quant_numel=1024)
    out["quant_none"] = run(QuantDDPFabricStrategy(codec="none"))
    out["quant_auto"] = run(QuantDDPFabricStrategy(codec="auto", min_quant_numel=0))
    steps, half = 12, 6
    out["ef_straight"] = run(QuantDDPFabricStrategy(**MULTI_BUCKET), _wide_mlp, steps, save_at=half)
    ckpt = os.path.join(outdir, "quant_ddp.ckpt")
    out["ef_resumed"] = run(QuantDDPFabricStrategy(**MULTI_BUCKET), _wide_mlp, steps, save_at=half, load=ckpt)
    saved = torch.load(ckpt, weights_only=True)["quant_ddp"]
    saved["per_rank"] = [e["quant_ddp"] for e in rank_files.read_all(ckpt)]  # each rank's own side file
    out["ef_saved"] = {"world_size": saved["world_size"], "steps": [s["step"] for s in saved["per_rank"]]}
    ef = [s["error_feedback"] for s in saved["per_rank"]]
    out["ef_saved"]["differ"] = any(not torch.equal(ef[0][k], ef[1][k]) for k in ef[0])


def _fabric_qsdp(rank: int, outdir: str, out: dict) -> None:
    from lightning.fabric.strategies import ModelParallelStrategy

    from lightning_qcomm import QSDPFabricStrategy

    def fsdp2(model, device_mesh):
        return _fsdp2(model, device_mesh["data_parallel"])

    def run(strategy, steps=GPT_STEPS, save_at=None, load=None):
        fabric = _fabric(strategy)
        model = fabric.setup_module(_gpt())
        opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0))
        start = 0
        if load is not None:
            fabric.load(load, {"model": model, "optimizer": opt})
            start = save_at

        def at(step):
            if save_at is not None and load is None and step == save_at:
                fabric.save(os.path.join(outdir, "qsdp_ckpt"), {"model": model, "optimizer": opt})

        losses = _gpt_losses(model, opt, rank, steps - start, start, backward=fabric.backward, at=at)
        qsdp = getattr(fabric.strategy, "qsdp", None)
        rng = None if qsdp is None else qsdp.rng_step
        trial = None if qsdp is None else qsdp.trial
        res = {"losses": losses, "rng_step": rng, "type": type(fabric.strategy).__name__}
        return {**res, "auto": None if trial is None else [trial.chosen, trial.decided_at]}

    out["fsdp2"] = run(ModelParallelStrategy(parallelize_fn=fsdp2, data_parallel_size=WORLD, tensor_parallel_size=1))
    out["qsdp32"] = run(QSDPFabricStrategy(bits=32))
    out["qsdp_w8g8"] = run("qsdp_w8g8", save_at=GPT_STEPS // 2)
    out["qsdp_resumed"] = run("qsdp_w8g8", save_at=GPT_STEPS // 2, load=os.path.join(outdir, "qsdp_ckpt"))
    # "auto": the 12-step trial decides, fabric.save keeps the choice, a resumed run continues it without a trial
    out["qsdp_auto"] = run(QSDPFabricStrategy(bits="auto"), save_at=GPT_STEPS - 2)
    out["qsdp_auto_resumed"] = run(
        QSDPFabricStrategy(bits="auto"), save_at=GPT_STEPS - 2, load=os.path.join(outdir, "qsdp_ckpt")
    )


def _fabric_local_sgd(rank: int, outdir: str, out: dict) -> None:
    from _siblings import from_test_file

    LR = from_test_file("strategies/test_quant_ddp", "LR")

    from lightning_qcomm import LocalSGDFabricStrategy

    def run(steps=LOCAL_STEPS, save_at=None, load=None, overlap=False):
        strategy = LocalSGDFabricStrategy(sync="constant", period=3, total_steps=steps, overlap=overlap)
        fabric = _fabric(strategy)
        net = _mlp()
        model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9))
        start = 0
        if load is not None:
            fabric.load(load, {"model": model, "optimizer": opt})
            start = save_at
        syncs = []

        def at(step):
            if strategy.local_sgd.last_sync_step == start + step:
                syncs.append(start + step)
            if save_at is not None and load is None and step == save_at:
                fabric.save(os.path.join(outdir, "local_sgd.ckpt"), {"model": model, "optimizer": opt})

        _train(model, opt, _mlp_batches(rank, steps)[start:], backward=fabric.backward, after_step=at)
        return {"params": _flat(model), "syncs": syncs, "type": type(strategy).__name__}

    out["local_sgd"] = run()
    # saved mid-round (rounds end at 3, 6, 9, 12): the save averages first, the resumed run continues from there
    out["local_sgd_saved"] = run(save_at=7)
    out["local_sgd_resumed"] = run(save_at=7, load=os.path.join(outdir, "local_sgd.ckpt"))
    out["registered"] = type(_fabric("local_sgd_qsr").strategy).__name__
    out["overlap"] = run(overlap=True)
    out["overlap_saved"] = run(save_at=7, overlap=True)  # the save applies the average in flight, then averages
    out["overlap_resumed"] = run(save_at=7, load=os.path.join(outdir, "local_sgd.ckpt"), overlap=True)


def _fabric_onebit(rank: int, out: dict) -> None:
    from _siblings import from_test_file

    FREEZE = from_test_file("optim/test_onebit_adam", "FREEZE")

    from lightning_qcomm import OneBitAdam, onebit_adam_ddp

    def runner(make_optimizer):
        fabric = _fabric("ddp")

        def wrap(net, opt):
            model, opt = fabric.setup(net, opt)
            if isinstance(opt.optimizer, OneBitAdam):
                onebit_adam_ddp(model, opt)  # the recipe: Fabric's wrappers are looked through
            return model, opt

        return _onebit_problem(rank, make_optimizer, wrap, backward=fabric.backward)

    out["adamw"] = runner(lambda g, lr: torch.optim.AdamW(g, lr=lr))
    out["onebit"] = runner(lambda g, lr: OneBitAdam(g, lr=lr, freeze_step=FREEZE))


# ---------------------------------------------------------------------------------------------- the workers
def _worker(rank: int, port: int, outdir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(WORLD), NODE_RANK="0")
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)  # a bare torch.distributed script
    out: dict = {"plain": {}, "fabric": {}}
    for section in (_plain_quant_ddp, _plain_qsdp, _plain_local_sgd, _plain_onebit, _plain_nonfinite):
        section(rank, out["plain"])
    for section in (_fabric_quant_ddp, _fabric_qsdp, _fabric_local_sgd):
        section(rank, outdir, out["fabric"])
    _fabric_onebit(rank, out["fabric"])
    write_rank_result(outdir, rank, out, "rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    outdir = tmp_path_factory.mktemp("entry_points")
    os.environ["OMP_NUM_THREADS"] = "1"
    spawn(_worker, free_port(), str(outdir), nprocs=WORLD)
    return rank_results(outdir, WORLD, "rank{rank}.pt")


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def _final(losses: list[float], k: int = 4) -> float:
    return sum(losses[-k:]) / k


# ---------------------------------------------------------------------------------------------- plain torch
@pytest.mark.slow
def test_plain_quant_ddp_hook_bands(runs):
    r0 = runs[0]["plain"]
    assert torch.equal(r0["quant_none"]["params"], r0["ddp"]["params"])  # the fp32 path is plain DDP
    for r in runs:
        q = r["plain"]["quant_uniform8"]
        assert q["identical"] and q["step"] == MLP_STEPS  # the optimizer's post-hook counted every step
    q, ddp = r0["quant_uniform8"], r0["ddp"]
    assert not torch.equal(q["params"], ddp["params"])  # it did quantize
    assert _rel(q["loss"], ddp["loss"]) <= 0.01, (q["loss"], ddp["loss"])
    _check_auto([r["plain"]["quant_auto"] for r in runs], ddp)


def _check_auto(auto: list[dict], ddp: dict) -> None:
    """``codec="auto"`` without the Trainer: every step counted, one choice on both ranks (after the 12 trial
    steps at 32, 8 and 4 bits, which did compress: not plain DDP), the 8-bit loss band."""
    assert auto[0]["chosen"] == auto[1]["chosen"] in (32, 8, 4)
    for a in auto:
        assert a["identical"] and a["step"] == MLP_STEPS
    assert not torch.equal(auto[0]["params"], ddp["params"])
    assert _rel(auto[0]["loss"], ddp["loss"]) <= 0.01, (auto[0]["loss"], ddp["loss"])


@pytest.mark.slow
def test_plain_apply_qsdp_bands(runs):
    for r in runs:
        plain, q32, q8 = r["plain"]["fsdp2"], r["plain"]["qsdp32"], r["plain"]["qsdp8"]
        assert len(plain) == GPT_STEPS and _final(plain) < 0.6 * plain[0]  # the task is learnable
        assert all(_rel(a, b) < 1e-5 for a, b in zip(q32["losses"], plain)), (q32["losses"], plain)
        assert q8["losses"] != plain and _rel(_final(q8["losses"]), _final(plain)) < 0.02, (q8["losses"], plain)
        assert q8["rng_step"] == GPT_STEPS and q8["groups"] == 6  # 2 blocks, tok, pos, ln_f, head


@pytest.mark.slow
def test_plain_local_sgd_matches_torch_averagers(runs):
    for r in runs:
        p = r["plain"]
        assert p["constant"]["syncs"] == [3, 6, 9, 12] and p["constant"]["identical"]
        torch.testing.assert_close(p["constant"]["params"], p["constant_reference"], rtol=1e-5, atol=1e-6)
        assert not torch.equal(p["constant"]["params"], p["init"])  # it trained
        assert p["post_local"]["syncs"] == [1, 2, 3, 5, 7, 9]
        torch.testing.assert_close(p["post_local"]["params"], p["post_local_reference"], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_plain_onebit_adam_recipe(runs):
    from _siblings import from_test_file

    FREEZE = from_test_file("optim/test_onebit_adam", "FREEZE")

    r0 = runs[0]["plain"]
    onebit, adamw = r0["onebit"], r0["adamw"]
    assert onebit["identical"]
    assert _rel(onebit["loss"], adamw["loss"]) < 0.03, (onebit["loss"], adamw["loss"])
    assert onebit["totals"][("all_reduce", "grads")][0] == FREEZE  # no gradient all-reduce after the freeze
    assert onebit["totals"][("all_reduce", "momentum")][0] > 0
    assert onebit["grad_sync"] is False  # DDP does not even reduce buckets any more (nor broadcast buffers)


@pytest.mark.slow
def test_plain_entry_points_skip_a_nonfinite_step(runs):
    for r in runs:
        p = r["plain"]
        for name in ("quant_ddp", "qsdp", "local_sgd"):
            assert p[f"{name}/skip"] and not p[f"{name}/propagate"], (name, p[f"{name}/skip"], p[f"{name}/propagate"])


# ---------------------------------------------------------------------------------------------- Fabric
@pytest.mark.slow
def test_fabric_quant_ddp_bands(runs):
    f0 = runs[0]["fabric"]
    assert f0["quant_ddp_uniform8"]["type"] == "QuantDDPFabricStrategy"
    assert torch.equal(f0["quant_none"]["params"], f0["ddp"]["params"])
    assert torch.equal(f0["ddp"]["params"], runs[0]["plain"]["ddp"]["params"])  # Fabric DDP = torch DDP here
    for r in runs:
        for name in ("quant_uniform8", "quant_ddp_uniform8"):
            q = r["fabric"][name]
            assert q["identical"] and q["step"] == MLP_STEPS
    ddp = f0["ddp"]
    for name in ("quant_uniform8", "quant_ddp_uniform8"):
        q = f0[name]
        assert not torch.equal(q["params"], ddp["params"]) and _rel(q["loss"], ddp["loss"]) <= 0.01, (name, q, ddp)
    # the same hook as the plain-torch entry point: bit-identical results
    assert torch.equal(f0["quant_uniform8"]["params"], runs[0]["plain"]["quant_uniform8"]["params"])
    _check_auto([r["fabric"]["quant_auto"] for r in runs], ddp)


@pytest.mark.slow
def test_fabric_quant_ddp_error_feedback_resumes_bit_for_bit(runs):
    f0 = runs[0]["fabric"]
    assert f0["ef_saved"] == {"world_size": WORLD, "steps": [6, 6], "differ": True}  # one residual set per rank
    for r in runs:
        f = r["fabric"]
        assert f["ef_resumed"]["step"] == 12
        assert torch.equal(f["ef_resumed"]["params"], f["ef_straight"]["params"])


@pytest.mark.slow
def test_fabric_qsdp_bands_and_resume(runs):
    for r in runs:
        f = r["fabric"]
        plain, q32, w8 = f["fsdp2"]["losses"], f["qsdp32"]["losses"], f["qsdp_w8g8"]["losses"]
        assert f["qsdp_w8g8"]["type"] == "QSDPFabricStrategy"
        assert plain == r["plain"]["fsdp2"]  # Fabric's ModelParallelStrategy = the plain FSDP2 run
        assert all(_rel(a, b) < 1e-5 for a, b in zip(q32, plain)), (q32, plain)
        assert w8 != plain and _rel(_final(w8), _final(plain)) < 0.02, (w8, plain)
        assert w8 == r["plain"]["qsdp8"]["losses"]  # the same apply_qsdp as plain torch
        resumed = f["qsdp_resumed"]
        assert len(resumed["losses"]) == GPT_STEPS // 2 and resumed["rng_step"] == GPT_STEPS
        assert all(_rel(a, b) < 1e-6 for a, b in zip(resumed["losses"], w8[GPT_STEPS // 2 :])), (resumed, w8)
        auto, auto_resumed = f["qsdp_auto"]["auto"], f["qsdp_auto_resumed"]["auto"]
        assert auto[0] in (32, 8, 4) and auto[1] == 12  # decided after 3 widths x 4 steps
        assert auto_resumed == auto and f["qsdp_auto_resumed"]["rng_step"] == GPT_STEPS
    assert runs[0]["fabric"]["qsdp_auto"]["auto"] == runs[1]["fabric"]["qsdp_auto"]["auto"]


@pytest.mark.slow
def test_fabric_local_sgd_matches_torch_and_resumes_mid_round(runs):
    for r in runs:
        f, p = r["fabric"], r["plain"]
        assert f["local_sgd"]["type"] == "LocalSGDFabricStrategy" and f["registered"] == "LocalSGDFabricStrategy"
        assert f["local_sgd"]["syncs"] == [3, 6, 9, 12]
        torch.testing.assert_close(f["local_sgd"]["params"], p["constant_reference"], rtol=1e-5, atol=1e-6)
        assert f["local_sgd_saved"]["syncs"] == [3, 6, 9, 12] and f["local_sgd_resumed"]["syncs"] == [9, 12]
        saved, resumed = f["local_sgd_saved"]["params"], f["local_sgd_resumed"]["params"]
        torch.testing.assert_close(resumed, saved, rtol=0, atol=1e-6)
        # overlap=True: Fabric drives the same object as plain torch; the last sync (step 12) is exact
        assert p["constant_overlap"]["identical"] and f["overlap"]["syncs"] == [3, 6, 9, 12]
        assert torch.equal(f["overlap"]["params"], p["constant_overlap"]["params"])
        assert not torch.equal(f["overlap"]["params"], f["local_sgd"]["params"])  # the averages came a round late
        torch.testing.assert_close(f["overlap_resumed"]["params"], f["overlap_saved"]["params"], rtol=0, atol=1e-6)
    assert torch.equal(runs[0]["fabric"]["overlap_saved"]["params"], runs[1]["fabric"]["overlap_saved"]["params"])


@pytest.mark.slow
def test_fabric_onebit_adam_recipe(runs):
    from _siblings import from_test_file

    FREEZE = from_test_file("optim/test_onebit_adam", "FREEZE")

    f0 = runs[0]["fabric"]
    onebit, adamw = f0["onebit"], f0["adamw"]
    assert onebit["identical"]
    assert _rel(onebit["loss"], adamw["loss"]) < 0.03, (onebit["loss"], adamw["loss"])
    assert onebit["totals"][("all_reduce", "grads")][0] == FREEZE
    assert onebit["loss"] == runs[0]["plain"]["onebit"]["loss"]  # the same recipe as plain torch


# ---------------------------------------------------------------------------------------------- no processes
def test_fabric_registry_has_every_preset_with_the_trainer_table():
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_qcomm
    from lightning_qcomm.fabric import register_fabric_strategies
    from lightning_qcomm.strategies.presets import LOCAL_SGD_PRESETS, QSDP_PRESETS, QUANT_DDP_PRESETS

    register_fabric_strategies(STRATEGY_REGISTRY)  # a second registration is a no-op, not an error
    expected = {
        **{n: lightning_qcomm.QSDPFabricStrategy for n in QSDP_PRESETS},
        **{n: lightning_qcomm.QuantDDPFabricStrategy for n in QUANT_DDP_PRESETS},
        **{n: lightning_qcomm.LocalSGDFabricStrategy for n in LOCAL_SGD_PRESETS},
    }
    for name, cls in expected.items():
        assert name == name.lower()
        assert STRATEGY_REGISTRY[name]["strategy"] is cls
        assert STRATEGY_REGISTRY[name]["init_params"] == StrategyRegistry[name]["init_params"]
    assert STRATEGY_REGISTRY.get("qsdp_w4g4").config == StrategyRegistry.get("qsdp_w4g4").config
    assert STRATEGY_REGISTRY.get("quant_ddp_nuqsgd4").config == StrategyRegistry.get("quant_ddp_nuqsgd4").config
    assert type(STRATEGY_REGISTRY.get("ddp")).__module__.startswith("lightning.fabric")  # untouched


def test_fabric_strategies_check_their_arguments_as_the_trainer_ones():
    from lightning_qcomm import LocalSGDFabricStrategy, QSDPFabricStrategy, QuantDDPFabricStrategy

    for cls, kwargs, name in (
        (QSDPFabricStrategy, {"bits": 9}, "QSDPFabricStrategy(bits=9)"),
        (QSDPFabricStrategy, {"seed": -1}, "QSDPFabricStrategy(seed=-1)"),
        (QuantDDPFabricStrategy, {"codec": "topk"}, "QuantDDPFabricStrategy(codec='topk')"),
        (QuantDDPFabricStrategy, {"ddp_comm_hook": print}, "ddp_comm_hook"),
        (LocalSGDFabricStrategy, {"period": 0}, "LocalSGDFabricStrategy(period=0)"),
        (LocalSGDFabricStrategy, {"total_steps": 0}, "total_steps=0"),
    ):
        with pytest.raises((TypeError, ValueError)) as info:
            cls(**kwargs)
        assert name in str(info.value), str(info.value)
    # a config object instead of its fields, but not both
    from lightning_qcomm import QSDPConfig

    assert QSDPFabricStrategy(QSDPConfig(bits=4)).config == QSDPFabricStrategy(bits=4).config
    with pytest.raises(ValueError, match="config= or its fields"):
        QSDPFabricStrategy(QSDPConfig(bits=4), bits=8)
    with pytest.raises(TypeError, match="unexpected keyword arguments"):
        QSDPFabricStrategy(start_method="spawn")  # Fabric's ModelParallelStrategy has no start_method


def test_trainer_strategy_in_fabric_is_refused_by_fabric():
    """A Trainer strategy is not a Fabric strategy (other setup and checkpoint interfaces): Fabric refuses it
    itself, before any of our code runs; the Fabric class with the same arguments is the way."""
    from lightning.fabric import Fabric

    from lightning_qcomm import QSDPStrategy

    with pytest.raises(ValueError, match="lightning.fabric.strategies.Strategy"):
        Fabric(accelerator="cpu", devices=1, strategy=QSDPStrategy(bits=8))


def test_configs_check_themselves_at_construction():
    from lightning_qcomm import LocalSGDConfig, QSDPConfig, QuantDDPConfig

    assert (QSDPConfig(bits=4, grad_bits=8).weight_bits, QSDPConfig(bits=4, grad_bits=8).grad_bits) == (4, 8)
    assert QuantDDPConfig(codec="none").bits == 32 and QuantDDPConfig().bits == 8
    for cls, kwargs, words in (
        (QSDPConfig, {"bits": 8.0}, "QSDPConfig(bits=8.0)"),
        (QSDPConfig, {"bits": 32, "quantize_master": True}, "quantize_master"),
        (QuantDDPConfig, {"codec": "none", "bits": 8}, "bits=8"),
        (QuantDDPConfig, {"overlap_comm": "yes"}, "QuantDDPConfig(overlap_comm='yes')"),
        (LocalSGDConfig, {"sync": "post_local"}, "switch_step"),
        (LocalSGDConfig, {"comm_bucket_mb": float("nan")}, "comm_bucket_mb"),
    ):
        with pytest.raises((TypeError, ValueError)) as info:
            cls(**kwargs)
        assert words in str(info.value), str(info.value)
