"""1-bit Adam's momentum buckets launched from backward (``adapters.onebit.overlap``).

Two gloo ranks, one spawn, plain torch DDP + ``onebit_adam_ddp``; each rank trains on its own data:

* overlap against the inline sync: the same parameters, momenta and error buffers bit for bit after every step;
  buckets really start from the gradient hooks (during backward); no separate non-finite agreement all-reduce;
* a NaN gradient on one rank under overlap: "skip" skips on both ranks (m, v̂, p, step count untouched),
  "propagate" makes both ranks' momenta non-finite, "raise" raises on both;
* two backward passes before a step (accumulation) raise a RuntimeError that names overlap=False;
* Lightning: ``accumulate_grad_batches=2`` and ``gradient_clip_val`` fall back to the inline sync (logged), and
  the callback's ``overlap=False`` reaches the optimizer; Lightning's demo Transformer (dropout, several buckets)
  ends bit-identical with and without overlap.
"""

from __future__ import annotations

import os
import tempfile

import lightning.pytorch as pl
import pytest
import torch
from _launch import free_port, rank_results, spawn, write_rank_result

from lightning_qcomm.callbacks.onebit_adam import OneBitAdamCallback
from lightning_qcomm.optim import OneBitAdam

N_FEAT, N_HID, N_CLS, BATCH = 32, 64, 8, 16
FREEZE, STEPS = 2, 7
BUCKET_MB = 600 * 4 / 2**20  # 600 fp32 elements: the 2632 momentum elements travel in several buckets


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(N_FEAT, N_HID), torch.nn.Tanh(), torch.nn.Linear(N_HID, N_CLS))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(BATCH, N_FEAT, generator=g), torch.randint(0, N_CLS, (BATCH,), generator=g)


def _train(rank: int, overlap: bool, steps: int = STEPS, nan_at: int | None = None, policy: str = "skip") -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightning_qcomm.comm.ledger import CommLedger, set_ledger
    from lightning_qcomm.parallel.onebit_adam import onebit_adam_ddp

    ledger = CommLedger()
    set_ledger(ledger)
    model = _net()
    ddp = DDP(model)
    opt = OneBitAdam(
        model.parameters(), lr=1e-2, weight_decay=0.05, freeze_step=FREEZE, bucket_mb=BUCKET_MB, overlap=overlap,
        nonfinite=policy,
    )  # fmt: skip
    onebit_adam_ddp(ddp, opt)
    params = list(model.parameters())
    out: dict = {"params": [], "momenta": [], "from_hooks": [], "control_calls": [], "error": None}
    for step in range(steps):
        x, y = _batch(rank, step)
        opt.zero_grad()
        handle = None
        if step == nan_at and rank == 0:  # one element of one gradient, on rank 0 only
            handle = params[0].register_hook(lambda g: g.clone().index_fill_(0, torch.tensor([0]), float("nan")))
        before = ledger.cumulative.get(("all_reduce", "control"))
        before = 0 if before is None else before.calls
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        if handle is not None:
            handle.remove()
        snapshot = (
            [p.detach().clone() for p in params],
            [opt.state[p]["exp_avg"].clone() for p in params if opt.state[p]],
        )
        steps_before = opt.num_steps
        try:
            opt.step()
        except FloatingPointError as err:
            out["error"] = str(err)
            break
        after = ledger.cumulative.get(("all_reduce", "control"))
        out["control_calls"].append((0 if after is None else after.calls) - before)
        if step == nan_at:
            out["untouched"] = (
                all(torch.equal(a, b) for a, b in zip(snapshot[0], params))
                and all(torch.equal(a, opt.state[b]["exp_avg"]) for a, b in zip(snapshot[1], params))
                and opt.num_steps == steps_before
            )
            out["momentum_finite"] = all(bool(torch.isfinite(opt.state[p]["exp_avg"]).all()) for p in params)
            out["skipped"] = opt.nonfinite.skipped
        launcher = opt._overlap.launcher
        out["from_hooks"].append(None if launcher is None else launcher.launched_in_backward)
        out["params"].append(torch.cat([p.detach().reshape(-1) for p in params]))
        out["momenta"].append(torch.cat([opt.state[p]["exp_avg"].reshape(-1) for p in params]))
    out["n_buckets"] = len(opt._sync.buckets) if opt._sync is not None else 0
    if opt._sync is not None and opt._sync.worker_error is not None:
        out["errors"] = [e.clone() for e in (*opt._sync.worker_error, *opt._sync.server_error)]
    set_ledger(None)
    return out


def _accumulation_error(rank: int) -> str | None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightning_qcomm.parallel.onebit_adam import onebit_adam_ddp

    model = _net()
    ddp = DDP(model)
    opt = OneBitAdam(model.parameters(), freeze_step=1, bucket_mb=BUCKET_MB)
    onebit_adam_ddp(ddp, opt)
    for step in range(2):  # warm-up step, first (inline) compressed step; the launcher exists from then on
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(_batch(rank, step)[0]), _batch(rank, step)[1]).backward()
        opt.step()
    opt.zero_grad()
    x, y = _batch(rank, 9)
    try:
        for _ in range(2):  # two micro-batches before one step
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
    except RuntimeError as err:
        opt._overlap.close()
        return str(err)
    return None


class _Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = _net()

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _lightning(rank: int, port: int, **kw) -> dict:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", NODE_RANK="0")
    os.environ["LOCAL_RANK"] = str(rank)
    x, y = _batch(rank, 0)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x.repeat(8, 1), y.repeat(8)), batch_size=8)
    overlap = kw.pop("overlap", None)
    cb = OneBitAdamCallback(freeze_step=2, bucket_mb=BUCKET_MB, overlap=overlap)
    seen = []

    class Probe(pl.Callback):  # buckets started from hooks, per step (the launcher is gone after fit)
        def on_train_batch_end(self, trainer, *args):
            launcher = trainer.optimizers[0]._overlap.launcher
            seen.append(None if launcher is None else launcher.launched_in_backward)

    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=6, callbacks=[cb, Probe()], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **kw,
    )  # fmt: skip
    trainer.fit(_Module(), data)
    opt = trainer.optimizers[0]
    return {"global_step": trainer.global_step, "from_hooks": seen, "off_reason": opt._overlap.off_reason,
            "frozen": opt.frozen, "hooks_left": opt._overlap.launcher is not None}  # fmt: skip


class _DemoTransformer(pl.LightningModule):
    """Lightning's own demo Transformer (not written for this), trained with AdamW on random tokens."""

    def __init__(self) -> None:
        super().__init__()
        from lightning.pytorch.demos import Transformer

        self.model = Transformer(vocab_size=64, ninp=32, nhead=2, nhid=32, nlayers=2)

    def training_step(self, batch, batch_idx):
        inputs, target = batch
        return torch.nn.functional.nll_loss(self.model(inputs, target), target.view(-1))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _demo_params(rank: int, port: int, overlap: bool) -> torch.Tensor:
    """The demo Transformer's parameters after 6 steps (freeze after 2; buckets of 2048 elements)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", NODE_RANK="0")
    os.environ["LOCAL_RANK"] = str(rank)
    g = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, 64, (48, 17), generator=g)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=8)
    pl.seed_everything(0, verbose=False)
    module = _DemoTransformer()
    cb = OneBitAdamCallback(freeze_step=2, bucket_mb=2048 * 4 / 2**20, overlap=overlap)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=6, callbacks=[cb], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, data)
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def _worker(rank: int, port: int, outdir: str) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=120)
    )
    res = {
        "inline": _train(rank, overlap=False),
        "overlap": _train(rank, overlap=True),
        "nan_skip": _train(rank, overlap=True, steps=6, nan_at=5),
        "nan_propagate": _train(rank, overlap=True, steps=6, nan_at=5, policy="propagate"),
        "nan_raise": _train(rank, overlap=True, steps=6, nan_at=5, policy="raise"),
        "accumulation": _accumulation_error(rank),
    }
    lport = port + 1
    res["lightning_overlap"] = _lightning(rank, lport)
    res["lightning_accumulate"] = _lightning(rank, lport, accumulate_grad_batches=2)
    res["lightning_clip"] = _lightning(rank, lport, gradient_clip_val=1.0)
    res["lightning_off"] = _lightning(rank, lport, overlap=False)
    res["demo"] = [_demo_params(rank, lport, overlap) for overlap in (False, True)]
    write_rank_result(outdir, rank, res, "rank{rank}.pkl")


@pytest.fixture(scope="module")
def results():
    with tempfile.TemporaryDirectory() as d:
        spawn(_worker, free_port(), d, nprocs=2, timeout_s=600)
        return rank_results(d, 2, "rank{rank}.pkl")


def test_overlapped_steps_are_bit_identical_to_inline_ones(results):
    for r in results:
        inline, overlap = r["inline"], r["overlap"]
        assert overlap["n_buckets"] == 2  # 2048 | 64 + 512 + 8 elements in buckets of 600
        for step in range(STEPS):
            assert torch.equal(inline["params"][step], overlap["params"][step]), step
            assert torch.equal(inline["momenta"][step], overlap["momenta"][step]), step
        assert all(torch.equal(a, b) for a, b in zip(inline["errors"], overlap["errors"]))
    assert torch.equal(results[0]["overlap"]["params"][-1], results[1]["overlap"]["params"][-1])


def test_buckets_start_from_the_gradient_hooks_and_no_agreement_all_reduce_runs(results):
    for r in results:
        inline, overlap = r["inline"], r["overlap"]
        # warm-up (FREEZE steps) and the first compressed step run inline; from then on every bucket of the step
        # starts from a hook
        assert inline["from_hooks"] == [None] * STEPS
        assert overlap["from_hooks"][: FREEZE + 1] == [None] * FREEZE + [0]
        assert overlap["from_hooks"][FREEZE + 1 :] == [overlap["n_buckets"]] * (STEPS - FREEZE - 1)
        assert inline["control_calls"][FREEZE:] == [1] * (STEPS - FREEZE)  # the 8-byte finite agreement
        assert overlap["control_calls"][FREEZE + 1 :] == [0] * (STEPS - FREEZE - 1)


def test_a_nan_gradient_on_one_rank_under_overlap_follows_the_policy_on_both(results):
    for r in results:
        skip = r["nan_skip"]
        assert skip["untouched"] and skip["skipped"] == 1 and skip["momentum_finite"]
        assert not r["nan_propagate"]["momentum_finite"]
        assert r["nan_raise"]["error"] and "the averaged 1-bit momentum" in r["nan_raise"]["error"]


def test_two_backward_passes_before_a_step_raise_and_name_the_way_out(results):
    for r in results:
        assert r["accumulation"] is not None and "overlap=False" in r["accumulation"]


def test_lightning_falls_back_to_inline_for_accumulation_and_clipping(results):
    for r in results:
        on = r["lightning_overlap"]
        assert on["frozen"] and on["from_hooks"][3:] == [2, 2, 2], on["from_hooks"]  # both buckets from hooks
        assert not on["hooks_left"], "fit's teardown removes the gradient hooks"
        for name, needle in (
            ("lightning_accumulate", "accumulate_grad_batches"),
            ("lightning_clip", "gradient_clip_val"),
        ):
            assert all(n is None for n in r[name]["from_hooks"]) and needle in (r[name]["off_reason"] or ""), name
        assert r["lightning_off"]["off_reason"] == "overlap=False"
        assert all(n is None for n in r["lightning_off"]["from_hooks"])
        assert r["lightning_accumulate"]["global_step"] == 6 and r["lightning_clip"]["global_step"] == 6


def test_lightning_demo_transformer_overlapped_equals_inline(results):
    for r in results:
        inline, overlap = r["demo"]
        assert torch.isfinite(overlap).all() and torch.equal(inline, overlap)


def test_overlap_argument_is_checked():
    with pytest.raises(ValueError, match="overlap"):
        OneBitAdam([torch.nn.Parameter(torch.zeros(2))], overlap="yes")
