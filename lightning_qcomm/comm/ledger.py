"""CommLedger: byte accounting for every collective lightning_qcomm issues (docs/design.md, "Byte accounting").

Each record carries, for this rank:

* ``op``: the torch.distributed primitive (all_reduce, all_gather, reduce_scatter, all_to_all, broadcast),
* ``tag``: what the traffic is for (grads, weights, param_average, momentum, control, ...), optionally with
  the link it crosses as a suffix: ``"grads@intra"`` (inside a node), ``"grads@inter"`` (between nodes; the
  hierarchical collectives of ``collectives.hierarchical`` record these). ``scope_of(tag)`` reads it back; a tag
  without a suffix is scope ``"flat"``: a collective over the whole group, which the ledger cannot split (its
  traffic crosses the nodes' links too when the world spans several nodes: counted as neither intra nor inter,
  docs/design.md "Byte accounting"). ``purpose_of(tag)`` is the tag without the suffix,
* ``payload_bytes``: bytes of the input tensors this rank handed to torch.distributed,
* ``wire_bytes``: estimated bytes this rank sends, ``factor(op, N) * collective_bytes`` with the
  usual ring/pairwise factors: all_reduce 2(N-1)/N; all_gather, reduce_scatter, all_to_all and
  broadcast (N-1)/N, where ``collective_bytes`` is the size of the whole logical buffer (the
  gathered output, the scattered input),
* ``baseline_bytes``: the same estimate for the uncompressed fp32 collective that would otherwise run.

Recording is plain Python integer arithmetic: no tensor is read, so no device sync. Steps are
delimited by ``next_step()`` (a strategy or callback calls it once per optimizer step). A counting
``CommLedger`` is active from import on, so ``ensure_ledger().cumulative`` read after training (the natural
order in a Fabric or plain-torch script) holds what the process sent; ``reset()`` starts it from zero,
``set_ledger(None)`` installs a fresh one, and ``set_ledger(NullLedger())`` stops counting.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
SCOPES = ("intra", "inter", "flat")


def scope_of(tag: str) -> str:
    """``"intra"`` / ``"inter"`` for a tag ending in ``@intra`` / ``@inter``, else ``"flat"``.

    Example::

        scope_of("grads@inter"), scope_of("grads")   # ("inter", "flat")
    """
    head, sep, tail = tag.rpartition("@")
    return tail if sep and tail in ("intra", "inter") else "flat"


def purpose_of(tag: str) -> str:
    """The tag without its scope suffix (``"grads@inter"`` -> ``"grads"``)."""
    return tag.rpartition("@")[0] if scope_of(tag) != "flat" else tag


def wire_factor(op: str, world_size: int) -> float:
    """Fraction of the logical buffer a rank sends in a bandwidth-optimal implementation of ``op``."""
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    n = int(world_size)
    if n < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    base = (n - 1) / n
    return 2.0 * base if op == "all_reduce" else base


@dataclass
class OpTotals:
    """Sums over a set of records."""

    calls: int = 0
    payload_bytes: int = 0
    wire_bytes: float = 0.0
    baseline_bytes: float = 0.0

    def add(self, other: OpTotals) -> None:
        self.calls += other.calls
        self.payload_bytes += other.payload_bytes
        self.wire_bytes += other.wire_bytes
        self.baseline_bytes += other.baseline_bytes

    @property
    def ratio(self) -> float:
        """wire / baseline (1.0 when nothing was sent)."""
        return self.wire_bytes / self.baseline_bytes if self.baseline_bytes else 1.0


@dataclass(frozen=True)
class CommRecord:
    op: str
    tag: str
    payload_bytes: int
    wire_bytes: float
    baseline_bytes: float
    world_size: int


@dataclass
class CommLedger:
    """Per-rank accounting of compressed (and uncompressed) collectives.

    ``keep_records`` retains every ``CommRecord`` of the current step (tests and debugging); totals
    are always kept per (op, tag) for the current step and cumulatively.

    Example::

        ledger = ensure_ledger()
        quantized_all_reduce(grad, get_codec("uniform", bits=8))
        ledger.summarize(ledger.next_step(), by="tag")   # {"grads": OpTotals(calls=1, wire_bytes=..., ...)}
    """

    keep_records: bool = False
    step: int = 0
    records: list[CommRecord] = field(default_factory=list)
    _current: dict[tuple[str, str], OpTotals] = field(default_factory=lambda: defaultdict(OpTotals))
    _last: dict[tuple[str, str], OpTotals] = field(default_factory=dict)
    _total: dict[tuple[str, str], OpTotals] = field(default_factory=lambda: defaultdict(OpTotals))

    enabled = True

    def record(
        self,
        op: str,
        collective_bytes: int,
        baseline_collective_bytes: int,
        world_size: int,
        payload_bytes: int | None = None,
        tag: str = "",
    ) -> CommRecord:
        """Account one collective. ``collective_bytes`` is the logical buffer size (see module doc);
        ``payload_bytes`` defaults to it (right for all_reduce, all_to_all, reduce_scatter)."""
        f = wire_factor(op, world_size)
        rec = CommRecord(
            op=op,
            tag=tag,
            payload_bytes=int(collective_bytes if payload_bytes is None else payload_bytes),
            wire_bytes=f * collective_bytes,
            baseline_bytes=f * baseline_collective_bytes,
            world_size=int(world_size),
        )
        one = OpTotals(1, rec.payload_bytes, rec.wire_bytes, rec.baseline_bytes)
        self._current[(op, tag)].add(one)
        self._total[(op, tag)].add(one)
        if self.keep_records:
            self.records.append(rec)
        return rec

    def next_step(self) -> dict[tuple[str, str], OpTotals]:
        """Close the current step; returns its totals (also available as ``last_step``)."""
        self._last = dict(self._current)
        self._current = defaultdict(OpTotals)
        self.records = []
        self.step += 1
        return self._last

    @property
    def current_step(self) -> dict[tuple[str, str], OpTotals]:
        return dict(self._current)

    @property
    def last_step(self) -> dict[tuple[str, str], OpTotals]:
        return dict(self._last)

    @property
    def cumulative(self) -> dict[tuple[str, str], OpTotals]:
        return dict(self._total)

    @staticmethod
    def summarize(totals: dict[tuple[str, str], OpTotals], by: str = "all") -> dict[str, OpTotals]:
        """Group totals by ``"op"``, ``"tag"`` (the purpose: scopes of one tag summed), ``"scope"`` (``SCOPES``)
        or into one ``"all"`` entry."""
        if by not in ("op", "tag", "scope", "all"):
            raise ValueError(f"by must be 'op', 'tag', 'scope' or 'all', got {by!r}")
        out: dict[str, OpTotals] = defaultdict(OpTotals)
        for (op, tag), t in totals.items():
            key = {"op": op, "tag": purpose_of(tag) or op, "scope": scope_of(tag), "all": "all"}[by]
            out[key].add(t)
        return dict(out)

    def reset(self) -> None:
        self.step = 0
        self.records = []
        self._current = defaultdict(OpTotals)
        self._last = {}
        self._total = defaultdict(OpTotals)


class NullLedger(CommLedger):
    """Drops every record: ``set_ledger(NullLedger())`` turns the accounting off."""

    enabled = False

    def record(self, op, collective_bytes, baseline_collective_bytes, world_size, payload_bytes=None, tag=""):  # noqa: D102
        wire_factor(op, world_size)
        return CommRecord(op, tag, int(payload_bytes or collective_bytes), 0.0, 0.0, int(world_size))


_active: CommLedger = CommLedger()


def get_ledger() -> CommLedger:
    """The process-wide ledger collectives record into: a counting ``CommLedger`` from import on, or the one set
    with ``set_ledger``.

    Example::

        get_ledger().cumulative   # {(op, tag): OpTotals} since the ledger was installed
    """
    return _active


def set_ledger(ledger: CommLedger | None) -> CommLedger:
    """Install ``ledger`` (None: a fresh counting ``CommLedger``; ``NullLedger()`` stops counting); returns the
    previous one.

    Example::

        previous = set_ledger(CommLedger(keep_records=True))
    """
    global _active
    prev = _active
    _active = CommLedger() if ledger is None else ledger
    return prev


def ensure_ledger() -> CommLedger:
    """The active counting ledger, installing a fresh ``CommLedger`` if a ``NullLedger`` was set. Read after
    training, it holds everything this process sent since import (or since its ``reset()``).

    Example::

        train(...)                        # any of the package's entry points
        ensure_ledger().cumulative        # {(op, tag): OpTotals} of the whole run
    """
    if not get_ledger().enabled:
        set_ledger(CommLedger())
    return get_ledger()
