"""destroy_gloo_group_at_exit: the registered handler destroys a live gloo default group, once registered."""

import atexit
import os
import subprocess
import sys
import textwrap

import torch.distributed as dist

from lightning_qcomm.comm import process_group


def test_handler_destroys_gloo_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    assert dist.is_initialized()
    process_group._destroy_if_gloo()
    assert not dist.is_initialized()
    process_group._destroy_if_gloo()  # nothing to do, no error


def test_registration_is_idempotent(monkeypatch):
    calls = []
    monkeypatch.setattr(process_group, "_registered", False)
    monkeypatch.setattr(atexit, "register", lambda fn: calls.append(fn))
    process_group.destroy_gloo_group_at_exit()
    process_group.destroy_gloo_group_at_exit()
    assert calls == [process_group._destroy_if_gloo]


def test_process_exits_cleanly_with_group_destroyed_at_exit(tmp_path):
    """A process that registers the handler and exits with pending-free gloo state ends with status 0 and
    has destroyed its group by the time atexit handlers ran (checked by a later-registered handler, which
    atexit runs first, and a marker written after ours)."""
    script = textwrap.dedent(
        f"""
        import atexit, torch, torch.distributed as dist
        from lightning_qcomm.comm.process_group import destroy_gloo_group_at_exit
        dist.init_process_group("gloo", init_method="file://{tmp_path}/store2", rank=0, world_size=1)
        atexit.register(lambda: open("{tmp_path}/after", "w").write(str(dist.is_initialized())))
        destroy_gloo_group_at_exit()  # registered last, so it runs first at exit
        dist.all_reduce(torch.ones(4))
        """
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "after").read_text() == "False"


def _registrations(monkeypatch) -> list:
    calls: list = []
    monkeypatch.setattr(process_group, "_registered", False)
    monkeypatch.setattr(atexit, "register", lambda fn: calls.append(fn))
    return calls


def test_a_group_made_for_background_collectives_registers_the_handler(tmp_path, monkeypatch):
    """The groups this package creates itself (the background worker's, the node groups) are reason enough to
    destroy the default group at exit: plain-torch users of ``OneBitAdam`` or ``LocalSGD`` have no strategy
    of ours to register it."""
    from lightning_qcomm.comm.comm_worker import dedicated_group
    from lightning_qcomm.comm.topology import Topology, node_groups

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store3", rank=0, world_size=1)
    try:
        calls = _registrations(monkeypatch)
        dedicated_group()
        assert calls == [process_group._destroy_if_gloo]
        calls = _registrations(monkeypatch)
        node_groups(Topology(world_size=1, node_size=1))
        assert calls == [process_group._destroy_if_gloo]
    finally:
        dist.destroy_process_group()


def test_the_onebit_callback_registers_the_handler(monkeypatch):
    """``OneBitAdamCallback`` runs under Lightning's own ``DDPStrategy``, which never destroys its group."""
    import lightning.pytorch as pl
    import torch

    from lightning_qcomm import OneBitAdamCallback

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, _):
            return self.layer(batch).pow(2).mean()

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=4)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    calls = _registrations(monkeypatch)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=1,
        callbacks=[OneBitAdamCallback(freeze_step=1)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Tiny())
    assert process_group._destroy_if_gloo in calls
