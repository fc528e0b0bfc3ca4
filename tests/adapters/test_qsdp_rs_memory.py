"""Peak extra memory of one QSDP gradient reduce-scatter stays within 2 fp32 shards at any world size.

"Extra" is what the call allocates beyond the wire buffers, which an all-to-all of encoded rows needs whatever
the implementation: the N encoded rows sent and the N received. Measured with benchmarks/qsdp_rs_memory.py's
``measure`` (torch.profiler's allocation trace, the fake process group at N = 2, 4, 8, async exchanges
holding their tensors until waited on, as gloo does), for 8-bit uniform and qsgd and the benchmark's three layouts of a
200K-element shard: segments that are not a whole number of buckets (per-row seeds), segments of whole
buckets with a raw bias (one flat encode per segment), and segments below the fused C path's row size. A
memory count, not a timing.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.qsdp_rs_memory import CODECS, LAYOUTS, WORLDS, measure  # noqa: E402
from lightning_qcomm.codecs import get_codec  # noqa: E402

BOUND = 2.0  # fp32 shards beyond the wire buffers


@pytest.fixture
def fake_worlds():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("codec", sorted(CODECS))
def test_reduce_scatter_extra_memory_is_bounded_at_any_world_size(fake_worlds, layout, codec):
    m = {world: measure(world, get_codec(**CODECS[codec]), LAYOUTS[layout]) for world in WORLDS}
    rest = {world: round(v["rest"], 3) for world, v in m.items()}
    assert max(rest.values()) <= BOUND, f"{codec}, {layout}: fp32 shards beyond the wire buffers per N: {rest}"
    # The encode runs before the receive buffer exists, so the rest cannot show its temporaries growing with
    # N while they stay below that buffer: they must not grow at all.
    encode = {world: round(v["encode"], 3) for world, v in m.items()}
    assert encode[8] <= encode[2] + 0.05, f"{codec}, {layout}: the encode's temporaries (shards) per N: {encode}"
