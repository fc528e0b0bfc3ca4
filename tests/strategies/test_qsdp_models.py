"""QSDP on models nobody here wrote for it: the model-shape matrix, on 2 CPU ranks (gloo).

Shapes: parameters held by the LightningModule itself (ViT-style ``cls_token`` / ``pos_embed``), a CNN
without ``nn.ModuleList`` (layers as attributes of a submodule, and as attributes of the LightningModule),
tied weights (the demo ``ByteGPT``: ``head.weight is tok_emb.weight``), frozen layers, and Lightning's demo
``Transformer``. Each is trained with plain DDP, with ``strategy="qsdp"`` (which saves a sharded checkpoint
after the first epoch) and with ``QSDPStrategy(bits=8)`` resuming that checkpoint; none has a
``configure_model``. All Trainers run in ONE spawn of two processes; the tests check its JSON results.
"""

from __future__ import annotations

import math
import os

import lightning.pytorch as pl
import pytest
import torch
from _launch import free_port, rank_results, set_rank_env, spawn, write_rank_result
from torch import nn

from lightning_qcomm.demo import ByteGPT
from lightning_qcomm.strategies.qsdp import QSDPStrategy

N_SAMPLES, BATCH = 256, 16  # per rank: 128 samples -> 8 optimizer steps per epoch
EPOCHS = 2
N_CLS, IMG, DIM = 4, 8, 32
SEQ, VOCAB = 32, 256
BYTEGPT_PARAMS = 34_688  # ByteGPT(n_layer=2, n_embd=32, block_size=32) with head.weight tied to tok_emb.weight


# --------------------------------------------------------------------------- data
def image_data() -> torch.utils.data.TensorDataset:
    """1x8x8 Gaussian images labelled by the quadrant with the largest mean, 10% label noise: learnable by
    convolutions and by patches alike, with a loss floor above 0."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(N_SAMPLES, 1, IMG, IMG, generator=g)
    y = x.unfold(2, 4, 4).unfold(3, 4, 4).mean(dim=(-1, -2)).reshape(N_SAMPLES, N_CLS).argmax(dim=1)
    flip = torch.rand(N_SAMPLES, generator=g) < 0.1
    return torch.utils.data.TensorDataset(x, torch.where(flip, torch.randint(0, N_CLS, (N_SAMPLES,), generator=g), y))


def token_data(vocab: int = VOCAB) -> torch.utils.data.TensorDataset:
    """(input, next-token target) pairs of an affine recurrence mod ``vocab`` with 10% random tokens."""
    g = torch.Generator().manual_seed(1234)
    x = torch.empty(N_SAMPLES, SEQ + 1, dtype=torch.long)
    x[:, 0] = torch.randint(0, vocab, (N_SAMPLES,), generator=g)
    for t in range(SEQ):
        x[:, t + 1] = (5 * x[:, t] + 3) % vocab
    noise = torch.rand(N_SAMPLES, SEQ + 1, generator=g) < 0.1
    x = torch.where(noise, torch.randint(0, vocab, x.shape, generator=g), x)
    return torch.utils.data.TensorDataset(x[:, :-1], x[:, 1:])


class _Classifier(pl.LightningModule):
    """Cross-entropy on the image data; subclasses define ``forward``. Seeded init: every run starts equal."""

    lr = 1e-2

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x).float(), y)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr, weight_decay=0.0)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(image_data(), batch_size=BATCH, shuffle=False)


# --------------------------------------------------------------------------- the shapes
class ViT(_Classifier):
    """ViT-style: ``cls_token`` and ``pos_embed`` are parameters of the LightningModule itself (the head reads
    every token, which learns this task in few steps)."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Linear(16, DIM)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, DIM))
        self.pos_embed = nn.Parameter(0.02 * torch.randn(1, 5, DIM))
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(DIM, 2, 2 * DIM, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(2)
        )
        self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(5 * DIM, N_CLS)

    def forward(self, x):
        p = x.unfold(2, 4, 4).unfold(3, 4, 4).reshape(x.shape[0], 4, 16)  # four 4x4 patches
        z = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), self.patch(p)], dim=1) + self.pos_embed
        for blk in self.blocks:
            z = blk(z)
        return self.head(self.norm(z).flatten(1))


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 8, 3, padding=1), nn.Conv2d(8, 16, 3, padding=1)
        self.fc1, self.fc2 = nn.Linear(64, 64), nn.Linear(64, N_CLS)

    def forward(self, x):
        x = nn.functional.avg_pool2d(torch.tanh(self.conv1(x)), 2)
        x = nn.functional.avg_pool2d(torch.tanh(self.conv2(x)), 2)
        return self.fc2(torch.tanh(self.fc1(x.flatten(1))))


class CNN(_Classifier):
    """No ModuleList: conv1, conv2, fc1, fc2 are attributes of a submodule."""

    def __init__(self) -> None:
        super().__init__()
        self.net = ConvNet()

    def forward(self, x):
        return self.net(x)


class FlatCNN(_Classifier):
    """The same layers as attributes of the LightningModule (the usual Lightning tutorial style)."""

    def __init__(self) -> None:
        super().__init__()
        net = ConvNet()
        self.conv1, self.conv2, self.fc1, self.fc2 = net.conv1, net.conv2, net.fc1, net.fc2

    forward = ConvNet.forward


class Frozen(_Classifier):
    """A frozen feature extractor (requires_grad=False) in front of trainable layers; one frozen LayerNorm
    shares a submodule with trainable weights."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.Tanh())
        self.features.requires_grad_(False)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(64), nn.Linear(64, 64), nn.Tanh()) for _ in range(2))
        self.blocks[0][0].requires_grad_(False)
        self.head = nn.Linear(64, N_CLS)

    def forward(self, x):
        z = self.features(x)
        for blk in self.blocks:
            z = z + blk(z)
        return self.head(z)


class TiedGPT(ByteGPT):
    """The demo ByteGPT (head.weight tied to tok_emb.weight), recording its losses."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__(n_layer=2, n_head=2, n_embd=32, block_size=SEQ, lr=1e-2, weight_decay=0.0, warmup_steps=1)
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.losses.append(float(loss.detach()))
        return loss

    def train_dataloader(self):
        return torch.utils.data.DataLoader(token_data(), batch_size=BATCH, shuffle=False)


class DemoTransformer(pl.LightningModule):
    """Lightning's own ``lightning.pytorch.demos.Transformer`` (as in its LightningTransformer), random tokens."""

    def __init__(self) -> None:
        super().__init__()
        from lightning.pytorch.demos import Transformer

        torch.manual_seed(0)
        self.model = Transformer(vocab_size=64, ninp=32, nhead=2, nhid=64, nlayers=1, dropout=0.0)
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.nll_loss(self.model(x, y), y.reshape(-1))
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.0)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(token_data(64), batch_size=BATCH, shuffle=False)


MODELS = {
    "vit": ViT,
    "cnn": CNN,
    "flat_cnn": FlatCNN,
    "tied": TiedGPT,
    "frozen": Frozen,
    "transformer": DemoTransformer,
}


# --------------------------------------------------------------------------- worker
def _probe_after_setup(out: dict):
    """Callback recording, once setup is done, the FSDP groups, the parameter count and the tie."""

    class _Probe(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            from torch.distributed.fsdp import FSDPModule

            out["groups"] = [n for n, m in pl_module.named_modules() if isinstance(m, FSDPModule)]
            out["n_params"] = sum(p.numel() for p in pl_module.parameters())
            if isinstance(pl_module, ByteGPT):
                head, emb = pl_module.head.weight, pl_module.tok_emb.weight
                local = (lambda t: t.to_local()) if hasattr(head, "to_local") else (lambda t: t)
                out["tie_identity"] = head is emb
                out["tie_data_ptr"] = local(head).data_ptr() == local(emb).data_ptr()

    return _Probe()


def _save_after_first_epoch(path: str):
    class _Save(pl.Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            if trainer.current_epoch == 0:
                trainer.save_checkpoint(path)

    return _Save()


def _full_state(trainer) -> dict[str, torch.Tensor]:
    """Full (unsharded) weights of the trained module on every rank (collective under QSDP)."""
    module = trainer.lightning_module
    if isinstance(trainer.strategy, QSDPStrategy):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.detach().cpu() for k, v in module.state_dict().items()}


def _fit(rank, world, port, name, strategy, ckpt_path=None, callbacks=()):
    set_rank_env(rank, world, port)
    strategy = strategy() if callable(strategy) else strategy  # built here: a bad argument is a recorded error
    module = MODELS[name]()
    initial = {k: v.detach().clone() for k, v in module.state_dict().items()}
    out: dict = {}
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_epochs=EPOCHS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[_probe_after_setup(out), *callbacks],
    )
    trainer.fit(module, ckpt_path=ckpt_path)
    full = _full_state(trainer)  # on rank 0 only under QSDP (full_state_dict=True)
    checks = {}
    if trainer.global_rank == 0 and name == "tied":
        checks["tie_max_diff"] = float((full["head.weight"] - full["tok_emb.weight"]).abs().max())
    if trainer.global_rank == 0 and name == "frozen":
        frozen = ("features.1.weight", "features.1.bias", "blocks.0.0.weight", "blocks.0.0.bias")
        checks["frozen_unchanged"] = all(torch.equal(full[k], initial[k]) for k in frozen)
        checks["trainable_changed"] = not torch.equal(full["blocks.1.1.weight"], initial["blocks.1.1.weight"])
    out.update(trainer.strategy.broadcast(checks))
    out.update(losses=module.losses, global_step=trainer.global_step)
    return out


def _worker(rank: int, world: int, port: int, outdir: str) -> None:
    import traceback
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    import lightning_qcomm  # noqa: F401  (registers "qsdp")

    res: dict = {}

    def case(key, *args, **kwargs):
        try:
            res[key] = _fit(rank, world, port, *args, **kwargs)
        except Exception as err:  # both ranks fail alike in setup; recorded for the asserts
            res[key] = {"error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()[-3000:]}

    for name in MODELS:
        ckpt = os.path.join(outdir, f"{name}_epoch1")
        case(f"{name}/ddp", name, "ddp")
        case(f"{name}/qsdp", name, "qsdp", callbacks=[_save_after_first_epoch(ckpt)])
        resume_from = ckpt if os.path.exists(ckpt) else None
        case(f"{name}/resumed", name, lambda: QSDPStrategy(bits=8), ckpt_path=resume_from)
    # the size-based auto-wrap policy with a threshold that splits the CNN into several groups
    case("cnn/small_wrap", "cnn", lambda: QSDPStrategy(bits=8, min_wrap_numel=1000))
    write_rank_result(outdir, rank, res)


@pytest.fixture(scope="module")
def outdir(tmp_path_factory):
    return tmp_path_factory.mktemp("qsdp_models")


@pytest.fixture(scope="module")
def runs(outdir):
    os.environ["OMP_NUM_THREADS"] = "1"
    spawn(_worker, 2, free_port(), str(outdir), nprocs=2)
    return rank_results(outdir, 2)


def _epoch_mean(losses: list[float], epoch: int) -> float:
    """Mean loss over one epoch's steps: every epoch sees the same batches, so batch noise cancels."""
    n = len(losses) // EPOCHS
    return sum(losses[epoch * n : (epoch + 1) * n]) / n


def _final(losses: list[float]) -> float:
    return _epoch_mean(losses, EPOCHS - 1)


def _ok(run: dict) -> dict:
    assert "error" not in run, run.get("trace", run.get("error"))
    return run


# --------------------------------------------------------------------------- tests on the 2-rank results
@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_trains_like_ddp(runs, name):
    """Each shape trains under strategy="qsdp" with no configure_model; loss within 2% of DDP at equal steps."""
    for r in runs:
        ddp, q = _ok(r[f"{name}/ddp"]), _ok(r[f"{name}/qsdp"])
        steps = EPOCHS * N_SAMPLES // (2 * BATCH)
        assert len(ddp["losses"]) == len(q["losses"]) == steps and q["global_step"] == steps
        assert all(math.isfinite(x) for x in q["losses"])
        assert _final(ddp["losses"]) < 0.9 * _epoch_mean(ddp["losses"], 0), ddp["losses"]  # the task is learnable
        assert q["losses"] != ddp["losses"]  # weights and gradients travelled quantized
        assert abs(_final(q["losses"]) - _final(ddp["losses"])) < 0.02 * _final(ddp["losses"]), (q, ddp)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_resume_with_bits8_continues_trajectory(runs, name):
    """QSDPStrategy(bits=8) resuming "qsdp"'s sharded checkpoint from after epoch 1 repeats its epoch 2."""
    for r in runs:
        ref, resumed = _ok(r[f"{name}/qsdp"]), _ok(r[f"{name}/resumed"])
        half = len(ref["losses"]) // 2
        assert resumed["global_step"] == ref["global_step"] and len(resumed["losses"]) == half
        for a, b in zip(resumed["losses"], ref["losses"][half:]):
            assert abs(a - b) <= 1e-6 * abs(b), (resumed["losses"], ref["losses"][half:])


@pytest.mark.slow
def test_root_held_parameters_go_to_the_root_group(runs):
    for r in runs:
        assert "" in _ok(r["vit/qsdp"])["groups"]  # the LightningModule itself is an FSDP group (the root)
        assert r["vit/qsdp"]["n_params"] == r["vit/ddp"]["n_params"]


@pytest.mark.slow
def test_tied_weights_stay_one_parameter(runs):
    for r in runs:
        ddp, q = _ok(r["tied/ddp"]), _ok(r["tied/qsdp"])
        assert ddp["n_params"] == q["n_params"] == BYTEGPT_PARAMS
        assert q["tie_identity"] and q["tie_data_ptr"]
        assert q["tie_max_diff"] == 0.0 and ddp["tie_max_diff"] == 0.0
        # neither head nor tok_emb is a group of its own (one group owns the tied weight)
        assert "head" not in q["groups"] and "tok_emb" not in q["groups"], q["groups"]


@pytest.mark.slow
def test_tied_checkpoint_consolidates_and_loads(runs, outdir, tmp_path):
    """The sharded checkpoint of the tied model, consolidated, loads strictly into a fresh ByteGPT whose
    head and embedding are still one parameter."""
    from lightning_qcomm import consolidate_checkpoint

    _ok(runs[0]["tied/qsdp"])
    single = consolidate_checkpoint(outdir / "tied_epoch1", tmp_path / "tied.ckpt")
    state = torch.load(single, weights_only=False)["state_dict"]
    assert torch.equal(state["head.weight"], state["tok_emb.weight"])
    model = TiedGPT.load_from_checkpoint(single)  # strict: every key present
    assert model.head.weight is model.tok_emb.weight
    assert sum(p.numel() for p in model.parameters()) == BYTEGPT_PARAMS
    assert not torch.equal(model.tok_emb.weight, TiedGPT().tok_emb.weight)  # trained weights, not the init


@pytest.mark.slow
def test_frozen_layers_stay_frozen(runs):
    for r in runs:
        for kind in ("ddp", "qsdp"):
            run = _ok(r[f"frozen/{kind}"])
            assert run["frozen_unchanged"] and run["trainable_changed"], kind


@pytest.mark.slow
def test_size_based_wrap_of_a_cnn(runs):
    """min_wrap_numel=1000 on the CNN: fc1 (4160 elements) and conv2 (1168) become groups of their own,
    conv1 (80) and fc2 (260) stay with their parent; the model still trains like the one-group default."""
    for r in runs:
        small = _ok(r["cnn/small_wrap"])
        assert small["groups"] == ["net", "net.conv2", "net.fc1"], small["groups"]
        ddp = r["cnn/ddp"]["losses"]
        assert abs(_final(small["losses"]) - _final(ddp)) < 0.02 * _final(ddp)


# --------------------------------------------------------------------------- the grouping plan (no processes)
def test_plan_groups_modulelist_size_and_ties():
    from lightning_qcomm.parallel.sharding import plan_fsdp_groups

    model = TiedGPT()
    names = {m: n for n, m in model.named_modules()}
    plan = [names[m] for m in plan_fsdp_groups(model, layer_classes=None, min_wrap_numel=10**9)]
    # ModuleList elements first, then direct children with params left, the root last; never head/tok_emb
    assert plan == ["blocks.0", "blocks.1", "pos_emb", "ln_f", ""], plan
    cnn = CNN()
    names = {m: n for n, m in cnn.named_modules()}
    assert [names[m] for m in plan_fsdp_groups(cnn, None, min_wrap_numel=1000)] == ["net.conv2", "net.fc1", "net"]
    assert [names[m] for m in plan_fsdp_groups(cnn, None, min_wrap_numel=10**9)] == ["net"]
    vit = ViT()
    names = {m: n for n, m in vit.named_modules()}
    assert [names[m] for m in plan_fsdp_groups(vit, None, 10**9)] == [
        "blocks.0",
        "blocks.1",
        "patch",
        "norm",
        "head",
        "",
    ]
    with pytest.raises(ValueError, match="Attention"):
        plan_fsdp_groups(vit, "Attention", 10**9)
    with pytest.raises(TypeError, match="min_wrap_numel"):
        QSDPStrategy(min_wrap_numel=1.5)
    with pytest.raises(ValueError, match="min_wrap_numel"):
        QSDPStrategy(min_wrap_numel=-1)
