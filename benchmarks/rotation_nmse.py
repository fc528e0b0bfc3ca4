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
byte-pair tokens of the Python stdlib's sources): the token-embedding gradient (rows of the 4,096 most
frequent tokens, 2^19 elements) and the first block's MLP input weight (2^16 elements).

    OMP_NUM_THREADS=1 python benchmarks/rotation_nmse.py [--seeds 20] [--d 131072] [--quick]

writes benchmarks/results/rotation_nmse.{json,md} (``--out`` to change the stem).
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

# ---------------------------------------------------------------------------------------------- rotation


def fwht_(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal fast Walsh-Hadamard transform of each row of ``x`` (rows of n = 2^k), in place.

    Fixed butterfly order: for h = 1, 2, 4, ..., n/2, every pair (i, i + h) with i mod 2h < h becomes
    (a + b, a - b); then the rows are multiplied by fl(1 / sqrt(n)) (exact when k is even). H is symmetric
    and H H = I, so ``fwht_`` is its own inverse (up to rounding).
    """
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"fwht_: row length must be a power of two, got {n}")
    rows = x.reshape(-1, n)
    h = 1
    while h < n:
        v = rows.view(rows.shape[0], n // (2 * h), 2, h)
        a = v[:, :, 0, :].clone()
        v[:, :, 0, :].add_(v[:, :, 1, :])
        v[:, :, 1, :].neg_().add_(a)
        h *= 2
    rows.mul_(1.0 / math.sqrt(n))
    return x


def rademacher(seed: int, n: int) -> torch.Tensor:
    """n random signs (+-1.0, fp32) from a ``torch.Generator`` seeded with ``seed``."""
    g = torch.Generator().manual_seed(seed & 0x7FFFFFFFFFFFFFFF)
    return torch.randint(0, 2, (n,), generator=g).to(torch.float32).mul_(2).sub_(1)


def rotate(x: torch.Tensor, block: int, seed: int) -> torch.Tensor:
    """R x = H_B D x of flat ``x`` zero-padded to whole blocks: a (num_blocks, block) fp32 tensor."""
    xf = x.reshape(-1).to(torch.float32)
    nb = -(-xf.numel() // block)
    y = torch.nn.functional.pad(xf, (0, nb * block - xf.numel())) * rademacher(seed, nb * block)
    return fwht_(y.view(nb, block))


def unrotate(y: torch.Tensor, seed: int, numel: int) -> torch.Tensor:
    """R^-1 y = D H_B y (H_B its own inverse, D = D^-1), flat, cut to ``numel`` elements."""
    z = fwht_(y.clone().view(-1, y.shape[-1])).reshape(-1)
    return (z * rademacher(seed, z.numel()))[:numel]


# ---------------------------------------------------------------------------------------------- Lloyd-Max


def _phi(t: float) -> float:
    return 0.0 if math.isinf(t) else math.exp(-0.5 * t * t) / math.sqrt(2 * math.pi)


def _Phi(t: float) -> float:
    return 0.5 * (1.0 + math.erf(t / math.sqrt(2)))


def lloyd_max(bits: int, iters: int = 2000) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(levels, boundaries, distortion D_b) of the 2^b-level minimum-MSE quantizer of N(0, 1) (Lloyd's method)."""
    L = 1 << bits
    c = [(-1 + (2 * i + 1) / L) * 2.5 for i in range(L)]
    for _ in range(iters):
        t = [-math.inf] + [(c[i] + c[i + 1]) / 2 for i in range(L - 1)] + [math.inf]
        c = [(_phi(t[i]) - _phi(t[i + 1])) / (_Phi(t[i + 1]) - _Phi(t[i])) for i in range(L)]
    t = [-math.inf] + [(c[i] + c[i + 1]) / 2 for i in range(L - 1)] + [math.inf]
    # D = 1 - sum_i p_i c_i^2 (centroid condition: E[z Q(z)] = E[Q(z)^2])
    dist = 1.0 - sum((_Phi(t[i + 1]) - _Phi(t[i])) * c[i] ** 2 for i in range(L))
    return torch.tensor(c, dtype=torch.float32), torch.tensor(t[1:-1], dtype=torch.float32), dist


_LM: dict[int, tuple[torch.Tensor, torch.Tensor, float]] = {}


def lm(bits: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    if bits not in _LM:
        _LM[bits] = lloyd_max(bits)
    return _LM[bits]


def lm_quantize(y: torch.Tensor, bits: int, scale: str) -> torch.Tensor:
    """Rotated blocks ``y`` (nb, B) -> S q per block (EDEN ``scale="unb"``, DRIVE ``"mse"``, or ``"one"``: the
    normalisation ||y|| / sqrt(B) alone, no correction). A block with a NaN/Inf decodes NaN; a zero block 0."""
    levels, bounds, _ = lm(bits)
    y64 = y.double()
    ss = (y64 * y64).sum(dim=1, keepdim=True)
    norm = ss.sqrt()
    z = y64 * math.sqrt(y.shape[1]) / torch.where(norm > 0, norm, torch.ones_like(norm))
    q = levels.double()[torch.bucketize(z.float().nan_to_num(0.0), bounds)]
    yq = (y64 * q).sum(dim=1, keepdim=True)
    if scale == "unb":
        s = ss / yq
    elif scale == "mse":
        s = yq / (q * q).sum(dim=1, keepdim=True)
    elif scale == "one":
        s = norm / math.sqrt(y.shape[1])
    else:
        raise ValueError(f"lm_quantize: scale={scale!r}; allowed: 'unb', 'mse', 'one'")
    s = torch.where(norm > 0, s, torch.zeros_like(s))
    s = torch.where(torch.isfinite(ss), s, torch.full_like(s, float("nan")))
    return (s.float() * q.float()).float()


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


def gpt2_grads(steps: int) -> dict[str, torch.Tensor]:
    """Gradients of a randomly initialised GPT-2 shape after ``steps`` AdamW steps on stdlib byte-pair tokens."""
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
    cfg = GPT2Config(vocab_size=vocab, n_positions=128, n_embd=128, n_layer=2, n_head=4)
    model = GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    batch, seq = 8, 128
    for step in range(steps + 1):
        starts = torch.randint(0, tokens.numel() - seq - 1, (batch,), generator=g)
        idx = torch.stack([tokens[s : s + seq] for s in starts.tolist()])
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=idx, labels=idx).loss
        loss.backward()
        if step < steps:
            opt.step()
    print(f"gpt2: loss after {steps} steps {loss.item():.3f}", file=sys.stderr)
    wte = model.transformer.wte.weight.grad[:4096].detach().clone()
    fc = model.transformer.h[0].mlp.c_fc.weight.grad.detach().clone()
    return {"gpt2 wte grad (4096 x 128)": wte.reshape(-1), "gpt2 h0.mlp.c_fc grad (128 x 512)": fc.reshape(-1)}


def tensors(d: int, grad_steps: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(12345)
    out = {f"gaussian (d={d})": torch.randn(d, generator=g), f"student-t nu=3 (d={d})": student_t(d, 3.0, g)}
    out.update(gpt2_grads(grad_steps))
    return out


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


def write_md(meta: dict, rows: list[dict], theory: dict, path: Path) -> None:
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
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--d", type=int, default=1 << 17)
    ap.add_argument("--blocks", default="512,4096,65536", help="rotation block sizes (powers of two), comma list")
    ap.add_argument("--grad-steps", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="d = 2^14, 3 seeds, no GPT-2 (a smoke run)")
    ap.add_argument("--out", default="benchmarks/results/rotation_nmse")
    args = ap.parse_args()
    blocks = [int(b) for b in args.blocks.split(",")]
    t0 = time.time()
    if args.quick:
        g = torch.Generator().manual_seed(12345)
        xs = {"gaussian": torch.randn(1 << 14, generator=g), "student-t nu=3": student_t(1 << 14, 3.0, g)}
        seeds = 3
    else:
        xs, seeds = tensors(args.d, args.grad_steps), args.seeds
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
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "theory": theory, "rows": rows}, indent=1) + "\n")
    write_md(meta, rows, theory, out.with_suffix(".md"))
    print(f"wrote {out}.json / .md in {meta['seconds']:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
