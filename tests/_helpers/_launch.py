"""The tests' one process harness: a free port, spawned workers, their per-rank results.

* ``free_port``: a TCP port on 127.0.0.1 nobody listens on (for ``MASTER_PORT`` / ``tcp://`` rendezvous).
* ``spawn(fn, *args, nprocs=N)``: ``fn(rank, *args)`` in N processes forked from a "forkserver" that has
  imported torch, Lightning and lightning_qcomm once per test session (``torch.multiprocessing``; "spawn" where the
  platform has no forkserver, or with ``start_method="spawn"``), each rank with the caller's environment
  variables as they are at the call; a rank that raises fails the caller with its traceback, and with
  ``timeout_s`` ranks still running are killed and ``TimeoutError`` is raised. A rank killed by a signal (a C++
  abort in a collective, a segfault) fails it with that rank's stderr tail and every thread's Python stack at the
  signal (``faulthandler``), since torch reports only the signal's name. A process group a rank leaves alive is
  destroyed when ``fn`` returns (torch can abort in interpreter teardown while a gloo group lives). ``fn`` may be
  a test module's function: a rank that cannot import its module by pytest's name for it loads it from its file.
* ``write_rank_result`` / ``rank_results``: each rank writes one file (``rank{rank}.json`` by default;
  ``.pt`` and ``.pkl`` names are saved with torch / pickle) and the parent reads them back in rank order.
* ``set_rank_env`` (a spawned worker's launcher variables) and ``FakeBucket`` (a DDP ``GradBucket`` stand-in).
* ``run_ranks``: one *script* as N real processes the way Lightning sees externally created processes
  (``LOCAL_RANK``/``NODE_RANK``/``WORLD_SIZE``/``MASTER_*`` set, as torchrun and SLURM set them), collecting
  each one's exit status and output (``preloaded=True``: each rank forked from ``spawn``'s forkserver, the script
  run as ``__main__``, so the ranks skip the imports); and the same environment for a spawned worker
  (``lightning_env``).

``run_ranks`` serves the tests that need processes to fail independently (hangs, timeouts, mismatched settings),
where ``torch.multiprocessing.spawn`` would tear the others down with the first failure, and the
multi-node tests: ``ranks_per_node`` < world lays the ranks out as nodes (global rank = node · ranks_per_node
+ local rank), for ``Trainer(num_nodes=world // ranks_per_node, devices=ranks_per_node)``.
"""

from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FunctionType, ModuleType
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What every spawned rank imports: a forkserver imports it once, and each rank is forked from there instead of
# paying the imports again (Lightning's alone is seconds of CPU per process).
PRELOAD = ["torch", "torch.distributed", "lightning.pytorch", "lightning_qcomm"]


class _Logged:
    """``fn(rank, *args)`` with the caller's environment variables (a forkserver's children inherit the server's),
    this rank's stdout and stderr in ``logdir/rank{rank}.out`` / ``.err`` and ``faulthandler`` on, so a fatal
    signal leaves every thread's Python stack there after the C++ message that preceded it; a process group ``fn``
    leaves alive is destroyed when it returns."""

    def __init__(self, fn: Callable[..., None], logdir: str, env: dict[str, str] | None = None) -> None:
        self.fn, self.logdir, self.env = fn, logdir, dict(os.environ) if env is None else env

    def __reduce__(self) -> tuple:
        """A module-level function goes by its module's name *and file*: pytest imports a test module under a name
        made from its path (``tests.strategies.test_qsdp``, the ``importlib`` import mode), which a rank whose
        ``sys.path`` lacks the checkout cannot import by name; ``_restore`` loads the file under that name first."""
        name, qualname = getattr(self.fn, "__module__", None), getattr(self.fn, "__qualname__", "")
        path = getattr(sys.modules.get(name or ""), "__file__", None)
        if not isinstance(self.fn, FunctionType) or name in (None, "__main__") or path is None or "<" in qualname:
            return (_Logged, (self.fn, self.logdir, self.env))
        return (_restore, (name, path, qualname, self.logdir, self.env))

    def __call__(self, rank: int, *args: Any) -> None:
        import faulthandler

        os.environ.clear()
        os.environ.update(self.env)
        out = open(Path(self.logdir) / f"rank{rank}.out", "w", buffering=1)  # noqa: SIM115 -- open until exit
        log = open(Path(self.logdir) / f"rank{rank}.err", "w", buffering=1)  # noqa: SIM115 -- open until exit
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(out.fileno(), 1)
        os.dup2(log.fileno(), 2)  # C++ (gloo, c10) messages too, which write to fd 2 directly
        faulthandler.enable(file=log, all_threads=True)
        self.fn(rank, *args)
        _destroy_process_group()


def _module_at(name: str, path: str) -> ModuleType:
    """The module ``name`` whose source is ``path``: imported by name where this process can, else loaded from the
    file under that name, with its missing parents made empty (as pytest's ``importlib`` mode makes them), so that
    pickle finds the module's other functions and classes by name afterwards."""
    import importlib
    import importlib.util

    if name in sys.modules:
        return sys.modules[name]
    try:
        module = importlib.import_module(name)
        if os.path.samefile(module.__file__ or "", path):
            return module
        del sys.modules[name]  # a namesake elsewhere on the path: the file wins
    except (ImportError, OSError):
        pass
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {name} from {path}")
    module = importlib.util.module_from_spec(spec)
    parts = name.split(".")
    for i in range(1, len(parts)):
        parent = ".".join(parts[:i])
        if parent not in sys.modules:
            try:
                importlib.import_module(parent)
            except ImportError:
                sys.modules[parent] = ModuleType(parent)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _restore(name: str, path: str, qualname: str, logdir: str, env: dict[str, str]) -> _Logged:
    """``_Logged.__reduce__``'s other half, run in the rank: the function ``qualname`` of module ``name`` at
    ``path``."""
    fn: Any = _module_at(name, path)
    for part in qualname.split("."):
        fn = getattr(fn, part)
    return _Logged(fn, logdir, env)


def _destroy_process_group() -> None:
    """Destroy a process group ``fn`` left alive: torch can abort in interpreter teardown while a gloo group lives
    ("terminate called without an active exception"), failing a rank that finished."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _replay_logs(logdir: str, nprocs: int) -> None:
    """Hand the ranks' stdout and stderr on to ours, so the test's captured output keeps them."""
    for rank in range(nprocs):
        for suffix, stream in ((".out", sys.stdout), (".err", sys.stderr)):
            path = Path(logdir) / f"rank{rank}{suffix}"
            if path.exists() and path.stat().st_size:
                stream.write(path.read_text(errors="replace"))


def _start_method(requested: str | None) -> str:
    """ "forkserver" with ``PRELOAD`` where the platform has it, else "spawn". Triton reads ``TRITON_INTERPRET``
    when the kernels are decorated, at import: a caller that sets it gets a fresh "spawn" (the server imported the
    kernels without it)."""
    import multiprocessing

    if requested is not None:
        return requested
    if "forkserver" not in multiprocessing.get_all_start_methods() or "TRITON_INTERPRET" in os.environ:
        return "spawn"
    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)  # read when the server starts
    return "forkserver"


def _signal_report(err: Exception, logdir: str, tail_lines: int = 60) -> RuntimeError:
    rank = getattr(err, "error_index", None)
    path = Path(logdir) / f"rank{rank}.err"
    tail = path.read_text(errors="replace").splitlines()[-tail_lines:] if path.exists() else ["(no log)"]
    return RuntimeError(f"{err}; rank {rank}'s stderr, last {len(tail)} lines:\n" + "\n".join(tail))


def spawn(
    fn: Callable[..., None],
    *args: Any,
    nprocs: int = 2,
    timeout_s: float | None = None,
    start_method: str | None = None,
) -> None:
    """Run ``fn(rank, *args)`` for rank 0..nprocs-1 in new processes (``_start_method``) and wait for all.

    A rank that raises makes this raise (torch's ``ProcessRaisedException``, with the rank's traceback); one killed
    by a signal raises ``RuntimeError`` with its stderr tail and its threads' Python stacks. ``timeout_s``: ranks
    still running after that long are killed and ``TimeoutError`` is raised."""
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="qcomm-ranks-") as logdir:
        try:
            _join(
                mp.start_processes(
                    _Logged(fn, logdir), args=args, nprocs=nprocs, start_method=_start_method(start_method), join=False
                ),
                nprocs,
                timeout_s,
            )
        except mp.ProcessExitedException as err:
            raise _signal_report(err, logdir) from err
        finally:
            _replay_logs(logdir, nprocs)


def _join(ctx: Any, nprocs: int, timeout_s: float | None) -> None:
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=2):
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{nprocs} spawned ranks did not finish within {timeout_s} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()


def run_checks(checks, *args: Any) -> dict[str, str]:
    """Run each check(*args) inside a rank: {name: "ok" or its traceback}, a barrier after each so a check that
    fails on one rank does not leave the others in its collectives."""
    import torch.distributed as dist

    results = {}
    for check in checks:
        try:
            check(*args)
            results[check.__name__] = "ok"
        except Exception:
            results[check.__name__] = traceback.format_exc()
        dist.barrier()
    return results


def _result_path(outdir: str | os.PathLike, rank: int, name: str) -> Path:
    return Path(outdir) / name.format(rank=rank)


def write_rank_result(outdir: str | os.PathLike, rank: int, data: Any, name: str = "rank{rank}.json") -> None:
    """Save one rank's result: JSON, or ``torch.save`` for a ``.pt`` name, ``pickle`` for ``.pkl``."""
    path = _result_path(outdir, rank, name)
    if path.suffix == ".pt":
        import torch

        torch.save(data, path)
    elif path.suffix == ".pkl":
        path.write_bytes(pickle.dumps(data))
    else:
        path.write_text(json.dumps(data))


def rank_results(outdir: str | os.PathLike, world: int, name: str = "rank{rank}.json") -> list[Any]:
    """The results ``write_rank_result`` saved, in rank order."""
    out = []
    for rank in range(world):
        path = _result_path(outdir, rank, name)
        if path.suffix == ".pt":
            import torch

            out.append(torch.load(path, weights_only=False))
        elif path.suffix == ".pkl":
            out.append(pickle.loads(path.read_bytes()))
        else:
            out.append(json.loads(path.read_text()))
    return out


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
    preloaded: bool = False,
) -> list[Outcome]:
    """Run ``script`` (a file path, or one per rank) as ``world`` processes; wait at most ``guard_s`` for
    each of ``wait_ranks`` (default: all), then kill every process still running (its returncode None).

    ``preloaded``: each rank is a process forked from the forkserver that has imported ``PRELOAD`` (``spawn``'s),
    running the script as ``__main__`` (``_script_main``), instead of a fresh interpreter that imports them again;
    for scripts whose claim is not about a fresh interpreter's imports."""
    scripts = [script] * world if isinstance(script, str) else list(script)
    world = len(scripts)
    port = free_port()
    envs = []
    for rank in range(world):
        env = dict(os.environ, **lightning_env(rank, world, port, ranks_per_node))
        env.update((extra_env or [{}] * world)[rank])
        envs.append(env)
    if preloaded:
        return _run_preloaded(scripts, envs, guard_s, wait_ranks)
    procs = [
        subprocess.Popen([sys.executable, path], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for path, env in zip(scripts, envs)
    ]
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


def _run_preloaded(
    scripts: list[str], envs: list[dict[str, str]], guard_s: float, wait_ranks: list[int] | None
) -> list[Outcome]:
    import multiprocessing
    import tempfile

    ctx = multiprocessing.get_context(_start_method(None))
    with tempfile.TemporaryDirectory(prefix="qcomm-scripts-") as logdir:
        logs = [os.path.join(logdir, f"rank{rank}.log") for rank in range(len(scripts))]
        procs = [ctx.Process(target=_script_main, args=a) for a in zip(scripts, envs, logs)]
        for p in procs:
            p.start()
        waited = set(range(len(scripts)) if wait_ranks is None else wait_ranks)
        codes: list[int | None] = [None] * len(scripts)
        for rank in sorted(waited):
            procs[rank].join(timeout=guard_s)
            codes[rank] = procs[rank].exitcode
        for p in procs:
            if p.exitcode is None:
                p.kill()
            p.join()
        return [Outcome(code, Path(log).read_text(errors="replace")) for code, log in zip(codes, logs)]


def _script_main(script: str, env: dict[str, str], log: str) -> None:
    """A ``run_ranks(preloaded=True)`` rank: ``script`` run as ``__main__`` (``sys.argv``, its folder first on
    ``sys.path``) with exactly ``env``, stdout and stderr both into ``log``, ending as the interpreter ends a script:
    the traceback and exit status 1 on an exception, ``SystemExit``'s code, the ``atexit`` handlers run."""
    import atexit
    import runpy

    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 -- the process's own streams
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.environ.clear()
    os.environ.update(env)
    if "OMP_NUM_THREADS" in env:  # read by torch when it loaded, in the server
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    sys.argv = [script]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if isinstance(e.code, int) or e.code is None:
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def set_rank_env(rank: int, world: int, port: int) -> None:
    """In a spawned worker: the launcher's variables (``lightning_env``) plus ``RANK``, into ``os.environ``."""
    os.environ.update(lightning_env(rank, world, port), RANK=str(rank))


class FakeBucket:
    """Just enough of ``torch.distributed.GradBucket`` for calling a DDP comm hook by hand: bucket ``index``
    holding the gradients of ``params``, flattened into one buffer."""

    def __init__(self, index: int, params: list, last: bool = True) -> None:
        import torch

        self._i, self._p, self._last = index, params, last
        self._buf = torch.cat([p.grad.reshape(-1) for p in params])

    def buffer(self):
        return self._buf

    def index(self) -> int:
        return self._i

    def parameters(self) -> list:
        return self._p

    def is_last(self) -> bool:
        return self._last
