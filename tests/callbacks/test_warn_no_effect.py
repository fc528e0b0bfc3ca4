"""A feature that does nothing says so, once (``rank_zero_warn``), naming the setting and why.

ActivationQuantization on a model where little of what autograd saves comes from ops it quantizes (the share
is in the message), and on a model that runs under ``torch.compile`` (the whole LightningModule, or a submodule compiled in
``configure_model``); a model it does quantize stays silent. (1-bit Adam's own DDP hook no longer draws a
message from CommVolumeLogger: tests/callbacks/test_comm_logger.py checks that in its two-rank run.)
"""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_qcomm import ActivationQuantization

LOW_SHARE = "so it saves little on this model"
COMPILED = "torch.compile"


class ConvNet(pl.LightningModule):
    """Convolutions and ReLU: the convolutions' and ReLU's saves are quantized (the first convolution's input
    is the batch itself, a leaf, which autograd holds anyway)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 1, 3, padding=1))

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.net(x).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(16, 3, 16, 16, generator=torch.Generator().manual_seed(0))), 4)


class CumprodNet(ConvNet):
    """A small Linear, then a running product along 4096 elements: ``cumprod`` saves its input and output
    (2 x 16 KiB per sample), an op the callback does not quantize; the Linear's saves are below min_numel."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(16, 16)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        y = self.net(x).repeat(1, 256)  # 4 x 4096 elements
        return torch.cumprod(1.0 + 0.01 * y, dim=1).mean()

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(16, 16, generator=torch.Generator().manual_seed(0))), 4)


class MLP(ConvNet):
    """Linear + GELU on 32 x 64 inputs: 2048-element saves, above min_numel, so they are quantized."""

    def __init__(self, compile_net: bool = False) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1))
        self.compile_net = compile_net

    def configure_model(self) -> None:
        if self.compile_net:
            self.net = torch.compile(self.net, backend="eager")

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(64, 64, generator=torch.Generator().manual_seed(0))), 32)


def _fit(model: pl.LightningModule, steps: int = 3) -> ActivationQuantization:
    cb = ActivationQuantization(bits=4)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        callbacks=[cb],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(model)
    return cb


def _messages(record, needle: str) -> list[str]:
    """The callback's own warnings containing ``needle`` (torch's dynamo warns about graph breaks too)."""
    return [
        str(w.message)
        for w in record
        if str(w.message).startswith("ActivationQuantization") and needle in str(w.message)
    ]


def test_model_with_little_quantizable_warns_once_with_the_share():
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        cb = _fit(CumprodNet())
    stats = cb.last_step_stats
    assert stats.coverage < 0.5 and stats.baseline > 0
    (msg,) = _messages(record, LOW_SHARE)
    assert "bits=4" in msg and "min_numel=1024" in msg and f"{stats.coverage:.0%}" in msg


@pytest.mark.parametrize("model", [ConvNet, lambda: MLP()])
def test_quantizable_model_is_silent(model):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        cb = _fit(model())
    assert cb.last_step_stats.quantized_tensors > 0 and cb.last_step_stats.coverage >= 0.5
    assert not _messages(record, LOW_SHARE) and not _messages(record, COMPILED)


@pytest.mark.parametrize("how", ["whole_module", "submodule"])
def test_torch_compile_warns_once(how):
    model = torch.compile(MLP(), backend="eager") if how == "whole_module" else MLP(compile_net=True)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _fit(model, steps=1)
    (msg,) = _messages(record, COMPILED)
    assert "not supported" in msg


def test_hsdp_weight_settings_without_intra_node_bits_warn():
    """With hsdp=True and intra_node_bits=None the weights are gathered by FSDP2 inside the node, unquantized:
    an explicit weight_bits / weight_codec does nothing and is said; the defaults stay silent."""
    from lightning_qcomm.parallel import QSDPConfig

    with pytest.warns(UserWarning, match="weight_bits=4.*no effect.*intra_node_bits"):
        QSDPConfig(hsdp=True, weight_bits=4)
    with pytest.warns(UserWarning, match="weight_codec='qsgd'.*no effect"):
        QSDPConfig(hsdp=True, weight_codec="qsgd")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        QSDPConfig(hsdp=True, grad_bits=8)
        QSDPConfig(hsdp=True, weight_bits=4, intra_node_bits=8)
