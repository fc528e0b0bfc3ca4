"""Device launches of the 1-bit momentum sync per bucket on the CUDA path, counted on CPU tensors under
TRITON_INTERPRET=1 (``benchmarks/launch_counts.py``, as tests/kernels/test_fused_launches.py counts).

``OneBitMomentumSync`` sends a bucket off the CPU as one piece (``resolve_piece_numel``), so the batched form
(``collectives.sign_collective``) runs it as one group: 8 Triton launches (the worker's encode 2, its residual
decoded from the payloads and written where finite 1 (``qcomm::feedback_rows``), the server's rank-order
decode-and-sum 1 (``qcomm::decode_rows_sum``, ``rank_order=True``, any N), its encode 2, its residual 1, the
final decode 1), two torch ops (Y = X + E_w, Z += E_s) and the two collectives: 12. One more torch op zero-pads Y
where the bucket is not a multiple of N, and a rank whose chunk is short zeroes Z's and E_s's padding (two more).

Criterion, fixed before measuring: at most ``MAX_ONEBIT_LAUNCHES`` = 12 per bucket at N = 2, 4 and 8 on a rank
with a full chunk and no padding. Before (2026-12-06, this file's worker on the previous code): 14 at N = 2 and 4
(10 Triton: a decode before each residual), 23 at N = 8 (the sum in an eager loop past 4 rows: 11 torch ops);
46 per bucket on the full model's layout and 25 for a bucket of one piece before the batched form.
"""

from __future__ import annotations

import json
import sys
from functools import partial
from pathlib import Path

import pytest

pytest.importorskip("triton")

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
MAX_ONEBIT_LAUNCHES = 12  # 8 Triton + 2 torch + 2 collectives per bucket of one piece
WORLDS = (2, 4, 8)
TRITON = 8  # encode 2 + residual 1, sum 1, encode 2 + residual 1, final decode 1
BLOCK = 256  # OneBitAdam's default scale_block
# buckets: one a multiple of 2 and 4 (no padding), one that is not (Y padded; the last rank's chunk short)
NUMELS = [4096, 3001]


def _worker() -> dict:
    import torch
    import torch.distributed as dist
    from launch_counts import count, cuda_path_on_cpu
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from lightning_qcomm.adapters.onebit.sync import OneBitMomentumSync
    from lightning_qcomm.collectives import onebit_pieces, sign_collective

    sign_collective.PATH = "batched"  # the accelerator form on CPU tensors
    out = {}
    with cuda_path_on_cpu() as log:
        for world in WORLDS:
            for rank in (0, world - 1):
                if dist.is_initialized():
                    dist.destroy_process_group()
                dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
                sync = OneBitMomentumSync(NUMELS, bucket_numel=4096, block_numel=BLOCK)
                sync.piece_numel = sync.resolve_piece_numel(torch.device("cuda"))  # as the first CUDA sync does
                assert all(len(onebit_pieces(n, world, sync.piece_numel)) == 1 for n in sync.bucket_numels)
                sync._checked = [True] * len(sync.buckets)  # the one-off consistency check is not per step
                for b, n in enumerate(sync.bucket_numels):
                    flat = torch.randn(n, generator=torch.Generator().manual_seed(b))
                    call = partial(sync.reduce_bucket_, b, flat)
                    out[f"N{world}_r{rank}_b{n}"] = count(call, log)
        out["values"] = {world: _values_on_the_cuda_path(world) for world in WORLDS}
    dist.destroy_process_group()
    return out


def _values_on_the_cuda_path(world: int) -> list[str]:
    """The batched form against the per-piece reference with the codec ops' CUDA kernels (the rows kernels, the sum
    and the feedback kernel, interpreted), on the fake group of ``world`` ranks whose every rank holds rank 1's
    inputs (as tests/collectives/test_onebit_batched.py's fake world): outputs and both error buffers bit for bit over three
    steps (the second with a NaN), for one padded piece (one scale per chunk and per block) and for a group of two
    full pieces plus a short one (per block), failures listed (empty: none). The ranks' rows are equal here, so
    the order of the sum is not what this checks: that is tests/codecs/test_rows_reduce.py's (the kernel against torch's
    order) and the gloo worlds' of tests/collectives/test_onebit_batched.py (the eager sum against the rank-order loop)."""
    import torch
    import torch.distributed as dist
    from _siblings import from_test_file
    from launch_counts import mirrored_collectives

    _same_values = from_test_file("collectives/test_onebit_batched", "_same_values")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from lightning_qcomm.collectives import onebit_all_reduce, sign_collective

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=world)
    failures, m = [], 96
    with mirrored_collectives():
        one, group = world * m - 3, 2 * world * m + 13 * world - 1
        for d, block in ((one, None), (one, 40), (group, 40)):
            errs = {p: (torch.zeros(d), torch.zeros(-(-d // world))) for p in ("batched", "reference")}
            for t in range(3):
                x = torch.randn(d, generator=torch.Generator().manual_seed(t)) * (0.5 + t)
                if t == 1:
                    x[-(-min(d, world * m) // world) + 5] = float("nan")  # in rank 1's chunk
                outs = {}
                for path, (ew, es) in errs.items():
                    sign_collective.PATH = path
                    outs[path] = onebit_all_reduce(x.clone(), ew, es, check=False, piece_numel=m, block_numel=block)
                for name, a, b in (
                    ("output", outs["batched"], outs["reference"]),
                    ("worker error", errs["batched"][0], errs["reference"][0]),
                    ("server error", errs["batched"][1], errs["reference"][1]),
                ):
                    if not _same_values(a, b):
                        failures.append(f"N={world} d={d} block={block} step {t}: {name} differs")
    return failures


@pytest.fixture(scope="module")
def report() -> dict:
    from _interpreted import run_interpreted

    return run_interpreted(__file__, 600)


@pytest.mark.parametrize("world", WORLDS)
def test_onebit_bucket_launches(report, world):
    """A bucket of one piece with no padding, on rank 0: at most ``MAX_ONEBIT_LAUNCHES`` (``TRITON`` Triton)."""
    r = report[f"N{world}_r0_b4096"]
    assert (r["triton"], r["collectives"]) == (TRITON, 2), r
    assert r["total"] <= MAX_ONEBIT_LAUNCHES, r


@pytest.mark.parametrize("world", WORLDS)
def test_onebit_padded_bucket_launches(report, world):
    """Padding costs the torch ops that zero it, nothing else: Y's on every rank, Z's and E_s's where the chunk
    is short."""
    first, last = report[f"N{world}_r0_b3001"], report[f"N{world}_r{world - 1}_b3001"]
    assert first["total"] <= MAX_ONEBIT_LAUNCHES + 1, first
    assert last["total"] <= MAX_ONEBIT_LAUNCHES + 3, last
    assert first["triton"] == last["triton"] == TRITON, (first, last)


def test_onebit_values_on_the_cuda_path(report):
    """The launches above are of the same values: the batched form (the rank-order sum kernel, the residuals
    through the wire-reading feedback kernel) equals the per-piece reference on the CUDA kernels, bit for bit, at
    N = 2, 4 and 8."""
    assert report["values"] == {str(w): [] for w in WORLDS}, report["values"]


if __name__ == "__main__":
    sys.path[:0] = [str(BENCHMARKS), str(Path(__file__).resolve().parents[1] / "_helpers")]
    print(json.dumps(_worker()))
