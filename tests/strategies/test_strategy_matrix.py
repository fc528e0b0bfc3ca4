"""Every strategy and callback in every precision and every Trainer flow (2 CPU ranks, gloo).

The matrix a new user walks through in the first hour: {32-true, bf16-mixed, bf16-true, 16-true, 16-mixed}
x {plain DDP (the reference), QuantDDP with error feedback, Local SGD (inline and overlapped), DDP + OneBitAdamCallback, DDP +
ActivationQuantization}, and the flows fit -> validate -> test -> predict on one Trainer, resume, a
two-optimizer manual-optimization GAN (Lightning's ``toggle_optimizer`` pattern) and
``load_from_checkpoint``. Each cell trains with finite losses within a band of plain DDP at the same
precision, or is refused before its first step with a message naming the precision and the allowed set.

Lightning turns ``precision="16-mixed"`` into bf16-mixed on CPU, so the fp16-mixed cells pass Lightning's
``MixedPrecision`` plugin with a CPU ``GradScaler`` explicitly: real fp16 autocast and loss scaling.
AdamW uses ``eps=1e-4``: the default 1e-8 is below fp16's smallest subnormal, and 16-true then divides
by zero under plain DDP too.

Cost: one pair of spawned processes runs every Trainer in-process (Lightning's "processes created
externally" mode), tiny models, a few steps each.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
import warnings

import pytest
import torch
import torch.nn.functional as F
from _launch import free_port, rank_results, spawn, write_rank_result
from torch import nn

STEPS = 48
PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "16-true", "16-mixed")
STRATEGIES = ("ddp", "quant_ddp_ef", "local_sgd", "local_sgd_overlap", "onebit_adam", "activation_quant")
FLOW_STEPS = 8


def _dataset(n: int = 512):
    """Teacher-labelled Gaussian inputs with 20% of the labels redrawn: the loss has a floor (~0.6 nats)
    that every method reaches, so losses are compared where they converge, not on a transient."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 32, generator=g)
    teacher = torch.randn(32, 4, generator=g)
    y = (x @ teacher).argmax(1)
    flip = torch.rand(n, generator=g) < 0.2
    return torch.utils.data.TensorDataset(x, torch.where(flip, torch.randint(0, 4, (n,), generator=g), y))


def _make_classifier():
    import lightning.pytorch as pl

    class Classifier(pl.LightningModule):
        """Linear / LayerNorm / GELU: what QuantDDP compresses and ActivationQuantization quantizes."""

        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 4))

        def forward(self, x):
            return self.body(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self(x), y)
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", F.cross_entropy(self(x), y), sync_dist=True)

        def test_step(self, batch, batch_idx):
            x, y = batch
            self.log("test_loss", F.cross_entropy(self(x), y), sync_dist=True)

        def predict_step(self, batch, batch_idx):
            return self(batch[0]).argmax(1)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2, eps=1e-4)

        def _loader(self):
            return torch.utils.data.DataLoader(_dataset(), batch_size=32)

        train_dataloader = val_dataloader = test_dataloader = predict_dataloader = _loader

    return Classifier


def _make_gan():
    import lightning.pytorch as pl

    class GAN(pl.LightningModule):
        """Lightning's GAN example pattern: two optimizers, manual optimization, toggle_optimizer."""

        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.generator = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16))
            self.discriminator = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))

        def training_step(self, batch, batch_idx):
            opt_g, opt_d = self.optimizers()
            real = batch[0]
            z = torch.randn(real.shape[0], 8)
            ones, zeros = torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)
            self.toggle_optimizer(opt_g)
            g_loss = F.binary_cross_entropy_with_logits(self.discriminator(self.generator(z)), ones)
            self.manual_backward(g_loss)
            opt_g.step()
            opt_g.zero_grad()
            self.untoggle_optimizer(opt_g)
            self.toggle_optimizer(opt_d)
            fake = self.generator(z).detach()
            d_loss = 0.5 * (
                F.binary_cross_entropy_with_logits(self.discriminator(real), ones)
                + F.binary_cross_entropy_with_logits(self.discriminator(fake), zeros)
            )
            self.manual_backward(d_loss)
            opt_d.step()
            opt_d.zero_grad()
            self.untoggle_optimizer(opt_d)
            self.log_dict({"g_loss": g_loss, "d_loss": d_loss})

        def configure_optimizers(self):
            return (
                torch.optim.Adam(self.generator.parameters(), lr=1e-3),
                torch.optim.Adam(self.discriminator.parameters(), lr=1e-3),
            )

        def train_dataloader(self):
            data = torch.randn(256, 16, generator=torch.Generator().manual_seed(1)) + 2.0
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=32)

    return GAN


def _strategy(name: str, manual: bool = False):
    """(strategy, callbacks). DDP-based strategies under manual optimization with toggle_optimizer need
    ``find_unused_parameters=True``, exactly as Lightning's own DDPStrategy does."""
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_qcomm import (
        ActivationQuantization,
        LocalSGDStrategy,
        OneBitAdamCallback,
        QuantDDPStrategy,
    )

    ddp_kw = {"find_unused_parameters": True} if manual else {}
    if name == "ddp":
        return DDPStrategy(**ddp_kw), []
    if name == "quant_ddp_ef":
        return QuantDDPStrategy(codec="uniform", bits=8, error_feedback=True, min_quant_numel=0, **ddp_kw), []
    if name == "local_sgd":
        return LocalSGDStrategy(sync="constant", period=2), []
    if name == "local_sgd_overlap":  # each average applied a round later (parallel/local_sgd_overlap.py)
        return LocalSGDStrategy(sync="constant", period=2, overlap=True), []
    if name == "onebit_adam":
        return DDPStrategy(**ddp_kw), [OneBitAdamCallback(freeze_step=4)]
    if name == "activation_quant":
        return DDPStrategy(**ddp_kw), [ActivationQuantization(bits=4, min_numel=256)]
    raise KeyError(name)


def _precision_kwargs(precision: str) -> dict:
    if precision == "16-mixed":
        from lightning.pytorch.plugins.precision import MixedPrecision

        return {"plugins": [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))]}
    return {"precision": precision}


# ---------------------------------------------------------------------------------------------- worker
def _flat(module) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in module.parameters()])


def _agree_across_ranks(t: torch.Tensor) -> bool:
    import torch.distributed as dist

    both = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(both, t)
    return all(torch.equal(both[0], b) for b in both)


def _full_loss(module) -> float:
    x, y = _dataset().tensors
    with torch.no_grad():
        return float(F.cross_entropy(module.float()(x), y))


class _StepProbe:
    """Records the global step at which training first ran a batch (a refusal must come before it)."""

    def __new__(cls):
        import lightning.pytorch as pl

        class Probe(pl.Callback):
            first_batch_step: int | None = None

            def on_train_batch_start(self, trainer, *args):
                if self.first_batch_step is None:
                    self.first_batch_step = trainer.global_step

        return Probe()


def _trainer(strategy, callbacks, root: str, max_steps: int, checkpoint: bool = False, **kw):
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    cbs = list(callbacks)
    if checkpoint:
        # saved after the epoch's last batch: a resume then starts the next epoch with the same sampler epoch as
        # an uninterrupted run. (Lightning's ``save_last`` copy, written after the epoch ended, resumes one
        # sampler epoch later, under plain DDP too, so it cannot serve as the uninterrupted reference.)
        cbs.append(ModelCheckpoint(dirpath=root, filename="resume", every_n_train_steps=max_steps, save_top_k=-1))
    return pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        callbacks=cbs,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=checkpoint,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        **kw,
    )


def _precision_cell(name: str, precision: str, root: str) -> dict:
    import lightning.pytorch as pl

    pl.seed_everything(0, verbose=False)
    strategy, callbacks = _strategy(name)
    probe = _StepProbe()
    trainer = _trainer(strategy, [*callbacks, probe], root, STEPS, **_precision_kwargs(precision))
    module = _make_classifier()()
    try:
        trainer.fit(module)
    except (ValueError, TypeError, RuntimeError) as err:
        return {"refused": f"{type(err).__name__}: {err}", "first_batch_step": probe.first_batch_step}
    hook = getattr(trainer.strategy, "hook_state", None)
    residual = None if hook is None else max(float(e.abs().max()) for e in hook.ef_state_dict().values())
    return {
        "loss": _full_loss(module),
        "train_loss": float(trainer.callback_metrics["train_loss"]),
        "agree": _agree_across_ranks(_flat(module)),
        "steps": trainer.global_step,
        "residual": residual,
    }


def _flow_cells(name: str, root: str) -> dict:
    import lightning.pytorch as pl

    out: dict = {}
    cls = _make_classifier()
    # fit -> validate -> test -> predict -> test on one Trainer, then resume from last.ckpt
    pl.seed_everything(0, verbose=False)
    strategy, callbacks = _strategy(name)
    trainer = _trainer(strategy, callbacks, os.path.join(root, "a"), FLOW_STEPS, checkpoint=True)
    module = cls()
    trainer.fit(module)
    v = trainer.validate(module, verbose=False)[0]["val_loss"]
    t1 = trainer.test(module, verbose=False)[0]["test_loss"]
    preds = trainer.predict(module)
    t2 = trainer.test(module, verbose=False)[0]["test_loss"]
    out["evaluate"] = {"val": v, "test": [t1, t2], "n_pred": sum(len(p) for p in preds)}
    last = os.path.join(root, "a", "resume.ckpt")
    out["trained"] = _flat(module)
    loaded = cls.load_from_checkpoint(last)
    out["loaded"] = _flat(loaded)

    pl.seed_everything(0, verbose=False)
    strategy, callbacks = _strategy(name)
    resumed = cls()
    _trainer(strategy, callbacks, os.path.join(root, "b"), 2 * FLOW_STEPS).fit(resumed, ckpt_path=last)
    pl.seed_everything(0, verbose=False)
    strategy, callbacks = _strategy(name)
    straight = cls()
    _trainer(strategy, callbacks, os.path.join(root, "c"), 2 * FLOW_STEPS).fit(straight)
    out["resume"] = {"resumed": _flat(resumed), "straight": _flat(straight)}

    # two optimizers, manual optimization
    pl.seed_everything(0, verbose=False)
    strategy, callbacks = _strategy(name, manual=True)
    gan = _make_gan()()
    before = _flat(gan)
    trainer = _trainer(strategy, callbacks, os.path.join(root, "d"), FLOW_STEPS)
    try:
        trainer.fit(gan)
        out["gan"] = {
            "g_moved": bool((_flat(gan.generator) != _flat_like(before, gan, "generator")).any()),
            "d_moved": bool((_flat(gan.discriminator) != _flat_like(before, gan, "discriminator")).any()),
            "agree": _agree_across_ranks(_flat(gan)),
            "losses": [float(trainer.callback_metrics[k]) for k in ("g_loss", "d_loss")],
            "steps": trainer.global_step,
        }
    except (ValueError, TypeError) as err:
        out["gan"] = {"refused": f"{type(err).__name__}: {err}"}
    return out


def _flat_like(before: torch.Tensor, module, prefix: str) -> torch.Tensor:
    """The slice of ``before`` (all parameters flattened in order) belonging to submodule ``prefix``."""
    pieces, off = [], 0
    for n, p in module.named_parameters():
        if n.startswith(prefix + "."):
            pieces.append(before[off : off + p.numel()])
        off += p.numel()
    return torch.cat(pieces)


def _worker(rank: int, port: int, outdir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", NODE_RANK="0")
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    res: dict = {"precision": {}, "flows": {}}
    for name in STRATEGIES:
        for precision in PRECISIONS:
            res["precision"][(name, precision)] = _precision_cell(name, precision, os.path.join(outdir, "p"))
            dist.barrier()
        res["flows"][name] = _flow_cells(name, os.path.join(outdir, "f", name))
        dist.barrier()
    write_rank_result(outdir, rank, res, "rank{rank}.pkl")


@pytest.fixture(scope="module")
def matrix():
    with tempfile.TemporaryDirectory() as d:
        spawn(_worker, free_port(), d, nprocs=2)
        return rank_results(d, 2, "rank{rank}.pkl")


# ---------------------------------------------------------------------------------------------- precision matrix
# Refusals a user may meet, with the words their message must contain (the precision and the allowed set).
REFUSED = {("onebit_adam", "16-mixed"): ["16-mixed", "32-true", "bf16-mixed", "bf16-true", "16-true"]}

# A precision may cost a method no more than it costs plain DDP, up to the widest band our fp32 tests allow
# between a method and its baseline at equal steps (1-bit Adam vs AdamW: 3%):
#     L(s, p) / L(s, 32-true)  <=  (1 + 3%) * L(ddp, p) / L(ddp, 32-true)
# (one-sided: doing better than DDP in a precision is fine). Each method's distance to DDP in fp32 is tested
# in its own file, on a problem made for it.
PRECISION_BAND = 0.03


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("name", STRATEGIES)
def test_precision_cell_trains_or_is_refused_before_the_first_step(matrix, name, precision):
    cell = matrix[0]["precision"][(name, precision)]
    if (name, precision) in REFUSED:
        assert "refused" in cell, f"{name} under {precision} was expected to be refused, got {cell}"
        assert cell["first_batch_step"] is None, "refused only after training started"
        for word in REFUSED[(name, precision)]:  # whole tokens: "16-true" is not found inside "bf16-true"
            assert re.search(rf"(?<![\w-]){re.escape(word)}(?![\w-])", cell["refused"]), (word, cell["refused"])
        return
    assert "refused" not in cell, cell.get("refused")
    assert cell["steps"] == STEPS
    assert math.isfinite(cell["loss"]) and math.isfinite(cell["train_loss"]), cell
    assert all(r["precision"][(name, precision)]["agree"] for r in matrix), "ranks hold different weights"
    initial = math.log(4)  # an untrained 4-way classifier
    assert cell["loss"] < 0.8 * initial, f"did not train: {cell['loss']} vs initial {initial}"
    cells = matrix[0]["precision"]
    cost = cell["loss"] / cells[(name, "32-true")]["loss"]
    ddp_cost = cells[("ddp", precision)]["loss"] / cells[("ddp", "32-true")]["loss"]
    assert cost <= (1 + PRECISION_BAND) * ddp_cost, (
        f"{name}/{precision}: x{cost:.3f} of its fp32 loss, DDP x{ddp_cost:.3f}"
    )


def test_error_feedback_residual_is_in_unscaled_units_under_a_grad_scaler(matrix):
    """16-mixed scales the loss by 2^16 before backward: a residual kept in DDP's (scaled) units would be
    ~2^16 times the fp32 run's; in unscaled units it is of the same size (same model, same steps)."""
    for r in matrix:
        fp32 = r["precision"][("quant_ddp_ef", "32-true")]["residual"]
        fp16 = r["precision"][("quant_ddp_ef", "16-mixed")]["residual"]
        assert 0 < fp16 <= 10 * fp32, (fp16, fp32)


def test_mixed_and_bf16_precisions_match_fp32_under_ddp(matrix):
    """The reference itself: with fp32 master weights (the mixed precisions) or bf16's range, DDP lands within
    1% of fp32. (16-true holds the weights in fp16, where small updates round away: it is compared against
    DDP in 16-true above, not against fp32.)"""
    fp32 = matrix[0]["precision"][("ddp", "32-true")]["loss"]
    for precision in ("bf16-mixed", "bf16-true", "16-mixed"):
        loss = matrix[0]["precision"][("ddp", precision)]["loss"]
        assert abs(loss - fp32) / fp32 < 0.01, (precision, loss, fp32)


# ---------------------------------------------------------------------------------------------- Trainer flows
@pytest.mark.parametrize("name", STRATEGIES)
def test_fit_validate_test_predict_on_one_trainer(matrix, name):
    ev = matrix[0]["flows"][name]["evaluate"]
    assert math.isfinite(ev["val"]) and all(math.isfinite(t) for t in ev["test"])
    assert ev["test"][0] == pytest.approx(ev["test"][1], rel=1e-6), "a second test run saw other weights"
    assert ev["n_pred"] == len(_dataset()) // 2  # each rank predicts its half


@pytest.mark.parametrize("name", STRATEGIES)
def test_load_from_checkpoint_gives_the_trained_weights(matrix, name):
    flows = matrix[0]["flows"][name]
    assert torch.equal(flows["loaded"], flows["trained"])


@pytest.mark.parametrize("name", STRATEGIES)
def test_resumed_fit_equals_uninterrupted_fit(matrix, name):
    for r in matrix:
        res = r["flows"][name]["resume"]
        assert torch.equal(res["resumed"], res["straight"]), float((res["resumed"] - res["straight"]).abs().max())


@pytest.mark.parametrize("name", STRATEGIES)
def test_two_optimizer_manual_optimization(matrix, name):
    gan = matrix[0]["flows"][name]["gan"]
    if name == "onebit_adam":  # documented limit: refused before training
        assert "automatic_optimization=False" in gan.get("refused", ""), gan
        return
    assert "refused" not in gan, gan
    assert gan["g_moved"] and gan["d_moved"], gan
    assert gan["agree"] and all(math.isfinite(v) for v in gan["losses"]), gan
