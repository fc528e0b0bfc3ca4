"""NMSE of one encode/decode with and without a randomized Hadamard rotation, at equal wire bytes.

Measures, for a fixed tensor x and S seeds (rotation signs and rounding bits both drawn per seed)::

    NMSE = mean_s ||x_s - x||^2 / ||x||^2                      (with its standard error over seeds)
    bias = ||mean_s x_s - x||^2 / ||x||^2,   floor = tr(Cov) / S / ||x||^2

``floor`` is what ``bias`` reads for an *unbiased* estimator (the seed-average still carries the
variance divided by S); a biased one shows ``bias`` well above ``floor``.

Methods (b = code bits per element; scales are counted in the bytes, one fp32 = 32 bits):

- ``<codec>``: the project's codecs as they are, ``get_codec(name, bits=b)`` (their default bucket);
- ``rot<B>+<codec>``: the same codec on R x, R = H_B D (random +-1 signs D, then an orthonormal fast
  Walsh-Hadamard transform per block of B = 2^k elements), inverted after decode: x = D H_B (decode);
- ``lm<b>-unb/B`` (EDEN): per rotated block y (B elements), z = y sqrt(B) / ||y||, q = the nearest of the
  2^b Lloyd-Max levels of N(0, 1) (deterministic), sent with one scale per block:
  unbiased (EDEN)  S = ||y||^2 / <y, q>;
- ``lm<b>-mse/B`` (DRIVE's MSE-minimising scale, generalised): S = <y, q> / ||q||^2.
  At b = 1 these are DRIVE's two scales: q = +-c, so S q = +-||y||^2 / ||y||_1 (unbiased) and
  +-||y||_1 / B (minimum error, biased towards 0).

With a uniform random rotation and large B, ``z`` is close to N(0, 1) per coordinate: the MSE scale gives
NMSE ~ D_b and the unbiased one D_b / (1 - D_b), D_b the Lloyd-Max distortion of N(0, 1) at b bits
(printed in the results as the "theory" rows).

Tensors: Gaussian, Student t (nu = 3), and two gradients of a GPT-2 shape (``transformers.GPT2Config``,
32,768-token vocabulary, d_model 128, 2 layers; no download: random init, trained a few AdamW steps on
byte-pair tokens of the Python stdlib's sources): the token-embedding gradient (rows of the 8,192 most
frequent tokens, 2^20 elements) and the first block's MLP input weight (2^16 elements).

    OMP_NUM_THREADS=1 python benchmarks/rotation_nmse.py [--seeds 20] [--d 262144] [--quick]

Then two design measurements (``benchmarks/rotation_mean.py``): the error of an average over ranks with shared vs
per-rank rotation keys (GPT-2 gradients of one weight on 8 batches; Gaussians with a shared component), and the
residual bias of EDEN's scale over the randomized Hadamard rotation (2,000 seeds, d = 4096).

Writes benchmarks/results/rotation_nmse.{json,md} (``--out`` to change the stem).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from lightning_qcomm.codecs import derive_seed, get_codec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rotation_math import lm, lm_quantize, rotate, unrotate  # noqa: E402
from rotation_mean import rank_average, rht_bias  # noqa: E402

# ---------------------------------------------------------------------------------------------- methods


class Method:
    """A named round trip ``run(x, seed) -> x_hat`` with its wire bits per element for ``numel``."""

    def __init__(self, name: str, bits: int, family: str, fn, bits_per_elem) -> None:
        self.name, self.bits, self.family, self.fn, self.bpe = name, bits, family, fn, bits_per_elem


def codec_method(name: str, bits: int, block: int | None = None) -> Method:
    codec = get_codec(name, bits=bits)
    bucket = "all" if codec.bucket_size is None else codec.bucket_size

    def fn(x: torch.Tensor, seed: int) -> torch.Tensor:
        if block is None:
            return codec.roundtrip(x, seed=derive_seed(seed, 1)).reshape(-1).float()
        y = rotate(x, block, derive_seed(seed, 2))
        out = codec.roundtrip(y.reshape(-1), seed=derive_seed(seed, 1)).view_as(y)
        return unrotate(out, derive_seed(seed, 2), x.numel())

    def bpe(numel: int) -> float:
        n = numel if block is None else -(-numel // block) * block
        return 8 * codec.nbytes(n) / numel

    nm = name if name == "sign1" else f"{name}{bits}"
    label = f"{nm}/b{bucket}" if block is None else f"rot{block}+{nm}/b{bucket}"
    return Method(label, bits, "codec" if block is None else "rot+codec", fn, bpe)


def lm_method(bits: int, scale: str, block: int) -> Method:
    def fn(x: torch.Tensor, seed: int) -> torch.Tensor:
        y = rotate(x, block, derive_seed(seed, 2))
        return unrotate(lm_quantize(y, bits, scale), derive_seed(seed, 2), x.numel())

    def bpe(numel: int) -> float:
        nb = -(-numel // block)
        return (nb * block * bits + nb * 32) / numel

    fam = {"unb": "EDEN (unbiased)", "mse": "DRIVE-scale (min MSE)", "one": "no correction"}[scale]
    return Method(f"rot{block}+lm{bits}-{scale}", bits, fam, fn, bpe)


def methods(blocks: list[int]) -> list[Method]:
    out: list[Method] = []
    for bits in (1, 2, 4):
        names = {1: ["uniform", "sign1"], 2: ["uniform", "qsgd", "nuqsgd"], 4: ["uniform", "qsgd", "nuqsgd"]}[bits]
        for n in names:
            out.append(codec_method(n, bits))
        for n in names:
            out.append(codec_method(n, bits, block=blocks[0]))
        out += [codec_method("uniform", bits, block=b) for b in blocks[1:2]]
        for block in blocks:
            out.append(lm_method(bits, "unb", block))
            out.append(lm_method(bits, "mse", block))
    return out


# ---------------------------------------------------------------------------------------------- tensors


def student_t(d: int, nu: float, g: torch.Generator) -> torch.Tensor:
    """Z / sqrt(chi2_nu / nu) for integer ``nu``, chi2_nu a sum of nu squared normals (all drawn from ``g``)."""
    z = torch.randn(d, generator=g, dtype=torch.float64)
    chi2 = sum(torch.randn(d, generator=g, dtype=torch.float64) ** 2 for _ in range(int(nu)))
    return (z / torch.sqrt(chi2 / nu)).float()


def gpt2_grads(steps: int, ranks: int) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """Gradients of a randomly initialised GPT-2 shape after ``steps`` AdamW steps on stdlib byte-pair tokens: the
    named tensors of one batch, and the MLP weight's gradient on ``ranks`` other batches (data-parallel ranks)."""
    import sysconfig

    from transformers import GPT2Config, GPT2LMHeadModel

    root = Path(sysconfig.get_paths()["stdlib"])
    data = b"".join(p.read_bytes() for p in sorted(root.glob("*.py"))[:60])[: 1 << 20]
    pairs = torch.tensor(list(data[: len(data) // 2 * 2]), dtype=torch.int64).view(-1, 2)
    pair_id = pairs[:, 0] * 256 + pairs[:, 1]
    counts = torch.bincount(pair_id, minlength=65536)
    rank = torch.empty(65536, dtype=torch.int64)
    rank[torch.argsort(counts, descending=True, stable=True)] = torch.arange(65536)
    vocab = 32768
    tokens = rank[pair_id].clamp_(max=vocab - 1)  # id = frequency rank of the byte pair
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=vocab, n_positions=128, n_embd=128, n_layer=2, n_head=4, bos_token_id=0)
    cfg.eos_token_id = 0
    model = GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    batch, seq = 8, 128

    def backward() -> float:
        starts = torch.randint(0, tokens.numel() - seq - 1, (batch,), generator=g)
        idx = torch.stack([tokens[s : s + seq] for s in starts.tolist()])
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=idx, labels=idx).loss
        loss.backward()
        return loss.item()

    for _ in range(steps):
        backward()
        opt.step()
    loss = backward()
    print(f"gpt2: loss after {steps} steps {loss:.3f}", file=sys.stderr)
    fc = model.transformer.h[0].mlp.c_fc.weight
    named = {
        "gpt2 wte grad (8192 x 128)": model.transformer.wte.weight.grad[:8192].detach().reshape(-1).clone(),
        "gpt2 h0.mlp.c_fc grad (128 x 512)": fc.grad.detach().reshape(-1).clone(),
    }
    per_rank = []
    for _ in range(ranks):
        backward()
        per_rank.append(fc.grad.detach().reshape(-1).clone())
    return named, per_rank


def tensors(d: int, grad_steps: int, ranks: int) -> tuple[dict[str, torch.Tensor], dict[str, list[torch.Tensor]]]:
    """The single tensors, and sets of per-rank tensors: GPT-2 gradients of one weight on ``ranks`` batches, and
    Gaussians g + z_i (g shared, z_i per rank, equal variance: each pair of ranks correlated 1/2)."""
    g = torch.Generator().manual_seed(12345)
    out = {f"gaussian (d={d})": torch.randn(d, generator=g), f"student-t nu=3 (d={d})": student_t(d, 3.0, g)}
    named, per_rank = gpt2_grads(grad_steps, ranks)
    out.update(named)
    common = torch.randn(1 << 16, generator=g)
    sets = {
        f"gpt2 h0.mlp.c_fc grad, {ranks} batches": per_rank,
        f"gaussian g + z_i (d=65536), {ranks} ranks": [
            common + torch.randn(1 << 16, generator=g) for _ in range(ranks)
        ],
    }
    return out, sets


# ---------------------------------------------------------------------------------------------- measure


def measure(m: Method, x: torch.Tensor, seeds: int) -> dict[str, float]:
    x64 = x.reshape(-1).double()
    xx = float((x64 * x64).sum())
    errs, acc, acc2 = [], torch.zeros_like(x64), 0.0
    for s in range(seeds):
        xh = m.fn(x, derive_seed(7, s)).double()
        errs.append(float(((xh - x64) ** 2).sum()) / xx)
        acc += xh
        acc2 += float((xh * xh).sum())
    mean = acc / seeds
    nmse = sum(errs) / seeds
    se = math.sqrt(sum((e - nmse) ** 2 for e in errs) / (seeds - 1) / seeds)
    bias = float(((mean - x64) ** 2).sum()) / xx
    tr_cov = max(acc2 - seeds * float((mean * mean).sum()), 0.0) / (seeds - 1)
    return {"nmse": nmse, "se": se, "bias": bias, "floor": tr_cov / seeds / xx, "bits_per_elem": m.bpe(x.numel())}


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def fmt(v: float) -> str:
    return f"{v:.4g}" if v >= 1e-3 or v == 0 else f"{v:.2e}"


def write_md(meta: dict, rows: list[dict], theory: dict, ranks: list[dict], bias: list[dict], path: Path) -> None:
    lines = [
        "# NMSE of one encode/decode: randomized Hadamard rotation vs the codecs at equal bytes",
        "",
        f"Command: `{meta['command']}`  ",
        f"Device: {meta['device']}; torch {meta['torch']}; commit {meta['commit']}; {meta['date']}; "
        f"{meta['seeds']} seeds; {meta['seconds']:.0f} s.",
        "",
        "NMSE = mean over seeds of ||x_hat - x||^2 / ||x||^2 (+- standard error); bias = ||mean x_hat - x||^2 / "
        "||x||^2; floor = tr(Cov)/S/||x||^2, what `bias` reads for an unbiased estimator "
        "(bias >> floor: biased). bits/elem counts the fp32 scales.",
        "",
        "Lloyd-Max levels of N(0,1), distortion D_b (theory for a uniform random rotation, large block: "
        "min-MSE scale NMSE = D_b, unbiased NMSE = D_b/(1-D_b)):",
        "",
        "| b | D_b | D_b/(1-D_b) |",
        "|---|---|---|",
    ]
    for b, t in theory.items():
        lines.append(f"| {b} | {t['D']:.5f} | {t['unbiased']:.5f} |")
    for tname in dict.fromkeys(r["tensor"] for r in rows):
        lines += [
            "",
            f"## {tname}",
            "",
            "| b | method | bits/elem | NMSE | +- SE | bias | floor |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            if r["tensor"] == tname:
                lines.append(
                    f"| {r['bits']} | {r['method']} | {r['bits_per_elem']:.3f} | {fmt(r['nmse'])} | {fmt(r['se'])} "
                    f"| {fmt(r['bias'])} | {fmt(r['floor'])} |"
                )
    lines += [
        "",
        "## Average over ranks (benchmarks/rotation_mean.py)",
        "",
        "NMSE of the receiver's average against the true average; corr = E||mean error||^2 / ((1/n^2) sum_i "
        "E||e_i||^2): 1 = the ranks' errors are uncorrelated, n = identical.",
        "",
        "| set | b | method | NMSE of mean | corr |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['set']} | {r['bits']} | {r['method']} | {fmt(r['nmse_of_mean'])} | {r['corr']:.2f} |" for r in ranks
    ]
    lines += [
        "",
        "## Residual bias of EDEN's scale over the randomized Hadamard rotation (benchmarks/rotation_mean.py)",
        "",
        "||E x_hat - x||^2 / ||x||^2 estimated as ||mean x_hat - x||^2/||x||^2 - floor, +- its standard error.",
        "",
        "| tensor | block | b | seeds | NMSE | bias^2 | +- SE |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['tensor']} | {r['block']} | {r['bits']} | {r['seeds']} | {fmt(r['nmse'])} | {r['bias2']:.2e} "
        f"| {r['bias2_se']:.1e} |"
        for r in bias
    ]
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--d", type=int, default=1 << 18)
    ap.add_argument("--blocks", default="512,4096,65536", help="rotation block sizes (powers of two), comma list")
    ap.add_argument("--grad-steps", type=int, default=10)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--rank-seeds", type=int, default=10)
    ap.add_argument("--bias-seeds", type=int, default=2000)
    ap.add_argument("--quick", action="store_true", help="d = 2^14, 3 seeds, no GPT-2 (a smoke run)")
    ap.add_argument("--out", default="benchmarks/results/rotation_nmse")
    args = ap.parse_args()
    blocks = [int(b) for b in args.blocks.split(",")]
    t0 = time.time()
    if args.quick:
        g = torch.Generator().manual_seed(12345)
        xs = {"gaussian": torch.randn(1 << 14, generator=g), "student-t nu=3": student_t(1 << 14, 3.0, g)}
        sets = {"gaussian g + z_i": [xs["gaussian"] + torch.randn(1 << 14, generator=g) for _ in range(4)]}
        seeds, rank_seeds, bias_seeds = 3, 2, 50
    else:
        (xs, sets), seeds = tensors(args.d, args.grad_steps, args.ranks), args.seeds
        rank_seeds, bias_seeds = args.rank_seeds, args.bias_seeds
    theory = {b: {"D": lm(b)[2], "unbiased": lm(b)[2] / (1 - lm(b)[2])} for b in (1, 2, 4)}
    rows = []
    for tname, x in xs.items():
        for m in methods(blocks):
            r = measure(m, x, seeds)
            rows.append(
                {"tensor": tname, "numel": x.numel(), "bits": m.bits, "method": m.name, "family": m.family, **r}
            )
            print(
                f"{tname:36s} {m.name:28s} bpe {r['bits_per_elem']:.3f} nmse {r['nmse']:.5f} +- {r['se']:.1e} "
                f"bias {r['bias']:.2e} floor {r['floor']:.2e}",
                file=sys.stderr,
                flush=True,
            )
    ranks = rank_average(sets, rank_seeds, blocks[0])
    g = torch.Generator().manual_seed(777)
    small = {"gaussian (d=4096)": torch.randn(4096, generator=g), "student-t nu=3 (d=4096)": student_t(4096, 3.0, g)}
    bias = rht_bias(small, (1, 2, 4), (512, 4096), bias_seeds)
    meta = {
        "command": "OMP_NUM_THREADS=1 python " + " ".join(["benchmarks/rotation_nmse.py", *sys.argv[1:]]),
        "device": f"CPU ({platform.processor() or platform.machine()}), {torch.get_num_threads()} thread(s)",
        "torch": torch.__version__,
        "commit": _git("rev-parse", "HEAD"),
        "dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "seeds": seeds,
        "seconds": time.time() - t0,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(
        json.dumps({"meta": meta, "theory": theory, "rows": rows, "ranks": ranks, "bias": bias}, indent=1) + "\n"
    )
    write_md(meta, rows, theory, ranks, bias, out.with_suffix(".md"))
    print(f"wrote {out}.json / .md in {meta['seconds']:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
