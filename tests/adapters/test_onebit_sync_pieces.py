"""``OneBitMomentumSync``'s pipelining piece: chosen from the buffers' device on the first sync (None, the default),
recorded in the rank state, adopted by an unchosen sync on load, refused where a set piece differs.

CPU tensors keep ``DEFAULT_ONEBIT_PIECE_NUMEL`` (pipelining on gloo: the same layout and values as before the piece
could be chosen); any other device gets one piece per bucket, so the 1-bit all-reduce runs each bucket as one group
of one piece (``collectives.sign_collective``) and launches no more per bucket than one piece does.
"""

from __future__ import annotations

import pytest
import torch

from lightning_qcomm.adapters.onebit.sync import OneBitMomentumSync
from lightning_qcomm.collectives import DEFAULT_ONEBIT_PIECE_NUMEL, onebit_pieces

NUMELS = [10, 7, 30, 45]  # buckets of at most 20: [10, 7] -> 17, [30], [45]


@pytest.mark.parametrize("bad", [0, -3, True, 1.5, "256"])
def test_piece_numel_is_none_or_a_positive_int(bad):
    with pytest.raises(ValueError, match=r"OneBitMomentumSync\(piece_numel=.*allowed None .* or an int >= 1"):
        OneBitMomentumSync(NUMELS, bucket_numel=20, piece_numel=bad)


def test_cpu_buffers_keep_the_default_piece_and_record_it():
    sync = OneBitMomentumSync(NUMELS, bucket_numel=20)
    assert sync.piece_numel is None
    assert sync.rank_state_dict()["piece_numel"] is None  # nothing synced: no layout yet
    sync.sync_([torch.randn(n) for n in NUMELS])
    assert sync.piece_numel == DEFAULT_ONEBIT_PIECE_NUMEL
    assert sync.rank_state_dict()["piece_numel"] == DEFAULT_ONEBIT_PIECE_NUMEL
    explicit = OneBitMomentumSync(NUMELS, bucket_numel=20, piece_numel=4)
    explicit.sync_([torch.randn(n) for n in NUMELS])
    assert explicit.piece_numel == 4  # an int is kept as given


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_off_the_cpu_every_bucket_is_one_piece(monkeypatch, world):
    sync = OneBitMomentumSync(NUMELS, bucket_numel=20)
    monkeypatch.setattr(sync, "world_size", lambda: world)
    piece = sync.resolve_piece_numel(torch.device("cuda"))
    assert piece == -(-max(sync.bucket_numels) // world)
    assert all(len(onebit_pieces(n, world, piece)) == 1 for n in sync.bucket_numels)
    assert sync.resolve_piece_numel(torch.device("cpu")) == DEFAULT_ONEBIT_PIECE_NUMEL
    sync._ensure_errors(torch.device("meta"))  # the first sync on a non-CPU device chooses it
    assert sync.piece_numel == piece


def test_an_unchosen_sync_adopts_the_saved_piece_a_set_one_must_match():
    saved_sync = OneBitMomentumSync(NUMELS, bucket_numel=20, piece_numel=4)
    saved_sync.sync_([torch.randn(n) for n in NUMELS])
    state = saved_sync.rank_state_dict()

    resumed = OneBitMomentumSync(NUMELS, bucket_numel=20)
    resumed.load_rank_state_dict(state)
    assert resumed.piece_numel == 4  # an exact resume keeps the saved layout
    assert all(torch.equal(a, b) for a, b in zip(resumed.server_error, saved_sync.server_error))
    resumed.sync_([torch.randn(n) for n in NUMELS])
    assert resumed.piece_numel == 4  # not re-chosen from the device

    with pytest.raises(ValueError, match="another layout"):
        OneBitMomentumSync(NUMELS, bucket_numel=20, piece_numel=5).load_rank_state_dict(state)
    chosen = OneBitMomentumSync(NUMELS, bucket_numel=20)
    chosen.sync_([torch.randn(n) for n in NUMELS])  # CPU: the default piece, not 4
    with pytest.raises(ValueError, match="another layout"):
        chosen.load_rank_state_dict(state)
    old_format = {k: v for k, v in state.items() if k != "piece_numel"}  # buffers of an unknown layout
    with pytest.raises(ValueError, match="another layout"):
        OneBitMomentumSync(NUMELS, bucket_numel=20).load_rank_state_dict(old_format)

    empty = OneBitMomentumSync(NUMELS, bucket_numel=20).rank_state_dict()  # saved before any sync
    fresh = OneBitMomentumSync(NUMELS, bucket_numel=20)
    fresh.load_rank_state_dict(empty)
    assert fresh.piece_numel is None and fresh.worker_error is None
