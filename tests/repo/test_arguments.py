"""Every public constructor refuses wrong-typed and out-of-range arguments at once, with a TypeError or
ValueError naming the argument (no coercion: "no" is not False, "0" and 1.7 are not ints, True is not a
number, NaN is not a size, 5 is not a timeout).

The wrong-typed values are derived from each argument's annotation, so an argument added later is walked
too; the out-of-range values are listed per argument below.
"""

from __future__ import annotations

import inspect
import math
import types
import typing
from datetime import timedelta
from typing import Literal, Union, get_args, get_origin, get_type_hints

import pytest
import torch

from lightning_qcomm import (
    ActivationQuantization,
    CommVolumeLogger,
    LocalSGDStrategy,
    OneBitAdam,
    OneBitAdamCallback,
    QSDPStrategy,
    QuantDDPStrategy,
    get_codec,
)

# Arguments that take Lightning or torch objects, not primitives (validated by Lightning / torch).
NOT_PRIMITIVE = {
    "accelerator",
    "parallel_devices",
    "cluster_environment",
    "checkpoint_io",
    "precision_plugin",
    "process_group_backend",
    "process_group",
    "params",
}


def _wrong_values(hint) -> list:
    args, origin = get_args(hint), get_origin(hint)
    optional = type(None) in args
    base = [a for a in args if a is not type(None)] if origin in (Union, types.UnionType) else [hint]
    b = base[0] if len(base) == 1 else None
    if len(base) == 2 and int in base and any(get_origin(a) is Literal for a in base):  # an int or a keyword
        return ["0", 1.7, True, "bogus"]
    if b is bool:
        return ["no", 1, 0.0] + ([] if optional else [None])
    if b is int:
        return ["0", 1.7, True] + ([] if optional else [None])
    if b is float:
        return ["x", math.nan, math.inf, True] + ([] if optional else [None])
    if b is str:
        return [5, True]
    if get_origin(b) is Literal:
        return ["bogus", 5]
    if b is timedelta:
        return [5, "5", timedelta(seconds=-1), timedelta(0)]
    if b is typing.Any or b is None:
        return []
    return []


def _make(owner, **kw):
    if owner is OneBitAdam:
        return OneBitAdam([torch.nn.Parameter(torch.zeros(2))], **kw)
    return owner(**kw)


OWNERS = (
    QSDPStrategy,
    QuantDDPStrategy,
    LocalSGDStrategy,
    OneBitAdamCallback,
    OneBitAdam,
    ActivationQuantization,
    CommVolumeLogger,
)


def _walk():
    cases = []
    for owner in OWNERS:
        hints = get_type_hints(owner.__init__)
        for name, p in inspect.signature(owner.__init__).parameters.items():
            if name == "self" or name in NOT_PRIMITIVE or p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
                continue
            for value in _wrong_values(hints.get(name)):
                cases.append(pytest.param(owner, name, value, id=f"{owner.__name__}-{name}={value!r}"))
    return cases


WALK = _walk()


def test_the_walk_covers_every_owner():
    covered = {c.values[0] for c in WALK}
    assert covered == set(OWNERS), set(OWNERS) - covered
    assert len(WALK) > 150


@pytest.mark.parametrize("owner, name, value", WALK)
def test_wrong_type_or_value_is_refused_naming_the_argument(owner, name, value):
    with pytest.raises((TypeError, ValueError)) as info:
        _make(owner, **{name: value})
    assert name in str(info.value), str(info.value)


OUT_OF_RANGE = [
    (QSDPStrategy, "seed", -1),
    (QSDPStrategy, "bucket_size", 0),
    (QSDPStrategy, "min_quant_numel", -1),
    (QSDPStrategy, "start_method", "thread"),
    (QuantDDPStrategy, "seed", -1),
    (QuantDDPStrategy, "start_method", "thread"),
    (QuantDDPStrategy, "timeout", timedelta(seconds=-5)),
    (LocalSGDStrategy, "seed", -1),
    (LocalSGDStrategy, "period", 0),
    (LocalSGDStrategy, "comm_bucket_mb", 0.0),
    (LocalSGDStrategy, "comm_bucket_mb", -1.0),
    (LocalSGDStrategy, "start_method", "thread"),
    (LocalSGDStrategy, "bits", 0),
    (OneBitAdamCallback, "freeze_step", 0),
    (OneBitAdamCallback, "bucket_mb", -1.0),
    (OneBitAdamCallback, "variance_refresh", -1),
    (OneBitAdam, "variance_refresh", -1),
    (OneBitAdam, "lr", -1.0),
    (OneBitAdam, "eps", -1.0),
    (ActivationQuantization, "bits", 0),
    (CommVolumeLogger, "log_every_n_steps", 0),
    (CommVolumeLogger, "summary_file", "/nonexistent-dir/summary.txt"),
]


@pytest.mark.parametrize("owner, name, value", OUT_OF_RANGE, ids=lambda x: getattr(x, "__name__", repr(x)))
def test_out_of_range_is_refused_naming_the_argument(owner, name, value):
    with pytest.raises((TypeError, ValueError)) as info:
        _make(owner, **{name: value})
    assert name in str(info.value), str(info.value)


def test_summary_file_that_is_a_directory_is_refused_at_construction(tmp_path):
    with pytest.raises(ValueError, match="summary_file"):
        CommVolumeLogger(summary_file=str(tmp_path))


@pytest.mark.parametrize("value", ["no", 1, None])
def test_codec_options_are_not_coerced(value):
    with pytest.raises(TypeError, match="stochastic"):
        get_codec("uniform", 4, stochastic=value)
