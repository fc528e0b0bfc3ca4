"""Fraction of optimizer steps that communicate under each Local SGD sync rule (pure schedule, no training).

Default setting: the QSR paper's ViT-B Local AdamW run (Gu et al., ICLR 2024): 93,600 steps (300 epochs x
312), 10k linear-warmup steps to peak lr 0.008, cosine decay to 0; QSR H_base 4, alpha 0.0175. Data-parallel
training communicates at every step (100%). Checked by tests/parallel/test_sync_rules.py.

    python benchmarks/qsr_schedule.py [--total 93600 --warmup 10000 --peak-lr 0.008 --alpha 0.0175 --h-base 4]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_qcomm.parallel.sync_rules import ConstantRule, PostLocalRule, QSRRule, simulate  # noqa: E402


def cosine_with_warmup(total: int, warmup: int, peak: float, final: float = 0.0):
    """lr used by step t: linear warmup peak*(t+1)/warmup, then cosine from peak to final at ``total``."""

    def lr_at(t: int) -> float:
        if t < warmup:
            return peak * (t + 1) / warmup
        return final + 0.5 * (peak - final) * (1 + math.cos(math.pi * (t - warmup) / (total - warmup)))

    return lr_at


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--total", type=int, default=93_600)
    p.add_argument("--warmup", type=int, default=10_000)
    p.add_argument("--peak-lr", type=float, default=0.008)
    p.add_argument("--final-lr", type=float, default=0.0)
    p.add_argument("--alpha", type=float, default=0.0175)
    p.add_argument("--h-base", type=int, default=4)
    p.add_argument("--post-local-switch", type=int, default=None, help="default: the warmup length")
    args = p.parse_args(argv)

    lr_at = cosine_with_warmup(args.total, args.warmup, args.peak_lr, args.final_lr)
    switch = args.warmup if args.post_local_switch is None else args.post_local_switch
    rules = {
        "qsr": QSRRule(args.h_base, args.alpha, 2.0, args.warmup),
        "qsr_linear(power=1)": QSRRule(args.h_base, args.alpha, 1.0, args.warmup),
        "qsr_cubic(power=3)": QSRRule(args.h_base, args.alpha, 3.0, args.warmup),
        "constant": ConstantRule(args.h_base),
        f"post_local(switch={switch})": PostLocalRule(switch, args.h_base),
    }
    print(
        f"steps={args.total} warmup={args.warmup} peak_lr={args.peak_lr} final_lr={args.final_lr} "
        f"cosine; alpha={args.alpha} h_base={args.h_base}"
    )
    print(f"{'rule':<28}{'syncs':>8}{'comm. steps':>13}{'max H':>8}")
    print(f"{'data-parallel':<28}{args.total:>8}{'100.00%':>13}{1:>8}")
    result: dict[str, dict[str, float]] = {}
    for name, rule in rules.items():
        rounds = simulate(rule, args.total, lr_at)
        frac = len(rounds) / args.total
        result[name.split("(")[0]] = {"syncs": len(rounds), "fraction": frac, "max_h": max(h for _, h in rounds)}
        print(f"{name:<28}{len(rounds):>8}{100 * frac:>12.2f}%{max(h for _, h in rounds):>8}")
    return result


if __name__ == "__main__":
    main()
