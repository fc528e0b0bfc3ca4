"""Two network namespaces joined by a rate-limited veth pair, for wall-clock benchmarks (docs/design.md).

    from benchmarks.netns import shaped_link, iface_bytes, netns_cmd

    with shaped_link(rate_mbit=100) as link:            # link.ns0, link.ns1, link.addr0, link.addr1
        p0 = subprocess.Popen(netns_cmd(link.ns0, [sys.executable, "worker.py", "--rank", "0"]),
                              env={**os.environ, **link.env(rank=0)})
        ...
        rx, tx = iface_bytes(link.iface0, ns=link.ns0)   # from outside; inside: iface_bytes(link.iface0)

Each direction is shaped on the sending interface with ``tc qdisc add dev IF root tbf rate R burst B
latency L``; burst = max(64 KiB, R/250) (at least one kernel tick of tokens, else tbf under-delivers at
1 Gbit/s). Addresses are only ever assigned inside namespaces created here (default 10.77.0.1/30 and
10.77.0.2/30); ``shaped_link`` deletes both namespaces on exit, also on error or KeyboardInterrupt.
Needs root, ``ip`` (iproute2) and ``tc``.

Interface counters (``/sys/class/net/IF/statistics/{rx,tx}_bytes``) count whole Ethernet frames: IP/TCP
headers and the receiver's ACKs are included, so they run a few percent above payload formulas.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    """A shaped veth pair: namespace, interface and address of each end."""

    ns0: str
    ns1: str
    addr0: str
    addr1: str
    iface0: str
    iface1: str
    rate_mbit: float

    def __iter__(self):
        """Unpack as ``ns0, ns1, addr0, addr1``."""
        return iter((self.ns0, self.ns1, self.addr0, self.addr1))

    def ns(self, rank: int) -> str:
        return (self.ns0, self.ns1)[rank]

    def iface(self, rank: int) -> str:
        return (self.iface0, self.iface1)[rank]

    def env(self, rank: int, port: int = 29500) -> dict[str, str]:
        """torch.distributed / gloo environment for the process of ``rank`` (0 or 1) in ``self.ns(rank)``."""
        return {
            "MASTER_ADDR": self.addr0,
            "MASTER_PORT": str(port),
            "GLOO_SOCKET_IFNAME": self.iface(rank),
            "RANK": str(rank),
            "WORLD_SIZE": "2",
        }


def _run(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), check=check, capture_output=True, text=True)


def require_tools() -> None:
    """Raise RuntimeError unless running as root with ip and tc available."""
    if os.geteuid() != 0:
        raise RuntimeError("network namespaces need root (run the benchmark as root)")
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if missing:
        raise RuntimeError(f"missing tools: {', '.join(missing)} (install iproute2)")


def netns_cmd(ns: str, argv: Sequence[str]) -> list[str]:
    """argv prefixed to run inside namespace ``ns``."""
    return ["ip", "netns", "exec", ns, *argv]


def _burst_bytes(rate_mbit: float) -> int:
    return max(64 * 1024, int(rate_mbit * 1e6 / 8 / 250))


def shape(ns: str, iface: str, rate_mbit: float, latency_ms: float = 100.0) -> None:
    """(Re)install a tbf root qdisc limiting egress of ``iface`` in ``ns`` to ``rate_mbit``."""
    if not rate_mbit > 0:
        raise ValueError(f"rate_mbit must be > 0, got {rate_mbit}")
    _run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", iface, "root"], check=False)
    _run(
        [
            *("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", iface, "root", "tbf"),
            *("rate", f"{rate_mbit}mbit", "burst", str(_burst_bytes(rate_mbit)), "latency", f"{latency_ms}ms"),
        ]
    )


@contextmanager
def shaped_link(
    rate_mbit: float,
    prefix: str = "lqc",
    subnet: str = "10.77.0",
    mtu: int = 1500,
    latency_ms: float = 100.0,
) -> Iterator[Link]:
    """Create namespaces ``{prefix}{pid}a`` / ``{prefix}{pid}b`` joined by a veth pair shaped to
    ``rate_mbit`` in each direction; yield the ``Link``; delete everything on exit.

    ``subnet`` is the first three octets of the /30 the two ends get (``.1`` and ``.2``).
    """
    require_tools()
    tag = f"{prefix}{os.getpid() % 100000}"
    ns0, ns1 = f"{tag}a", f"{tag}b"
    if0, if1 = f"{tag}v0"[:15], f"{tag}v1"[:15]
    link = Link(ns0, ns1, f"{subnet}.1", f"{subnet}.2", if0, if1, float(rate_mbit))
    try:
        _run(["ip", "netns", "add", ns0])
        _run(["ip", "netns", "add", ns1])
        _run(["ip", "link", "add", if0, "netns", ns0, "type", "veth", "peer", "name", if1, "netns", ns1])
        for ns, iface, addr in ((ns0, if0, link.addr0), (ns1, if1, link.addr1)):
            _run(["ip", "-n", ns, "addr", "add", f"{addr}/30", "dev", iface])
            _run(["ip", "-n", ns, "link", "set", iface, "mtu", str(mtu), "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            shape(ns, iface, rate_mbit, latency_ms)
        yield link
    finally:
        for ns in (ns0, ns1):  # deleting a namespace deletes its end of the veth, and the peer with it
            _run(["ip", "netns", "del", ns], check=False)


@dataclass(frozen=True)
class IfaceBytes:
    rx: int
    tx: int


def iface_bytes(iface: str, ns: str | None = None) -> IfaceBytes:
    """Byte counters of ``iface``: from sysfs when called inside its namespace (``ns=None``), else via
    ``ip -n ns -s -j link``."""
    if ns is None:
        base = f"/sys/class/net/{iface}/statistics"
        with open(f"{base}/rx_bytes") as f_rx, open(f"{base}/tx_bytes") as f_tx:
            return IfaceBytes(int(f_rx.read()), int(f_tx.read()))
    out = _run(["ip", "-n", ns, "-s", "-j", "link", "show", "dev", iface]).stdout
    stats = json.loads(out)[0]["stats64"]
    return IfaceBytes(int(stats["rx"]["bytes"]), int(stats["tx"]["bytes"]))
