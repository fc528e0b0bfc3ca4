"""Launch one script as N real processes the way Lightning sees externally created processes
(``LOCAL_RANK``/``WORLD_SIZE``/``MASTER_*`` set), and collect each one's exit status and output.

Shared by the tests that need processes to fail independently (hangs, timeouts, mismatched settings),
where ``torch.multiprocessing.spawn`` would tear the others down with the first failure.
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


def run_ranks(
    script: str | list[str], world: int = 2, guard_s: float = 60.0, extra_env: list[dict] | None = None
) -> list[Outcome]:
    """Run ``script`` (a file path, or one per rank) as ``world`` processes; wait at most ``guard_s`` for
    each, kill the ones still running."""
    scripts = [script] * world if isinstance(script, str) else list(script)
    world = len(scripts)
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), NODE_RANK="0")
        env.update(LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
        env.update((extra_env or [{}] * world)[rank])
        procs.append(
            subprocess.Popen([sys.executable, scripts[rank]], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        )
    outcomes = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=guard_s)
            outcomes.append(Outcome(p.returncode, out.decode(errors="replace")))
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            outcomes.append(Outcome(None, out.decode(errors="replace")))
    return outcomes
