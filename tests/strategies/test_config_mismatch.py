"""Ranks that disagree on a strategy's or callback's settings, or where one rank lacks it, stop at setup
with the same clear error on every rank that runs it (no hang, no silent garbage).

Each case runs two real processes with different settings; the assertions are on what they print and on
their exit status. The guard (60 s) only bounds a hang; the error comes within the strategies' 5 s
timeout, the time allowed for a rank to publish its settings.
"""

from __future__ import annotations

import textwrap

import pytest
from _launch import run_ranks

GUARD_S = 60

_SCRIPT = textwrap.dedent(
    """
    import datetime, os, warnings
    warnings.filterwarnings("ignore")
    import torch, lightning.pytorch as pl
    from torch import nn
    from lightning.pytorch.strategies import DDPStrategy
    from lightning_qcomm import LocalSGDStrategy, OneBitAdamCallback, QSDPStrategy, QuantDDPStrategy

    rank = int(os.environ["LOCAL_RANK"])
    T = datetime.timedelta(seconds=5)

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 4))
        def training_step(self, batch, i):
            x, y = batch
            return nn.functional.cross_entropy(self.body(x), y)
        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)
        def train_dataloader(self):
            x = torch.randn(256, 32)
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, :4].argmax(1)), batch_size=16)

    strategy, callbacks = {setup}
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, callbacks=callbacks, max_steps=8,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Net())
    print("FINISHED")
    """
)

# case -> (expression per rank, words rank 0's error must contain, whether rank 1 runs the component too)
CASES = {
    "quant_ddp_vs_plain_ddp": (
        ["(QuantDDPStrategy(codec='uniform', bits=8, timeout=T), [])", "(DDPStrategy(timeout=T), [])"],
        ["QuantDDPStrategy", "ranks [1]", "did not publish"],
        False,
    ),
    "quant_ddp_codec": (
        [f"(QuantDDPStrategy(codec='{c}', bits=4, timeout=T), [])" for c in ("qsgd", "nuqsgd")],
        ["codec", "rank0='qsgd'", "rank1='nuqsgd'"],
        True,
    ),
    "local_sgd_period": (
        [f"(LocalSGDStrategy(sync='constant', period={p}, timeout=T), [])" for p in (3, 4)],
        ["period", "rank0=3", "rank1=4"],
        True,
    ),
    "local_sgd_alpha": (
        [f"(LocalSGDStrategy(sync='qsr', alpha={a}, timeout=T), [])" for a in (0.01, 0.02)],
        ["alpha", "rank0=0.01", "rank1=0.02"],
        True,
    ),
    "onebit_freeze_step": (
        [f"(DDPStrategy(timeout=T), [OneBitAdamCallback(freeze_step={f})])" for f in (3, 5)],
        ["OneBitAdamCallback", "freeze_step", "rank0=3", "rank1=5"],
        True,
    ),
    "qsdp_weight_codec": (
        [f"(QSDPStrategy(bits=4, weight_codec='{c}', min_quant_numel=0, timeout=T), [])" for c in ("qsgd", "nuqsgd")],
        ["QSDPStrategy", "weight_codec", "'name': 'qsgd'", "'name': 'nuqsgd'"],
        True,
    ),
    "qsdp_bits": (
        [f"(QSDPStrategy(bits={b}, min_quant_numel=0, timeout=T), [])" for b in (8, 4)],
        ["QSDPStrategy", "'bits': 8", "'bits': 4"],
        True,
    ),
    "onebit_on_rank0_only": (
        ["(DDPStrategy(timeout=T), [OneBitAdamCallback(freeze_step=3)])", "(DDPStrategy(timeout=T), [])"],
        ["OneBitAdamCallback", "ranks [1]", "did not publish"],
        False,
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_mismatch_stops_at_setup_with_both_values(case, tmp_path):
    setups, words, both_run_it = CASES[case]
    scripts = []
    for rank, setup in enumerate(setups):
        path = tmp_path / f"rank{rank}.py"
        path.write_text(_SCRIPT.replace("{setup}", setup))
        scripts.append(str(path))
    outcomes = run_ranks(scripts, guard_s=GUARD_S, preloaded=True)
    for rank, o in enumerate(outcomes):
        assert o.returncode is not None, f"rank {rank} still running after {GUARD_S} s:\n{o.output[-2000:]}"
        assert o.returncode != 0 and "FINISHED" not in o.output, f"rank {rank} trained:\n{o.output[-2000:]}"
    checked = outcomes if both_run_it else outcomes[:1]
    for rank, o in enumerate(checked):
        for w in words:
            assert w in o.output, (rank, w, o.output[-3000:])
