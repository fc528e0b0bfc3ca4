"""Kernel-launching aten ops and host syncs per 1-bit Adam optimizer step after the freeze (CPU proxy of a GPU step).

On a GPU every eager op that computes is a kernel launch and every read of a device value on the host
(``.item()``, ``bool(t)``, a tensor made from Python data, a data-dependent shape) stops the host from queuing
ahead. This counts both per ``OneBitAdam.step()`` in the compression phase, on CPU tensors in the form a GPU
runs them (the codec layer's accelerator form, ``scaling._HOST_BRANCHES = False``; the fused CPU kernels off),
with a ``TorchDispatchMode``:

* **launches**: dispatched aten ops except views and allocations (``empty*``, ``detach``, ``alias``) and the
  sync ops below; the optimizer's per-parameter step counters are CPU tensors on a GPU too, so a few of these
  launch nothing there (a proxy, not a profile);
* **syncs**: the ops ``tests/_helpers/_sync_guard.py`` refuses (``_local_scalar_dense``, ``nonzero``, ``lift_fresh``, ...),
  each attributed to the innermost ``lightning_qcomm`` frame that called it.

Parameters: a GPT-2-small-shaped list (tied embeddings, 12 layers, 148 tensors, 124M elements at ``--scale 1``).
``--scale s`` multiplies the widths (model, vocabulary, context) by s and the momentum bucket and the 1-bit
pipelining piece by s², so the number of buckets and pieces per step stays that of the full model (475 pieces at
N = 1). Gradients are random; the world is one process (N = 1, as one GPU), or ``--world N`` on torch's ``fake``
process group (no data moves). Each form of the 1-bit all-reduce is counted: ``reference`` (the per-piece
spec phases, ``codecs.sign_phases.SPEC``, what a GPU ran before the batched form) and ``batched``::

    OMP_NUM_THREADS=1 python benchmarks/onebit_step_ops.py --scale 0.125
    OMP_NUM_THREADS=1 python benchmarks/onebit_step_ops.py --scale 0.125 --world 4
    OMP_NUM_THREADS=1 python benchmarks/onebit_step_ops.py --scale 0.0625 --world 4 --triton   # the CUDA kernels

``--triton`` runs the codec ops' CUDA kernels on the CPU tensors (Triton's interpreter,
``launch_counts.cuda_path_on_cpu``) and counts their launches apart: what a GPU runs where the kernels take the
rows (sign1 with ``scale_block`` blocks of at most 8192 elements).

``--pieces`` picks the 1-bit pipelining pieces: ``model`` the full model's pieces on gloo (``piece_numel`` 2^18 s²,
what ``OneBitMomentumSync`` takes for CPU tensors), ``cuda`` one piece per bucket (what it takes for CUDA tensors,
``OneBitMomentumSync.resolve_piece_numel``); ``auto`` (the default) ``cuda`` with ``--triton``, else ``model``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections import Counter

if __name__ == "__main__" and "--triton" in sys.argv:  # before torch or triton is imported
    os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "_helpers"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from _sync_guard import OPENED_OPS, SYNC_OPS, run_opened  # noqa: E402  (as the tests' guard has them)
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

PIECE_NUMEL = 1 << 18  # onebit_all_reduce's default piece (elements per rank)
BUCKET_MB = 32.0  # OneBitAdam's default bucket
NO_LAUNCH = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "alias", "set_"}
SYNC = "adapters/onebit/sync.py"  # the momentum sync's module, as ``_layer`` names it
CHECK = "comm/nonfinite.py"  # the gradient check's


def gpt2_shapes(scale: float) -> list[tuple[int, ...]]:
    """Parameter shapes of GPT-2 small (tied embeddings) with the widths scaled by ``scale``."""
    d, v, t = max(8, round(768 * scale)), max(8, round(50257 * scale)), max(8, round(1024 * scale))
    layer = [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    return [(v, d), (t, d)] + layer * 12 + [(d,), (d,)]


class StepCounter(TorchDispatchMode):
    """Launching ops and host syncs (by op and by calling site) while entered."""

    def __init__(self) -> None:
        super().__init__()
        self.launches: Counter[str] = Counter()
        self.by_layer: Counter[str] = Counter()
        self.syncs: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if func.namespace == "qcomm" and name in OPENED_OPS:  # rows, sum, feedback: count the ops their kernel runs
            return run_opened(self, func, args, kwargs)
        bool_index = name == "index" and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else ()) or ()
        )
        if name in SYNC_OPS or bool_index:
            self.syncs[f"{name} at {_caller()}"] += 1
        elif not func.is_view and name not in NO_LAUNCH:
            self.launches[name] += 1
            self.by_layer[_layer()] += 1
        return func(*args, **(kwargs or {}))


def _caller() -> str:
    """file:line function of the innermost frame in lightning_qcomm (or outside it: this script)."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if "lightning_qcomm" in path and "_python_dispatch" not in path:
            rel = path[path.rindex("lightning_qcomm") :]
            return f"{rel}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return "outside lightning_qcomm"


def _layer() -> str:
    """Who launched an op: the outermost module of lightning_qcomm's comm, collectives or adapters on the stack,
    as its path under the package (``adapters/onebit/sync.py``: the momentum sync and the codecs it calls;
    ``comm/nonfinite.py``: the gradient check), else ``optim`` (the optimizer's math), or ``harness`` outside
    lightning_qcomm (this script making the random gradients)."""
    frame, found = sys._getframe(2), "harness"
    package = f"lightning_qcomm{os.sep}"
    while frame is not None:
        path = frame.f_code.co_filename
        inside = path.split(package, 1)[1] if package in path else ""
        if inside.split(os.sep, 1)[0] in ("comm", "collectives", "adapters"):
            found = inside.replace(os.sep, "/")
        elif found == "harness" and inside and "_python_dispatch" not in path:
            found = "optim"
        frame = frame.f_back
    return found


def count(
    path: str,
    scale: float,
    world: int,
    steps: int,
    nonfinite: str,
    triton_log: list | None = None,
    pieces: str = "model",
) -> dict:
    """Per compressed step: launches, syncs and the pieces of every bucket, with ``sign_collective.PATH = path``;
    ``triton_log``: the launch log of ``launch_counts.cuda_path_on_cpu`` (the Triton kernels, interpreted);
    ``pieces``: ``"model"`` the full model's pieces, ``"cuda"`` one piece per bucket (module docstring)."""
    from lightning_qcomm.collectives import onebit_pieces, sign_collective
    from lightning_qcomm.optim import OneBitAdam

    sign_collective.PATH = path
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in gpt2_shapes(scale)]
    opt = OneBitAdam(params, lr=1e-4, freeze_step=2, bucket_mb=BUCKET_MB * scale**2, overlap=False, nonfinite=nonfinite)

    def step() -> None:
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        opt.step()

    for _ in range(3):  # two warm-up steps, then the first compressed step (layout, consistency check)
        step()
    if pieces == "cuda":  # the layout the sync takes for CUDA tensors: one piece per bucket
        piece = opt._sync.resolve_piece_numel(torch.device("cuda"))
    else:
        piece = max(8, round(PIECE_NUMEL * scale**2))
    opt._sync.piece_numel = piece  # the layout counted (the consistency check ran on the first call)
    step()  # steady state: caches warm
    counter = StepCounter()
    before = len(triton_log or ())
    with counter:
        for _ in range(steps):
            step()
    triton = (len(triton_log or ()) - before) / steps
    pieces = sum(len(onebit_pieces(n, world, piece)) for n in opt._sync.bucket_numels)
    return {
        "params": sum(p.numel() for p in params),
        "tensors": len(params),
        "buckets": len(opt._sync.buckets),
        "pieces": pieces,
        "launches": sum(counter.launches.values()) / steps,
        "triton": triton,
        "by_layer": {k: v / steps for k, v in counter.by_layer.most_common()},
        "syncs": sum(counter.syncs.values()) / steps,
        "sync_sites": {k: v / steps for k, v in counter.syncs.most_common()},
        "top_ops": counter.launches.most_common(8),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scale", type=float, default=1.0, help="width factor (bucket and piece: its square)")
    parser.add_argument("--world", type=int, default=1, help="ranks (> 1: torch's fake process group)")
    parser.add_argument("--steps", type=int, default=2, help="compressed steps counted (averaged)")
    parser.add_argument("--nonfinite", default="skip", choices=("skip", "raise", "propagate"))
    parser.add_argument("--paths", default="reference,batched", help="comma-separated sign_collective.PATH values")
    parser.add_argument(
        "--triton",
        action="store_true",
        help="the codec ops' CUDA kernels on CPU tensors (Triton interpreted; small --scale)",
    )
    parser.add_argument(
        "--pieces",
        default="auto",
        choices=("auto", "model", "cuda"),
        help="1-bit pieces: the full model's (gloo), one per bucket (CUDA); auto: cuda with --triton",
    )
    args = parser.parse_args(argv)
    pieces = args.pieces if args.pieces != "auto" else ("cuda" if args.triton else "model")

    from lightning_qcomm.codecs import cpu_fused, scaling

    scaling._HOST_BRANCHES = False  # the codec layer as it runs on an accelerator
    os.environ[cpu_fused.ENV_SWITCH] = "0"  # no fused CPU kernels: the torch ops a GPU runs
    if args.world > 1:
        import torch.distributed as dist
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world)
    with contextlib.ExitStack() as stack:
        log = None
        if args.triton:
            from launch_counts import cuda_path_on_cpu

            log = stack.enter_context(cuda_path_on_cpu())
        rows = {
            p: count(p, args.scale, args.world, args.steps, args.nonfinite, log, pieces) for p in args.paths.split(",")
        }
    first = next(iter(rows.values()))
    print(
        f"OneBitAdam compressed step, GPT-2-small shapes x{args.scale}: {first['params'] / 1e6:.2f}M parameters in "
        f"{first['tensors']} tensors, {first['buckets']} buckets, {first['pieces']} pieces per step ({pieces} "
        f"layout), N = {args.world}, "
        f"nonfinite={args.nonfinite}, torch {torch.__version__}, mean of {args.steps} steps"
    )
    print()
    print(
        "| 1-bit all-reduce form | launching aten ops / step | momentum sync (adapters/onebit/sync.py) | Triton launches / step "
        "| host syncs / step |"
    )
    print("|---|---:|---:|---:|---:|")
    for p, r in rows.items():
        sync_ops = r["by_layer"].get(SYNC, 0)
        print(f"| {p} | {r['launches']:.0f} | {sync_ops:.0f} | {r['triton']:.0f} | {r['syncs']:.0f} |")
    for p, r in rows.items():
        print(f"\n{p}: launches by caller {r['by_layer']}; top ops {r['top_ops']}")
        for site, n in r["sync_sites"].items():
            print(f"  sync {n:g}/step: {site}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
