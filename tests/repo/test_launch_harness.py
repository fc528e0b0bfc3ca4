"""The test harness's ``spawn`` (``tests/_helpers/_launch.py``): how a rank died, and a test module's function.

torch's spawn names only the signal of a rank that a C++ abort or a segfault kills ("process 0 terminated with
signal SIGABRT"); the harness adds that rank's stderr tail (where c10 / gloo print the exception that aborted) and
every thread's Python stack at the signal. Without it a rare crash in CI cannot be traced. A rank runs a function
of a test module even where it cannot import that module by pytest's name for it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

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
    from multiprocessing import util

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    dist.all_reduce(torch.ones(4))

    def record() -> None:  # runs at the process's exit, after fn (a forked rank leaves by os._exit: no atexit)
        with open(os.path.join(outdir, f"rank{rank}.alive"), "w") as f:
            f.write(str(dist.is_initialized()))

    util.Finalize(None, record, exitpriority=0)


@pytest.mark.parametrize("start_method", [None, "spawn"])
def test_a_rank_that_returns_has_its_process_group_destroyed_before_exit(tmp_path, start_method):
    """torch aborts now and then in interpreter teardown when a gloo group is still alive ("terminate called
    without an active exception"), which fails a test whose ranks all finished. The harness destroys the group
    once ``fn`` returns, so no worker depends on remembering to."""
    from _launch import free_port

    spawn(_leave_group_alive, free_port(), str(tmp_path), nprocs=2, start_method=start_method)
    assert [(tmp_path / f"rank{r}.alive").read_text() for r in range(2)] == ["False", "False"]


def _report_environment(rank: int, outdir: str) -> None:
    import json

    print(f"rank {rank} wrote to stdout")
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump({"var": os.environ.get("QCOMM_HARNESS_PROBE"), "lightning": "lightning.pytorch" in sys.modules}, f)


def test_a_rank_sees_the_callers_environment_and_its_stdout_reaches_the_caller(tmp_path, monkeypatch, capfd):
    """The ranks are forked from a server started once per session: they must still see the environment as it is
    at the call (a forked rank would otherwise inherit the server's, from its first use), and what they print
    must reach the test's output."""
    import json

    from _launch import rank_results

    for value in ("first", "second"):  # the server is running by the second call
        monkeypatch.setenv("QCOMM_HARNESS_PROBE", value)
        spawn(_report_environment, str(tmp_path), nprocs=2)
        assert [r["var"] for r in rank_results(tmp_path, 2)] == [value, value]
    out = capfd.readouterr().out
    assert "rank 0 wrote to stdout" in out and "rank 1 wrote to stdout" in out
    assert json.loads((tmp_path / "rank0.json").read_text())["lightning"]  # preloaded (or imported) in the rank


def _report_module(rank: int, outdir: str, repo: str) -> None:
    import json

    on_path = any(os.path.realpath(p or ".") == repo for p in sys.path)
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump({"module": __name__, "checkout_on_path": on_path}, f)


def test_a_test_modules_function_runs_in_a_rank_whose_path_lacks_the_checkout(tmp_path, monkeypatch):
    """pytest imports this file under a name made from its path (``tests.<folder>.test_launch_harness``: the
    ``importlib`` import mode, pyproject.toml), which a rank can import by name only with the checkout on its path;
    one started without it (``pytest`` run from another directory, as benchmarks/gpu_check.py runs tests/cuda) loads
    the file under that name instead."""
    from _launch import rank_results

    repo = os.path.realpath(Path(__file__).resolve().parents[2])
    assert __name__.startswith("tests."), __name__
    monkeypatch.setattr(sys, "path", [p for p in sys.path if os.path.realpath(p or ".") != repo])
    spawn(_report_module, str(tmp_path), repo, nprocs=1, start_method="spawn")  # a spawned rank gets this sys.path
    assert rank_results(tmp_path, 1) == [{"module": __name__, "checkout_on_path": False}]


@pytest.mark.parametrize(
    ("tail", "code"), [("", 0), ("sys.exit(3)", 3), ("raise ValueError('boom')", 1)], ids=["ok", "exit", "raise"]
)
def test_a_preloaded_script_rank_ends_as_the_interpreter_ends_a_script(tmp_path, tail, code):
    """``run_ranks(preloaded=True)``: the script runs as ``__main__`` with its launcher variables and its folder
    first on ``sys.path``; its exit status is ``SystemExit``'s code, 1 after a traceback, and its ``atexit``
    handlers run, as with ``python script.py``; a rank past the guard is killed (returncode None)."""
    from _launch import run_ranks

    (tmp_path / "sibling.py").write_text("NAME = 'sibling'\n")
    script = tmp_path / "run.py"
    script.write_text(
        "import atexit, os, sys\n"
        "import sibling\n"
        f"atexit.register(lambda: open(os.path.join({str(tmp_path)!r}, 'exit' + os.environ['LOCAL_RANK']), 'w'))\n"
        "print('main', __name__, sibling.NAME, os.environ['LOCAL_RANK'], os.environ['WORLD_SIZE'], flush=True)\n"
        f"{tail}\n"
    )
    outcomes = run_ranks(str(script), guard_s=60, preloaded=True)
    for rank, o in enumerate(outcomes):
        assert o.returncode == code, o.output
        assert f"main __main__ sibling {rank} 2" in o.output, o.output
        assert (tmp_path / f"exit{rank}").exists()
    if code == 1:
        assert "ValueError: boom" in outcomes[0].output and "Traceback" in outcomes[0].output


def test_a_preloaded_script_rank_past_the_guard_is_killed(tmp_path):
    from _launch import run_ranks

    script = tmp_path / "run.py"
    script.write_text("import os, time\nif os.environ['LOCAL_RANK'] == '1':\n    time.sleep(600)\n")
    fast, stalled = run_ranks(str(script), guard_s=60, wait_ranks=[0], preloaded=True)
    assert fast.returncode == 0 and stalled.returncode is None
