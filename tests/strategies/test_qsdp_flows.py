"""QSDP through every Trainer flow and precision, on 2 CPU ranks (gloo), in ONE spawn of two processes.

* flows on one Trainer: fit (ending in validation) -> validate -> validate -> test -> predict -> test;
  a second Trainer on the already-sharded module; resume from the sharded ``last.ckpt`` and from its
  consolidated single file; ``load_from_checkpoint`` of the consolidated file and of a full-state-dict save;
* Lightning's GAN pattern (manual optimization, two optimizers, ``toggle_optimizer``) against DDP;
* precisions {32-true, bf16-mixed, bf16-true, 16-mixed (Lightning maps it to bf16-mixed on CPU), 16-true}
  and a user's ``MixedPrecisionPolicy(param_dtype=bf16)`` without an fp32 ``reduce_dtype``;
* the reduce-scatter of bf16/fp16 gradient rows: raw segments (biases) come back as the exact sum;
* the warnings for settings with no effect (nothing quantized; one device).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import warnings

import lightning.pytorch as pl
import pytest
import torch
from _launch import free_port, rank_results, set_rank_env, spawn, write_rank_result
from torch import nn

from lightning_qcomm.strategies.qsdp import QSDPStrategy

N_SAMPLES, BATCH, N_CLS = 256, 16, 4  # per rank: 128 samples -> 8 optimizer steps per epoch
PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "16-mixed", "16-true")  # 16-mixed: bf16-mixed on CPU


def image_data(seed: int = 1234) -> torch.utils.data.TensorDataset:
    """1x8x8 Gaussian images labelled by the quadrant with the largest mean, 10% label noise."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N_SAMPLES, 1, 8, 8, generator=g)
    y = x.unfold(2, 4, 4).unfold(3, 4, 4).mean(dim=(-1, -2)).reshape(N_SAMPLES, N_CLS).argmax(dim=1)
    flip = torch.rand(N_SAMPLES, generator=g) < 0.1
    return torch.utils.data.TensorDataset(x, torch.where(flip, torch.randint(0, N_CLS, (N_SAMPLES,), generator=g), y))


def _loader(seed: int = 1234) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(image_data(seed), batch_size=BATCH, shuffle=False)


class FlowNet(pl.LightningModule):
    """Classifier with every step; ``offset`` (if ``root_param``) is held by the LightningModule itself, which
    makes the LightningModule an FSDP group (the root) whose forward brackets every step."""

    def __init__(self, hidden: int = 64, lr: float = 1e-2, root_param: bool = True, eps: float = 1e-8) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        if root_param:
            self.offset = nn.Parameter(torch.zeros(1, 1, 8, 8))
        else:
            self.register_buffer("offset", torch.zeros(1, 1, 8, 8), persistent=False)
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.Tanh(), nn.Linear(hidden, N_CLS))
        self.losses: list[float] = []

    def forward(self, x):
        return self.body(x + self.offset)

    def _loss(self, batch):
        x, y = batch
        return nn.functional.cross_entropy(self(x).float(), y)

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.losses.append(float(loss.detach()))
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self._loss(batch), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self(batch[0]).float()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, eps=self.hparams.eps, weight_decay=0.0)

    def train_dataloader(self):
        return _loader()

    def val_dataloader(self):
        return _loader(5)

    def test_dataloader(self):
        return _loader(6)

    def predict_dataloader(self):
        return _loader(7)


class FlowNetUserMP(FlowNet):
    """The user's own fully_shard with bf16 parameters and no reduce_dtype: gradients reduce in bf16."""

    def configure_model(self):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = self.device_mesh["data_parallel"]
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        fully_shard(self.body, mesh=mesh, mp_policy=policy)
        fully_shard(self, mesh=mesh, mp_policy=policy)


class GAN(pl.LightningModule):
    """Lightning's GAN example pattern: manual optimization, two optimizers, toggle_optimizer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(8, 64), nn.LeakyReLU(0.2), nn.Linear(64, 64))
        self.discriminator = nn.Sequential(nn.Linear(64, 64), nn.LeakyReLU(0.2), nn.Linear(64, 1))
        self.g_losses: list[float] = []
        self.d_losses: list[float] = []

    def forward(self, z):
        return self.generator(z)

    def training_step(self, batch, batch_idx):
        real = batch[0].flatten(1)
        opt_g, opt_d = self.optimizers()
        z = torch.randn(real.shape[0], 8, generator=torch.Generator().manual_seed(2 * batch_idx + self.global_rank))
        ones, zeros = torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)
        bce = nn.functional.binary_cross_entropy_with_logits

        self.toggle_optimizer(opt_g)
        g_loss = bce(self.discriminator(self(z)), ones)
        self.manual_backward(g_loss)
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)

        self.toggle_optimizer(opt_d)
        d_loss = (bce(self.discriminator(real), ones) + bce(self.discriminator(self(z).detach()), zeros)) / 2
        self.manual_backward(d_loss)
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)
        self.g_losses.append(float(g_loss.detach()))
        self.d_losses.append(float(d_loss.detach()))

    def configure_optimizers(self):
        kw = {"lr": 2e-3, "betas": (0.5, 0.999)}
        return [
            torch.optim.Adam(self.generator.parameters(), **kw),
            torch.optim.Adam(self.discriminator.parameters(), **kw),
        ]

    def train_dataloader(self):
        return _loader()


class RootGAN(GAN):
    """The GAN with a parameter of its own (``scale``, the LightningModule's: the root FSDP group) read
    directly in both phases of the manual step: after the generator's backward and step (FSDP2 reshards the
    root group at the end of each backward), and while toggled off for the discriminator's phase."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1, 64))

    def training_step(self, batch, batch_idx):
        real = batch[0].flatten(1)
        opt_g, opt_d = self.optimizers()
        z = torch.randn(real.shape[0], 8, generator=torch.Generator().manual_seed(2 * batch_idx + self.global_rank))
        ones, zeros = torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)
        bce = nn.functional.binary_cross_entropy_with_logits

        self.toggle_optimizer(opt_g)
        g_loss = bce(self.discriminator(self.generator(z) * self.scale), ones)
        self.manual_backward(g_loss)
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)

        self.toggle_optimizer(opt_d)  # scale is frozen now: no gradient may reach it
        fake = self.generator(z).detach() * self.scale
        d_loss = (bce(self.discriminator(real), ones) + bce(self.discriminator(fake), zeros)) / 2
        self.manual_backward(d_loss)
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)
        self.g_losses.append(float(g_loss.detach()))
        self.d_losses.append(float(d_loss.detach()))

    def configure_optimizers(self):
        kw = {"lr": 2e-3, "betas": (0.5, 0.999)}
        generator = [*self.generator.parameters(), self.scale]
        return [torch.optim.Adam(generator, **kw), torch.optim.Adam(self.discriminator.parameters(), **kw)]


# --------------------------------------------------------------------------- worker
def _trainer(world: int, strategy, **kw) -> pl.Trainer:
    args = dict(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    args.update(kw)
    return pl.Trainer(**args)


def _full_state(module) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _qsdp_warnings(records) -> list[str]:
    return [str(w.message) for w in records if "QSDP" in str(w.message)]


def _flows(rank, world, port, outdir, res, root_param=True):
    from lightning.pytorch.callbacks import ModelCheckpoint

    set_rank_env(rank, world, port)
    tag = "" if root_param else "_plain"
    ckdir = os.path.join(outdir, f"flows{tag}_ckpt")
    m = FlowNet(root_param=root_param)
    trainer = _trainer(world, "qsdp", enable_checkpointing=True, callbacks=[ModelCheckpoint(ckdir, save_last=True)])
    trainer.fit(m)  # its last step is the end-of-epoch validation, then the checkpoint
    out = {"val_fit": float(trainer.callback_metrics["val_loss"]), "fit_losses": list(m.losses)}
    out["val_1"] = trainer.validate(m, verbose=False)[0]["val_loss"]
    out["val_2"] = trainer.validate(m, verbose=False)[0]["val_loss"]
    out["test_1"] = trainer.test(m, verbose=False)[0]["test_loss"]
    preds = trainer.predict(m)
    out["pred_rows"] = sum(p.shape[0] for p in preds)
    out["pred_finite"] = all(bool(torch.isfinite(p).all()) for p in preds)
    out["test_2"] = trainer.test(m, verbose=False)[0]["test_loss"]
    full = _full_state(m)
    if trainer.global_rank == 0:
        torch.save(full, os.path.join(outdir, f"flows{tag}_ref.pt"))
    res[f"flows{tag}"] = out
    # a new Trainer on the module the first one sharded (and tore down): setup must take it as it is
    again = _trainer(world, QSDPStrategy(bits=8))
    again.fit(m)
    out["refit_losses"] = m.losses[len(out["fit_losses"]) :]
    out["refit_val"] = _trainer(world, QSDPStrategy(bits=8)).validate(m, verbose=False)[0]["val_loss"]


def _resume(rank, world, port, outdir, res):
    from lightning_qcomm.consolidate import consolidate_checkpoint

    set_rank_env(rank, world, port)
    last = os.path.join(outdir, "flows_ckpt", "last.ckpt")
    single = os.path.join(outdir, "flows_last_consolidated.ckpt")
    if rank == 0:
        consolidate_checkpoint(last, single)
    torch.distributed.barrier()
    for key, path in (("uninterrupted", None), ("from_dir", last), ("from_file", single)):
        m = FlowNet()
        trainer = _trainer(world, "qsdp", max_epochs=2, limit_val_batches=0)
        trainer.fit(m, ckpt_path=path)
        res[f"resume/{key}"] = {"losses": m.losses, "global_step": trainer.global_step}


def _full_ckpt(rank, world, port, outdir, res):
    from lightning.pytorch.callbacks import ModelCheckpoint

    set_rank_env(rank, world, port)
    m = FlowNet()
    ckdir = os.path.join(outdir, "full_ckpt")
    strategy = QSDPStrategy(bits=8, save_distributed_checkpoint=False)
    trainer = _trainer(world, strategy, enable_checkpointing=True, callbacks=[ModelCheckpoint(ckdir, save_last=True)])
    trainer.fit(m)
    full = _full_state(m)
    if trainer.global_rank == 0:
        torch.save(full, os.path.join(outdir, "full_ref.pt"))
    res["full_ckpt"] = {"is_file": os.path.isfile(os.path.join(ckdir, "last.ckpt"))}


def _gan(rank, world, port, res):
    ddp = "ddp_find_unused_parameters_true"
    for key, cls, strategy in (
        ("ddp", GAN, ddp),
        ("q32", GAN, QSDPStrategy(bits=32)),
        ("q8", GAN, "qsdp"),
        ("root_ddp", RootGAN, ddp),
        ("root_q32", RootGAN, QSDPStrategy(bits=32)),
    ):
        set_rank_env(rank, world, port)
        m = cls()
        before = {k: v.clone() for k, v in m.state_dict().items()}
        trainer = _trainer(world, strategy)
        trainer.fit(m)
        after = _full_state(m) if "ddp" not in key else m.state_dict()
        changed = {}
        if trainer.global_rank == 0:
            changed = {
                part: not torch.equal(after[f"{part}.0.weight"], before[f"{part}.0.weight"])
                for part in ("generator", "discriminator")
            }
        res[f"gan/{key}"] = {"g": m.g_losses, "d": m.d_losses, "changed": trainer.strategy.broadcast(changed)}


def _precisions(rank, world, port, res):
    # Adam's default eps=1e-8 is 0 in fp16 (whose smallest normal is 6e-5): 16-true then gives NaN from the
    # second step under plain DDP too; every row uses eps=1e-4, representable in all three dtypes. And lr 3e-3:
    # at 1e-2 pure-fp16 Adam (its v = g^2 underflows) is chaotic, so that changing only QSDP's seed moved the
    # epoch-2 loss by 3.4% (0.05% under fp32); at 3e-3 by 0.5%, which leaves the 2% band its meaning
    for precision in PRECISIONS:
        for kind, strategy in (("ddp", "ddp"), ("qsdp", "qsdp")):
            set_rank_env(rank, world, port)
            m = FlowNet(eps=1e-4, lr=3e-3)
            trainer = _trainer(world, strategy, precision=precision, max_epochs=2, limit_val_batches=0)
            trainer.fit(m)
            res[f"precision/{precision}/{kind}"] = {"losses": m.losses, "plugin": trainer.precision}
    set_rank_env(rank, world, port)
    m = FlowNetUserMP(eps=1e-4, lr=3e-3)
    trainer = _trainer(world, QSDPStrategy(bits=8), max_epochs=2, limit_val_batches=0)
    trainer.fit(m)
    res["precision/user_mp_bf16/qsdp"] = {"losses": m.losses}


def _reduce_scatter_dtypes(rank, world, res):
    """A quantized weight segment and a raw bias segment in one bf16/fp16/fp32 reduce-scatter: the bias
    comes back as the exact sum of the two ranks' rows (computed in fp32, rounded once), the weight
    within one quantization step of the other rank's bucket plus one rounding to the output dtype."""
    from lightning_qcomm.adapters.fsdp2.comms import ParamShard, QSDPCommState, QuantizedReduceScatter
    from lightning_qcomm.codecs import get_codec

    group = torch.distributed.group.WORLD
    codec = get_codec("uniform", bits=8, bucket_size=1024)
    params = [ParamShard(2048, 2048, 4096, 2, True), ParamShard(32, 32, 64, 1, True)]
    s_numel = 2080
    out = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        rows = {
            r: (torch.randn(world, s_numel, generator=torch.Generator().manual_seed(10 + r)) * (1 + r)).to(dtype)
            for r in range(world)
        }
        rs = QuantizedReduceScatter(codec, QSDPCommState(), 0, params, 1024)
        output = torch.empty(s_numel, dtype=dtype)
        try:
            rs(output, rows[rank].reshape(-1).clone(), group)
        except Exception as err:
            out[str(dtype)] = {"error": f"{type(err).__name__}: {err}"}
            torch.distributed.barrier()
            continue
        exact = sum(rows[r][rank].float() for r in range(world))
        other = [rows[r][rank].float() for r in range(world) if r != rank]
        step = sum(
            (o[:2048].view(2, 1024).amax(1) - o[:2048].view(2, 1024).amin(1)).repeat_interleave(1024) / 255
            for o in other
        )
        eps = torch.finfo(dtype).eps
        w_err = (output[:2048].float() - exact[:2048]).abs()
        out[str(dtype)] = {
            "bias_exact": bool(torch.equal(output[2048:], exact[2048:].to(dtype))),
            "weight_within_bound": bool((w_err <= step + eps * exact[:2048].abs() + 1e-6).all()),
            "weight_max_err_over_step": float((w_err / step).max()),
        }
    res["reduce_scatter"] = out


def _warn_cases(rank, world, port, res):
    for key, strategy in (
        ("min_quant_numel", QSDPStrategy(bits=8, min_quant_numel=10**9)),
        ("bits32", QSDPStrategy(bits=32)),
        ("quantizes", QSDPStrategy(bits=8)),
    ):
        set_rank_env(rank, world, port)
        with warnings.catch_warnings(record=True) as records:
            warnings.simplefilter("always")
            _trainer(world, strategy, limit_train_batches=2, limit_val_batches=0).fit(FlowNet())
        res[f"warn/{key}"] = _qsdp_warnings(records)


def _worker(rank: int, world: int, port: int, outdir: str) -> None:
    import traceback

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    import lightning_qcomm  # noqa: F401  (registers "qsdp")

    res: dict = {}
    for key, fn, args in (
        ("flows", _flows, (rank, world, port, outdir, res)),
        ("flows_plain", _flows, (rank, world, port, outdir, res, False)),
        ("reduce_scatter", _reduce_scatter_dtypes, (rank, world, res)),
        ("resume", _resume, (rank, world, port, outdir, res)),
        ("full_ckpt", _full_ckpt, (rank, world, port, outdir, res)),
        ("gan", _gan, (rank, world, port, res)),
        ("precisions", _precisions, (rank, world, port, res)),
        ("warn", _warn_cases, (rank, world, port, res)),
    ):
        try:
            fn(*args)
        except Exception as err:  # recorded; both ranks fail alike (setup) or the spawn reports the crash
            res[f"error/{key}"] = f"{type(err).__name__}: {err}\n{traceback.format_exc()[-3000:]}"
    write_rank_result(outdir, rank, res)


def _single_worker(rank: int, port: int, outdir: str) -> None:
    """World size 1: QSDP communicates nothing, which it says once."""
    torch.set_num_threads(1)
    import lightning_qcomm  # noqa: F401

    set_rank_env(rank, 1, port)
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        _trainer(1, QSDPStrategy(bits=8), limit_train_batches=2, limit_val_batches=0).fit(FlowNet())
    with open(os.path.join(outdir, "single.json"), "w") as f:
        json.dump({"warnings": _qsdp_warnings(records)}, f)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    outdir = tmp_path_factory.mktemp("qsdp_flows")
    os.environ["OMP_NUM_THREADS"] = "1"
    spawn(_worker, 2, free_port(), str(outdir), nprocs=2)
    return outdir, rank_results(outdir, 2)


def _no_errors(ranks: list[dict], key: str) -> None:
    for r in ranks:
        assert f"error/{key}" not in r, r[f"error/{key}"]


def _epoch(losses: list[float], epoch: int, steps: int = 8) -> float:
    """Mean loss of one epoch (every epoch sees the same batches, so batch noise cancels)."""
    return sum(losses[epoch * steps : (epoch + 1) * steps]) / steps


# --------------------------------------------------------------------------- flows
@pytest.mark.slow
@pytest.mark.parametrize("key", ["flows", "flows_plain"])
def test_fit_validate_test_predict_on_one_trainer(run, key):
    """With (flows) and without (flows_plain) a parameter on the LightningModule: the root FSDP group."""
    _, ranks = run
    _no_errors(ranks, key)
    for r in ranks:
        f = r[key]
        assert len(f["fit_losses"]) == 8 and all(math.isfinite(x) for x in f["fit_losses"])
        # no optimizer step in between: the same quantized weights, the same losses
        assert f["val_1"] == f["val_2"] == pytest.approx(f["val_fit"], rel=1e-6)
        assert f["test_1"] == f["test_2"] and math.isfinite(f["test_1"])
        assert f["pred_rows"] == N_SAMPLES // 2 and f["pred_finite"]
        assert len(f["refit_losses"]) == 8 and all(math.isfinite(x) for x in f["refit_losses"])
        assert math.isfinite(f["refit_val"])


@pytest.mark.slow
def test_resume_from_sharded_and_consolidated_checkpoints(run):
    _, ranks = run
    _no_errors(ranks, "resume")
    for r in ranks:
        ref = r["resume/uninterrupted"]["losses"]
        assert len(ref) == 16
        for key in ("from_dir", "from_file"):
            resumed = r[f"resume/{key}"]
            assert resumed["global_step"] == 16 and len(resumed["losses"]) == 8
            for a, b in zip(resumed["losses"], ref[8:]):
                assert abs(a - b) <= 1e-6 * abs(b), (key, resumed["losses"], ref[8:])


def _assert_weights_equal(module: pl.LightningModule, ref: dict) -> None:
    sd = module.state_dict()
    assert set(sd) == set(ref)
    for k, v in ref.items():
        assert torch.equal(sd[k], v), k


@pytest.mark.slow
def test_load_from_checkpoint_of_the_consolidated_file(run, tmp_path):
    from lightning_qcomm import consolidate_checkpoint

    outdir, ranks = run
    _no_errors(ranks, "flows")
    last = outdir / "flows_ckpt" / "last.ckpt"
    assert last.is_dir()
    ref = torch.load(outdir / "flows_ref.pt")
    target = tmp_path / "single.ckpt"
    consolidate_checkpoint(last, target)
    model = FlowNet.load_from_checkpoint(target)
    assert model.hparams.hidden == 64
    _assert_weights_equal(model, ref)
    # the command line does the same
    cli_target = tmp_path / "cli.ckpt"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_qcomm.consolidate", str(last), str(cli_target)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    _assert_weights_equal(FlowNet.load_from_checkpoint(cli_target), ref)
    # an existing output is not overwritten
    with pytest.raises(FileExistsError, match="cli.ckpt"):
        consolidate_checkpoint(last, cli_target)


@pytest.mark.slow
def test_load_from_checkpoint_of_a_full_state_dict_save(run):
    outdir, ranks = run
    _no_errors(ranks, "full_ckpt")
    assert ranks[0]["full_ckpt"]["is_file"]
    ref = torch.load(outdir / "full_ref.pt")
    _assert_weights_equal(FlowNet.load_from_checkpoint(outdir / "full_ckpt" / "last.ckpt"), ref)


def test_consolidate_refuses_what_is_not_a_sharded_checkpoint(tmp_path):
    from lightning_qcomm.consolidate import consolidate_checkpoint

    with pytest.raises(FileNotFoundError, match="nothere"):
        consolidate_checkpoint(tmp_path / "nothere", tmp_path / "out.ckpt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty"):
        consolidate_checkpoint(tmp_path / "empty", tmp_path / "out.ckpt")


# --------------------------------------------------------------------------- manual optimization
@pytest.mark.slow
def test_gan_manual_optimization_with_toggle_optimizer(run):
    _, ranks = run
    _no_errors(ranks, "gan")
    for r in ranks:
        ddp, q32, q8 = r["gan/ddp"], r["gan/q32"], r["gan/q8"]
        assert len(ddp["g"]) == len(q32["g"]) == len(q8["g"]) == 8
        # unquantized QSDP computes what DDP computes, step by step, for both players
        for a, b in zip(q32["g"] + q32["d"], ddp["g"] + ddp["d"]):
            assert abs(a - b) <= 1e-5 * abs(b), (q32, ddp)
        assert all(math.isfinite(x) for x in q8["g"] + q8["d"]) and q8["g"] != q32["g"]
        for run_ in (ddp, q32, q8):
            assert run_["changed"] == {"generator": True, "discriminator": True}
        # a root-held parameter read directly after a backward and while toggled off
        root_ddp, root_q32 = r["gan/root_ddp"], r["gan/root_q32"]
        assert len(root_q32["g"]) == 8
        for a, b in zip(root_q32["g"] + root_q32["d"], root_ddp["g"] + root_ddp["d"]):
            assert abs(a - b) <= 1e-5 * abs(b), (root_q32, root_ddp)


# --------------------------------------------------------------------------- precisions
@pytest.mark.slow
def test_precision_matrix(run):
    """Every precision trains under QSDP with finite losses, within the model matrix's band of DDP at the same
    precision (2% of the epoch-2 mean loss) and learning (epoch 2 below 0.9x epoch 1, same batches). A user's
    bf16 MixedPrecisionPolicy (fp32 master weights, bf16 gradients reduced in bf16) is held to DDP's
    bf16-mixed."""
    _, ranks = run
    _no_errors(ranks, "precisions")
    for r in ranks:
        assert r["precision/16-mixed/qsdp"]["plugin"] == "bf16-mixed"  # Lightning's own choice on CPU
        for key in (*PRECISIONS, "user_mp_bf16"):
            losses = r[f"precision/{key}/qsdp"]["losses"]
            ddp = r[f"precision/{'bf16-mixed' if key == 'user_mp_bf16' else key}/ddp"]["losses"]
            assert len(losses) == 16 and all(math.isfinite(x) for x in losses), key
            assert _epoch(losses, 1) < 0.9 * _epoch(losses, 0), (key, losses)
            assert abs(_epoch(losses, 1) - _epoch(ddp, 1)) < 0.02 * _epoch(ddp, 1), (key, losses, ddp)


@pytest.mark.slow
def test_half_precision_reduce_scatter_is_exact_on_raw_segments(run):
    _, ranks = run
    _no_errors(ranks, "reduce_scatter")
    for r in ranks:
        for dtype, v in r["reduce_scatter"].items():
            assert "error" not in v, (dtype, v)
            assert v["bias_exact"], dtype
            assert v["weight_within_bound"], (dtype, v)
            assert v["weight_max_err_over_step"] > 0.05, dtype  # the weight did travel quantized


# --------------------------------------------------------------------------- settings with no effect
@pytest.mark.slow
def test_warns_when_nothing_is_quantized(run):
    _, ranks = run
    _no_errors(ranks, "warn")
    rank0 = ranks[0]
    (msg,) = rank0["warn/min_quant_numel"]
    assert "min_quant_numel=1000000000" in msg and "nothing" in msg
    (msg,) = rank0["warn/bits32"]
    assert "32" in msg and "nothing" in msg
    assert rank0["warn/quantizes"] == []
    assert ranks[1]["warn/min_quant_numel"] == []  # rank_zero_warn


@pytest.mark.slow
def test_warns_on_one_device(tmp_path):
    spawn(_single_worker, free_port(), str(tmp_path), nprocs=1)
    (msg,) = json.load(open(tmp_path / "single.json"))["warnings"]
    assert "one device" in msg and "nothing is communicated" in msg


# --------------------------------------------------------------------------- no processes
def test_full_state_launcher_gates_on_global_rank(monkeypatch):
    """Multi-node spawn: the main process of node 1 has local rank 0 but is not global rank 0."""
    import types

    import torch.distributed.checkpoint.state_dict as sd

    from lightning_qcomm.strategies.qsdp_checkpoint import FullStateLauncher

    monkeypatch.setattr(sd, "get_model_state_dict", lambda *a, **k: {"w": torch.ones(1)})
    launcher = FullStateLauncher.__new__(FullStateLauncher)
    trainer = types.SimpleNamespace(
        checkpoint_callback=None, lightning_module=None, state=types.SimpleNamespace(fn="x")
    )
    launcher._strategy = types.SimpleNamespace(local_rank=0, global_rank=2)
    launcher.get_extra_results = lambda trainer: {}
    assert launcher._collect_rank_zero_results(trainer, results=None) is None


def test_torch_internals_are_checked(monkeypatch):
    import types

    from torch.distributed.fsdp import FSDPModule

    from lightning_qcomm.adapters.fsdp2.shim import check_fsdp_param_internals, check_torch_fsdp_api

    check_torch_fsdp_api()  # this torch passes
    monkeypatch.delattr(FSDPModule, "set_custom_reduce_scatter")
    with pytest.raises(RuntimeError, match=rf"torch {re.escape(torch.__version__)}.*set_custom_reduce_scatter"):
        check_torch_fsdp_api()
    with pytest.raises(RuntimeError, match=r"padded_sharded_param_size"):
        check_fsdp_param_internals(types.SimpleNamespace(sharded_size=torch.Size([2])))
