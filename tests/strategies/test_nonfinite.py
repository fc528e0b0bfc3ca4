"""The non-finite gradient policy of every strategy, with NaN or Inf injected on one rank only (2 gloo ranks).

Rank 1's loss is multiplied by NaN or Inf in one training step, so its local backward produces non-finite
gradients, as a real overflow would, before any synchronisation. Under ``nonfinite="skip"`` (the default)
that step must leave the weights untouched on every rank that applies the synchronised gradient (each
DDP-style strategy, QSDP, Local SGD's data-parallel steps, 1-bit Adam in both phases), and only on rank 1
for a Local SGD local step; training goes on with finite weights, identical on all ranks where the
strategy keeps them identical, and error-feedback / 1-bit error buffers stay finite. ``"raise"`` stops every
rank with a FloatingPointError; ``"propagate"`` reproduces the old behaviour (NaN weights).

Cost: one pair of spawned processes runs every case in-process, a tiny model, 6 steps each.
"""

from __future__ import annotations

import os
import tempfile
import warnings

import pytest
import torch
import torch.nn.functional as F
from _launch import free_port, rank_results, spawn, write_rank_result
from torch import nn

STEPS = 6


def _module_class(inject_step: int, kind: str):
    import lightning.pytorch as pl

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 4))

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self.body(x), y)
            if self.global_rank == 1 and self.trainer.global_step == inject_step:
                loss = loss * float(kind)  # "nan" / "inf": rank 1's local gradients become non-finite
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

        def train_dataloader(self):
            g = torch.Generator().manual_seed(0)
            x = torch.randn(512, 32, generator=g)
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, :4].argmax(1)), batch_size=16)

    return Net


def _strategy(spec: dict):
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_qcomm import LocalSGDStrategy, OneBitAdamCallback, QSDPStrategy, QuantDDPStrategy

    kind, kw, policy = spec["strategy"], dict(spec.get("kw", {})), spec["policy"]
    if kind == "quant_ddp":
        return QuantDDPStrategy(nonfinite=policy, **kw), []
    if kind == "qsdp":
        return QSDPStrategy(nonfinite=policy, **kw), []
    if kind == "local_sgd":
        return LocalSGDStrategy(nonfinite=policy, **kw), []
    if kind == "onebit":
        return DDPStrategy(), [OneBitAdamCallback(nonfinite=policy, **kw)]
    raise KeyError(kind)


def _full(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().reshape(-1)


CASES: dict[str, dict] = {}
for i, (codec, bits, ef) in enumerate(
    [
        ("uniform", 8, False),
        ("qsgd", 4, False),
        ("qsgdinf", 8, False),
        ("nuqsgd", 4, False),
        ("fp8_e4m3", 8, False),
        ("fp8_e5m2", 8, False),
        ("none", None, False),
        ("uniform", 2, True),
    ]
):
    CASES[f"quant_ddp-{codec}{bits or ''}{'-ef' if ef else ''}"] = {
        "strategy": "quant_ddp",
        "kw": {"codec": codec, "bits": bits, "error_feedback": ef, "min_quant_numel": 0},
        "policy": "skip",
        "kind": "nan" if i % 2 == 0 else "inf",
        "at": 2,
    }
CASES.update(
    {
        "quant_ddp-raise": {"strategy": "quant_ddp", "kw": {"codec": "uniform", "bits": 8}, "policy": "raise"},
        "quant_ddp-propagate": {"strategy": "quant_ddp", "kw": {"codec": "uniform", "bits": 8}, "policy": "propagate"},
        "qsdp-uniform8": {"strategy": "qsdp", "kw": {"bits": 8, "min_quant_numel": 0}, "policy": "skip"},
        "qsdp-qsgd4": {
            "strategy": "qsdp",
            "kw": {"bits": 4, "grad_codec": "qsgd", "min_quant_numel": 0},
            "policy": "skip",
            "kind": "inf",
        },
        "qsdp-raise": {"strategy": "qsdp", "kw": {"bits": 8}, "policy": "raise"},
        "qsdp-propagate": {"strategy": "qsdp", "kw": {"bits": 8}, "policy": "propagate"},
        "local_sgd-local": {"strategy": "local_sgd", "kw": {"sync": "constant", "period": 2}, "policy": "skip"},
        "local_sgd-local-uniform8": {
            "strategy": "local_sgd",
            "kw": {"sync": "constant", "period": 2, "codec": "uniform", "bits": 8},
            "policy": "skip",
            "kind": "inf",
        },
        "local_sgd-data_parallel": {
            "strategy": "local_sgd",
            "kw": {"sync": "post_local", "switch_step": 100, "period": 2},
            "policy": "skip",
        },
        "local_sgd-raise": {
            "strategy": "local_sgd",
            "kw": {"sync": "post_local", "switch_step": 100, "period": 2},
            "policy": "raise",
        },
        "local_sgd-propagate": {
            "strategy": "local_sgd",
            "kw": {"sync": "constant", "period": 2},
            "policy": "propagate",
        },
        "onebit-warmup": {"strategy": "onebit", "kw": {"freeze_step": 4}, "policy": "skip", "at": 1},
        "onebit-compressed": {"strategy": "onebit", "kw": {"freeze_step": 2}, "policy": "skip", "kind": "inf", "at": 4},
        "onebit-raise": {"strategy": "onebit", "kw": {"freeze_step": 2}, "policy": "raise", "at": 4},
        "onebit-propagate": {"strategy": "onebit", "kw": {"freeze_step": 2}, "policy": "propagate", "at": 4},
    }
)


def _run_case(spec: dict) -> dict:
    import lightning.pytorch as pl
    import torch.distributed as dist

    at, kind = spec.get("at", 2), spec.get("kind", "nan")
    seen: dict = {}

    class Probe(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == at:
                seen["before"] = torch.cat([_full(p) for p in pl_module.parameters()])

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == at + 1:
                seen["after"] = torch.cat([_full(p) for p in pl_module.parameters()])

    pl.seed_everything(0, verbose=False)
    strategy, callbacks = _strategy(spec)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        callbacks=[*callbacks, Probe()],
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = _module_class(at, kind)()
    out: dict = {}
    try:
        trainer.fit(module)
    except FloatingPointError as err:
        out["raised"] = str(err)
    dist.barrier()
    final = torch.cat([_full(p) for p in module.parameters()])
    both = [torch.empty_like(final) for _ in range(2)]
    dist.all_gather(both, final)
    guard = getattr(trainer.strategy, "nonfinite", None)
    if spec["strategy"] == "onebit":
        guard = getattr(trainer.optimizers[0] if trainer.optimizers else None, "nonfinite", None)
    out.update(
        finite=bool(torch.isfinite(final).all()),
        identical=torch.equal(both[0], both[1]),
        skipped=None if guard is None else guard.skipped,
        untouched=("before" in seen and "after" in seen and torch.equal(seen["before"], seen["after"])),
        steps=trainer.global_step,
    )
    hook = getattr(trainer.strategy, "hook_state", None)
    if hook is not None and hook.config.error_feedback:
        out["buffers_finite"] = all(bool(torch.isfinite(e).all()) for e in hook.ef_state_dict().values())
    if spec["strategy"] == "onebit" and trainer.optimizers:
        rank_state = trainer.optimizers[0].rank_state_dict()
        errors = [e for key in ("worker_error", "server_error") for e in (rank_state.get(key) or [])]
        out["buffers_finite"] = all(bool(torch.isfinite(e).all()) for e in errors)
    return out


def _worker(rank: int, port: int, outdir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", NODE_RANK="0")
    os.environ["LOCAL_RANK"] = str(rank)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    res = {name: _run_case(spec) for name, spec in CASES.items()}
    write_rank_result(outdir, rank, res, "rank{rank}.pkl")


@pytest.fixture(scope="module")
def results():
    with tempfile.TemporaryDirectory() as d:
        spawn(_worker, free_port(), d, nprocs=2)
        return rank_results(d, 2, "rank{rank}.pkl")


SKIP_EVERYWHERE = [
    n for n, s in CASES.items() if s["policy"] == "skip" and n not in ("local_sgd-local", "local_sgd-local-uniform8")
]


@pytest.mark.parametrize("name", SKIP_EVERYWHERE)
def test_skip_leaves_every_rank_untouched_and_training_goes_on(results, name):
    for rank, r in enumerate(results):
        case = r[name]
        assert "raised" not in case, case["raised"]
        assert case["steps"] == STEPS
        assert case["untouched"], f"rank {rank}: the step with the non-finite gradient changed the weights"
        assert case["skipped"] == 1, f"rank {rank}: skipped={case['skipped']}"
        assert case["finite"] and case["identical"], case
        assert case.get("buffers_finite", True), "error-feedback buffers were poisoned"


@pytest.mark.parametrize("name", ["local_sgd-local", "local_sgd-local-uniform8"])
def test_local_sgd_local_step_skips_on_the_rank_with_the_bad_gradient(results, name):
    r0, r1 = results[0][name], results[1][name]
    assert r1["untouched"] and r1["skipped"] == 1
    assert not r0["untouched"] and r0["skipped"] == 0  # rank 0's own gradient was fine: its local step ran
    for case in (r0, r1):
        assert case["steps"] == STEPS and case["finite"] and case["identical"], case  # the final sync averages


@pytest.mark.parametrize("name", [n for n, s in CASES.items() if s["policy"] == "raise"])
def test_raise_stops_every_rank(results, name):
    for r in results:
        assert "non-finite gradient" in r[name].get("raised", ""), r[name]
        assert "nonfinite='raise'" in r[name]["raised"]


@pytest.mark.parametrize("name", [n for n, s in CASES.items() if s["policy"] == "propagate"])
def test_propagate_keeps_torch_behaviour(results, name):
    """The old behaviour, kept on request: the NaN reaches the weights (of rank 1 at least)."""
    assert any(not r[name]["finite"] for r in results), [r[name] for r in results]


def test_policy_is_validated():
    from lightning_qcomm import LocalSGDStrategy, OneBitAdamCallback, QSDPStrategy, QuantDDPStrategy

    for cls in (QuantDDPStrategy, QSDPStrategy, LocalSGDStrategy, OneBitAdamCallback):
        with pytest.raises(ValueError, match="nonfinite='ignore'.*skip, raise, propagate"):
            cls(nonfinite="ignore")
        with pytest.raises(TypeError, match="nonfinite"):
            cls(nonfinite=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_nonfinite_params_flags_exactly_the_bad_gradients(dtype):
    from lightning_qcomm.comm.nonfinite import nonfinite_params

    big = torch.finfo(dtype).max
    grads = {
        "finite extremes": torch.tensor([big, -big, 0.0, 1e-30]),
        "nan": torch.tensor([1.0, float("nan")]),
        "+inf": torch.tensor([float("inf"), 1.0]),
        "-inf": torch.tensor([-float("inf")]),
        "both infs": torch.tensor([float("inf"), -float("inf")]),
        "empty": torch.zeros(0),
        "plain": torch.randn(1000),
    }
    params = []
    for g in grads.values():
        p = torch.nn.Parameter(torch.zeros(g.shape, dtype=dtype))
        p.grad = g.to(dtype)
        params.append(p)
    bad = {list(grads)[i] for i in nonfinite_params(params)}
    assert bad == {"nan", "+inf", "-inf", "both infs"}


def test_nonfinite_params_mixed_dtypes_in_one_call():
    """One call over gradients of different dtypes (the flags are stacked across them): a finite fp64 value
    beyond fp32's range is not flagged, an fp16 -inf is."""
    from lightning_qcomm.comm.nonfinite import nonfinite_params

    grads = [
        torch.tensor([1e300, -1e300], dtype=torch.float64),
        torch.tensor([1.0, -float("inf")], dtype=torch.float16),
        torch.tensor([3e38], dtype=torch.float32),
        torch.tensor([float("nan")], dtype=torch.bfloat16),
        torch.zeros(0, dtype=torch.float64),
    ]
    params = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros(g.shape, dtype=g.dtype))
        p.grad = g
        params.append(p)
    assert nonfinite_params(params) == [1, 3]
