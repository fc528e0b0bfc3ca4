"""Pure tests of the Local SGD synchronization rules and schedule (no processes)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

from lightning_qcomm.parallel.sync_rules import (
    ConstantRule,
    PostLocalRule,
    QSRRule,
    SyncSchedule,
    cap_period,
    make_rule,
    simulate,
)

# Paper (Gu et al. 2024), ViT-B Local AdamW: H_base 4, alpha 0.0175, peak lr 0.008, cosine, 10k warmup, 93,600 steps.
VIT_TOTAL, VIT_WARMUP, VIT_PEAK = 93_600, 10_000, 0.008


def vit_lr(t: int) -> float:
    if t < VIT_WARMUP:
        return VIT_PEAK * (t + 1) / VIT_WARMUP
    return 0.5 * VIT_PEAK * (1 + math.cos(math.pi * (t - VIT_WARMUP) / (VIT_TOTAL - VIT_WARMUP)))


def test_qsr_paper_values():
    rule = QSRRule(h_base=4, alpha=0.0175, power=2, warmup_steps=VIT_WARMUP)
    # (0.0175/0.008)^2 = 4.79 -> 4 ; (0.0175/0.004)^2 = 19.14 -> 19 ; (0.0175/0.001)^2 = 306.25 -> 306
    assert [rule.next_period(VIT_WARMUP, lr) for lr in (0.008, 0.004, 0.001)] == [4, 19, 306]
    assert rule.next_period(VIT_WARMUP - 1, 1e-6) == 4  # warmup: h_base whatever the lr
    assert rule.next_period(VIT_WARMUP, 0.02) == 4  # never below h_base


def test_qsr_power_variants():
    linear = QSRRule(h_base=4, alpha=0.0175, power=1)
    cubic = QSRRule(h_base=4, alpha=0.0175, power=3)
    assert [linear.next_period(0, lr) for lr in (0.008, 0.004, 0.001)] == [4, 4, 17]  # 2.19, 4.375, 17.5
    assert [cubic.next_period(0, lr) for lr in (0.008, 0.004, 0.001)] == [10, 83, 5359]  # 10.47, 83.74, 5359.4


def test_qsr_lr_zero_is_capped_by_steps_left():
    rule = QSRRule(h_base=4, alpha=0.0175)
    assert cap_period(rule.next_period(100, 0.0), 100, 150) == 50
    assert cap_period(7, 10, None) == 7 and cap_period(7, 10, float("inf")) == 7


def test_vit_schedule_matches_independent_loop():
    rule = QSRRule(h_base=4, alpha=0.0175, power=2, warmup_steps=VIT_WARMUP)
    rounds = simulate(rule, VIT_TOTAL, vit_lr)
    # Independent straight-line implementation of the rule.
    t, expected = 0, []
    while t < VIT_TOTAL:
        h = 4 if t < VIT_WARMUP else max(4, math.floor((0.0175 / vit_lr(t)) ** 2))
        h = min(h, VIT_TOTAL - t)
        expected.append((t, h))
        t += h
    assert rounds == expected
    assert rounds[-1][0] + rounds[-1][1] == VIT_TOTAL  # training ends on a sync
    assert sum(1 for s, _ in rounds if s < VIT_WARMUP) == VIT_WARMUP // 4  # H = 4 through warmup
    hs = [h for s, h in rounds[:-1] if s >= VIT_WARMUP]
    assert hs == sorted(hs)  # lr decays monotonically -> H never shrinks (before the final cap)
    # H at the first round start where the lr has fallen to <= 0.004 / 0.001 is 19 / 306 (+- the lr moved within a round).
    first = {target: next(h for s, h in rounds if s >= VIT_WARMUP and vit_lr(s) <= target) for target in (0.004, 0.001)}
    assert first[0.004] in (19, 20) and first[0.001] in range(306, 320)


def test_qsr_schedule_script_prints_fraction(capsys):
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "qsr_schedule.py"
    spec = importlib.util.spec_from_file_location("qsr_schedule", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    result = mod.main([])
    out = capsys.readouterr().out
    rounds = simulate(QSRRule(4, 0.0175, 2, VIT_WARMUP), VIT_TOTAL, vit_lr)
    assert result["qsr"]["syncs"] == len(rounds)
    assert result["qsr"]["fraction"] == pytest.approx(len(rounds) / VIT_TOTAL)
    assert f"{100 * len(rounds) / VIT_TOTAL:.2f}%" in out
    assert result["constant"]["fraction"] == pytest.approx(1 / 4)


def test_constant_rule_and_cap():
    rounds = simulate(ConstantRule(8), 100, lambda t: None)
    assert [h for _, h in rounds] == [8] * 12 + [4]
    assert sum(h for _, h in rounds) == 100


def test_post_local_rule():
    rule = PostLocalRule(switch_step=5, period=4)
    rounds = simulate(rule, 20, lambda t: None)
    assert rounds == [(0, 1), (1, 1), (2, 1), (3, 1), (4, 1), (5, 4), (9, 4), (13, 4), (17, 3)]
    assert [rule.data_parallel(s) for s in (0, 4, 5, 19)] == [True, True, False, False]


def test_schedule_state_roundtrip_reproduces_rounds():
    rule = QSRRule(h_base=2, alpha=0.05, power=2)
    lr = lambda t: 0.05 * 0.5 * (1 + math.cos(math.pi * t / 200))
    full = SyncSchedule(rule, total_steps=200)
    syncs_full = []
    for _ in range(200):
        full.begin_step(lr(full.step))
        if full.end_step():
            syncs_full.append(full.step)
    first = SyncSchedule(rule, total_steps=200)
    syncs = []
    for _ in range(77):  # stop mid-round
        first.begin_step(lr(first.step))
        if first.end_step():
            syncs.append(first.step)
    assert first.steps_since_sync > 0
    resumed = SyncSchedule(rule, total_steps=200)
    resumed.load_state_dict(first.state_dict())
    while resumed.step < 200:
        resumed.begin_step(lr(resumed.step))
        if resumed.end_step():
            syncs.append(resumed.step)
    assert syncs == syncs_full and syncs[-1] == 200
    assert resumed.num_syncs == full.num_syncs == len(syncs_full)


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: QSRRule(alpha=0.0), "alpha"),
        (lambda: QSRRule(alpha=-1.0), "alpha"),
        (lambda: QSRRule(alpha=float("nan")), "alpha"),
        (lambda: QSRRule(h_base=0), "h_base"),
        (lambda: QSRRule(power=-2.0), "power"),
        (lambda: ConstantRule(0), "period"),
        (lambda: PostLocalRule(-1, 4), "switch_step"),
        (lambda: make_rule("cubic"), "sync must be one of"),
        (lambda: make_rule("post_local"), "switch_step"),
        (lambda: QSRRule().next_period(0, None), "lr"),
        (lambda: QSRRule().next_period(0, -0.1), "lr"),
    ],
)
def test_bad_input(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_bad_types():
    with pytest.raises(TypeError, match="h_base"):
        QSRRule(h_base=2.5)
    with pytest.raises(TypeError, match="period"):
        ConstantRule(True)
