"""Two measurements behind the rotation stage's design, run by ``benchmarks/rotation_nmse.py``.

1. ``rank_average``: n ranks each compress their own x_i and the receiver averages. With the error e_i of rank i,

       E||mean_i x_hat_i - mean_i x_i||^2 = (1/n^2) (sum_i E||e_i||^2 + sum_{i != j} E<e_i, e_j>)

   ``corr`` = that over (1/n^2) sum_i E||e_i||^2: 1 when the ranks' errors are uncorrelated (the average cuts the
   error n-fold), up to n when they are equal. Summing in the rotated domain needs every rank to rotate with the
   *same* keys; a deterministic quantizer (EDEN's nearest levels) then makes the errors of similar x_i similar, while
   stochastic rounding keyed per rank keeps them independent given the rotation.
2. ``rht_bias``: EDEN's scale is unbiased over a *uniform* random rotation; over the randomized Hadamard rotation it
   is only close to unbiased. Many seeds on a small x resolve the residual: ||E x_hat - x||^2 / ||x||^2 is estimated
   as (||mean_s x_s - x||^2 - tr(Cov) / S) / ||x||^2, with standard error tr(Cov) / S sqrt(2 / d) / ||x||^2
   (errors near-independent across coordinates).

Example::

    rows = rank_average({"g + z_i": xs}, seeds=10, block=512)
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

from lightning_qcomm.codecs import derive_seed, get_codec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rotation_math import lm_quantize, rotate, unrotate  # noqa: E402


def _estimators(block: int):
    """name -> (bits, shared_keys, fn(x, rotation_key, rounding_key) -> x_hat). Shared keys: one rotation for all
    ranks; otherwise one per rank. Rounding keys are always per rank."""
    out = {}
    for bits in (1, 2, 4):
        uni = get_codec("uniform", bits=bits)
        for shared in (True, False):
            tag = "shared" if shared else "per-rank"
            out[f"rot{block}+lm{bits}-unb (EDEN), {tag} keys"] = (
                bits,
                shared,
                lambda x, rk, qk, b=bits: unrotate(lm_quantize(rotate(x, block, rk), b, "unb"), rk, x.numel()),
            )
            out[f"rot{block}+uniform{bits}/b512, {tag} keys"] = (
                bits,
                shared,
                lambda x, rk, qk, c=uni: unrotate(
                    c.roundtrip(rotate(x, block, rk).reshape(-1), seed=qk).view(-1, block), rk, x.numel()
                ),
            )
        out[f"uniform{bits}/b512 (no rotation)"] = (bits, False, lambda x, rk, qk, c=uni: c.roundtrip(x, seed=qk))
    return out


def rank_average(sets: dict[str, list[torch.Tensor]], seeds: int, block: int) -> list[dict]:
    rows = []
    for sname, xs in sets.items():
        n = len(xs)
        xs64 = [x.double() for x in xs]
        mean = sum(xs64) / n
        mm = float((mean * mean).sum())
        for name, (bits, shared, fn) in _estimators(block).items():
            tot, own = 0.0, 0.0
            for s in range(seeds):
                est = torch.zeros_like(mean)
                for i, x in enumerate(xs):
                    rk = derive_seed(11, s, 2) if shared else derive_seed(11, s, 2, i)
                    xh = fn(x, rk, derive_seed(11, s, 1, i)).reshape(-1).double()
                    own += float(((xh - xs64[i]) ** 2).sum())
                    est += xh
                tot += float(((est / n - mean) ** 2).sum())
            nmse = tot / seeds / mm
            rows.append(
                {
                    "set": sname,
                    "ranks": n,
                    "bits": bits,
                    "method": name,
                    "nmse_of_mean": nmse,
                    "corr": tot / (own / n / n),
                }  # fmt: skip
            )
            print(f"{sname:40s} {name:44s} nmse(mean) {nmse:.5f} corr {rows[-1]['corr']:.2f}", file=sys.stderr)
    return rows


def rht_bias(
    xs: dict[str, torch.Tensor], bits_list: tuple[int, ...], blocks: tuple[int, ...], seeds: int
) -> list[dict]:
    rows = []
    for xname, x in xs.items():
        x64 = x.double()
        xx = float((x64 * x64).sum())
        d = x.numel()
        for block in blocks:
            for bits in bits_list:
                acc, acc2, err2 = torch.zeros_like(x64), 0.0, 0.0
                for s in range(seeds):
                    k = derive_seed(13, s)
                    xh = unrotate(lm_quantize(rotate(x, block, k), bits, "unb"), k, d).double()
                    acc += xh
                    acc2 += float((xh * xh).sum())
                    err2 += float(((xh - x64) ** 2).sum())
                m = acc / seeds
                tr_cov = (acc2 - seeds * float((m * m).sum())) / (seeds - 1)
                floor = tr_cov / seeds / xx
                raw = float(((m - x64) ** 2).sum()) / xx
                rows.append(
                    {
                        "tensor": xname,
                        "d": d,
                        "block": block,
                        "bits": bits,
                        "seeds": seeds,
                        "nmse": err2 / seeds / xx,
                        "bias2": raw - floor,
                        "bias2_se": floor * math.sqrt(2 / d),
                    }  # fmt: skip
                )
                r = rows[-1]
                print(f"bias {xname} B={block} b={bits}: {r['bias2']:.2e} +- {r['bias2_se']:.1e}", file=sys.stderr)
    return rows
