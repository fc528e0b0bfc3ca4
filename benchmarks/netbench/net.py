"""netbench's network: the two shaped namespaces (``NamespaceNet``, root) or plain loopback (``LoopbackNet``).

As root: two network namespaces joined by a veth pair (``benchmarks.netns.shaped_link``), each end's
egress shaped with ``tc qdisc ... tbf rate R``; torn down on exit, on error and on Ctrl-C / SIGTERM /
SIGHUP. Otherwise both ranks on 127.0.0.1, unshaped, with machine-wide ``lo`` counters.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from typing import Any


class LoopbackNet:
    """Both ranks on 127.0.0.1; no shaping; ``lo`` counters include every process on the machine."""

    mode = "loopback"
    shaped = False
    master_addr = "127.0.0.1"

    def iface(self, rank: int) -> str:
        return "lo"

    def prefix(self, rank: int) -> list[str]:
        return []

    def shape(self, rate_mbit: float | None) -> None:
        pass

    def link_check(self, rate_mbit: float | None) -> dict:
        return {}

    def __enter__(self) -> LoopbackNet:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


class NamespaceNet:
    """The two shaped namespaces of ``netns.shaped_link`` (created on enter, deleted on exit), plus
    re-shaping between rates and a TCP goodput check of the shaped link."""

    mode = "netns"
    shaped = True

    def __init__(self, first_rate_mbit: float, prefix: str = "lqnb", subnet: str = "10.88.0") -> None:
        from benchmarks import netns

        self._netns = netns
        self._cm = netns.shaped_link(first_rate_mbit, prefix=prefix, subnet=subnet)
        self.link = None

    def __enter__(self) -> NamespaceNet:
        self.link = self._cm.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._cm.__exit__(*exc)

    @property
    def master_addr(self) -> str:
        return self.link.addr0

    @property
    def ns(self) -> tuple[str, str]:
        return (self.link.ns0, self.link.ns1)

    def iface(self, rank: int) -> str:
        return self.link.iface(rank)

    def prefix(self, rank: int) -> list[str]:
        return self._netns.netns_cmd(self.link.ns(rank), [])

    def shape(self, rate_mbit: float | None) -> None:
        for rank in (0, 1):
            self._netns.shape(self.link.ns(rank), self.link.iface(rank), rate_mbit)

    def link_check(self, rate_mbit: float | None, seconds: float = 0.5) -> dict:
        """Send ~``seconds`` worth of bytes ns0 -> ns1 over TCP; the receiver measures the goodput."""
        nbytes = int(max(1e6, (rate_mbit or 1000) * 1e6 / 8 * seconds))
        addr, port = self.link.addr1, 29400
        server = (
            "import socket,time\n"
            f"s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);s.bind(('{addr}',{port}))\n"
            "s.listen(1);print('ready',flush=True);c,_=s.accept();n=0;t0=None\n"
            "while True:\n d=c.recv(1<<20)\n if t0 is None:t0=time.perf_counter()\n if not d:break\n n+=len(d)\n"
            "print(n,time.perf_counter()-t0,flush=True)\n"
        )
        client = (
            f"import socket;s=socket.create_connection(('{addr}',{port}));b=bytes(1<<20);n={nbytes}\n"
            "while n>0:\n s.sendall(b[:min(n,1<<20)]);n-=1<<20\ns.close()"
        )
        srv = subprocess.Popen([*self.prefix(1), sys.executable, "-c", server], stdout=subprocess.PIPE, text=True)
        try:
            srv.stdout.readline()
            subprocess.run([*self.prefix(0), sys.executable, "-c", client], check=True, capture_output=True)
            out, _ = srv.communicate(timeout=60)
            n, dt = out.split()
            return {
                "bytes": int(n),
                "seconds": round(float(dt), 4),
                "goodput_mbit": round(int(n) * 8 / float(dt) / 1e6, 1),
            }
        finally:
            if srv.poll() is None:
                srv.kill()
                srv.wait()


def make_net(args: argparse.Namespace, first_rate: float):
    """NamespaceNet when root and iproute2 is there; LoopbackNet otherwise, saying why."""
    if args.loopback:
        print("[netbench] --loopback: both ranks on 127.0.0.1, unshaped, counters machine-wide.", flush=True)
        return LoopbackNet()
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if os.geteuid() != 0 or missing:
        why = "not root" if os.geteuid() != 0 else f"missing tools {missing}"
        print(
            f"[netbench] WARNING: {why}, so no network namespaces: falling back to plain loopback "
            "(127.0.0.1, NO rate limit, interface counters include other processes' loopback traffic). "
            "Step times are not link-limited and no efficiency is computed. Run as root for the real benchmark.",
            flush=True,
        )
        return LoopbackNet()
    return NamespaceNet(first_rate)


__all__ = ["LoopbackNet", "NamespaceNet", "make_net"]
