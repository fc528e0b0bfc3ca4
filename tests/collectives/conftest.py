"""Fixtures of the collectives' tests: ``mirrored_fake_world``, torch's ``fake`` process group of 4 ranks (this
process is rank 1) where every rank holds this rank's inputs, so an all-to-all delivers this rank's own row from
every rank and an all-gather N copies of this rank's bytes (``benchmarks/launch_counts.mirrored_collectives``):
a collective's arithmetic checked in one process.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks.launch_counts
from benchmarks.launch_counts import mirrored_collectives  # noqa: E402


@pytest.fixture
def mirrored_fake_world():
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    with mirrored_collectives():
        yield
    dist.destroy_process_group()
