"""Tests of the counter-based random bits (codecs/rng.py) and the dense bit packing (codecs/layout.py).

Oracles are written here independently from the module docstrings: the hash in plain Python integer
arithmetic, the packing as one little-endian bit stream built with Python big integers.
"""

from __future__ import annotations

import math

import pytest
import torch

from lightning_qcomm.codecs import layout, rng

Z = 5.33  # two-sided standard-normal quantile: P(|N(0,1)| > 5.33) = 9.8e-8


def _mix32(x: int) -> int:
    """lowbias32, straight from its definition (mod 2^32)."""
    x &= 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    x ^= x >> 16
    return x


def _hash_python(seed: int, i: int) -> int:
    k1, k2 = rng.seed_to_key(seed)
    return _mix32(_mix32(i ^ k1) ^ k2)


@pytest.mark.parametrize("seed", [0, 1, 2**63 + 12345, rng.derive_seed(7, 3, 1)])
def test_hash_matches_python_integers(seed):
    """The vectorised int64 torch hash (with its split multiply) equals exact integer arithmetic."""
    idx = [0, 1, 2, 255, 256, 65535, 65536, 10**6, 2**31 - 1, 2**31, 2**32 - 1]
    for i in idx:
        got = int(rng.hash_u32(seed, 1, offset=i)[0])
        assert got == _hash_python(seed, i), (seed, i)
    block = rng.hash_u32(seed, 1000, offset=123)
    assert [int(v) for v in block[:50]] == [_hash_python(seed, 123 + j) for j in range(50)]
    assert int(block.min()) >= 0 and int(block.max()) < 2**32


def test_uniform_offset_and_grid():
    u = rng.uniform(5, 4096)
    assert u.dtype == torch.float32
    assert torch.equal(rng.uniform(5, 1000, offset=3000), u[3000:4000])
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    scaled = u.double() * 2**24
    assert torch.equal(scaled, scaled.round())  # on the 2^-24 grid
    assert torch.equal(u, rng.uniform(5, 4096))  # pure function of (seed, index)
    assert not torch.equal(u, rng.uniform(6, 4096))


def test_uniform_moments():
    """u = k 2^-24 with k uniform on 0..2^24-1 (if the hash is good): E u = (1 - 2^-24)/2,
    Var u = (1 - 2^-48)/12. With n = 10^6 the sample mean has sd sqrt(1/12/n) = 2.9e-4 and the sample
    mean of (u - 1/2)^2 has sd sqrt(Var((u-1/2)^2)/n), Var((u-1/2)^2) = 1/80 - 1/144 = 1/180; by the
    CLT (n = 10^6 bounded terms) a Z = 5.33 (two-sided 1e-7) band. Also the lag-1 and cross-seed
    correlations (sd 1/sqrt(n)) and each of the 24 bits' frequency (sd 1/(2 sqrt(n)))."""
    n = 10**6
    u = rng.uniform(rng.derive_seed(2026, 0), n).double()
    mean = (1 - 2**-24) / 2
    assert abs(float(u.mean()) - mean) <= Z * math.sqrt(1 / 12 / n)
    c = u - 0.5
    assert abs(float((c * c).mean()) - 1 / 12) <= Z * math.sqrt(1 / 180 / n) + 1e-12
    zc = (u - 0.5) * math.sqrt(12)  # unit variance
    assert abs(float((zc[1:] * zc[:-1]).mean())) <= Z / math.sqrt(n)
    v = (rng.uniform(rng.derive_seed(2026, 1), n).double() - 0.5) * math.sqrt(12)
    assert abs(float((zc * v).mean())) <= Z / math.sqrt(n)
    k = (u * 2**24).to(torch.int64)
    for bit in range(24):
        freq = float(((k >> bit) & 1).double().mean())
        # 24 tests: Z covers a union bound of 24 * 1e-7
        assert abs(freq - 0.5) <= Z * 0.5 / math.sqrt(n), f"bit {bit}: {freq}"


def test_uniform_histogram_chi2():
    """64 equal bins, n = 2^20: chi2 with 63 degrees of freedom; P(chi2_63 > 130) < 1e-6
    (Wilson-Hilferty: ((130/63)^(1/3) - (1 - 2/(9*63))) / sqrt(2/(9*63)) = 5.6 sd)."""
    n = 2**20
    u = rng.uniform(99, n)
    counts = torch.bincount((u * 64).to(torch.int64), minlength=64).double()
    e = n / 64
    chi2 = float(((counts - e) ** 2 / e).sum())
    assert chi2 < 130, chi2


def test_derive_seed_is_splitmix_fold():
    def splitmix(x):
        m = 2**64 - 1
        x = (x + 0x9E3779B97F4A7C15) & m
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
        return x ^ (x >> 31)

    assert rng.derive_seed(42) == splitmix(42)
    assert rng.derive_seed(42, 3, 1) == splitmix(splitmix(splitmix(42) ^ 3) ^ 1)
    assert rng.derive_seed(-1) == splitmix(2**64 - 1)


# ---------------------------------------------------------------------------------------------- packing
def _pack_python(codes: list[int], bits: int) -> bytes:
    """Code i occupies bits [b*i, b*i + b) of one little-endian bit stream, padded to ceil(n/8)*b bytes."""
    v = 0
    for i, c in enumerate(codes):
        v |= c << (bits * i)
    return v.to_bytes(-(-len(codes) // 8) * bits, "little")


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("n", [1, 3, 7, 8, 9, 15, 17, 1001])
def test_pack_roundtrip_and_layout(bits, n):
    g = torch.Generator().manual_seed(bits * 1000 + n)
    codes = torch.randint(0, 2**bits, (n,), generator=g, dtype=torch.int64).to(torch.uint8)
    packed = layout.pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == layout.packed_nbytes(n, bits) == -(-n // 8) * bits
    assert bytes(packed.tolist()) == _pack_python(codes.tolist(), bits)
    assert torch.equal(layout.unpack_bits(packed, bits, n), codes)


def test_pack_known_answers():
    assert layout.pack_bits(torch.tensor([1, 2], dtype=torch.uint8), 4).tolist() == [0x21, 0, 0, 0]
    assert layout.pack_bits(torch.tensor([7, 0, 0, 0, 0, 0, 0, 5], dtype=torch.uint8), 3).tolist() == [7, 0, 0xA0]
    assert layout.pack_bits(torch.tensor([1, 0, 1], dtype=torch.uint8), 1).tolist() == [0b101]
    assert layout.pack_bits(torch.tensor([255, 3], dtype=torch.uint8), 8).tolist() == [255, 3, 0, 0, 0, 0, 0, 0]


@pytest.mark.parametrize("bits", [0, 9])
def test_pack_bad_bits(bits):
    with pytest.raises(ValueError, match="bits"):
        layout.pack_bits(torch.zeros(8, dtype=torch.uint8), bits)
    with pytest.raises(ValueError, match="bits"):
        layout.unpack_bits(torch.zeros(8, dtype=torch.uint8), bits, 8)
