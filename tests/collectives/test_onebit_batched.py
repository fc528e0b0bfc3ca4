"""The batched (accelerator) form of the 1-bit all-reduce gives the per-piece reference's bits.

``collectives.sign_collective`` (``PATH = "batched"``) runs every piece of a bucket in one set of multi-row ops; it
must leave the same outputs, worker errors and server errors as the spec (``codecs.sign_phases.SPEC``, the codec's
encode / decode) piece by piece, and record the same
ledger bytes. Checked over several steps (the error buffers carry over), with full pieces, a short last piece
whose last chunks are short or empty on some ranks, one scale per chunk and per block, a NaN step and fp16
input: on real gloo worlds of 2 and 4 processes, and on torch's ``fake`` process group (4 ranks, one process)
with collectives that stand for ranks holding this rank's inputs. The codec layer runs in its accelerator form
and the fused CPU kernels are off, as on a GPU.
"""

from __future__ import annotations

import datetime
import os
import traceback

import pytest
import torch
import torch.distributed as dist
from _launch import free_port, rank_results, spawn, write_rank_result

from lightning_qcomm.codecs import cpu_fused, scaling
from lightning_qcomm.collectives import onebit_all_reduce, onebit_pieces, sign_collective
from lightning_qcomm.collectives.sign_collective import piece_groups
from lightning_qcomm.comm import CommLedger, set_ledger

M = 96  # elements per rank per piece


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical fp32 values, NaN positions equal (a NaN's payload bits are not compared)."""
    a, b = a.float(), b.float()
    nan = torch.isnan(a)
    if not torch.equal(nan, torch.isnan(b)):
        return False
    return torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32))


def _input(seed: int, rank: int, d: int, scale: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randn(d, generator=g) * scale


def compare_paths(rank: int, world: int) -> list[str]:
    """Failures of the batched form, and of the CPU default's schedule (``"auto"``: one unit per piece), against the
    reference (empty: bit-identical everywhere)."""
    failures = []
    saved = (sign_collective.PATH, scaling._HOST_BRANCHES, os.environ.get(cpu_fused.ENV_SWITCH))
    scaling._HOST_BRANCHES = False
    os.environ[cpu_fused.ENV_SWITCH] = "0"
    # full pieces only; a 4-element last piece (the last ranks own no real element of it); a last piece of
    # 13-element chunks (not whole bytes of codes), the last one shorter; one piece
    sizes = (3 * world * M, 2 * world * M + 4, world * M + 13 * world - 1, world * M - 3)
    try:
        for d in sizes:
            for block in (None, 40):
                c = -(-d // world)
                errs = {p: (torch.zeros(d), torch.zeros(c)) for p in ("batched", "auto", "reference")}
                for t in range(4):
                    x = _input(t, rank, d, 0.5 + t)
                    if t == 2 and rank == 1:  # in rank 1's own chunk: the fake group's ranks hold rank 1's inputs
                        x[-(-min(d, world * M) // world) + 5] = float("nan")
                    outs, ledgers = {}, {}
                    for path, (ew, es) in errs.items():
                        sign_collective.PATH = path
                        ledger = CommLedger(keep_records=True)
                        prev = set_ledger(ledger)
                        try:
                            xin = x.clone() if t != 3 else x.half()  # fp16 input: decoded into a copy
                            outs[path] = onebit_all_reduce(xin, ew, es, piece_numel=M, block_numel=block, check=t == 0)
                        finally:
                            set_ledger(prev)
                        ledgers[path] = [(r.op, r.wire_bytes, r.payload_bytes, r.tag) for r in ledger.records]
                    where = f"d={d} block={block} step {t}"
                    for path in ("batched", "auto"):
                        for name, i in (("worker error", 0), ("server error", 1)):
                            if not _same_values(errs[path][i], errs["reference"][i]):
                                failures.append(f"{where} ({path}): {name} differs")
                        if not _same_values(outs[path], outs["reference"]):
                            failures.append(f"{where} ({path}): output differs")
                    if ledgers["batched"] != ledgers["reference"]:
                        failures.append(f"{where}: ledger {ledgers['batched']} != {ledgers['reference']}")
                    if sum(r[1] for r in ledgers["auto"]) != sum(r[1] for r in ledgers["reference"]):
                        failures.append(f"{where} (auto): wire bytes {ledgers['auto']} != {ledgers['reference']}")
                    if t == 2 and not bool(torch.isnan(outs["batched"]).any()):
                        failures.append(f"{where}: the NaN step gave a finite output")
    finally:
        sign_collective.PATH, scaling._HOST_BRANCHES = saved[0], saved[1]
        if saved[2] is None:
            os.environ.pop(cpu_fused.ENV_SWITCH, None)
        else:
            os.environ[cpu_fused.ENV_SWITCH] = saved[2]
    return failures


# ------------------------------------------------------------------------------------------ gloo worlds
def _worker(rank: int, world: int, port: int, outdir: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        result = compare_paths(rank, world)
    except Exception:
        result = [traceback.format_exc()]
    finally:
        write_rank_result(outdir, rank, {"failures": result if "result" in locals() else ["no result"]})
    try:
        dist.destroy_process_group()
    except Exception:
        pass


@pytest.mark.parametrize("world", [2, 4])
def test_gloo_batched_equals_reference(tmp_path, world):
    spawn(_worker, world, free_port(), str(tmp_path), nprocs=world)
    bad = {r: res["failures"] for r, res in enumerate(rank_results(str(tmp_path), world)) if res["failures"]}
    assert not bad, bad


# ------------------------------------------------------------------------------------------ fake process group
def test_fake_group_batched_equals_reference(mirrored_fake_world):
    assert compare_paths(dist.get_rank(), dist.get_world_size()) == []


def test_the_batched_form_runs_off_the_cpu_by_default(monkeypatch):
    """ "auto" batches the pieces of a non-CPU tensor and runs a CPU tensor's piece by piece (pipelined on gloo);
    an unknown PATH is refused."""
    meta = torch.empty(8, device="meta")
    assert sign_collective.selected_path(meta) == "batched"
    assert sign_collective.selected_path(torch.zeros(8)) == "pieces"
    monkeypatch.setattr(sign_collective, "PATH", "fast")
    with pytest.raises(ValueError, match="allowed"):
        sign_collective.selected_path(meta)


def test_piece_groups_cover_the_pieces_in_order():
    """At most two groups (the full pieces, the short last one), whose pieces and server-error offsets are those
    of ``onebit_pieces`` piece by piece."""
    for d, world, m in ((10, 2, 3), (5003, 4, 96), (4 * 96 * 7, 4, 96), (50, 3, 100)):
        pieces = onebit_pieces(d, world, m)
        groups = piece_groups(pieces, world)
        assert len(groups) <= 2
        flat, es = [], 0
        for o, n in pieces:
            flat.append((o, n, es))
            es += -(-n // world)
        expanded = [
            (g.offset + k * g.numel, g.numel, g.es_offset + k * g.chunk) for g in groups for k in range(g.count)
        ]
        assert expanded == flat
