"""The user's ``timeout`` holds on every process group we create (issue: the overlap path's own group had
torch's 30-minute default): a peer that stalls makes the others fail within about that timeout.

Each case starts two real processes the way Lightning's "processes created externally" mode sees them
(``LOCAL_RANK``/``WORLD_SIZE`` set); rank 1 stalls inside its third training step, so rank 0 waits in
the overlapped gradient collective on the strategy's dedicated group. The assertion is on the outcome
(rank 0 exits with the collective's timeout error), with a generous wall-clock guard (90 s for a 5 s
timeout) that only a 30-minute wait can exceed: no timing is measured or compared.
"""

from __future__ import annotations

import textwrap

import pytest
from _launch import run_ranks

TIMEOUT_S = 5
GUARD_S = 90

_SCRIPT = textwrap.dedent(
    """
    import os, sys, time, datetime, warnings
    warnings.filterwarnings("ignore")
    import torch, lightning.pytorch as pl
    from torch import nn
    from lightning_qcomm import QSDPStrategy, QuantDDPStrategy

    rank = int(os.environ["LOCAL_RANK"])

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 4))
        def training_step(self, batch, i):
            if rank == 1 and self.global_step == 2:
                time.sleep(600)  # a stalled peer
            x, y = batch
            return nn.functional.cross_entropy(self.body(x), y)
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)
        def train_dataloader(self):
            x = torch.randn(256, 64)
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, :4].argmax(1)), batch_size=16)

    strategy = {strategy}
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=8, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Net())
    """
)

CASES = {
    "quant_ddp_overlap": "QuantDDPStrategy(codec='uniform', bits=8, min_quant_numel=0, overlap_comm=True, "
    f"timeout=datetime.timedelta(seconds={TIMEOUT_S}))",
    "qsdp_overlap": f"QSDPStrategy(bits=8, min_quant_numel=0, overlap_comm=True, timeout=datetime.timedelta(seconds={TIMEOUT_S}))",
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_stalled_peer_fails_the_others_within_the_strategy_timeout(case, tmp_path):
    script = tmp_path / "run.py"
    script.write_text(_SCRIPT.replace("{strategy}", CASES[case]))
    rank0 = run_ranks(str(script), guard_s=GUARD_S, wait_ranks=[0], preloaded=True)[0]  # rank 1 stalls for good
    assert rank0.returncode is not None, (
        f"rank 0 still waiting after {GUARD_S} s for a peer, with timeout={TIMEOUT_S} s"
    )
    assert rank0.returncode != 0, rank0.output[-3000:]
    assert "timed out" in rank0.output.lower() or "timeout" in rank0.output.lower(), rank0.output[-3000:]
