"""The test harness's ``spawn`` (``tests/_launch.py``) reports how a rank died.

torch's spawn names only the signal of a rank that a C++ abort or a segfault kills ("process 0 terminated with
signal SIGABRT"); the harness adds that rank's stderr tail (where c10 / gloo print the exception that aborted) and
every thread's Python stack at the signal. Without it a rare crash in CI cannot be traced.
"""

from __future__ import annotations

import os
import sys

import pytest
from _launch import spawn


def _abort_on_rank_one(rank: int, marker: str) -> None:
    if rank == 1:
        os.write(2, f"{marker}: the C++ side says why\n".encode())  # as c10 writes: straight to fd 2
        os.abort()


def _raise_on_rank_zero(rank: int) -> None:
    if rank == 0:
        raise KeyError("rank zero's own error")


def _print_and_return(rank: int) -> None:
    print(f"rank {rank} wrote to stderr", file=sys.stderr)


def test_a_rank_killed_by_a_signal_fails_with_its_stderr_and_python_stack():
    with pytest.raises(RuntimeError) as info:
        spawn(_abort_on_rank_one, "marker-7c1", nprocs=2)
    text = str(info.value)
    assert "process 1 terminated with signal SIGABRT" in text
    assert "marker-7c1: the C++ side says why" in text
    assert "Fatal Python error: Aborted" in text
    assert "_abort_on_rank_one" in text  # the aborting frame, from faulthandler's stack


def test_a_rank_that_raises_still_fails_with_its_traceback():
    import torch.multiprocessing as mp

    with pytest.raises(mp.ProcessRaisedException, match="rank zero's own error"):
        spawn(_raise_on_rank_zero, nprocs=2)


def test_the_ranks_stderr_reaches_the_callers(capfd):
    spawn(_print_and_return, nprocs=2)
    err = capfd.readouterr().err
    assert "rank 0 wrote to stderr" in err and "rank 1 wrote to stderr" in err


def _leave_group_alive(rank: int, port: int, outdir: str) -> None:
    import atexit

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    dist.all_reduce(torch.ones(4))

    def record() -> None:  # registered before the harness returns, so it runs at exit, after fn
        with open(os.path.join(outdir, f"rank{rank}.alive"), "w") as f:
            f.write(str(dist.is_initialized()))

    atexit.register(record)


def test_a_rank_that_returns_has_its_process_group_destroyed_before_exit(tmp_path):
    """torch aborts now and then in interpreter teardown when a gloo group is still alive ("terminate called
    without an active exception"), which fails a test whose ranks all finished. The harness destroys the group
    once ``fn`` returns, so no worker depends on remembering to."""
    from _launch import free_port

    spawn(_leave_group_alive, free_port(), str(tmp_path), nprocs=2)
    assert [(tmp_path / f"rank{r}.alive").read_text() for r in range(2)] == ["False", "False"]
