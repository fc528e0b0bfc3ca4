"""OneBitAdam's multi-tensor arithmetic (``optim.adam_foreach``) against the per-parameter reference
(``optim.adam_math``), bit for bit, and its op count, which must not grow with the number of parameters.

The parameters mix what a model brings: fp32, bf16 (fp32 moments) and fp64 (fp64 moments: the reference path)
tensors, a channels_last convolution weight, a frozen parameter (``requires_grad=False``), one without a gradient,
two param groups (decoupled weight decay and Adam's L2 term, other betas/eps/lr), coordinates whose variance is
zero (w = 0), huge and infinite variances, and NaN/Inf gradients.
"""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_qcomm.optim.adam_foreach import bucket_candidates, bucket_update_, warmup_step_
from lightning_qcomm.optim.adam_math import adamw_update_, frozen_update_, moment_dtype, momentum_candidates

GROUPS = [
    dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, decoupled_weight_decay=True),
    dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1, decoupled_weight_decay=False),
]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _model(seed: int = 0):
    """(params, state, group_of): params in layout order over two groups, states as after a warm-up step."""
    g = torch.Generator().manual_seed(seed)
    specs = [  # (shape, dtype, group, channels_last, requires_grad, has_grad)
        ((33, 7), torch.float32, 0, False, True, True),
        ((5,), torch.float32, 0, False, True, True),
        ((4, 3, 3, 3), torch.float32, 0, True, True, True),
        ((17,), torch.bfloat16, 0, False, True, True),
        ((9, 2), torch.float32, 0, False, False, True),
        ((64,), torch.float64, 0, False, True, True),
        ((13,), torch.float32, 0, False, True, False),
        ((31, 3), torch.float32, 1, False, True, True),
        ((6,), torch.bfloat16, 1, False, True, True),
        ((257,), torch.float32, 1, False, True, True),
    ]
    groups = [dict(GROUPS[0]), dict(GROUPS[1])]
    params, state, group_of = [], {}, {}
    for shape, dtype, gi, cl, rg, has_grad in specs:
        p = torch.randn(shape, generator=g).to(dtype)
        if cl:
            p = p.to(memory_format=torch.channels_last)
        p = torch.nn.Parameter(p, requires_grad=rg)
        if has_grad:
            p.grad = (torch.randn(shape, generator=g) * 0.1).to(dtype)
        md = moment_dtype(p)
        v = torch.rand(shape, generator=g).to(md) * 1e-3
        v.view(-1)[::5] = 0.0  # no usable variance: w = 0
        state[p] = {
            "step": torch.tensor(3.0),
            "exp_avg": (torch.randn(shape, generator=g) * 0.01).to(md),
            "exp_avg_sq": v,
        }
        if cl:
            for k in ("exp_avg", "exp_avg_sq"):
                state[p][k] = state[p][k].to(memory_format=torch.channels_last)
        params.append(p)
        group_of[p] = groups[gi]
    return params, state, group_of


def _specials(params, state) -> None:
    """NaN/Inf gradients, huge and infinite variances, a gradient far beyond its variance (the clip)."""
    params[0].grad.view(-1)[3] = float("nan")
    params[0].grad.view(-1)[4] = float("inf")
    params[7].grad.view(-1)[1] = -float("inf")
    params[9].grad.view(-1)[7] = 1e30
    state[params[9]]["exp_avg_sq"].view(-1)[8] = float("inf")
    state[params[9]]["exp_avg_sq"].view(-1)[9] = 3e38


def _copy(params, state, group_of):
    """A deep copy of (params, state, group_of) with the parameter keys remapped."""
    params2 = copy.deepcopy(params)
    for p, q in zip(params, params2):
        q.grad = None if p.grad is None else p.grad.clone()
    state2 = {q: {k: v.clone() for k, v in state[p].items()} for p, q in zip(params, params2)}
    groups = {id(g): dict(g) for g in group_of.values()}
    group_of2 = {q: groups[id(group_of[p])] for p, q in zip(params, params2)}
    return params2, state2, group_of2


def _assert_same_state(params, state, params2, state2):
    for i, (p, q) in enumerate(zip(params, params2)):
        assert _same(p, q), f"parameter {i}"
        for k in ("step", "exp_avg", "exp_avg_sq"):
            assert _same(state[p][k], state2[q][k]), f"parameter {i}: {k}"


@pytest.mark.parametrize("specials", [False, True])
@torch.no_grad()
def test_candidates_and_update_equal_the_reference_bit_for_bit(specials):
    params, state, group_of = _model()
    if specials:
        _specials(params, state)
    ref = _copy(params, state, group_of)
    flat = bucket_candidates(params, state, group_of)
    expected = momentum_candidates(*ref)
    assert _same(flat, expected)
    _assert_same_state(params, state, ref[0], ref[1])  # m stays
    if specials:
        assert flat.isnan().any() and flat.isinf().any()  # the special inputs reached the candidates
    averaged = flat * 0.5 + 0.25  # as if averaged over ranks
    bucket_update_(params, state, group_of, averaged.clone())
    u = averaged.clone()
    for p, up in zip(ref[0], u.split([p.numel() for p in ref[0]])):
        if p.requires_grad:
            frozen_update_(p, ref[1][p], ref[2][p], up)
    _assert_same_state(params, state, ref[0], ref[1])
    assert not _same(params[0], _model()[0][0])  # the update moved the parameters


@torch.no_grad()
def test_warmup_equals_the_reference_and_torch_adamw_bit_for_bit():
    params, state, group_of = _model(1)
    trainable = [p for p in params if p.requires_grad and p.grad is not None]
    ref = _copy(params, state, group_of)
    for group in {id(g): g for g in group_of.values()}.values():
        warmup_step_([p for p in trainable if group_of[p] is group], state, group)
    for p, q in zip(params, ref[0]):
        if p.requires_grad and p.grad is not None:
            adamw_update_(q, q.grad, ref[1][q], ref[2][q])
    _assert_same_state(params, state, ref[0], ref[1])

    # and torch's own single-tensor AdamW, for fp32 parameters from a fresh state
    ps = [torch.nn.Parameter(torch.randn(s)) for s in [(7, 5), (3,), (130,)]]
    qs = copy.deepcopy(ps)
    adamw = torch.optim.AdamW(qs, lr=1e-2, weight_decay=0.05, foreach=False)
    st = {p: {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)} for p in ps}
    for k in range(3):
        for p, q in zip(ps, qs):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        warmup_step_(
            ps, st, dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.05, decoupled_weight_decay=True)
        )
        adamw.step()
        for p, q in zip(ps, qs):
            assert _same(p, q), f"step {k}"


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _uniform_model(count: int):
    g = torch.Generator().manual_seed(count)
    group = dict(GROUPS[0])
    params = [torch.nn.Parameter(torch.randn(16, generator=g)) for _ in range(count)]
    state = {
        p: {
            "step": torch.tensor(5.0),
            "exp_avg": torch.randn(16, generator=g),
            "exp_avg_sq": torch.rand(16, generator=g),
        }
        for p in params
    }
    for p in params:
        p.grad = torch.randn(16, generator=g)
    return params, state, {p: group for p in params}, group


def _count(fn, *args) -> int:
    with _Ops() as mode:
        fn(*args)
    return sum(mode.ops.values())


def _compressed(params, state, group_of) -> None:
    bucket_update_(params, state, group_of, bucket_candidates(params, state, group_of))


def _compressed_reference(params, state, group_of) -> None:
    for p in params:
        frozen_update_(p, state[p], group_of[p], momentum_candidates([p], state, group_of))


@pytest.mark.parametrize("phase", ["warmup", "compressed"])
@torch.no_grad()
def test_ops_do_not_grow_with_the_number_of_parameters(phase):
    counts = []
    for n in (4, 64):
        params, state, group_of, group = _uniform_model(n)
        if phase == "warmup":
            counts.append(_count(warmup_step_, params, state, group))
        else:
            counts.append(_count(_compressed, params, state, group_of))
    assert counts[0] == counts[1], counts
    # the per-parameter reference: about 30 ops per parameter in the compressed phase
    params, state, group_of, _ = _uniform_model(4)
    if phase == "compressed":
        ref = _count(_compressed_reference, params, state, group_of)
        assert counts[0] < ref


def test_onebit_adam_step_ops_do_not_grow_with_the_number_of_parameters():
    """Through the public optimizer: a compressed step (one bucket, world 1) of 8 or 64 parameters dispatches as
    many ops (the per-parameter loop it replaced: ~30 more per parameter)."""
    from lightning_qcomm.optim import OneBitAdam

    counts = []
    for n in (8, 64):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(32)) for _ in range(n)]
        opt = OneBitAdam(params, lr=1e-3, freeze_step=2, overlap=False, nonfinite="propagate", variance_refresh=0)
        for step in range(4):
            for p in params:
                p.grad = torch.randn_like(p)
            if step < 3:
                opt.step()
        with _Ops() as mode:
            opt.step()
        counts.append(sum(mode.ops.values()))
    assert counts[0] == counts[1], counts
