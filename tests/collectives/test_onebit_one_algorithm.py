"""The 1-bit all-reduce is one algorithm: its CPU kernels (the C sign kernels) and its accelerator kernels (the rows
ops, run on CPU tensors with the fused path off, as on a GPU) run through the same reducer and the same units and
hand the engine the same payload sizes, so they issue the same collectives with the same bytes, and leave the same
bits. Only the kernels differ (a spy shows which ran). On torch's ``fake`` process group, 4 ranks, every rank
holding this rank's inputs (``benchmarks/launch_counts.mirrored_collectives``).
"""

from __future__ import annotations

import pytest
import torch

from lightning_qcomm.codecs import cpu_fused, native, sign_ops
from lightning_qcomm.collectives import onebit_all_reduce, sign_collective

M = 96  # elements per rank per piece


def _run(monkeypatch, c_kernels: bool, d: int) -> dict:
    """Outputs, error buffers, the reducer's class and units, and the bytes of every payload handed to a
    collective, over two steps, with the C sign kernels on or off."""
    monkeypatch.setattr(cpu_fused, "FUSED_MIN_NUMEL", 1)
    monkeypatch.setenv(cpu_fused.ENV_SWITCH, "1" if c_kernels else "0")
    seen = {"reducers": [], "units": [], "sent": [], "c_calls": 0}
    real_run, real_encode = sign_collective.run_pipelined, sign_ops.sign_encode_err

    def run_pipelined(reducer, units, group, world):
        seen["reducers"].append(type(reducer))
        seen["units"].append(list(units))
        encode, reduce = reducer.encode, reducer.reduce
        reducer.encode = lambda u: _sent(encode(u))
        reducer.reduce = lambda u, recv: _sent(reduce(u, recv))
        return real_run(reducer, units, group, world)

    def _sent(payload: torch.Tensor) -> torch.Tensor:
        seen["sent"].append((payload.dtype, payload.numel()))
        return payload

    def spy(*args):
        seen["c_calls"] += 1
        return real_encode(*args)

    monkeypatch.setattr(sign_collective, "run_pipelined", run_pipelined)
    monkeypatch.setattr(sign_ops, "sign_encode_err", spy)
    ew, es = torch.zeros(d), torch.zeros(-(-d // 4))
    outs = []
    try:
        for t in range(2):
            x = torch.randn(d, generator=torch.Generator().manual_seed(t)) * (1 + t)
            outs.append(onebit_all_reduce(x, ew, es, check=False, piece_numel=M))
    finally:
        monkeypatch.undo()
    return {**seen, "outs": outs, "ew": ew, "es": es}


@pytest.mark.skipif(native.load() is None, reason="the C library cannot be built here")
@pytest.mark.parametrize("d", [3 * 4 * M, 2 * 4 * M + 5])  # full pieces; a short last piece with an empty chunk
def test_cpu_and_accelerator_kernels_run_one_algorithm(mirrored_fake_world, monkeypatch, d):
    c = _run(monkeypatch, True, d)
    rows = _run(monkeypatch, False, d)
    assert c["c_calls"] > 0 and rows["c_calls"] == 0  # the kernels did differ
    assert len(set(c["reducers"] + rows["reducers"])) == 1, (c["reducers"], rows["reducers"])
    assert c["units"] == rows["units"]
    assert c["sent"] == rows["sent"] and c["sent"], (c["sent"], rows["sent"])
    for a, b in zip(c["outs"] + [c["ew"], c["es"]], rows["outs"] + [rows["ew"], rows["es"]]):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
