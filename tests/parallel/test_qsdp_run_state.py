"""QSDP's run state has one format and one restore for the Trainer's and Fabric's strategies: each writes the
same entry, and each warns when a checkpoint written with another seed is resumed (no process group: the
strategies are not launched, so ``world_size`` is 1 and the layout flat)."""

from __future__ import annotations

import logging

import pytest

from lightning_qcomm.fabric.qsdp import QSDPFabricStrategy
from lightning_qcomm.strategies.qsdp import QSDPStrategy

KINDS = ("trainer", "fabric")


def _strategy(kind: str, seed: int):
    return QSDPStrategy(bits=8, seed=seed) if kind == "trainer" else QSDPFabricStrategy(bits=8, seed=seed)


def _save(strategy) -> dict:
    if isinstance(strategy, QSDPStrategy):
        return strategy.qsdp_state_dict()
    return strategy.checkpoint_entry({})[0]


def _load(strategy, entry: dict) -> None:
    if isinstance(strategy, QSDPStrategy):
        strategy.load_qsdp_state_dict(entry)
    else:
        strategy.restore_entry(entry, {})


def _written(kind: str, seed: int, step: int) -> dict:
    strategy = _strategy(kind, seed)
    strategy.comm_state.step = step
    return _save(strategy)


def test_both_strategies_write_the_same_entry():
    trainer, fabric = (_written(kind, seed=3, step=7) for kind in KINDS)
    assert trainer == fabric
    assert trainer == {"rng_step": 7, "seed": 3, "world_size": 1, "topology": None}


@pytest.mark.parametrize("written_by", KINDS)
@pytest.mark.parametrize("kind", KINDS)
def test_another_seed_is_warned_and_the_step_restored(kind, written_by, caplog):
    entry = _written(written_by, seed=0, step=5)
    strategy = _strategy(kind, seed=1)
    with caplog.at_level(logging.WARNING):
        _load(strategy, entry)
    assert strategy.comm_state.step == 5
    said = [r.getMessage() for r in caplog.records if "seed" in r.getMessage()]
    assert len(said) == 1 and "seed 0 differs" in said[0] and "seed 1" in said[0], said


@pytest.mark.parametrize("kind", KINDS)
def test_the_same_seed_is_not_warned(kind, caplog):
    entry = _written(kind, seed=2, step=4)
    strategy = _strategy(kind, seed=2)
    with caplog.at_level(logging.WARNING):
        _load(strategy, entry)
    assert strategy.comm_state.step == 4
    assert not [r for r in caplog.records if "seed" in r.getMessage()]


@pytest.mark.parametrize("kind", KINDS)
def test_an_entry_of_the_older_format_still_loads(kind, caplog, recwarn):
    """Checkpoints written before the layout and the seed were recorded hold only the RNG step."""
    strategy = _strategy(kind, seed=1)
    with caplog.at_level(logging.WARNING):
        _load(strategy, {"rng_step": 5})
    assert strategy.comm_state.step == 5
    assert not [r for r in caplog.records if "seed" in r.getMessage() or "layout" in r.getMessage()]
    assert not [w for w in recwarn if "checkpoint" in str(w.message)]
