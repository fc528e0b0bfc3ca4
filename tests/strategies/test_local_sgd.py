"""LocalSGDStrategy (Lightning, 2 CPU ranks over gloo) and the TensorAverager adapter.

Lightning runs on 2 ranks, each rank writing what it saw to files the test compares. Runs A and B share one pair
of ranks from the tests' harness (``_launch.spawn``), where each ``Trainer`` runs in-process as Lightning runs
processes created externally; run C goes through Lightning's own spawn launcher (``start_method="spawn"``), and
run D through the harness too:

* run A -- QSR driven by a cosine LambdaLR scheduler, AdamW, BatchNorm, validation and a checkpoint
  every epoch: parameters equal on both ranks right after every sync and at validation (and *not*
  equal between syncs), zero collectives inside steps that do not sync, syncs exactly where the
  pure schedule predicts from the lrs the scheduler produced.
* run B -- resumes run A from its mid-training checkpoint (mid-round): same later sync steps and the
  same final parameters on both ranks (needs the schedule state and each rank's own optimizer state).
* run C -- constant period, SGD with momentum; inside the same workers torch's ``PeriodicModelAverager``
  trains a second copy on the same shards: same parameters after N steps. Ledger bytes checked too.
"""

from __future__ import annotations

import math
import os

import lightning as L
import pytest
import torch
import torch.distributed as dist
from _launch import free_port, lightning_env, rank_results, spawn, write_rank_result
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_qcomm.comm.ledger import CommLedger, set_ledger
from lightning_qcomm.parallel import rank_files
from lightning_qcomm.parallel.sync_rules import QSRRule, simulate
from lightning_qcomm.strategies.local_sgd import LocalSGDStrategy, register_local_sgd_strategies

STEPS_PER_EPOCH = 8  # 64 samples / 2 ranks / batch 4
EPOCHS = 4
TOTAL = STEPS_PER_EPOCH * EPOCHS
WARMUP = 4
PEAK_LR = 0.05
QSR_KW = dict(sync="qsr", h_base=2, alpha=0.08, power=2.0, warmup_steps=WARMUP, max_period=6)  # binds from step 17


def lr_factor(t: int) -> float:
    """Linear warmup over WARMUP steps, then cosine to 0 at TOTAL (factor of the lr step t uses)."""
    if t < WARMUP:
        return (t + 1) / WARMUP
    return 0.5 * (1 + math.cos(math.pi * (t - WARMUP) / (TOTAL - WARMUP)))


def make_data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=g)
    y = x @ torch.linspace(-1, 1, 8) + 0.1 * torch.randn(64, generator=g)
    return TensorDataset(x, y)


def make_net(bn: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    mid = [torch.nn.BatchNorm1d(16)] if bn else []
    return torch.nn.Sequential(torch.nn.Linear(8, 16), *mid, torch.nn.Tanh(), torch.nn.Linear(16, 1))


class Regressor(L.LightningModule):
    def __init__(self, bn: bool, optim: str) -> None:
        super().__init__()
        self.net = make_net(bn)
        self.optim = optim

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x).squeeze(-1), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x).squeeze(-1), y))

    def configure_optimizers(self):
        if self.optim == "sgd":
            return torch.optim.SGD(self.parameters(), lr=PEAK_LR, momentum=0.9)
        opt = torch.optim.AdamW(self.parameters(), lr=PEAK_LR, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        return DataLoader(make_data(), batch_size=4)

    def val_dataloader(self):
        return DataLoader(make_data(), batch_size=16)


COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_to_all_single",
    "broadcast",
    "reduce_scatter_tensor",
    "gather",
    "gather_object",
    "all_gather_object",
    "broadcast_object_list",
    "barrier",
)
_CALLS: list[str] = []


def _install_collective_counter() -> None:
    if getattr(dist, "_lsgd_counted", False):
        return
    for name in COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is None:
            continue

        def counted(*args, __fn=fn, __name=name, **kwargs):
            _CALLS.append(__name)
            return __fn(*args, **kwargs)

        setattr(dist, name, counted)
    dist._lsgd_counted = True


def flat_params(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in module.parameters()])


def flat_buffers(module: torch.nn.Module) -> torch.Tensor:
    bufs = [b.detach().reshape(-1).clone() for b in module.buffers() if b.is_floating_point()]
    return torch.cat(bufs) if bufs else torch.zeros(0)


def flat_optimizer_state(optimizers) -> torch.Tensor:
    vals = [
        v.detach().reshape(-1).clone()
        for opt in optimizers
        for group in opt.param_groups
        for p in group["params"]
        for _, v in sorted(opt.state.get(p, {}).items())
        if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() >= 1
    ]
    return torch.cat(vals) if vals else torch.zeros(0)


class Recorder(L.Callback):
    """Runs in every worker; writes ``{out}/{tag}_rank{r}.pt``."""

    def __init__(self, out: str, tag: str, reference_period: int = 0) -> None:
        self.out, self.tag, self.reference_period = out, tag, reference_period
        self.rec: dict = {"sync_steps": [], "sync_params": {}, "sync_buffers": {}, "sync_calls": {}, "lrs": {}}
        self.rec["sync_optstate"] = {}
        self.rec.update({"nonsync_calls": {}, "nonsync_params": {}, "val_params": {}, "val_buffers": {}})
        self._start = 0
        self._syncs = 0

    def setup(self, trainer, pl_module, stage):
        _install_collective_counter()
        set_ledger(CommLedger())

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        step = trainer.global_step
        self.rec["lrs"][step] = max(g["lr"] for opt in trainer.optimizers for g in opt.param_groups)
        self._start = len(_CALLS)
        self._syncs = trainer.strategy.num_syncs

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        calls = _CALLS[self._start :]
        step = trainer.global_step  # optimizer steps completed, this one included
        if trainer.strategy.num_syncs != self._syncs:
            self.rec["sync_steps"].append(step)
            self.rec["sync_params"][step] = flat_params(pl_module)
            self.rec["sync_buffers"][step] = flat_buffers(pl_module)
            self.rec["sync_calls"][step] = list(calls)
            self.rec["sync_optstate"][step] = flat_optimizer_state(trainer.optimizers)
        else:
            self.rec["nonsync_calls"][step] = list(calls)
            self.rec["nonsync_params"][step] = flat_params(pl_module)

    def on_validation_epoch_start(self, trainer, pl_module):
        if trainer.sanity_checking:
            return
        self.rec["val_params"][trainer.global_step] = flat_params(pl_module)
        self.rec["val_buffers"][trainer.global_step] = flat_buffers(pl_module)

    def on_fit_end(self, trainer, pl_module):
        from lightning_qcomm.comm.ledger import get_ledger

        self.rec["final_params"] = flat_params(pl_module)
        self.rec["numel"] = sum(p.numel() for p in pl_module.parameters())
        self.rec["ledger"] = {k: (v.calls, v.payload_bytes) for k, v in get_ledger().cumulative.items()}
        self.rec["ledger_wire"] = {k: (v.wire_bytes, v.baseline_bytes) for k, v in get_ledger().cumulative.items()}
        self.rec["num_syncs"] = trainer.strategy.num_syncs
        self.rec["num_forced_syncs"] = trainer.strategy.num_forced_syncs
        if self.reference_period:
            self.rec["reference_params"] = self._torch_reference(trainer)
        torch.save(self.rec, os.path.join(self.out, f"{self.tag}_rank{trainer.global_rank}.pt"))

    def _torch_reference(self, trainer) -> torch.Tensor:
        """Same model, data shard, SGD and period with torch's PeriodicModelAverager (process group reused).

        PeriodicModelAverager averages on its 0-based call index s when s >= warmup_steps and
        (s - warmup_steps) % period == 0; warmup_steps = period - 1 makes that "after optimizer steps
        period, 2*period, ...", the constant-period Local SGD schedule."""
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

        p = self.reference_period
        net = make_net(bn=False)
        opt = torch.optim.SGD(net.parameters(), lr=PEAK_LR, momentum=0.9)
        averager = PeriodicModelAverager(period=p, warmup_steps=p - 1)
        from torch.utils.data import DistributedSampler

        # Lightning gives training loaders DistributedSampler(shuffle=True, seed=$PL_GLOBAL_SEED or 0) and
        # calls set_epoch(epoch); reuse the seed of the sampler the run actually had.
        data = make_data()
        seed = trainer.train_dataloader.sampler.seed
        sampler = DistributedSampler(data, num_replicas=trainer.world_size, rank=trainer.global_rank, seed=seed)
        batches = []
        for epoch in range(math.ceil(trainer.global_step / STEPS_PER_EPOCH)):
            sampler.set_epoch(epoch)
            idx = torch.tensor(list(sampler))
            batches += [data[idx[i : i + 4]] for i in range(0, len(idx), 4)]
        for step in range(trainer.global_step):
            bx, by = batches[step]
            opt.zero_grad()
            torch.nn.functional.mse_loss(net(bx).squeeze(-1), by).backward()
            opt.step()
            averager.average_parameters(net.parameters())
        return flat_params(net)


def _trainer(strategy, callbacks, root: str, **kw) -> L.Trainer:
    return L.Trainer(
        default_root_dir=root,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        **kw,
    )


def _load(out, tag):
    return [torch.load(os.path.join(out, f"{tag}_rank{r}.pt"), weights_only=False) for r in range(2)]


def _run_qsr(out: str) -> None:
    """Run A (full) and run B (resumed from A's epoch-1 checkpoint, step 16), one after the other."""
    ckpt_dir = os.path.join(out, "ckpt")
    ckpt = ModelCheckpoint(
        dirpath=ckpt_dir, filename="{epoch}-{step}", save_top_k=-1, every_n_epochs=1, save_on_train_epoch_end=True
    )
    strategy = LocalSGDStrategy(**QSR_KW)
    _trainer(strategy, [Recorder(out, "A"), ckpt], out, max_epochs=EPOCHS, limit_val_batches=1).fit(
        Regressor(bn=True, optim="adamw")
    )
    strategy = LocalSGDStrategy(**QSR_KW)
    _trainer(strategy, [Recorder(out, "B")], out, max_epochs=EPOCHS, limit_val_batches=1).fit(
        Regressor(bn=True, optim="adamw"), ckpt_path=_resume_path(out)
    )


def _run_post_local(out: str) -> None:
    """Run D: post_local from step 3, period 2, 8-bit codes, AdamW moments averaged too."""
    strategy = LocalSGDStrategy(
        sync="post_local", switch_step=3, period=2, codec="uniform", bits=8, average_optimizer_state=True
    )
    _trainer(strategy, [Recorder(out, "D")], out, max_steps=9, limit_val_batches=0).fit(
        Regressor(bn=True, optim="adamw")
    )


_RUNS = {"qsr": _run_qsr, "post_local": _run_post_local}


def _fit_worker(rank: int, port: int, out: str, run: str) -> None:
    """``_RUNS[run]`` on this rank: its Trainers see the launcher's variables and run in-process."""
    os.environ.update(lightning_env(rank, 2, port))
    torch.set_num_threads(1)
    _RUNS[run](out)


def _resume_path(out: str) -> str:
    return os.path.join(out, "ckpt", f"epoch=1-step={2 * STEPS_PER_EPOCH}.ckpt")


@pytest.fixture(scope="module")
def qsr_runs(tmp_path_factory):
    """Run A (full) and run B (resumed from A's epoch-1 checkpoint, step 16)."""
    out = str(tmp_path_factory.mktemp("lsgd"))
    spawn(_fit_worker, free_port(), out, "qsr", nprocs=2)
    resume_from = _resume_path(out)
    loaded = torch.load(resume_from, weights_only=False)
    loaded["side_files"] = rank_files.read_all(resume_from)  # each rank's own state, beside the checkpoint
    return _load(out, "A"), _load(out, "B"), loaded


@pytest.mark.slow
def test_qsr_syncs_follow_schedule_driven_by_lr_scheduler(qsr_runs):
    (a0, a1), _, _ = qsr_runs
    assert a0["lrs"] == a1["lrs"]
    lrs = a0["lrs"]
    assert sorted(lrs) == list(range(TOTAL))
    assert lrs[0] == pytest.approx(PEAK_LR * lr_factor(0)) and lrs[20] == pytest.approx(PEAK_LR * lr_factor(20))
    rounds = simulate(QSRRule(2, 0.08, 2.0, WARMUP, max_period=6), TOTAL, lambda t: lrs[t])
    expected = [start + h for start, h in rounds]
    assert a0["sync_steps"] == expected == a1["sync_steps"]
    assert a0["num_syncs"] == len(expected)
    assert len({h for _, h in rounds}) >= 3, rounds  # H really moved with the lr
    assert expected[-1] == TOTAL  # ends on a sync


@pytest.mark.slow
def test_params_identical_after_sync_and_at_validation_diverged_between(qsr_runs):
    (a0, a1), _, _ = qsr_runs
    for step in a0["sync_steps"]:
        assert torch.equal(a0["sync_params"][step], a1["sync_params"][step]), step
        assert torch.equal(a0["sync_buffers"][step], a1["sync_buffers"][step]), step
    assert sorted(a0["val_params"]) == [STEPS_PER_EPOCH * (e + 1) for e in range(EPOCHS)]
    for step in a0["val_params"]:
        assert torch.equal(a0["val_params"][step], a1["val_params"][step]), step
        assert torch.equal(a0["val_buffers"][step], a1["val_buffers"][step]), step
    # Between syncs each rank trains on its own shard: the replicas must differ.
    diverged = [s for s in a0["nonsync_params"] if not torch.equal(a0["nonsync_params"][s], a1["nonsync_params"][s])]
    assert diverged == sorted(a0["nonsync_params"])
    # Validation at step 8, 16, 24 fell mid-round -> forced averages; 32 is a scheduled sync.
    assert a0["num_forced_syncs"] == sum(1 for s in a0["val_params"] if s not in a0["sync_steps"])


@pytest.mark.slow
def test_no_collective_between_syncs(qsr_runs):
    (a0, a1), _, _ = qsr_runs
    for rec in (a0, a1):
        assert rec["nonsync_calls"], "no local step recorded"
        assert all(calls == [] for calls in rec["nonsync_calls"].values()), rec["nonsync_calls"]
        for step, calls in rec["sync_calls"].items():
            assert calls and set(calls) <= {"all_reduce", "all_gather_into_tensor"}, (step, calls)
            assert calls.count("all_reduce") == 2, (step, calls)  # params + BatchNorm buffers
        tags = {tag for (_, tag) in rec["ledger"]}
        assert tags == {"param_average", "buffers"}, rec["ledger"]
        # B's ledger starts at the resume; A's covers the whole run.
    n_avg = len(a0["sync_steps"]) + a0["num_forced_syncs"]
    assert a0["ledger"][("all_reduce", "param_average")] == (n_avg, n_avg * a0["numel"] * 4)


@pytest.mark.slow
def test_resume_reproduces_sync_steps_and_parameters(qsr_runs):
    (a0, a1), (b0, b1), ckpt = qsr_runs
    resume_step = 2 * STEPS_PER_EPOCH
    state = ckpt["local_sgd"]["schedule"]
    assert state["step"] == resume_step and state["h"] is not None and state["steps_since_sync"] > 0  # mid-round
    per_rank = [entry["local_sgd"]["optimizer_states"][0] for entry in ckpt["side_files"]]
    assert len(per_rank) == 2
    assert not torch.equal(per_rank[0]["state"][0]["exp_avg"], per_rank[1]["state"][0]["exp_avg"])
    assert b0["sync_steps"] == [s for s in a0["sync_steps"] if s > resume_step] == b1["sync_steps"]
    assert b0["num_syncs"] == a0["num_syncs"]
    torch.testing.assert_close(b0["final_params"], a0["final_params"], rtol=0, atol=1e-6)
    torch.testing.assert_close(b1["final_params"], a1["final_params"], rtol=0, atol=1e-6)


@pytest.mark.slow
def test_constant_period_matches_torch_periodic_model_averager(tmp_path):
    period, steps = 3, 12
    strategy = LocalSGDStrategy(sync="constant", period=period, average_buffers=False, start_method="spawn")
    _trainer(
        strategy,
        [Recorder(str(tmp_path), "C", reference_period=period)],
        str(tmp_path),
        max_steps=steps,
        limit_val_batches=0,
    ).fit(Regressor(bn=False, optim="sgd"))
    for rec in _load(str(tmp_path), "C"):
        assert rec["sync_steps"] == [3, 6, 9, 12]
        # Float tolerance: AVG all-reduce vs pre-divide-then-SUM rounding, compounded over 12 steps.
        torch.testing.assert_close(rec["final_params"], rec["reference_params"], rtol=1e-5, atol=1e-6)
        assert not torch.equal(rec["final_params"], flat_params(make_net(bn=False)))  # it trained
        assert rec["ledger"][("all_reduce", "param_average")] == (4, 4 * rec["numel"] * 4)
        assert {tag for (_, tag) in rec["ledger"]} == {"param_average"}


@pytest.mark.slow
def test_post_local_quantized_with_optimizer_state(tmp_path):
    """post_local: data-parallel (gradient all-reduce) for 3 steps, then 8-bit quantized parameter averaging
    every 2 steps, with AdamW moments and BatchNorm buffers averaged too."""
    spawn(_fit_worker, free_port(), str(tmp_path), "post_local", nprocs=2)
    d0, d1 = _load(str(tmp_path), "D")
    assert d0["sync_steps"] == [1, 2, 3, 5, 7, 9] == d1["sync_steps"]
    for step in d0["sync_steps"]:
        assert torch.equal(d0["sync_params"][step], d1["sync_params"][step]), step
        assert torch.equal(d0["sync_buffers"][step], d1["sync_buffers"][step]), step
        assert d0["sync_optstate"][step].numel() > 0
        assert torch.equal(d0["sync_optstate"][step], d1["sync_optstate"][step]), step
    for step in (4, 6, 8):
        assert d0["nonsync_calls"][step] == [] and not torch.equal(
            d0["nonsync_params"][step], d1["nonsync_params"][step]
        )
    ledger = d0["ledger"]
    assert ledger[("all_reduce", "grads")][0] == 3  # one gradient bucket per data-parallel step
    assert ledger[("all_reduce", "param_average")][0] == 3 * 2  # 3 local rounds x (parameters + optimizer state)
    wire, baseline = d0["ledger_wire"][("all_reduce", "param_average")]
    assert wire < baseline  # the parameters travelled as 8-bit codes


# ---------------------------------------------------------------------- TensorAverager (plain torch.multiprocessing)


def _averager_worker(rank: int, port: int, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    from lightning_qcomm.codecs import get_codec
    from lightning_qcomm.collectives.averaging import TensorAverager

    ledger = CommLedger()
    set_ledger(ledger)
    g = torch.Generator().manual_seed(0)
    anchor = [torch.randn(1000, generator=g), torch.randn(37, generator=g), torch.randn(5, generator=g)]
    g_rank = torch.Generator().manual_seed(100 + rank)
    res = {}
    # Plain fp32 average, several buckets.
    xs = [a + 0.01 * torch.randn(a.shape, generator=g_rank) for a in anchor]
    plain = [x.clone() for x in xs]
    avg = TensorAverager(plain, None, bucket_numel=600, tag="param_average")
    avg.average(0)
    res["inputs"] = xs
    res["plain"] = plain
    res["plain_buckets"] = avg.num_buckets
    res["plain_ledger"] = {k: (v.calls, v.payload_bytes) for k, v in ledger.cumulative.items()}
    # Quantized (uniform 8 bit) average of the change since a common anchor.
    quant = [a.clone() for a in anchor]
    qavg = TensorAverager(quant, get_codec("uniform", bits=8, bucket_size=64), bucket_numel=600, seed=3, delta=True)
    with torch.no_grad():
        for q, x in zip(quant, xs):
            q.copy_(x)
    qavg.average(0)
    res["quant"] = quant
    write_rank_result(out, rank, res, "avg_rank{rank}.pt")
    dist.destroy_process_group()


def test_tensor_averager_plain_and_quantized(tmp_path):
    spawn(_averager_worker, free_port(), str(tmp_path), nprocs=2)
    r0, r1 = rank_results(tmp_path, 2, "avg_rank{rank}.pt")
    assert r0["plain_buckets"] == 2  # [1000] alone (over 600), [37 + 5] together
    for p0, p1, x0, x1 in zip(r0["plain"], r1["plain"], r0["inputs"], r1["inputs"]):
        assert torch.equal(p0, p1)
        torch.testing.assert_close(p0, (x0 + x1) / 2, rtol=0, atol=1e-7)
    numel = 1000 + 37 + 5
    assert r0["plain_ledger"][("all_reduce", "param_average")] == (2, numel * 4)
    for q0, q1, x0, x1 in zip(r0["quant"], r1["quant"], r0["inputs"], r1["inputs"]):
        assert torch.equal(q0, q1)  # every rank decodes the same bytes
        exact = (x0 + x1) / 2
        # Deltas lie within +-0.05 (0.01 * 5 sigma); two 8-bit stochastic-rounding stages, each off by < one unit
        # of its bucket range / 255 <= 0.1 / 255.
        bound = 2 * 0.1 / 255
        assert (q0 - exact).abs().max() <= bound
        # ... far below what quantizing the raw values (range ~ 6) would allow: the delta mode is in effect.
        assert (q0 - exact).abs().max() < 6 / 255 / 4


# ---------------------------------------------------------------------- construction, registry, errors


def test_registry_names_and_double_registration():
    from lightning.fabric.strategies.registry import _StrategyRegistry

    reg = _StrategyRegistry()
    register_local_sgd_strategies(reg)
    register_local_sgd_strategies(reg)  # no error the second time
    assert set(reg.available_strategies()) == {"local_sgd", "local_sgd_qsr"}
    assert reg["local_sgd_qsr"]["init_params"] == {"sync": "qsr"}
    s = reg.get("local_sgd")
    assert isinstance(s, LocalSGDStrategy) and s.sync == "constant"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"sync": "qsr", "alpha": 0.0}, "alpha"),
        ({"sync": "qsr", "alpha": -0.1}, "alpha"),
        ({"sync": "qsr", "h_base": 0}, "h_base"),
        ({"sync": "qsr", "power": 0.0}, "power"),
        ({"sync": "periodic"}, r"sync='periodic'\) is not allowed; allowed: qsr, constant, post_local"),
        ({"sync": "constant", "period": 0}, "period"),
        ({"sync": "post_local"}, "switch_step"),
        ({"sync": "qsr", "warmup_steps": -1}, "warmup_steps"),
        ({"sync": "qsr", "codec": "int3"}, "codec"),
        ({"sync": "qsr", "codec": "uniform", "bits": 12}, "bits"),
        ({"sync": "qsr", "comm_bucket_mb": 0}, "comm_bucket_mb"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LocalSGDStrategy(**kwargs)


def test_optimizer_without_lr_is_rejected_for_qsr():
    class NoLr(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, defaults={"rho": 0.9})

        def step(self, closure=None):
            return None

    s = LocalSGDStrategy(sync="qsr")
    s.optimizers = [NoLr([torch.nn.Parameter(torch.zeros(2))])]
    with pytest.raises(ValueError, match=r"param_groups\[0\] has lr=None"):
        s._check_optimizers_have_lr()
    LocalSGDStrategy(sync="constant")  # constant does not read the lr


def test_trainer_resolves_registered_name():
    from lightning.pytorch.strategies import StrategyRegistry

    register_local_sgd_strategies(StrategyRegistry)
    trainer = L.Trainer(strategy="local_sgd_qsr", accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, LocalSGDStrategy) and trainer.strategy.sync == "qsr"
