"""Launch one script as N real processes the way Lightning sees externally created processes
(``LOCAL_RANK``/``NODE_RANK``/``WORLD_SIZE``/``MASTER_*`` set, as torchrun and SLURM set them), and collect
each one's exit status and output; and the same environment for a spawned worker (``lightning_env``).

Shared by the tests that need processes to fail independently (hangs, timeouts, mismatched settings),
where ``torch.multiprocessing.spawn`` would tear the others down with the first failure, and by the
multi-node tests: ``ranks_per_node`` < world lays the ranks out as nodes (global rank = node · ranks_per_node
+ local rank), for ``Trainer(num_nodes=world // ranks_per_node, devices=ranks_per_node)``.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from dataclasses import dataclass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Outcome:
    returncode: int | None  # None: still running when the guard expired (then killed)
    output: str


def lightning_env(rank: int, world: int, port: int, ranks_per_node: int | None = None) -> dict[str, str]:
    """The variables a launcher sets for global ``rank`` (node-major layout, one node by default)."""
    per_node = world if ranks_per_node is None else ranks_per_node
    if world % per_node:
        raise ValueError(f"ranks_per_node={per_node} does not divide world={world}")
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(world),
        "NODE_RANK": str(rank // per_node),
        "LOCAL_RANK": str(rank % per_node),
        "OMP_NUM_THREADS": "1",
    }


def run_ranks(
    script: str | list[str],
    world: int = 2,
    guard_s: float = 60.0,
    extra_env: list[dict] | None = None,
    ranks_per_node: int | None = None,
    wait_ranks: list[int] | None = None,
) -> list[Outcome]:
    """Run ``script`` (a file path, or one per rank) as ``world`` processes; wait at most ``guard_s`` for
    each of ``wait_ranks`` (default: all), then kill every process still running (its returncode None)."""
    scripts = [script] * world if isinstance(script, str) else list(script)
    world = len(scripts)
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, **lightning_env(rank, world, port, ranks_per_node))
        env.update((extra_env or [{}] * world)[rank])
        procs.append(
            subprocess.Popen([sys.executable, scripts[rank]], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        )
    waited = set(range(world) if wait_ranks is None else wait_ranks)
    outcomes: list[Outcome | None] = [None] * world
    for rank in sorted(waited):
        try:
            out, _ = procs[rank].communicate(timeout=guard_s)
            outcomes[rank] = Outcome(procs[rank].returncode, out.decode(errors="replace"))
        except subprocess.TimeoutExpired:
            pass
    for rank, p in enumerate(procs):
        if outcomes[rank] is None:
            p.kill()
            out, _ = p.communicate()
            outcomes[rank] = Outcome(None, out.decode(errors="replace"))
    return outcomes
