"""Every compressed all-reduce runs on one engine (``collectives.engine.run_pipelined``).

* The engine's order: every unit encoded (its all-to-all issued) before the first reduce; reduces, then decodes,
  in unit order; ``finish`` once, last. A reducer may decode into its input's storage only because of it.
* No collective of the package moves the compressed exchange's bytes itself: the quantized all-reduce, the 1-bit
  all-reduce per piece and batched (and through them the hierarchical forms), the quantized reduce-scatter and
  all-gather and QSDP's reduce-scatter and all-gather call the engine (read from the sources with ``ast``).
* Through the engine the all-reduces keep their results bit for bit: tests/collectives/test_collectives.py,
  tests/collectives/test_onebit_batched.py and the launch counts in tests/kernels/test_fused_launches.py.
"""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from lightning_qcomm.collectives.engine import run_pipelined

ROOT = Path(__file__).resolve().parents[2] / "lightning_qcomm"
# the byte transfers of the compressed exchange (comm.transport); ``_all_gather`` of raw values (no codec) is not one
EXCHANGES = ("_all_to_all_async", "_all_gather_async", "_all_to_all", "all_to_all_bytes", "all_to_all_pieces")
EXCHANGES += ("all_gather_bytes",)


class _Recorder:
    """A reducer of world size 1 that records its calls and moves one byte per unit."""

    def __init__(self):
        self.calls = []

    def chunk_nbytes(self, unit):
        return unit + 1

    def encode(self, unit):
        self.calls.append(f"encode{unit}")
        return torch.full((1,), unit, dtype=torch.uint8)

    def reduce(self, unit, recv):
        self.calls.append(f"reduce{unit}:{int(recv[0])}")
        return recv + 10

    def decode(self, unit, gathered):
        self.calls.append(f"decode{unit}:{int(gathered[0])}")

    def finish(self):
        self.calls.append("finish")


def test_engine_encodes_every_unit_before_it_reduces_and_decodes_in_order():
    reducer = _Recorder()
    assert run_pipelined(reducer, [0, 1, 2], group=None, world=1) == 1 + 2 + 3
    assert reducer.calls == [
        "encode0",
        "encode1",
        "encode2",
        "reduce0:0",
        "reduce1:1",
        "reduce2:2",
        "decode0:10",
        "decode1:11",
        "decode2:12",
        "finish",
    ]


def async_exchange_callers(root: Path) -> list[str]:
    """'module:line' of every call of the compressed exchange's byte transfers outside the engine and transport."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).as_posix() in ("collectives/engine.py", "comm/transport.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Call):
                fn = node.func
                name = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else ""
                if name in EXCHANGES:
                    found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_only_the_engine_moves_the_compressed_bytes():
    assert async_exchange_callers(ROOT) == []


def test_the_source_check_can_fail(tmp_path):
    (tmp_path / "comm").mkdir()
    (tmp_path / "comm" / "mine.py").write_text("def f(r, s, g):\n    return _all_to_all_async(r, s, g, 2)\n")
    assert async_exchange_callers(tmp_path) == ["comm/mine.py:2"]


def test_reduce_scatter_frees_the_send_buffer_before_it_reduces():
    import weakref

    seen = {}

    def encode():
        send = torch.arange(6, dtype=torch.uint8)
        seen["send"] = weakref.ref(send)
        return send

    def reduce(recv):
        seen["alive"] = seen["send"]() is not None
        return int(recv.sum())

    from lightning_qcomm.collectives.engine import run_all_gather, run_reduce_scatter

    assert run_reduce_scatter(encode, reduce, group=None, world=1) == 15
    assert seen["alive"] is False
    assert run_all_gather(lambda: torch.tensor([3, 4], dtype=torch.uint8), lambda g: g.tolist(), None, 1) == [3, 4]
