"""NUQSGD vs QSGD variance at equal bits: E||Q(x) - x||^2 / ||x||^2, measured and exact.

Both codecs are unbiased, so E||Q(x) - x||^2 is the quantization variance. For each distribution,
bit width and bucket length this prints the Monte Carlo mean over K seeds (``get_codec(...).roundtrip``)
and the exact expectation sum_i n^2 (r_i - l_lo)(l_hi - r_i), r_i = |x_i| / n bracketed by levels
l_lo <= r_i <= l_hi (QSGD: k/s, s = 2^(b-1) - 1; NUQSGD: {0} U {2^-k : k = 0..2^(b-1) - 2}).

    python benchmarks/nuqsgd_variance.py [--d 100000] [--seeds 4] [--out benchmarks/results/nuqsgd_variance.md]
"""

from __future__ import annotations

import argparse
import datetime
import math

import torch

from lightning_qcomm.codecs import derive_seed, get_codec


def sample(kind: str, d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "gauss":
        return torch.randn(d, generator=g)
    if kind == "student_t2":  # Z / sqrt(chi2_2 / 2), chi2_2 = -2 ln U
        z = torch.randn(d, generator=g, dtype=torch.float64)
        u = torch.rand(d, generator=g, dtype=torch.float64).clamp_min(1e-300)
        return (z / torch.sqrt(-torch.log(u))).float()
    sigma = {"lognormal_s1": 1.0, "lognormal_s2": 2.0}[kind]  # sign * exp(sigma N(0, 1))
    sign = torch.where(torch.rand(d, generator=g) < 0.5, -1.0, 1.0)
    return sign * torch.exp(sigma * torch.randn(d, generator=g))


def levels(name: str, bits: int) -> torch.Tensor:
    if name == "qsgd":
        s = 2 ** (bits - 1) - 1
        return torch.arange(s + 1, dtype=torch.float64) / s
    L = 2 ** (bits - 1)
    return torch.cat([torch.zeros(1, dtype=torch.float64), 2.0 ** -torch.arange(L - 2, -1, -1, dtype=torch.float64)])


def exact_ratio(name: str, bits: int, bucket: int, x: torch.Tensor) -> float:
    x = x.double()
    d = x.numel()
    nb = -(-d // bucket)
    xb = torch.nn.functional.pad(x, (0, nb * bucket - d)).view(nb, bucket)
    n = xb.norm(dim=1, keepdim=True)
    r = torch.where(n > 0, xb.abs() / n, torch.zeros_like(xb)).clamp(0, 1).reshape(-1)
    lv = levels(name, bits)
    j = (torch.searchsorted(lv, r.contiguous(), right=True) - 1).clamp(0, len(lv) - 1)
    lo, hi = lv[j], lv[(j + 1).clamp(max=len(lv) - 1)]
    var = ((r - lo) * (hi - r)).view(nb, bucket) * n**2
    return float(var.sum() / (x**2).sum())


def mc_ratio(name: str, bits: int, bucket: int, x: torch.Tensor, seeds: int) -> float:
    codec = get_codec(name, bits, bucket)
    x64 = x.double()
    tot = sum(
        float(((codec.roundtrip(x, seed=derive_seed(900 + bits, k)).double() - x64) ** 2).sum()) for k in range(seeds)
    )
    return tot / seeds / float((x64**2).sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", type=int, default=100_000)
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_flush_denormal(True)
    rows = []
    for kind in ("gauss", "student_t2", "lognormal_s1", "lognormal_s2"):
        x = sample(kind, args.d, seed=41)
        for bits in (2, 3, 4, 8):
            for bucket in (512, args.d):
                q_mc, n_mc = (mc_ratio(n, bits, bucket, x, args.seeds) for n in ("qsgd", "nuqsgd"))
                q_ex, n_ex = (exact_ratio(n, bits, bucket, x) for n in ("qsgd", "nuqsgd"))
                s = 2 ** (bits - 1) - 1
                bound = min(bucket / s**2, math.sqrt(bucket) / s)
                winner = "NUQSGD" if n_ex < q_ex * (1 - 1e-9) else ("QSGD" if q_ex < n_ex * (1 - 1e-9) else "equal")
                rows.append(
                    f"| {kind} | {bits} | {'whole (' + str(args.d) + ')' if bucket == args.d else bucket} "
                    f"| {q_mc:.4g} | {q_ex:.4g} | {n_mc:.4g} | {n_ex:.4g} | {bound:.4g} | {winner} |"
                )
                print(rows[-1], flush=True)
    header = [
        "| distribution | bits | bucket | QSGD ratio (MC) | QSGD ratio (exact) | NUQSGD ratio (MC) "
        "| NUQSGD ratio (exact) | QSGD bound min(B/s², √B/s) | lower variance |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    if args.out:
        with open(args.out, "w") as f:
            f.write(
                f"<!-- generated {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC by "
                f"`python benchmarks/nuqsgd_variance.py --d {args.d} --seeds {args.seeds}` -->\n"
            )
            f.write("\n".join(header + rows) + "\n")


if __name__ == "__main__":
    main()
