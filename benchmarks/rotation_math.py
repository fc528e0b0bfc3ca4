"""The math of a randomized Hadamard rotation stage, for measurement (``benchmarks/rotation_nmse.py``).

Rotation R = H_B D per block of B = 2^k elements: D random +-1 signs from a seeded ``torch.Generator``, H_B the
orthonormal Walsh-Hadamard matrix (Sylvester order) applied by an in-place butterfly in a fixed order. R is
orthogonal, so ||R x|| = ||x|| and R^-1 = D H_B. A non-finite entry reaches every output of its block (each output
is a signed sum of all inputs), so a NaN/Inf block stays non-finite through the round trip, and only that block.

Rotated Lloyd-Max quantizer (EDEN / DRIVE): per rotated block y, z = y sqrt(B) / ||y|| is close to N(0, 1) per
coordinate, q = the nearest of the 2^b Lloyd-Max levels of N(0, 1), and one fp32 scale S per block:

    EDEN, unbiased over the rotation:   S = ||y||^2 / <y, q>      (then <S q, y> = ||y||^2 exactly)
    DRIVE's minimum-error scale:        S = <y, q> / ||q||^2      (least squares; shrinks towards 0)

At b = 1, q = +-c: S q = +-||y||^2 / ||y||_1 (unbiased) or +-||y||_1 / B (minimum error).

Example::

    y = rotate(x, 512, seed=3)                                  # (blocks, 512)
    x_hat = unrotate(lm_quantize(y, 2, "unb"), 3, x.numel())    # EDEN at 2 bits
"""

from __future__ import annotations

import math

import torch

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
