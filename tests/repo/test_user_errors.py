"""What a new user types wrong: every argument error names the class the user called, the argument as the user
spelled it, the value, and what that codec (or argument) allows; one form everywhere:
``Owner(arg=value) <what is wrong>; allowed: <the set>``."""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
import warnings

import pytest
import torch

import lightning_qcomm as lq
from lightning_qcomm.codecs import codec_spec

PUBLIC = [
    "ActivationQuantConfig",
    "ActivationQuantization",
    "CommVolumeLogger",
    "LocalSGDConfig",
    "LocalSGDStrategy",
    "OneBitAdamCallback",
    "QSDPConfig",
    "QSDPStrategy",
    "QuantDDPConfig",
    "QuantDDPStrategy",
]
FABRIC = {  # Fabric strategies take their config's fields as keyword arguments
    "LocalSGDFabricStrategy": "LocalSGDConfig",
    "QSDPFabricStrategy": "QSDPConfig",
    "QuantDDPFabricStrategy": "QuantDDPConfig",
}


def _range(codec: str) -> tuple[int, int]:
    bits = codec_spec(codec).bits
    return bits.start, bits.stop - 1


def _raised(cls, **kwargs) -> Exception:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises((TypeError, ValueError)) as err:
            cls(**kwargs)
    return err.value


def _bad_widths(codec: str) -> list[int]:
    lo, hi = _range(codec)
    return [0, hi + 1] + ([lo - 1] if lo > 1 else [])


@pytest.mark.parametrize("owner", ["QuantDDPStrategy", "QuantDDPFabricStrategy", "QuantDDPConfig"])
@pytest.mark.parametrize("codec", ["uniform", "qsgd", "nuqsgd", "fp8_e4m3"])
def test_quant_ddp_width_is_checked_against_the_codec_first(owner, codec):
    lo, hi = _range(codec)
    allowed = str(lo) if lo == hi else f"{lo}..{hi}"
    for bits in _bad_widths(codec):
        msg = str(_raised(getattr(lq, owner), codec=codec, bits=bits))
        assert msg.startswith(f"{owner}(bits={bits})"), msg
        assert f"codec={codec!r}" in msg and f"allowed: {allowed}" in msg, msg


@pytest.mark.parametrize("owner", ["LocalSGDStrategy", "LocalSGDFabricStrategy", "LocalSGDConfig"])
@pytest.mark.parametrize("codec", ["uniform", "nuqsgd"])
def test_local_sgd_width_is_checked_against_the_codec_first(owner, codec):
    lo, hi = _range(codec)
    for bits in _bad_widths(codec):
        msg = str(_raised(getattr(lq, owner), codec=codec, bits=bits))
        assert msg.startswith(f"{owner}(bits={bits})") and f"{lo}..{hi}" in msg, msg


@pytest.mark.parametrize("owner", ["QSDPStrategy", "QSDPFabricStrategy", "QSDPConfig"])
def test_qsdp_names_the_width_argument_the_user_passed(owner):
    cls = getattr(lq, owner)
    msg = str(_raised(cls, bits=9))
    assert msg.startswith(f"{owner}(bits=9)") and "weight_bits" not in msg and "1..8" in msg, msg
    msg = str(_raised(cls, grad_bits=9))
    assert msg.startswith(f"{owner}(grad_bits=9)") and "grad_codec='uniform'" in msg, msg
    msg = str(_raised(cls, bits=8, weight_bits=0))
    assert msg.startswith(f"{owner}(weight_bits=0)"), msg
    msg = str(_raised(cls, weight_codec="nuqsgd", grad_codec="nuqsgd", bits=1))
    assert msg.startswith(f"{owner}(bits=1)") and "2..8" in msg, msg


def _arguments(name: str):
    """(parameter name, default) of the public constructor (a Fabric strategy: its config's fields)."""
    if name in FABRIC:
        return [(f.name, f.default) for f in dataclasses.fields(getattr(lq, FABRIC[name]))]
    return [(p.name, p.default) for p in inspect.signature(getattr(lq, name)).parameters.values()]


def _bad_values(default):
    if isinstance(default, bool):
        return ["yes", 1]
    if isinstance(default, (int, float)):
        return ["x", -1]
    if isinstance(default, str):
        return ["zzz", 3]
    return []


@pytest.mark.parametrize("owner", PUBLIC + list(FABRIC))
def test_every_argument_error_names_the_class_and_the_argument(owner):
    """One form everywhere: the message starts with ``Owner(arg=value)``. Every typed argument with a bool, int,
    float or str default gets a value of the wrong type and an out-of-range one; those that raise must say so in
    that form (a free-form str that is accepted is fine)."""
    cls = getattr(lq, owner)
    checked = 0
    for arg, default in _arguments(owner):
        for value in _bad_values(default):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    cls(**{arg: value})
                    continue
                except (TypeError, ValueError) as err:
                    msg, is_type = str(err), isinstance(err, TypeError)
            checked += 1
            assert msg.startswith(f"{owner}(") and arg in msg.split(")")[0], (arg, value, msg)
            if is_type or "allowed" in msg or "must be" in msg:
                continue
            raise AssertionError(f"{owner}({arg}={value!r}): the message does not say what is allowed: {msg}")
    assert checked >= 2


@pytest.mark.parametrize(
    "call,starts",
    [
        (lambda: lq.LocalSGDStrategy(sync="qsr", h_base=0), "LocalSGDStrategy(h_base=0)"),
        (lambda: lq.LocalSGDStrategy(sync="qsrr"), "LocalSGDStrategy(sync='qsrr')"),
        (lambda: lq.LocalSGDStrategy(alpha=0.0), "LocalSGDStrategy(alpha=0.0)"),
        (lambda: lq.ActivationQuantization(bits=9), "ActivationQuantization(bits=9)"),
        (lambda: lq.ActivationQuantization(policy="greedy"), "ActivationQuantization(policy='greedy')"),
    ],
)
def test_the_issue_examples_name_their_class(call, starts):
    with pytest.raises((TypeError, ValueError)) as err:
        call()
    assert str(err.value).startswith(starts), str(err.value)


# ------------------------------------------------------------------ the QSR period at AdamW's learning rates


def _qsr(total_steps: int, lr: float = 1e-3, **config):
    from lightning_qcomm.parallel import LocalSGD, LocalSGDConfig

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    cfg = LocalSGDConfig(sync="qsr", **config)
    return LocalSGD(model, opt, cfg, total_steps=total_steps, broadcast=False, register_hooks=False)


def test_qsr_warns_once_when_its_period_reaches_the_end_of_the_run(caplog):
    """The default alpha at AdamW's lr 1e-3 gives H = (0.0175 / 0.001)^2 = 306 > 160 steps: the run would average
    only at its end. Said once, with the alpha that gives a short period at this lr."""
    local_sgd = _qsr(160)
    with pytest.warns(UserWarning) as record, caplog.at_level(logging.INFO):
        local_sgd.begin_step()
    texts = [str(w.message) for w in record if "reaches the end of the run" in str(w.message)]
    assert len(texts) == 1 and "H=306" in texts[0] and "160 steps left" in texts[0], texts
    alpha = float(texts[0].split("alpha=")[2].split(" ")[0])
    assert math.floor((alpha / 1e-3) ** 2) == 8  # the suggestion gives what it says
    assert "= 306 steps at lr=0.001" in caplog.text
    for _ in range(local_sgd.sync_period):  # the next round starts: no second warning
        local_sgd.schedule.end_step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        local_sgd.begin_step()


def test_qsr_max_period_bounds_the_period_and_a_short_period_is_not_warned():
    local_sgd = _qsr(1000, max_period=16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        local_sgd.schedule.step = 1  # past step 0's warmup hint
        local_sgd.begin_step()
    assert local_sgd.sync_period == 16
    short = _qsr(1000, alpha=1e-3 * math.sqrt(8))  # H = 8 at lr 1e-3
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        short.schedule.step = 1
        short.begin_step()
    assert short.sync_period == 8


def test_qsr_long_period_without_a_known_end_is_warned():
    local_sgd = _qsr(None, lr=3e-4)  # H = (0.0175 / 3e-4)^2 = 3402 at the lr LLMs use with AdamW
    with pytest.warns(UserWarning, match=r"H=3402, is longer than 100 steps"):
        local_sgd.begin_step()


# ------------------------------------------------------------------ YAML mistakes in the bundled CLI

_YAML = """
trainer:
  accelerator: cpu
  devices: 1
  strategy:
    class_path: QSDPStrategy
    init_args:
      {strategy_args}
  callbacks:
    - class_path: lightning_qcomm.CommVolumeLogger
    - class_path: ActivationQuantization
      init_args:
        {callback_args}
model:
  class_path: lightning_qcomm.demo.ByteGPT
data:
  class_path: lightning_qcomm.demo.StdlibBytes
"""


@pytest.mark.parametrize(
    "strategy_args,callback_args,words",
    [
        ("grad_bitz: 8", "bits: 4", ["trainer.strategy.init_args.grad_bitz", "did you mean grad_bits?", "accepted:"]),
        ("grad_bits: 9", "bits: 4", ["trainer.strategy: QSDPStrategy(grad_bits=9)", "allowed: 1..8"]),
        ("bits: 8", "bitz: 4", ["trainer.callbacks[1].init_args.bitz", "ActivationQuantization", "did you mean bits?"]),
        ("bits: 8", "bits: 9", ["trainer.callbacks[1]: ActivationQuantization(bits=9)", "1..8"]),
    ],
)
def test_cli_reports_a_yaml_mistake_in_one_line(strategy_args, callback_args, words, tmp_path, capsys):
    from lightning_qcomm.cli import make_cli

    path = tmp_path / "mine.yaml"
    path.write_text(_YAML.format(strategy_args=strategy_args, callback_args=callback_args))
    with pytest.raises(SystemExit) as exit_info:
        make_cli(["--config", str(path)], run=False)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("lightning-qcomm: error: mine.yaml: "), err
    for w in words:
        assert w in err, (w, err)


def test_cli_check_passes_a_correct_yaml(tmp_path):
    from lightning_qcomm.cli import make_cli

    path = tmp_path / "mine.yaml"
    path.write_text(_YAML.format(strategy_args="grad_bits: 4", callback_args="bits: 4"))
    cli = make_cli(["--config", str(path), "--trainer.logger=false"], run=False)
    assert cli.trainer.strategy.config.grad_bits == 4  # the YAML reached the strategy through LightningCLI
