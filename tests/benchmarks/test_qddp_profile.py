"""benchmarks/qddp_profile.py: the bounds it reports follow their definitions, and its codec step makes the
collective's calls in the collective's pieces (no timing is asserted)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import qddp_profile  # noqa: E402
from lightning_qcomm.codecs import get_codec  # noqa: E402


def test_bounds_split_the_run_floor_in_the_profile_proportions():
    phases = {"fwd": 20.0, "bwd": 60.0, "opt": 20.0}  # profile floor 100 ms; the run's floor 200 ms: scale 2
    b = qddp_profile.bounds(phases, codec_ms=10.0, floor_ms=200.0, step_ms=500.0, wire_ms=300.0)
    assert b["codec"] == 20.0
    assert b["L0"] == 300.0  # max(floor, wire)
    assert b["L1"] == max(200.0 + 20.0, 40.0 + 40.0 + 300.0) == 380.0  # wire hides behind backward only
    assert b["L2"] == 200.0 + 300.0  # one bucket: the wire after backward
    wire_bound = qddp_profile.bounds(phases, codec_ms=10.0, floor_ms=200.0, step_ms=500.0, wire_ms=10.0)
    assert wire_bound["L0"] == 200.0 and wire_bound["L1"] == 220.0 and wire_bound["L2"] == 220.0


def test_codec_step_encodes_every_piece(monkeypatch):
    codec = get_codec("uniform", bits=8)
    grad = torch.randn(1 << 17)
    calls = []
    real = qddp_profile._encode_rows
    monkeypatch.setattr(
        qddp_profile, "_encode_rows", lambda c, rows, seeds: calls.append(rows.shape) or real(c, rows, seeds)
    )
    qddp_profile.codec_step(codec, grad, None)
    pieces = qddp_profile.all_reduce_pieces(grad.numel(), 2, codec)
    assert len(calls) == len(pieces) > 1
    assert sum(r * c for r, c in calls) >= grad.numel()
    calls.clear()
    qddp_profile.codec_step(codec, grad, grad.numel())
    assert len(calls) == 1
