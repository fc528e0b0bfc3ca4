"""Device launches on the CUDA code path, counted on CPU tensors: codec encode/decode, a quantized all-reduce,
and a training step with activation quantization.

On a GPU every eager torch op and every Triton kernel is a launch; a step that launches thousands is bound by
the host. Here the codec ops' CUDA kernels (``codecs.ops.kernel(op, "cuda")``, every op)
are registered for CPU tensors and the Triton kernels run through Triton's interpreter (``TRITON_INTERPRET=1``, set by this script for
its own process before anything imports Triton), in their accelerator form (``scaling._HOST_BRANCHES = False``,
the fused C path off), so the counts are those of a CUDA tensor:

* Triton launches, by wrapping the kernels (the interpreter's own tensor copies inside a launch are not counted);
* torch launches: aten ops seen by a ``TorchDispatchMode``, except allocations and views (``LAUNCH_FREE``); a codec
  op (``qcomm::*``) is opened: the ops its kernel runs are counted, not the op;
* collectives (fake process group: one process, any world size).

    python benchmarks/launch_counts.py                  # the three tables (about a minute)
    python benchmarks/launch_counts.py --json out.json

``cuda_path_on_cpu`` and ``Launches`` are what tests/kernels/test_fused_launches.py counts with.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Iterator
from functools import partial
from pathlib import Path

if __name__ == "__main__":  # before torch or triton is imported
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

# aten ops that allocate or make views: no kernel launch on a GPU
LAUNCH_FREE = frozenset(
    "empty empty_strided empty_like new_empty view _unsafe_view reshape as_strided alias detach t unsqueeze "
    "squeeze expand slice select lift_fresh to".split()  # to: a real conversion dispatches _to_copy, counted
)
COLLECTIVE_PREFIXES = (
    "allgather",
    "alltoall",
    "allreduce",
    "_allgather",
    "reduce_scatter",
    "_reduce_scatter",
    "broadcast",
)


class Launches(TorchDispatchMode):
    """Counts the torch launches (``torch_ops``), collectives apart (``collectives``)."""

    def __init__(self) -> None:
        super().__init__()
        self.torch_ops: list[str] = []
        self.collectives: list[str] = []

    def __enter__(self):
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _ACTIVE.pop()
        return super().__exit__(*exc)

    def seen_collective(self, name: str) -> None:
        """A collective that dispatches no c10d op (``mirrored_collectives``' stand-ins)."""
        self.collectives.append(name)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if func.namespace == "qcomm":  # no launch itself: its kernel reopens this mode (``_opened``)
            return func(*args, **(kwargs or {}))
        if name.startswith(COLLECTIVE_PREFIXES):
            self.collectives.append(name)
        elif name not in LAUNCH_FREE:
            self.torch_ops.append(name)
        return func(*args, **(kwargs or {}))


_ACTIVE: list[Launches] = []


def _opened(kernel, as_python: bool = False):
    """A codec op's kernel that runs under the active ``Launches`` (the dispatcher pops a mode while the op runs,
    so without this the ops inside a codec op would not be seen). ``as_python``: with the autograd keys the
    dispatcher excluded on its way to the kernel included again, so composite ops (``reshape``, ``to``) decompose
    as in a call from Python (the rows ops: what the collectives ran in Python before they were ops)."""

    def run(*args, **kwargs):
        if not _ACTIVE:
            return kernel(*args, **kwargs)
        mode = _ACTIVE[-1]
        exclude = torch._C._dispatch_tls_local_exclude_set()
        if as_python:
            for key in (torch._C.DispatchKey.AutogradFunctionality, torch._C.DispatchKey.ADInplaceOrView):
                exclude = exclude.remove(key)
        with mode, torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude):
            _ACTIVE.pop()  # entered again only to be seen by torch, not to be counted twice on exit
            try:
                return kernel(*args, **kwargs)
            finally:
                _ACTIVE.append(mode)

    return run


class _Counted:
    def __init__(self, kernel, name: str, log: list[str]) -> None:
        self.kernel, self.name, self.log = kernel, name, log

    def __getitem__(self, grid):
        self.log.append(self.name)
        launch = self.kernel[grid]

        def run(*args, **kwargs):  # the interpreter's own tensor copies are not launches
            with _disable_current_modes():
                return launch(*args, **kwargs)

        return run


@contextlib.contextmanager
def cuda_path_on_cpu() -> Iterator[list[str]]:
    """CPU tensors take the codec ops' CUDA kernels (Triton, interpreted) while active; yields the list the
    Triton launches are appended to (kernel names: "encode", "decode", "wire", "sum", "feedback", "hadamard", "window")."""
    from unittest import mock

    from lightning_qcomm.codecs import ops, scaling
    from lightning_qcomm.kernels.cuda import (
        codec_kernels,
        reduce_kernels,
        rotation_kernels,
        rounding_kernels,
        segment_kernels,
        wire_params,
    )

    if not codec_kernels._is_interpreted():
        raise RuntimeError("set TRITON_INTERPRET=1 before lightning_qcomm.kernels is imported")
    log: list[str] = []
    fused_switch = os.environ.get("LIGHTNING_QCOMM_CPU_FUSED")
    os.environ["LIGHTNING_QCOMM_CPU_FUSED"] = "0"  # CPU tensors stand for CUDA ones: no fused C path
    lib = torch.library.Library("qcomm", "IMPL")
    for op in ops.KERNELS:  # every op's CUDA kernel for CPU tensors; the element-wise ones as C++ calls them
        as_python = op not in ("encode", "decode", "decode_into")
        lib.impl(op, _opened(ops.kernel(op, "cuda"), as_python=as_python), "CPU", allow_override=True)
    patches = [
        mock.patch.object(codec_kernels, "_encode_kernel", _Counted(codec_kernels._encode_kernel, "encode", log)),
        mock.patch.object(codec_kernels, "_decode_kernel", _Counted(codec_kernels._decode_kernel, "decode", log)),
        mock.patch.object(wire_params, "_wire_kernel", _Counted(wire_params._wire_kernel, "wire", log)),
        mock.patch.object(
            reduce_kernels, "_decode_sum_kernel", _Counted(reduce_kernels._decode_sum_kernel, "sum", log)
        ),
        mock.patch.object(
            reduce_kernels, "_feedback_kernel", _Counted(reduce_kernels._feedback_kernel, "feedback", log)
        ),
        mock.patch.object(
            reduce_kernels, "_feedback_rows_kernel", _Counted(reduce_kernels._feedback_rows_kernel, "feedback", log)
        ),
        mock.patch.object(segment_kernels, "_wire_kernel", _Counted(segment_kernels._wire_kernel, "wire", log)),
        mock.patch.object(segment_kernels, "_encode_kernel", _Counted(segment_kernels._encode_kernel, "encode", log)),
        mock.patch.object(segment_kernels, "_decode_kernel", _Counted(segment_kernels._decode_kernel, "decode", log)),
        mock.patch.object(
            rotation_kernels, "_hadamard_kernel", _Counted(rotation_kernels._hadamard_kernel, "hadamard", log)
        ),
        mock.patch.object(
            rounding_kernels,
            "_add_square_sr_kernel",
            _Counted(rounding_kernels._add_square_sr_kernel, "window", log),
        ),
        mock.patch.object(scaling, "_HOST_BRANCHES", False),
    ]
    try:
        for p in patches:
            p.start()
        yield log
    finally:
        for p in reversed(patches):
            p.stop()
        lib._destroy()
        if fused_switch is None:
            os.environ.pop("LIGHTNING_QCOMM_CPU_FUSED")
        else:
            os.environ["LIGHTNING_QCOMM_CPU_FUSED"] = fused_switch


class _Done:
    def wait(self, *args, **kwargs) -> bool:
        return True


@contextlib.contextmanager
def mirrored_collectives() -> Iterator[None]:
    """On torch's fake process group (which moves no data), ``dist.all_to_all_single`` and the all-gathers as if
    every rank held this rank's inputs: an all-to-all delivers this rank's own row from every rank, an all-gather
    N copies of this rank's bytes, so the values stay finite and a collective's math can be checked in one
    process. Each call counts as a collective of the active ``Launches`` (the stand-ins dispatch no c10d op);
    their copies are not counted.

    Example::

        with cuda_path_on_cpu() as log, mirrored_collectives():
            c = count(lambda: onebit_all_reduce(x, ew, es, check=False), log)
    """
    from unittest import mock

    import torch.distributed as dist

    def seen(name: str) -> None:
        if _ACTIVE:
            _ACTIVE[-1].seen_collective(name)

    def all_to_all_single(out, inp, group=None, async_op=False, **kwargs):
        seen("alltoall_base_")
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        with _disable_current_modes():
            out.view(world, -1).copy_(inp.view(world, -1)[rank].expand(world, -1))
        return _Done() if async_op else None

    def all_gather_single(out, inp, group=None, async_op=False, **kwargs):
        seen("_allgather_base_")
        world = dist.get_world_size(group)
        with _disable_current_modes():
            out.view(world, -1).copy_(inp.view(1, -1).expand(world, -1))
        return _Done() if async_op else None

    names = [n for n in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, n)]
    patches = [mock.patch.object(dist, "all_to_all_single", all_to_all_single)]
    patches += [mock.patch.object(dist, n, all_gather_single) for n in names]
    for p in patches:
        p.start()
    try:
        yield
    finally:
        for p in reversed(patches):
            p.stop()


def count(fn, log: list[str]) -> dict:
    """Launches of one call of ``fn`` after a warm-up call: {"triton", "torch", "collectives", "total"}."""
    fn()
    log.clear()
    with Launches() as mode:
        fn()
    c = {"triton": len(log), "torch": len(mode.torch_ops), "collectives": len(mode.collectives)}
    return {**c, "total": sum(c.values())}


CODECS = [("uniform", 8, {}), ("fp8_e4m3", 8, {}), ("qsgd", 4, {}), ("nuqsgd", 4, {}), ("qsgdinf", 4, {})]
CODECS += [("sign1", 1, {}), ("sign1", 1, {"bucket_size": 256})]  # one bucket of 2^14 (> MAX_BUCKET); 1-bit Adam's


def codec_rows(log: list[str], codecs=CODECS) -> list[dict]:
    """Launches of one encode and one decode of 2^14 elements per (name, bits, options) codec."""
    from lightning_qcomm.codecs import get_codec, ops, rng

    x = torch.randn(1 << 14, generator=torch.Generator().manual_seed(0))
    rows = []
    encode, decode = ops.kernel("encode", "cuda"), ops.kernel("decode", "cuda")
    for name, bits, opts in codecs:
        codec = get_codec(name, bits, **opts)
        args = codec.op_args()
        codes, scales = encode(x, *args, rng.signed_seed(3))
        enc = count(lambda a=args: encode(x, *a, rng.signed_seed(3)), log)
        dec = count(lambda a=args, c=codes, s=scales: decode(c, s, x.numel(), *a), log)
        rows.append({"codec": f"{name}-{bits}", "options": opts, "encode": enc, "decode": dec})
    return rows


def all_reduce_rows(log: list[str], numel: int = (1 << 15) + 37, codecs=("uniform-8", "fp8_e4m3-8", "nuqsgd-4")):
    """Launches of one quantized all-reduce (error feedback on, buckets of 512) at N = 2, 4, 8."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from lightning_qcomm.codecs import get_codec
    from lightning_qcomm.collectives import quantized_all_reduce

    rows = []
    for label in codecs:
        name, bits = label.rsplit("-", 1)
        codec = get_codec(name, int(bits), 512)
        for world in (2, 4, 8):
            if dist.is_initialized():
                dist.destroy_process_group()
            dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
            x = torch.randn(numel, generator=torch.Generator().manual_seed(world))
            ef = torch.zeros_like(x)
            call = partial(quantized_all_reduce, x, codec, op="avg", error_feedback=ef, seed=3, check=False)
            c = count(call, log)
            rows.append({"codec": label, "world": world, **c})
    dist.destroy_process_group()
    return rows


def activation_rows(log: list[str]) -> list[dict]:
    """One training step (forward, loss, backward) of the bench GPT's "small" preset, batch 2."""
    import torch.nn.functional as F
    from bench_model import GPT, MODEL_PRESETS

    from lightning_qcomm.memory import ActivationQuantConfig, ActivationQuantizer

    rows = []
    for setting in ("fp32", "uniform-4"):
        torch.manual_seed(0)
        cfg = MODEL_PRESETS["small"]
        net = GPT(cfg)
        x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
        quantizer = None
        if setting != "fp32":
            quantizer = ActivationQuantizer(ActivationQuantConfig(bits=4))
            quantizer.attach(net)

        def step(net=net, quantizer=quantizer, x=x):
            with quantizer.forward_context(step=0) if quantizer else contextlib.nullcontext():
                loss = F.cross_entropy(net(x).flatten(0, 1), x.flatten())
            loss.backward()

        rows.append({"setting": setting, **count(step, log)})
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    with cuda_path_on_cpu() as log:
        report = {"codecs": codec_rows(log), "all_reduce": all_reduce_rows(log), "activations": activation_rows(log)}
    print("| codec | encode: Triton + torch | decode: Triton + torch |\n|---|---|---|")
    for r in report["codecs"]:
        e, d = r["encode"], r["decode"]
        label = r["codec"] + "".join(f", {k}={v}" for k, v in r["options"].items())
        print(f"| {label} | {e['triton']} + {e['torch']} | {d['triton']} + {d['torch']} |")
    print("\n| all-reduce (2^15 + 37 fp32) | N | Triton | torch | collectives | total |\n|---|---|---|---|---|---|")
    for r in report["all_reduce"]:
        print(f"| {r['codec']} | {r['world']} | {r['triton']} | {r['torch']} | {r['collectives']} | {r['total']} |")
    print("\n| training step (small GPT) | Triton | torch | total |\n|---|---|---|---|")
    for r in report["activations"]:
        print(f"| {r['setting']} | {r['triton']} | {r['torch']} | {r['total']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
