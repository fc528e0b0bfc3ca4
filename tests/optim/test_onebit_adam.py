"""OneBitAdam (optimizer), adapters.onebit.sync (fused momentum sync, warm-up hook) and OneBitAdamCallback (Lightning).

Single process: bit-exact equality with torch.optim.AdamW / Adam during warm-up (per-group lr, betas, eps),
the freeze (v <- v̂), argument validation, bucket layout, a world-of-one compressed step against the formula
(AdamW and L2 decay), requires_grad=False parameters left alone after the freeze; the callback with
SequentialLR / ChainedScheduler (inner schedulers re-pointed), refusals (SGD, clashing settings, manual
optimization, unknown scheduler, fp16 GradScaler), and validate(ckpt_path) not leaking buffers into a fit.

Two gloo ranks, ONE ``torch.multiprocessing`` spawn for everything (each Lightning ``Trainer`` runs
in-process on its rank: ``LOCAL_RANK`` is set, so Lightning does not launch). Inside the workers:

* plain torch DDP + ``onebit_adam_grad_hook`` + OneBitAdam: torch.distributed calls counted per step
  (all_reduce during warm-up; after the freeze only the 1-bit all-to-all + all-gather and the 8-byte
  non-finite agreement), and the
  first compressed step's momentum and parameters against an independent oracle of docs/design.md's formulas ("1-bit Adam"),
  computed from both ranks' local momenta; NaN gradients stay NaN; auto-freeze on rank-local gradients
  (the max over ranks decides, booked under ledger tag "control");
* Lightning ``strategy="ddp"``: plain AdamW vs ``OneBitAdamCallback`` (AdamW + LambdaLR replaced), loss
  and ledger per phase; a checkpoint in the compression phase, then a resumed fit: error buffers, frozen
  step and v restored per rank, and the resumed run ends bit-identical to the uninterrupted one;
  accumulate_grad_batches=2 (one gradient all-reduce per warm-up step, none after the freeze);
* ``strategy="quant_ddp"`` + the callback; ``configs/onebit_adam.yaml`` through the CLI (both phases).
"""

from __future__ import annotations

import copy
import math
import os
import shutil
import tempfile
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from _launch import free_port, rank_results, spawn, write_rank_result

from lightning_qcomm.adapters.onebit.sync import OneBitMomentumSync, bucket_layout
from lightning_qcomm.callbacks.onebit_adam import CHECKPOINT_KEY, OneBitAdamCallback
from lightning_qcomm.optim import OneBitAdam
from lightning_qcomm.parallel import rank_files

REPO = Path(__file__).resolve().parents[2]

# ---------------------------------------------------------------------------------------------- tiny problem
N_SAMPLES, N_FEAT, N_HID, N_CLS = 1024, 32, 64, 8
BATCH = 32  # per rank: 1024 / 2 / 32 = 16 optimizer steps per epoch
STEPS = 48  # 3 epochs (not a multiple of RESUME_AT: one checkpoint only)
FREEZE = 16  # warm-up = the first epoch (25%)
RESUME_AT = 32  # checkpoint at the end of epoch 2 (compression phase)
REFRESH = 5  # variance_refresh of the checkpointed run: the checkpoint falls one step into a window (32 - 16 = 3·5 + 1)
LR = 0.01


def _dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(N_SAMPLES, N_FEAT, generator=g)
    y = (torch.tanh(x @ torch.randn(N_FEAT, 16, generator=g)) @ torch.randn(16, N_CLS, generator=g)).argmax(1)
    flip = torch.rand(N_SAMPLES, generator=g) < 0.1
    y = torch.where(flip, torch.randint(0, N_CLS, (N_SAMPLES,), generator=g), y)
    return torch.utils.data.TensorDataset(x, y)


def _net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(N_FEAT, N_HID), torch.nn.Tanh(), torch.nn.Linear(N_HID, N_CLS))


class _HoldingLR(torch.optim.lr_scheduler.LambdaLR):
    """A scheduler that keeps a second reference to its optimizer (the swap cannot re-point it)."""

    def __init__(self, optimizer) -> None:
        super().__init__(optimizer, lambda t: 1.0)
        self.held = optimizer


def _scheduler(opt, name: str):
    """The test schedules: per-step LambdaLR warm-up, or nested ones (warm-up 4 steps then cosine / exponential)."""
    lrs = torch.optim.lr_scheduler
    if name == "sequential":
        inner = [lrs.LinearLR(opt, start_factor=0.1, total_iters=4), lrs.CosineAnnealingLR(opt, T_max=8)]
        return lrs.SequentialLR(opt, inner, milestones=[4])
    if name == "chained":
        return lrs.ChainedScheduler([lrs.LinearLR(opt, start_factor=0.1, total_iters=4), lrs.ExponentialLR(opt, 0.8)])
    if name == "holding":
        return _HoldingLR(opt)
    return lrs.LambdaLR(opt, lambda t: min(1.0, (t + 1) / 8))


class _Module(pl.LightningModule):
    """AdamW with two param groups (weights decay, biases do not) and a per-step LambdaLR schedule."""

    def __init__(self, optimizer: str = "adamw", sched: str = "lambda", adamw_kw=None, **onebit_kw) -> None:
        super().__init__()
        self.net = _net()
        self.optimizer_name = optimizer
        self.sched = sched
        self.adamw_kw = adamw_kw or {}
        self.onebit_kw = onebit_kw
        self.losses: list[float] = []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        loss = torch.nn.functional.cross_entropy(self(batch[0]), batch[1])
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}]
        if self.optimizer_name == "onebit":
            opt = OneBitAdam(groups, lr=LR, **self.onebit_kw)
        elif self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=LR)
        else:
            opt = torch.optim.AdamW(groups, lr=LR, **self.adamw_kw)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": _scheduler(opt, self.sched), "interval": "step"}}

    def train_dataloader(self):
        return torch.utils.data.DataLoader(_dataset(), batch_size=BATCH, shuffle=True)


class _ManualModule(_Module):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(torch.nn.functional.cross_entropy(self(batch[0]), batch[1]))
        opt.step()


class _ValModule(_Module):
    def validation_step(self, batch, batch_idx):
        return torch.nn.functional.cross_entropy(self(batch[0]), batch[1])

    def val_dataloader(self):
        return torch.utils.data.DataLoader(_dataset(), batch_size=256)


def _trainer(tmp_path, callbacks, max_steps, **kw) -> pl.Trainer:
    """A quiet one-process CPU Trainer."""
    tkw = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    tkw.update(kw)
    return pl.Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, callbacks=callbacks, default_root_dir=tmp_path, **tkw
    )


def _full_loss(model) -> float:
    ds = _dataset()
    with torch.no_grad():
        return float(torch.nn.functional.cross_entropy(model(ds.tensors[0]), ds.tensors[1]))


# ---------------------------------------------------------------------------------------------- the oracle
def _c(x: torch.Tensor) -> torch.Tensor:
    """docs/design.md ("1-bit sign"): C(x) = (||x||_2 / sqrt(len x)) * sign(x), sign(0) = +1 (float64)."""
    x = x.double()
    return (x.norm() / math.sqrt(x.numel())) * torch.where(x < 0, -1.0, 1.0).double()


def _c_blocks(x: torch.Tensor, block: int | None) -> torch.Tensor:
    """``_c`` of every block of ``block`` consecutive elements of x (the last one shorter); None: of x whole."""
    if block is None:
        return _c(x)
    return torch.cat([_c(x[i : i + block]) for i in range(0, x.numel(), block)])


def onebit_oracle(xs: list[torch.Tensor], block: int | None = None) -> torch.Tensor:
    """Output of the 1-bit all-reduce with zero error buffers, for rank inputs ``xs`` (flat), from the formulas.
    ``block``: one scale per block of that many elements of each chunk (``scale_block``); None: one per chunk."""
    n, d = len(xs), xs[0].numel()
    c = -(-d // n)
    padded = [torch.cat([x.double(), torch.zeros(n * c - d, dtype=torch.float64)]) for x in xs]
    out = []
    for j in range(n):
        z = sum(_c_blocks(y[j * c : (j + 1) * c], block) for y in padded) / n
        valid = min(c, d - j * c)
        z[max(valid, 0) :] = 0.0
        out.append(_c_blocks(z, block))
    return torch.cat(out)[:d]


def _weight(vhat: torch.Tensor, eps: float) -> torch.Tensor:
    """docs/design.md ("1-bit Adam"): the frozen preconditioner w = 1/(sqrt(v̂) + eps) where sqrt(v̂) > eps, else 0."""
    root = vhat.double().sqrt()
    return torch.where(root > eps, 1.0 / (root + eps), torch.zeros_like(root))


# ---------------------------------------------------------------------------------------------- single process
def _groups(model):
    """Two groups; the second has its own lr, betas and eps (and no weight decay)."""
    return [
        {"params": list(model[0].parameters()), "weight_decay": 0.1},
        {"params": list(model[2].parameters()), "lr": 0.02, "betas": (0.7, 0.95), "eps": 1e-6, "weight_decay": 0.0},
    ]


@pytest.mark.parametrize("reference", ["adamw", "adam_l2"])
def test_warmup_equals_torch_adam_bitwise(reference):
    """One rank, never frozen: OneBitAdam is torch's AdamW (or Adam with L2 decay), bit for bit, incl. an lr schedule
    and a param group with its own lr, betas and eps."""
    torch.manual_seed(0)
    m1 = _net()
    m2 = copy.deepcopy(m1)
    if reference == "adamw":
        ref = torch.optim.AdamW(_groups(m1), lr=3e-3, betas=(0.8, 0.99), foreach=False)
        ours = OneBitAdam(_groups(m2), lr=3e-3, betas=(0.8, 0.99), freeze_step=10**9)
    else:
        ref = torch.optim.Adam(_groups(m1), lr=3e-3, weight_decay=0.01, foreach=False)
        ours = OneBitAdam(_groups(m2), lr=3e-3, weight_decay=0.01, decoupled_weight_decay=False, freeze_step=10**9)
    s1 = torch.optim.lr_scheduler.LambdaLR(ref, lambda t: 1.0 / (1 + t))
    s2 = torch.optim.lr_scheduler.LambdaLR(ours, lambda t: 1.0 / (1 + t))
    g = torch.Generator().manual_seed(1)
    for _ in range(40):
        x = torch.randn(16, N_FEAT, generator=g)
        for model, opt, sched in ((m1, ref, s1), (m2, ours, s2)):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
            sched.step()
    for a, b in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(ref.state[a]["exp_avg_sq"], ours.state[b]["exp_avg_sq"])
    assert not ours.frozen


@pytest.mark.parametrize("scale_block", [None, 0], ids=["default_per_block", "per_chunk"])
@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam_l2"])
def test_freeze_bias_corrects_v_and_world1_step_matches_formula(decoupled, scale_block):
    """World of one, first compressed step against docs/design.md, per group (own lr/betas/eps/wd), both decay modes;
    the default code (one scale per block of 256) and the per-chunk one (``scale_block=0``)."""
    torch.manual_seed(0)
    model = _net()
    groups = _groups(model)
    groups[1]["weight_decay"] = 0.05  # both groups decay: the L2 term reaches m in both
    kw = {} if scale_block is None else {"scale_block": scale_block}
    opt = OneBitAdam(
        groups, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1, decoupled_weight_decay=decoupled, freeze_step=3, **kw
    )
    block = 256 if scale_block is None else None
    hp = {p: (g["lr"], g["betas"][0], g["eps"], g["weight_decay"]) for g in opt.param_groups for p in g["params"]}
    assert hp[model[2].weight] == (0.02, 0.7, 1e-6, 0.05)
    beta2_of = {p: g["betas"][1] for g in opt.param_groups for p in g["params"]}
    x = torch.randn(16, N_FEAT)
    for t in range(1, 5):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        if t == 4:  # first compressed step: build the expectation from the formulas before stepping
            params = list(model.parameters())
            before = [p.detach().clone() for p in params]
            u_local, weights = [], []
            for p in params:
                _, b1, eps, wd = hp[p]
                g = p.grad if decoupled else p.grad + wd * p.detach()  # L2: g <- g + wd p
                w = _weight(opt.state[p]["exp_avg_sq"], eps)  # v̂, frozen at the end of step 3
                weights.append(w)
                b2 = beta2_of[p]
                bound = max(1.0, (1 - b1) / math.sqrt(1 - b2))  # Adam's largest step, in units of lr
                u_local.append(((b1 * opt.state[p]["exp_avg"] + (1 - b1) * g).double() * w).clamp(-bound, bound))
            flat = torch.cat([u.reshape(-1) for u in u_local])
            u_expect = onebit_oracle([flat], block)  # world of one: C(C(y)) = C(y)
        opt.step()
        assert opt.frozen == (t >= 3)
    # m <- u (sqrt(v̂) + eps) where w > 0, else 0;  p <- p(1 - lr wd) - lr / (1 - b1^4) * u (no decay factor in L2 mode)
    off = 0
    for p, p0, w in zip(params, before, weights):
        lr, b1, eps, wd = hp[p]
        u = u_expect[off : off + p.numel()].view_as(p) * (w > 0)
        off += p.numel()
        m_expect = u * (opt.state[p]["exp_avg_sq"].double().sqrt() + eps)
        torch.testing.assert_close(opt.state[p]["exp_avg"].double(), m_expect, rtol=1e-6, atol=1e-7)
        decay = (1 - lr * wd) if decoupled else 1.0
        expect = p0.double() * decay - lr / (1 - b1**4) * u
        torch.testing.assert_close(p.detach().double(), expect, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_low_precision_parameters_keep_fp32_moments_and_track_the_fp32_run(dtype):
    """precision="16-true" / "bf16-true": parameters in fp16/bf16, m and v in fp32 (a variance frozen from fp16
    statistics is coarse or zero: g^2 (1 - beta2) of a 1e-3 gradient is below fp16's smallest subnormal, and
    the update becomes lr m / eps). The low-precision run then tracks the fp32-parameter run up to the
    rounding of p itself: per step |dp| <= 2^-k |p| (k = 11 fp16, 8 bf16), so after T steps
    |p_low - p_32| <= T * 2^-k * max|p| plus the propagated difference, bounded here by 4 T 2^-k max|p|.
    A checkpoint round trip keeps the fp32 moments (torch's load_state_dict would cast them to p's dtype)."""
    eps_bits = {torch.float16: 11, torch.bfloat16: 8}[dtype]
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 16, generator=g)
    target = torch.randn(64, 4, generator=g) * 1e-2
    w0 = torch.randn(16, 4, generator=g) * 0.1

    def run(param_dtype, steps, resume_at=None):
        w = torch.nn.Parameter(w0.to(param_dtype).clone())
        opt = OneBitAdam([w], lr=1e-3, eps=1e-6, freeze_step=3)
        for t in range(steps):
            if t == resume_at:
                sd, rank_sd = opt.state_dict(), opt.rank_state_dict()
                opt = OneBitAdam([w], lr=1e-3, eps=1e-6, freeze_step=3)
                opt.load_state_dict(sd)
                opt.load_rank_state_dict(rank_sd)
            opt.zero_grad()
            ((x.to(param_dtype) @ w).float() - target).pow(2).mean().backward()
            opt.step()
        return w, opt

    w32, _ = run(torch.float32, 12)
    wlow, opt = run(dtype, 12)
    bound = 4 * 12 * 2.0**-eps_bits * float(w0.abs().max())
    assert float((wlow.float() - w32).abs().max()) <= bound
    for key in ("exp_avg", "exp_avg_sq"):
        assert opt.state[wlow][key].dtype == torch.float32, key
    wres, opt_res = run(dtype, 12, resume_at=6)
    assert torch.equal(wres, wlow)
    assert all(opt_res.state[wres][k].dtype == torch.float32 for k in ("exp_avg", "exp_avg_sq"))


@pytest.mark.parametrize("bucket_mb", [32.0, 600 * 4 / 2**20], ids=["shared_bucket", "own_bucket"])
def test_parameter_without_requires_grad_is_not_moved_after_freeze(bucket_mb):
    """As torch's AdamW: a parameter switched to requires_grad=False keeps p, m, v̂ and step; the layout stays."""
    torch.manual_seed(0)
    model = _net()
    opt = OneBitAdam(model.parameters(), lr=1e-2, weight_decay=0.1, freeze_step=2, bucket_mb=bucket_mb)
    x = torch.randn(16, N_FEAT)
    w = model[0].weight  # 2048 elements: with 600-element buckets it is a bucket of its own
    for t in range(6):
        if t == 3:  # compression phase, layout already built with w in it
            w.requires_grad_(False)
            layout, n_buckets = list(opt._layout), len(opt._sync.buckets)
            frozen_w = {k: v.clone() for k, v in opt.state[w].items()}
            w0, b0 = w.detach().clone(), model[0].bias.detach().clone()
        if t == 5:
            w.requires_grad_(True)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        if t == 4:
            assert torch.equal(w, w0)
            for k, v in frozen_w.items():
                assert torch.equal(opt.state[w][k], v), k
            assert not torch.equal(model[0].bias, b0)  # the others train on
            assert len(opt._layout) == len(layout) and all(a is b for a, b in zip(opt._layout, layout))
            assert len(opt._sync.buckets) == n_buckets
    assert not torch.equal(w, w0)  # trained again once requires_grad is back


def test_freeze_replaces_v_by_bias_corrected_v():
    torch.manual_seed(0)
    model = _net()
    opt = OneBitAdam(model.parameters(), betas=(0.9, 0.99), freeze_step=5)
    x = torch.randn(16, N_FEAT)
    for t in range(5):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        if t == 4:
            before = {p: opt.state[p]["exp_avg_sq"].clone() for p in model.parameters()}
            # what step 5 will make of v, computed here: v5 = 0.99 v4 + 0.01 g^2, then / (1 - 0.99^5)
            expect = {p: (0.99 * before[p] + 0.01 * p.grad.pow(2)) / (1 - 0.99**5) for p in model.parameters()}
        opt.step()
    assert opt.frozen_at == 5
    for p in model.parameters():
        torch.testing.assert_close(opt.state[p]["exp_avg_sq"], expect[p], rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        ({"freeze_step": 0}, "freeze_step=0"),
        ({"freeze_step": 2.5}, "freeze_step=2.5"),
        ({"freeze_step": True}, "freeze_step=True"),
        ({"auto_freeze_threshold": 1.5}, "auto_freeze_threshold=1.5"),
        ({"auto_freeze_threshold": 0.0}, "auto_freeze_threshold=0.0"),
        ({"auto_freeze_interval": 0}, "auto_freeze_interval=0"),
        ({"auto_freeze_patience": -1}, "auto_freeze_patience=-1"),
        ({"bucket_mb": 0}, "bucket_mb=0"),
        ({"bucket_mb": float("inf")}, "bucket_mb=inf"),
        ({"scale_block": 4}, "scale_block=4"),
        ({"scale_block": None}, "scale_block=None"),
        ({"scale_block": 256.0}, "scale_block=256.0"),
        ({"lr": -1.0}, "lr=-1.0"),
        ({"betas": (0.9, 1.0)}, "betas=(0.9, 1.0)"),
        ({"eps": float("nan")}, "eps=nan"),
        ({"weight_decay": -0.1}, "weight_decay=-0.1"),
        ({"decoupled_weight_decay": "yes"}, "decoupled_weight_decay='yes'"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(kwargs, needle):
    with pytest.raises(ValueError) as err:
        OneBitAdam(_net().parameters(), **kwargs)
    assert needle in str(err.value) and "allowed" in str(err.value)
    cb_kwargs = {
        k: v for k, v in kwargs.items() if k.startswith(("freeze", "auto", "bucket", "scale")) and v is not None
    }
    if cb_kwargs:
        with pytest.raises(ValueError) as err:
            OneBitAdamCallback(**cb_kwargs)
        assert str(err.value).startswith("OneBitAdamCallback(") and needle in str(err.value)


def test_amsgrad_and_maximize_groups_are_rejected():
    with pytest.raises(ValueError, match="amsgrad/maximize"):
        OneBitAdam([{"params": list(_net().parameters()), "amsgrad": True}])
    params = list(_net().parameters())
    with pytest.raises(ValueError, match="load_state_dict: param_groups.0. has amsgrad=True.*allowed: both False"):
        OneBitAdam(params).load_state_dict(torch.optim.Adam(params, amsgrad=True).state_dict())


def test_bucket_layout_greedy_in_order():
    assert bucket_layout([3, 3, 3, 10, 1], 6) == [[0, 1], [2], [3], [4]]
    assert bucket_layout([5], 1) == [[0]]
    with pytest.raises(ValueError, match="bucket_numel"):
        bucket_layout([1], 0)


def test_momentum_sync_world1_rank_state_roundtrip_and_layout_check():
    sync = OneBitMomentumSync([10, 7, 30], bucket_numel=20)
    assert sync.buckets == [[0, 1], [2]]
    ts = [torch.randn(10), torch.randn(7), torch.randn(3, 10)]
    expect = [onebit_oracle([torch.cat([ts[0], ts[1]])]), onebit_oracle([ts[2].reshape(-1)])]
    sync.sync_(ts)
    torch.testing.assert_close(torch.cat([ts[0], ts[1]]).double(), expect[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ts[2].reshape(-1).double(), expect[1], rtol=1e-6, atol=1e-7)
    state = sync.rank_state_dict()
    assert any(bool(e.abs().sum() > 0) for e in state["worker_error"])  # the sign residual is not zero
    other = OneBitMomentumSync([10, 7, 30], bucket_numel=20)
    other.load_rank_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(other.worker_error, sync.worker_error))
    with pytest.raises(ValueError, match="another layout"):
        OneBitMomentumSync([10, 7, 30], bucket_numel=100).load_rank_state_dict(state)
    # the pipelining piece decides where each server-error element belongs: another piece is another layout
    with pytest.raises(ValueError, match="another layout"):
        OneBitMomentumSync([10, 7, 30], bucket_numel=20, piece_numel=4).load_rank_state_dict(state)
    old_format = {k: v for k, v in state.items() if k != "piece_numel"}
    with pytest.raises(ValueError, match="another layout"):
        OneBitMomentumSync([10, 7, 30], bucket_numel=20).load_rank_state_dict(old_format)


def test_state_dict_roundtrip_keeps_freeze_and_plain_adamw_state_loads():
    torch.manual_seed(0)
    model = _net()
    opt = OneBitAdam(model.parameters(), freeze_step=3)
    for _ in range(5):
        opt.zero_grad()
        model(torch.randn(8, N_FEAT)).sum().backward()
        opt.step()
    sd = opt.state_dict()
    fresh = OneBitAdam(model.parameters(), freeze_step=3)
    fresh.load_state_dict(sd)
    assert (fresh.frozen_at, fresh.num_steps) == (3, 5)
    # a torch AdamW state (no "onebit" entry) past freeze_step freezes on load
    adamw = torch.optim.AdamW(model.parameters())
    for _ in range(4):
        adamw.zero_grad()
        model(torch.randn(8, N_FEAT)).sum().backward()
        adamw.step()
    v = [adamw.state[p]["exp_avg_sq"].clone() for p in model.parameters()]
    fresh = OneBitAdam(model.parameters(), betas=(0.9, 0.999), freeze_step=3)
    fresh.load_state_dict(adamw.state_dict())
    assert fresh.frozen_at == 4
    for p, v0 in zip(model.parameters(), v):
        torch.testing.assert_close(fresh.state[p]["exp_avg_sq"], v0 / (1 - 0.999**4))


# ---------------------------------------------------------------------------------------------- 2-rank worker
COUNTED = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_to_all_single", "broadcast")
_CALLS: list[str] = []


def _install_counter() -> None:
    import torch.distributed as dist

    for name in COUNTED:
        fn = getattr(dist, name, None)
        if fn is None or getattr(fn, "_counted", False):
            continue

        def counted(*args, __fn=fn, __name=name, **kwargs):
            _CALLS.append(__name)
            return __fn(*args, **kwargs)

        counted._counted = True
        setattr(dist, name, counted)


def _torch_ddp_checks(rank: int) -> dict:
    """Plain torch DDP + warm-up hook + OneBitAdam: calls per step, the oracle, NaN, auto-freeze."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightning_qcomm.adapters.onebit.sync import OneBitGradHookState, onebit_adam_grad_hook
    from lightning_qcomm.comm.ledger import CommLedger, set_ledger

    out: dict = {}
    ledger = CommLedger(keep_records=True)
    set_ledger(ledger)
    torch.manual_seed(0)
    model = _net()
    ddp = DDP(model)
    hook = OneBitGradHookState()
    ddp.register_comm_hook(hook, onebit_adam_grad_hook)
    # bucket of ~600 fp32 elements: the 2632 momentum elements travel in several fused buckets
    # the inline sync (its calls, its exact skip); tests/adapters/test_onebit_overlap.py holds the overlapped one to it
    opt = OneBitAdam(
        model.parameters(), lr=1e-2, weight_decay=0.05, freeze_step=3, bucket_mb=600 * 4 / 2**20, overlap=False
    )
    ds = _dataset()
    g = torch.Generator().manual_seed(100 + rank)  # different local data per rank
    calls, records, oracle_err, param_err = [], [], None, None
    for step in range(6):
        idx = torch.randint(0, N_SAMPLES, (BATCH,), generator=g)
        opt.zero_grad()
        hook.compressing = opt.frozen
        _CALLS.clear()
        loss = torch.nn.functional.cross_entropy(ddp(ds.tensors[0][idx]), ds.tensors[1][idx])
        loss.backward()
        if step == 3:  # first compressed step: the oracle, from both ranks' local momenta
            params = list(model.parameters())
            w = torch.cat([_weight(opt.state[p]["exp_avg_sq"], 1e-8).reshape(-1) for p in params])
            m_local = torch.cat([(0.9 * opt.state[p]["exp_avg"] + 0.1 * p.grad).reshape(-1) for p in params])
            u_local = (m_local.double() * w).clamp(-3.16227766, 3.16227766).float()  # (1 - b1) / sqrt(1 - b2)
            both = [torch.empty_like(u_local) for _ in range(2)]
            dist.all_gather(both, u_local)
            before = [p.detach().clone() for p in params]
            _CALLS.clear()
        opt.step()
        calls.append(sorted(_CALLS))
        records.append(sorted({(r.op, r.tag) for r in ledger.records}))
        ledger.next_step()
        if step == 3:
            off, expect_m = 0, []
            for b in opt._sync.buckets:
                n = sum(params[i].numel() for i in b)
                expect_m.append(onebit_oracle([x[off : off + n] for x in both], block=256))  # the default code
                off += n
            expect_u = torch.cat(expect_m) * (w > 0)
            expect_m = expect_u / torch.where(w > 0, w, 1.0)  # u (sqrt(v̂) + eps), 0 where w = 0
            got = torch.cat([opt.state[p]["exp_avg"].reshape(-1) for p in params]).double()
            oracle_err = float((got - expect_m).abs().max() / expect_m.abs().max())
            off, errs = 0, []
            for p, p0 in zip(params, before):
                u = expect_u[off : off + p.numel()].view_as(p)
                off += p.numel()
                wd = 0.05
                expect = p0.double() * (1 - 1e-2 * wd) - 1e-2 / (1 - 0.9**4) * u
                errs.append(float((p.detach().double() - expect).abs().max()))
            param_err = max(errs)
    out["calls"], out["records"] = calls, records
    out["n_buckets"] = len(opt._sync.buckets)
    out["oracle_err"], out["param_err"] = oracle_err, param_err
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    both = [torch.empty_like(flat) for _ in range(2)]
    dist.all_gather(both, flat)
    out["params_equal_across_ranks"] = bool(torch.equal(both[0], both[1]))

    # a NaN gradient on rank 0 only, in the compression phase. Under the default nonfinite="skip" the ranks agree
    # and nothing moves on either rank (m, p, error buffers, step count)
    def inject_nan():
        opt.zero_grad()
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        if rank == 0:
            next(model.parameters()).grad[0, 0] = float("nan")

    snapshot = [t.clone() for t in [*params, *(opt.state[p]["exp_avg"] for p in params), *opt._sync.worker_error]]
    steps_before = opt.num_steps
    inject_nan()
    opt.step()
    after = [*params, *(opt.state[p]["exp_avg"] for p in params), *opt._sync.worker_error]
    out["skip_untouched"] = all(torch.equal(a, b) for a, b in zip(snapshot, after)) and opt.num_steps == steps_before
    out["skip_counted"] = opt.nonfinite.skipped
    # with nonfinite="propagate" (torch's behaviour): momentum and parameters non-finite on BOTH ranks
    opt.nonfinite.policy = "propagate"
    errs_before = [e.clone() for e in opt._sync.worker_error]
    inject_nan()
    opt.step()
    out["nan_momentum_nonfinite"] = not all(bool(torch.isfinite(opt.state[p]["exp_avg"]).all()) for p in params)
    out["nan_param_nonfinite"] = not bool(torch.isfinite(next(model.parameters())).all())
    out["nan_errors_finite"] = all(bool(torch.isfinite(e).all()) for e in opt._sync.worker_error)
    out["nan_errors"] = (errs_before[0], opt._sync.worker_error[0].clone())

    out["auto"] = _auto_freeze_checks(rank)
    set_ledger(None)
    return out


AUTO = dict(freeze_step=1000, auto_freeze_threshold=0.3, auto_freeze_interval=2, auto_freeze_patience=2)
AUTO_STEPS = 60


def _auto_freeze_checks(rank: int) -> dict:
    """Auto-freeze on rank-LOCAL gradients (no DDP), so each rank's variance change r differs: rank 1's loss
    is scaled by 1.2^t for t < 16 (its v̂ keeps growing, r stays high), rank 0's is not. A shadow optimizer
    per rank on a one-rank group makes the local decision; the real one must take the max over ranks."""
    import torch.distributed as dist

    from lightning_qcomm.comm.ledger import CommLedger, set_ledger

    solo = [dist.new_group([0]), dist.new_group([1])][rank]  # every rank creates both groups, same order
    ledger = CommLedger(keep_records=True)
    set_ledger(ledger)
    torch.manual_seed(0)
    model = _net()
    shadow_model = copy.deepcopy(model)
    opt = OneBitAdam(model.parameters(), **AUTO)
    shadow = OneBitAdam(shadow_model.parameters(), process_group=solo, **AUTO)
    ds = _dataset()
    g = torch.Generator().manual_seed(200 + rank)
    changes, warmup_keys = [], set()
    for t in range(AUTO_STEPS):
        idx = torch.randint(0, N_SAMPLES, (BATCH,), generator=g)
        scale = 1.2 ** min(t, 16) if rank == 1 else 1.0
        for m, o in ((model, opt), (shadow_model, shadow)):
            if o.frozen:
                continue
            o.zero_grad()
            (scale * torch.nn.functional.cross_entropy(m(ds.tensors[0][idx]), ds.tensors[1][idx])).backward()
            o.step()
        if opt.num_steps % 2 == 0:
            changes.append(opt.last_variance_change)
        warmup_keys |= {(r.op, r.tag, r.payload_bytes) for r in ledger.records}
        if opt.frozen:
            break
    set_ledger(None)
    return {
        "frozen_at": opt.frozen_at,
        "changes": changes,
        "local_frozen_at": shadow.frozen_at,
        "n_checks": opt.num_steps // 2,
        "ledger_keys": warmup_keys,
        "control_calls": ledger.cumulative[("all_reduce", "control")].calls,
    }


def _fit(rank, port, module, callbacks=(), strategy="ddp", max_steps=STEPS, ckpt_path=None, **kw):
    from lightning_qcomm.comm.ledger import CommLedger, set_ledger

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", NODE_RANK="0")
    os.environ["LOCAL_RANK"] = str(rank)
    ledger = CommLedger()
    set_ledger(ledger)
    tkw = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    tkw.update(kw)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=max_steps, callbacks=list(callbacks), **tkw
    )
    trainer.fit(module, ckpt_path=ckpt_path)
    set_ledger(None)
    return trainer, ledger


class _PhaseProbe(pl.Callback):
    """Per optimizer step: the ledger's (op, tag) keys and the torch.distributed calls of that step."""

    def __init__(self) -> None:
        self.keys: list[list[tuple[str, str]]] = []
        self.calls: list[list[str]] = []
        self._start: dict = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        from lightning_qcomm.comm.ledger import get_ledger

        self._start = {k: t.calls for k, t in get_ledger().cumulative.items()}
        _CALLS.clear()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        from lightning_qcomm.comm.ledger import get_ledger

        now = get_ledger().cumulative
        self.keys.append(sorted(k for k, t in now.items() if t.calls > self._start.get(k, 0)))
        self.calls.append(sorted(_CALLS))

    def on_train_end(self, trainer, pl_module):
        model = trainer.strategy.model  # still the DDP wrapper here (Lightning unwraps it at teardown)
        self.sync_flag = model.require_backward_grad_sync
        self.comm_hook = model._get_ddp_logging_data().get("comm_hook")


def _lightning_checks(rank: int, port: int, outdir: str) -> dict:
    import torch.distributed as dist
    from lightning.pytorch.callbacks import ModelCheckpoint

    out: dict = {}
    pl.seed_everything(0, verbose=False)
    module = _Module()
    out["init_loss"] = _full_loss(module)
    _fit(rank, port, module)
    out["ddp_loss"] = _full_loss(module)
    out["ddp_params"] = [p.detach().clone() for p in module.parameters()]

    # the callback on plain DDP, with a checkpoint at RESUME_AT (compression phase)
    saved: dict = {}

    class SaveProbe(pl.Callback):
        def on_save_checkpoint(self, trainer, pl_module, checkpoint):
            opt = trainer.optimizers[0]
            saved["rank_state"] = opt.rank_state_dict()
            saved["frozen_at"], saved["num_steps"] = opt.frozen_at, opt.num_steps
            saved["v"] = [opt.state[p]["exp_avg_sq"].clone() for p in pl_module.parameters()]

    pl.seed_everything(0, verbose=False)
    module = _Module()
    cb, probe = OneBitAdamCallback(freeze_step=FREEZE, variance_refresh=REFRESH), _PhaseProbe()
    mc = ModelCheckpoint(dirpath=outdir, filename="onebit", every_n_train_steps=RESUME_AT, save_top_k=-1)
    trainer, ledger = _fit(rank, port, module, [cb, probe, SaveProbe(), mc], enable_checkpointing=True)
    opt = trainer.optimizers[0]
    out["onebit"] = {
        "loss": _full_loss(module),
        "losses": module.losses,
        "optimizer": type(opt).__name__,
        "groups": [(g["lr"], g["weight_decay"], g["decoupled_weight_decay"]) for g in opt.param_groups],
        "sched_optimizer_is_new": trainer.lr_scheduler_configs[0].scheduler.optimizer is opt,
        "frozen_at": opt.frozen_at,
        "keys": probe.keys,
        "calls": probe.calls,
        "require_backward_grad_sync": probe.sync_flag,
        "comm_hook": probe.comm_hook,
        "params": [p.detach().clone() for p in module.parameters()],
        "totals": {k: (t.calls, t.wire_bytes, t.baseline_bytes) for k, t in ledger.cumulative.items()},
    }
    flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    both = [torch.empty_like(flat) for _ in range(2)]
    dist.all_gather(both, flat)
    out["onebit"]["params_equal_across_ranks"] = bool(torch.equal(both[0], both[1]))
    both_err = [None, None]
    dist.all_gather_object(both_err, saved["rank_state"])
    out["saved"] = saved
    out["saved_errors_differ_between_ranks"] = any(
        not torch.equal(a, b) for a, b in zip(both_err[0]["worker_error"], both_err[1]["worker_error"])
    )
    out["saved_windows_differ_between_ranks"] = any(
        not torch.equal(a, b) for a, b in zip(both_err[0]["variance_window"], both_err[1]["variance_window"])
    )

    # resume from RESUME_AT: the callback must hand each rank its own buffers back
    seen: dict = {}

    class StartProbe(pl.Callback):  # listed after the OneBitAdamCallback, so it sees the restored state
        def on_train_start(self, trainer, pl_module):
            opt = trainer.optimizers[0]
            seen["rank_state"] = opt.rank_state_dict()
            seen["frozen_at"], seen["num_steps"] = opt.frozen_at, opt.num_steps
            seen["v"] = [opt.state[p]["exp_avg_sq"].clone() for p in pl_module.parameters()]
            seen["sync_off"] = not trainer.strategy.model.require_backward_grad_sync

    pl.seed_everything(0, verbose=False)
    module = _Module()
    ckpt = os.path.join(outdir, "onebit.ckpt")
    cb = OneBitAdamCallback(freeze_step=FREEZE, variance_refresh=REFRESH)
    _fit(rank, port, module, [cb, StartProbe()], ckpt_path=ckpt)
    out["resume"] = {
        "errors_equal": all(
            torch.equal(a, b) for a, b in zip(seen["rank_state"]["worker_error"], saved["rank_state"]["worker_error"])
        )
        and all(
            torch.equal(a, b) for a, b in zip(seen["rank_state"]["server_error"], saved["rank_state"]["server_error"])
        ),
        "frozen": (seen["frozen_at"], seen["num_steps"]) == (saved["frozen_at"], saved["num_steps"]),
        "v_equal": all(torch.equal(a, b) for a, b in zip(seen["v"], saved["v"])),
        "window_equal": all(
            torch.equal(a, b)
            for a, b in zip(seen["rank_state"]["variance_window"], saved["rank_state"]["variance_window"])
        ),
        "sync_off": seen["sync_off"],
        "params": [p.detach().clone() for p in module.parameters()],
    }
    if rank == 0:
        ck = torch.load(ckpt, weights_only=False)
        out["resume"]["ckpt_world"] = ck[CHECKPOINT_KEY]["world_size"]

    # the user returns OneBitAdam; a clashing callback argument is refused
    pl.seed_everything(0, verbose=False)
    module = _Module("onebit", freeze_step=8)
    trainer, ledger = _fit(rank, port, module, [OneBitAdamCallback()], max_steps=12)
    out["user_onebit"] = {"frozen_at": trainer.optimizers[0].frozen_at, "loss": _full_loss(module)}

    # accumulate_grad_batches=2: DDP syncs only the last micro-batch in warm-up, nothing after the freeze
    pl.seed_everything(0, verbose=False)
    module = _Module()
    probe = _PhaseProbe()
    trainer, ledger = _fit(
        rank, port, module, [OneBitAdamCallback(freeze_step=4), probe], max_steps=8, accumulate_grad_batches=2
    )
    opt = trainer.optimizers[0]
    flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    both = [torch.empty_like(flat) for _ in range(2)]
    dist.all_gather(both, flat)
    out["accumulate"] = {
        "frozen_at": opt.frozen_at,
        "num_steps": opt.num_steps,
        "global_step": trainer.global_step,
        "keys": probe.keys,
        "calls": probe.calls,
        "params_equal_across_ranks": bool(torch.equal(both[0], both[1])),
    }

    # quant_ddp: warm-up gradients compressed by QuantDDP's hook, nothing after the freeze
    from lightning_qcomm.strategies.quant_ddp import QuantDDPStrategy

    pl.seed_everything(0, verbose=False)
    module = _Module()
    probe = _PhaseProbe()
    trainer, ledger = _fit(
        rank,
        port,
        module,
        [OneBitAdamCallback(freeze_step=8), probe],
        strategy=QuantDDPStrategy(codec="uniform"),
        max_steps=24,
    )
    out["quant_ddp"] = {
        "loss": _full_loss(module),
        "keys": probe.keys,
        "comm_hook": probe.comm_hook,
        "grads": {k: (t.calls, t.wire_bytes, t.baseline_bytes) for k, t in ledger.cumulative.items()},
    }
    return out


def _cli_check(rank: int, outdir: str) -> dict:
    import sys

    from lightning_qcomm.callbacks import CommVolumeLogger
    from lightning_qcomm.cli import make_cli

    sys.argv = ["lightning-qcomm"]
    tiny = [
        "--trainer.max_steps=4",
        "--trainer.val_check_interval=4",
        "--trainer.limit_val_batches=1",
        "--trainer.num_sanity_val_steps=0",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        "--model.n_layer=1",
        "--model.n_head=2",
        "--model.n_embd=32",
        "--model.block_size=32",
        "--model.warmup_steps=2",
        "--data.block_size=32",
        "--data.batch_size=4",
        "--data.max_bytes=40000",
        f"--trainer.logger.init_args.save_dir={outdir}",
    ]
    import yaml

    cfg = yaml.safe_load((REPO / "configs" / "onebit_adam.yaml").read_text())
    (cb,) = [c for c in cfg["trainer"]["callbacks"] if c["class_path"] == "OneBitAdamCallback"]
    cb["init_args"]["freeze_step"] = 2  # both phases within the 4 steps
    path = Path(outdir) / f"onebit_adam_rank{rank}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg))
    cli = make_cli(["fit", "--config", str(path), *tiny])
    logger_cb = next(c for c in cli.trainer.callbacks if isinstance(c, CommVolumeLogger))
    onebit_cb = next(c for c in cli.trainer.callbacks if isinstance(c, OneBitAdamCallback))
    return {
        "global_step": cli.trainer.global_step,
        "frozen_at": onebit_cb.optimizer.frozen_at,
        "optimizer": type(cli.trainer.optimizers[0]).__name__,
        "totals": {
            f"{op}|{tag}": (t.calls, t.wire_bytes, t.baseline_bytes)
            for (op, tag), t in logger_cb.summary_totals.items()
        },
    }


def _local_sgd_is_rejected(rank: int, port: int) -> str | None:
    from lightning_qcomm.strategies.local_sgd import LocalSGDStrategy

    try:
        _fit(rank, port, _Module(), [OneBitAdamCallback()], strategy=LocalSGDStrategy(sync="constant"), max_steps=2)
    except ValueError as err:
        return str(err)
    return None


def _worker(rank: int, port: int, outdir: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    from datetime import timedelta

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), NODE_RANK="0")
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=120))
    _install_counter()
    res = {"torch": _torch_ddp_checks(rank)}
    res.update(_lightning_checks(rank, port, os.path.join(outdir, "ckpt")))
    res["cli"] = _cli_check(rank, os.path.join(outdir, "cli"))
    res["local_sgd_error"] = _local_sgd_is_rejected(rank, port)  # last: it ends a fit with an exception
    write_rank_result(outdir, rank, res, "rank{rank}.pkl")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    keep = tmp_path_factory.mktemp("onebit_ckpt")
    with tempfile.TemporaryDirectory() as d:
        spawn(_worker, free_port(), d, nprocs=2)
        out = rank_results(d, 2, "rank{rank}.pkl")
        shutil.copy(os.path.join(d, "ckpt", "onebit.ckpt"), keep / "onebit.ckpt")
    out[0]["ckpt_copy"] = keep / "onebit.ckpt"  # the 2-rank compression-phase checkpoint, for a 1-rank resume
    return out


# ---------------------------------------------------------------------------------------------- 2-rank tests
def test_torch_ddp_no_gradient_allreduce_after_freeze(results):
    for r in results:
        t = r["torch"]
        for step in range(3):  # warm-up: the hook all-reduces the gradient bucket(s), nothing else
            assert t["calls"][step] and set(t["calls"][step]) == {"all_reduce"}, (step, t["calls"][step])
            assert t["records"][step] == [("all_reduce", "grads")]
        n = t["n_buckets"]
        assert n == 2, "the layout (2048 | 64 + 512 + 8 elements, bucket 600) must give two fused buckets"
        for step in range(3, 6):  # compression: per bucket one all_to_all_single + one all_gather; the only
            calls = t["calls"][step]  # all_reduce is the 8-byte "all gradients finite" agreement (tag control)
            assert calls.count("all_reduce") == 1, (step, calls)
            assert calls.count("all_to_all_single") == n
            assert ("all_reduce", "grads") not in t["records"][step]
            assert ("all_reduce", "momentum") in t["records"][step] and ("all_reduce", "control") in t["records"][step]
        assert t["params_equal_across_ranks"]


def test_torch_ddp_first_compressed_step_equals_oracle(results):
    for r in results:
        assert r["torch"]["oracle_err"] < 1e-6, r["torch"]["oracle_err"]
        assert r["torch"]["param_err"] < 1e-6, r["torch"]["param_err"]


def test_nan_gradient_on_one_rank_skips_the_step_on_both(results):
    for r in results:
        assert r["torch"]["skip_untouched"] and r["torch"]["skip_counted"] == 1


def test_nan_gradient_on_one_rank_stays_nonfinite_on_both_when_propagated(results):
    for r in results:
        t = r["torch"]
        assert t["nan_momentum_nonfinite"] and t["nan_param_nonfinite"]
        assert t["nan_errors_finite"]
    # rank 0's NaN sits in scale block 0 (elements 0..255; the default scale_block=256) of chunk 0 (0..1023) of bucket
    # 0 (2048 elements): there its worker error keeps the previous residual instead of absorbing NaN; the other
    # blocks, of the same chunk and of chunk 1, are finite and their residuals move on
    before, after = results[0]["torch"]["nan_errors"]
    assert torch.equal(before[:256], after[:256])
    assert not torch.equal(before[256:1024], after[256:1024])
    assert not torch.equal(before[1024:], after[1024:])


def test_auto_freeze_uses_the_max_over_ranks_and_freezes_both_at_once(results):
    a0, a1 = results[0]["torch"]["auto"], results[1]["torch"]["auto"]
    # the setup discriminates: alone, the ranks would freeze at different steps (rank 0 first)
    assert a0["local_frozen_at"] is not None and a1["local_frozen_at"] is not None
    assert a0["local_frozen_at"] < a1["local_frozen_at"], (a0["local_frozen_at"], a1["local_frozen_at"])
    # together: the same r on both ranks (the max), one freeze step, not before the later rank is stable
    assert a0["changes"] == a1["changes"]
    assert a0["frozen_at"] == a1["frozen_at"] is not None
    assert a1["local_frozen_at"] <= a0["frozen_at"] < AUTO_STEPS and a0["frozen_at"] % 2 == 0
    ch = a0["changes"]
    assert ch[0] == pytest.approx(1.0)  # the first check compares with nothing: r = 1, never "stable"
    assert ch[-1] < 0.3 and ch[-2] < 0.3  # the two checks that froze it
    assert len(ch) == 2 or ch[-3] >= 0.3, ch
    # the 8-byte max is booked as "control" (one per check), never as "momentum" or "grads"
    for a in (a0, a1):
        assert a["ledger_keys"] == {("all_reduce", "control", 8)}, a["ledger_keys"]
        assert a["control_calls"] == a["n_checks"]


def test_lightning_callback_replaces_adamw_and_switches_phase(results):
    for r in results:
        ob = r["onebit"]
        assert ob["optimizer"] == "OneBitAdam" and ob["sched_optimizer_is_new"]
        assert ob["groups"] == [(LR, 0.05, True), (LR, 0.0, True)]  # the LambdaLR reached lr = LR, decay per group
        assert ob["frozen_at"] == FREEZE
        assert ob["comm_hook"] == "onebit_adam_grad_hook" and ob["require_backward_grad_sync"] is False
        for step, (keys, calls) in enumerate(zip(ob["keys"], ob["calls"])):
            if step < FREEZE:  # warm-up: the fp32 gradient all-reduce through our hook, recorded as grads
                assert keys == [("all_reduce", "grads")] and set(calls) == {"all_reduce"}, (step, keys, calls)
            else:  # compression: no gradient bytes; one fused bucket -> one all_to_all + one all_gather
                assert ("all_reduce", "grads") not in keys and ("all_reduce", "momentum") in keys, (step, keys)
                assert calls.count("all_to_all_single") == 1, (step, calls)
                # the step that ends a variance-refresh window (every REFRESH compressed steps) adds its one bf16
                # all_reduce, tagged "variance"
                refresh = (step + 1 - FREEZE) % REFRESH == 0
                assert (("all_reduce", "variance") in keys) == refresh, (step, keys)
                if step == FREEZE:  # the first one runs inline: the 8-byte agreement that every local gradient is
                    # finite is its one all_reduce
                    assert calls.count("all_reduce") == 1 and ("all_reduce", "control") in keys, (step, calls)
                else:  # overlapped (tests/adapters/test_onebit_overlap.py): the verdict is read from the averaged momentum
                    assert calls.count("all_reduce") == refresh and ("all_reduce", "control") not in keys, (step, calls)
        assert ob["params_equal_across_ranks"]


def test_lightning_ledger_bytes_per_phase(results):
    """fp32 grads during warm-up (ratio 1), then momentum at ceil(c/8) + 4 ceil(c/256) B per chunk of c = ceil(d/2)
    elements (the default scale_block=256): ~1/32 (1 + 32/256) of fp32."""
    from lightning_qcomm.collectives.wire_bytes import wire_bytes_formula

    d = sum(p.numel() for p in _net().parameters())
    totals = results[0]["onebit"]["totals"]
    calls, wire, base = totals[("all_reduce", "grads")]
    assert calls == FREEZE and wire == base == FREEZE * 2 * (2 - 1) / 2 * 4 * d
    calls, wire, base = totals[("all_reduce", "momentum")]
    assert calls == STEPS - FREEZE
    assert wire == (STEPS - FREEZE) * wire_bytes_formula("onebit_all_reduce", d, 2, onebit_block_numel=256)
    assert 1 / 29 < wire / base < 1 / 27, wire / base
    # the variance refresh: one bf16 all-reduce of the d window sums every REFRESH compressed steps
    calls, wire, _ = totals[("all_reduce", "variance")]
    assert calls == (STEPS - FREEZE) // REFRESH and wire == calls * 2 * (2 - 1) / 2 * 2 * d


def test_lightning_loss_decreases_and_is_near_ddp_adamw(results):
    """48 steps (16 warm-up), same seed/data: measured 1.1624 vs DDP+AdamW 1.1601 (+0.2%).

    The 3% band is empirical (about 15x the measured gap), not derived from the math: it only catches a
    broken compression phase (e.g. a wrong step size), which moves the loss by far more.
    """
    r0 = results[0]
    assert r0["onebit"]["loss"] < 0.7 * r0["init_loss"]
    assert abs(r0["onebit"]["loss"] - r0["ddp_loss"]) / r0["ddp_loss"] < 0.03, (r0["onebit"]["loss"], r0["ddp_loss"])
    losses = r0["onebit"]["losses"]
    assert sum(losses[-8:]) / 8 < sum(losses[:8]) / 8


def test_lightning_resume_restores_per_rank_state_and_reproduces_run(results):
    for rank, r in enumerate(results):
        res = r["resume"]
        assert res["errors_equal"], f"rank {rank}: restored error buffers differ from the saved ones"
        assert res["frozen"] and res["v_equal"] and res["sync_off"]
        assert res["window_equal"], f"rank {rank}: restored variance-refresh window sums differ from the saved ones"
        for p, q in zip(res["params"], r["onebit"]["params"]):
            assert torch.equal(p, q), "the resumed run must end bit-identical to the uninterrupted one"
    assert results[0]["saved_errors_differ_between_ranks"], "error buffers are per rank"
    assert results[0]["saved_windows_differ_between_ranks"], "the variance-refresh window sums are per rank"
    assert results[0]["saved"]["rank_state"]["worker_error"] is not None
    assert results[0]["resume"]["ckpt_world"] == 2


def test_gradient_accumulation_syncs_last_micro_batch_in_warmup_and_nothing_after(results):
    """accumulate_grad_batches=2, freeze after 4 of 8 optimizer steps (16 micro-batches)."""
    for r in results:
        a = r["accumulate"]
        assert (a["frozen_at"], a["num_steps"], a["global_step"]) == (4, 8, 8)
        assert len(a["keys"]) == 16
        for i, (keys, calls) in enumerate(zip(a["keys"], a["calls"])):
            step, last = i // 2, i % 2 == 1
            if not last:  # accumulating micro-batch: DDP's no_sync, no optimizer step
                assert keys == [] and calls == [], (i, keys, calls)
            elif step < 4:  # warm-up step: the accumulated gradient all-reduced once, fp32
                assert keys == [("all_reduce", "grads")] and set(calls) == {"all_reduce"}, (i, keys, calls)
            else:  # compression step: momentum (+ the one-off shape check, an all_gather, at the first) and the
                # 8-byte non-finite agreement
                assert ("all_reduce", "momentum") in keys and {t for _, t in keys} == {"momentum", "control"}, (i, keys)
                assert calls.count("all_reduce") == 1, (i, calls)
        assert a["params_equal_across_ranks"]


def test_resume_with_another_world_size_restarts_error_buffers(results, tmp_path):
    """The 2-rank checkpoint resumed by one process: m, v̂, freeze step restored; error buffers at zero (warned)."""
    seen = {}

    class StartProbe(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            opt = trainer.optimizers[0]
            seen["state"] = (opt.frozen_at, opt.num_steps, opt.rank_state_dict()["worker_error"])

    cb = OneBitAdamCallback(freeze_step=FREEZE)
    trainer = _trainer(tmp_path, [cb, StartProbe()], max_steps=RESUME_AT + 2)
    with pytest.warns(UserWarning, match="written by 2 ranks, now 1; they restart at zero"):
        trainer.fit(_Module(), ckpt_path=results[0]["ckpt_copy"])
    assert seen["state"] == (FREEZE, RESUME_AT, None)
    assert cb.optimizer.num_steps == RESUME_AT + 2 and cb.optimizer._sync.worker_error is not None


def test_user_onebit_optimizer_is_kept(results):
    for r in results:
        assert r["user_onebit"]["frozen_at"] == 8


def test_quant_ddp_warmup_compressed_then_no_gradient_traffic(results):
    q = results[0]["quant_ddp"]
    assert q["comm_hook"] == "quant_ddp_comm_hook"
    calls, wire, base = q["grads"][("all_reduce", "grads")]
    # 8 warm-up steps x 2 all-reduces (weights as 8-bit uniform codes, biases < min_quant_numel in fp32)
    assert calls == 2 * 8 and wire < 0.5 * base
    for step, keys in enumerate(q["keys"]):
        assert (("all_reduce", "grads") in keys) == (step < 8), (step, keys)
    assert q["loss"] < 0.8 * results[0]["init_loss"]


def test_cli_config_runs_both_phases(results):
    for r in results:
        cli = r["cli"]
        assert cli["global_step"] == 4 and cli["frozen_at"] == 2 and cli["optimizer"] == "OneBitAdam"
        calls, wire, base = cli["totals"]["all_reduce|grads"]
        assert calls == 2 * 2 and wire == base  # 2 warm-up steps x 2 ranks, fp32
        calls, wire, base = cli["totals"]["all_reduce|momentum"]
        assert calls == 2 * 2 and base / 29 < wire < base / 28  # 1/32 (1 + 32/256): one fp32 scale per 256


def test_strategy_without_ddp_wrapper_is_rejected(results):
    for r in results:
        msg = r["local_sgd_error"]
        assert msg and "LocalSGDStrategy does not wrap the model in DistributedDataParallel" in msg
        assert "allowed strategies" in msg


def test_callback_rejects_other_optimizers_and_clashing_settings(tmp_path):
    """One process (world of one): SGD is refused; a OneBitAdam with another freeze_step clashes; manual
    optimization is refused (Lightning would turn DDP's gradient sync back on after each forward); a
    scheduler holding the old optimizer outside ``.optimizer`` is refused."""
    for module, cb, needle in (
        (_Module("sgd"), OneBitAdamCallback(), "allowed: torch.optim.Adam, torch.optim.AdamW"),
        (_Module("onebit", freeze_step=8), OneBitAdamCallback(freeze_step=9), "freeze_step=9 vs the optimizer's 8"),
        (_ManualModule(), OneBitAdamCallback(), "automatic_optimization=False; allowed: True"),
        (_Module(sched="holding"), OneBitAdamCallback(), "_HoldingLR holds the replaced optimizer in held"),
    ):
        with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
            _trainer(tmp_path, [cb], max_steps=1).fit(module)


class _LrProbe(pl.Callback):
    def __init__(self) -> None:
        self.lrs: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])


@pytest.mark.parametrize("sched", ["sequential", "chained"])
def test_nested_lr_schedulers_drive_the_new_optimizer(tmp_path, sched):
    """SequentialLR / ChainedScheduler step inner schedulers: those must move to the OneBitAdam too."""
    steps = 10
    dummy = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=LR)
    ref = _scheduler(dummy, sched)
    expect = []
    for _ in range(steps):
        expect.append(dummy.param_groups[0]["lr"])
        dummy.step()
        ref.step()
    assert len(set(expect)) == steps  # the schedule changes the lr at every step
    probe = _LrProbe()
    module = _Module(sched=sched, adamw_kw={"foreach": True})
    with pytest.warns(UserWarning, match="AdamW asked for foreach=True; OneBitAdam has one implementation"):
        _trainer(tmp_path, [OneBitAdamCallback(freeze_step=4), probe], max_steps=steps).fit(module)
    assert probe.lrs == pytest.approx(expect, rel=1e-12)


def test_checkpoint_loaded_by_validate_is_not_applied_to_a_later_fit(tmp_path):
    """validate(ckpt_path=X) then fit(): X's error buffers must not reach the new fit's optimizer."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    mc = ModelCheckpoint(dirpath=tmp_path, filename="x", every_n_train_steps=4, save_top_k=-1)
    _trainer(tmp_path, [OneBitAdamCallback(freeze_step=2), mc], 4, enable_checkpointing=True).fit(_ValModule())
    ckpt = tmp_path / "x.ckpt"
    assert rank_files.read_all(ckpt)[0][CHECKPOINT_KEY]["worker_error"] is not None  # rank 0's side file
    seen = {}

    class StartProbe(pl.Callback):  # after the OneBitAdamCallback: sees what it handed the optimizer
        def on_train_start(self, trainer, pl_module):
            seen["worker_error"] = trainer.optimizers[0].rank_state_dict()["worker_error"]

    trainer = _trainer(tmp_path, [OneBitAdamCallback(freeze_step=2), StartProbe()], 1, limit_val_batches=1)
    module = _ValModule()
    trainer.validate(module, ckpt_path=ckpt, verbose=False)
    trainer.fit(module)
    assert "worker_error" in seen and seen["worker_error"] is None


def test_callback_rejects_fp16_grad_scaler(tmp_path):
    from lightning.pytorch.plugins.precision import MixedPrecision

    scaler = torch.amp.GradScaler("cpu")  # what 16-mixed brings on CUDA; on CPU Lightning adds none itself
    trainer = _trainer(
        tmp_path, [OneBitAdamCallback()], max_steps=1, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)]
    )
    with pytest.raises(ValueError, match="GradScaler"):
        trainer.fit(_Module())


def test_single_device_trains_both_phases(tmp_path):
    """World of one without DDP: the callback still swaps the optimizer and the 1-bit round trip runs."""
    pl.seed_everything(0, verbose=False)
    module = _Module()
    cb = OneBitAdamCallback(freeze_step=4)
    trainer = _trainer(tmp_path, [cb], max_steps=12)
    init = _full_loss(module)
    trainer.fit(module)
    assert cb.optimizer.frozen_at == 4 and cb.optimizer.num_steps == 12
    assert _full_loss(module) < init


def test_rank_state_with_another_layout_resets_with_a_warning(caplog):
    torch.manual_seed(0)
    model = _net()
    opt = OneBitAdam(model.parameters(), freeze_step=1, bucket_mb=0.001)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, N_FEAT)).sum().backward()
        opt.step()
    saved = opt.rank_state_dict()
    same = OneBitAdam(model.parameters(), freeze_step=1, bucket_mb=0.001)
    same.load_state_dict(opt.state_dict())
    same.load_rank_state_dict(saved)
    other = OneBitAdam(model.parameters(), freeze_step=1, bucket_mb=1.0)
    other.load_state_dict(opt.state_dict())
    other.load_rank_state_dict(saved)
    for o in (same, other):
        o.zero_grad()
        model(torch.randn(8, N_FEAT)).sum().backward()
        with caplog.at_level("WARNING", logger="lightning_qcomm.optim.onebit_adam"):
            o.step()
    assert len(same._sync.buckets) > 1 and len(other._sync.buckets) == 1
    assert "restart at zero" in caplog.text and caplog.text.count("restart at zero") == 1
