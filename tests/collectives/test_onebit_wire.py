"""``onebit_all_reduce_wire`` keeps the 1-bit average in its wire form: ``decode()`` gives the bits
``onebit_all_reduce`` leaves in x, the error buffers move on alike, x is only read, and ``finite()`` (read from the
scales) is False exactly when the decoded average holds a NaN or Inf. On torch's ``fake`` process group, 4 ranks,
every rank holding this rank's inputs (``benchmarks/launch_counts.mirrored_collectives``); the C sign kernels and
the rows ops (the accelerator's form), each schedule, pieces of several lengths, one scale per chunk and per block.
"""

from __future__ import annotations

import pytest
import torch

from lightning_qcomm.codecs import cpu_fused
from lightning_qcomm.collectives import sign_collective
from lightning_qcomm.collectives.sign_collective import (
    onebit_all_reduce,
    onebit_all_reduce_wire,
    onebit_server_error_numel,
)

M = 96  # elements per rank per piece: d = 1000 is 3 pieces of 384 and a short one of 232


def _both(x: torch.Tensor, block: int | None) -> tuple:
    """(in place: x, ew, es), (wire: the wire, x after, ew, es), from the same inputs and error buffers."""
    g = torch.Generator().manual_seed(1)
    ew = torch.randn(x.numel(), generator=g)
    es = torch.randn(onebit_server_error_numel(x.numel()), generator=g)
    a = (x.clone(), ew.clone(), es.clone())
    onebit_all_reduce(*a, piece_numel=M, block_numel=block)
    b = (x.clone(), ew.clone(), es.clone())
    wire = onebit_all_reduce_wire(*b, piece_numel=M, block_numel=block)
    return a, (wire, *b)


@pytest.mark.parametrize("path", ["auto", "batched"])
@pytest.mark.parametrize("c_kernels", [True, False], ids=["c_kernels", "rows_ops"])
@pytest.mark.parametrize("block", [None, 16], ids=["per_chunk", "per_block"])
@pytest.mark.parametrize("d", [1000, 77])
def test_decoded_wire_is_the_in_place_result(mirrored_fake_world, monkeypatch, path, c_kernels, block, d):
    monkeypatch.setattr(cpu_fused, "FUSED_MIN_NUMEL", 1)
    monkeypatch.setenv(cpu_fused.ENV_SWITCH, "1" if c_kernels else "0")
    monkeypatch.setattr(sign_collective, "PATH", path)
    x = torch.randn(d, generator=torch.Generator().manual_seed(0))
    (out, ew, es), (wire, x_after, ew_w, es_w) = _both(x, block)
    assert torch.equal(x_after, x)  # only read
    decoded = wire.decode()
    assert decoded.view(torch.int32).equal(out.view(torch.int32))
    assert ew_w.view(torch.int32).equal(ew.view(torch.int32)) and es_w.view(torch.int32).equal(es.view(torch.int32))
    assert bool(wire.finite())
    sign = sign_collective._sign_codec(block)  # held: the N gathered payloads of every piece, no fp32 values
    assert wire.nbytes() == sum(4 * sign.nbytes(-(-n // 4)) for _, n in sign_collective.onebit_pieces(d, 4, M))
    into = torch.full((d,), 7.0)
    assert wire.decode(into) is into and into.view(torch.int32).equal(out.view(torch.int32))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("c_kernels", [True, False], ids=["c_kernels", "rows_ops"])
@pytest.mark.parametrize("block", [None, 16], ids=["per_chunk", "per_block"])
def test_finite_is_false_exactly_when_the_decoded_average_is_not(
    mirrored_fake_world, monkeypatch, bad, c_kernels, block
):
    monkeypatch.setattr(cpu_fused, "FUSED_MIN_NUMEL", 1)
    monkeypatch.setenv(cpu_fused.ENV_SWITCH, "1" if c_kernels else "0")
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    x[100] = bad  # piece 0, chunk 1: this rank's (rank 1's) chunk, which the mirrored ranks send it too
    (out, _, _), (wire, *_rest) = _both(x, block)
    decoded = wire.decode()
    assert not bool(decoded.isfinite().all()) and not bool(wire.finite())
    assert decoded.view(torch.int32).equal(out.view(torch.int32))


def test_decode_into_a_wrong_buffer_names_the_allowed_one(mirrored_fake_world):
    x = torch.randn(100)
    wire = onebit_all_reduce_wire(x, torch.zeros(100), torch.zeros(onebit_server_error_numel(100)))
    with pytest.raises(ValueError, match=r"OneBitWire.decode\(out=.*contiguous fp32 tensor of 100 elements"):
        wire.decode(torch.zeros(100, dtype=torch.float64))
