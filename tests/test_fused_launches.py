"""Device launches of one encode and one decode on the CUDA path, counted on CPU tensors under TRITON_INTERPRET=1.

On a GPU every eager torch op and every Triton kernel is a launch, and a host-bound codec is a slow codec. The
ops' CUDA kernels (``codecs.ops.encode_cuda`` / ``decode_cuda``) run here on CPU tensors through Triton's
interpreter, in their accelerator form (``scaling._HOST_BRANCHES = False``: no branch on device values); a
``TorchDispatchMode`` counts the aten ops that launch a kernel (allocations and views launch none) and a proxy
counts the Triton launches.

Criteria, fixed before measuring: a decode is one launch for every codec with kernels (the decode parameters are
made from the wire scales in the kernel); an encode of a uniform or FP8 codec with buckets of at most
``MAX_BUCKET`` elements is two (scales and parameters in one, the codes in the other). The torch-side encode of
the norm codecs is counted too, as a figure (``test_norm_codecs_launches_reported``), without a bound.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

FUSED_ENCODE = [("uniform", 8, {}), ("uniform", 4, {"stochastic": False}), ("fp8_e4m3", 8, {})]
FUSED_ENCODE += [("fp8_e5m2", 8, {"rounding": "stochastic"})]
OTHER = [("qsgd", 4, {}), ("qsgdinf", 4, {}), ("nuqsgd", 4, {}), ("sign1", 1, {})]
# aten ops that allocate or make views: no kernel launch on a GPU
LAUNCH_FREE = {
    "empty",
    "empty_strided",
    "empty_like",
    "new_empty",
    "view",
    "_unsafe_view",
    "reshape",
    "as_strided",
    "alias",
    "detach",
    "t",
    "unsqueeze",
    "squeeze",
    "expand",
    "slice",
    "select",
    "lift_fresh",
}


def _worker() -> dict:
    from unittest import mock

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

    from lightning_qcomm.codecs import get_codec, ops, rng, scaling
    from lightning_qcomm.kernels import codec_kernels, wire_params

    lib = torch.library.Library("qcomm", "IMPL")  # CPU tensors take the ops' CUDA kernels (Triton) from here on
    lib.impl("encode", ops.encode_cuda, "CPU", allow_override=True)
    lib.impl("decode", ops.decode_cuda, "CPU", allow_override=True)

    class Launches(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.torch_ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name not in LAUNCH_FREE:
                self.torch_ops.append(name)
            return func(*args, **(kwargs or {}))

    triton_launches = []

    class Counted:
        def __init__(self, kernel, name):
            self.kernel, self.name = kernel, name

        def __getitem__(self, grid):
            triton_launches.append(self.name)
            launch = self.kernel[grid]

            def run(*args, **kwargs):  # the interpreter's own tensor copies are not launches: not counted
                with _disable_current_modes():
                    return launch(*args, **kwargs)

            return run

    patches = [
        mock.patch.object(codec_kernels, "_encode_kernel", Counted(codec_kernels._encode_kernel, "encode")),
        mock.patch.object(codec_kernels, "_decode_kernel", Counted(codec_kernels._decode_kernel, "decode")),
        mock.patch.object(wire_params, "_wire_kernel", Counted(wire_params._wire_kernel, "wire")),
        mock.patch.object(scaling, "_HOST_BRANCHES", False),
    ]
    for p in patches:
        p.start()
    x = torch.randn(3000, generator=torch.Generator().manual_seed(0))
    report = {"rows": _rows_cases(), "all_reduce": _all_reduce_launches(Launches, triton_launches)}
    for name, bits, opts in FUSED_ENCODE + OTHER:
        codec = get_codec(name, bits, **opts)
        args = codec.op_args()
        codes, scales = ops.encode_cuda(x, *args, 0)  # warm-up: the first use probes the kernels once
        ops.decode_cuda(codes, scales, x.numel(), *args)
        counts = {}
        for phase in ("encode", "decode"):
            triton_launches.clear()
            with Launches() as mode:
                if phase == "encode":
                    codes, scales = ops.encode_cuda(x, *args, rng.signed_seed(7))
                else:
                    ops.decode_cuda(codes, scales, x.numel(), *args)
            counts[phase] = {"triton": list(triton_launches), "torch": mode.torch_ops}
        report[f"{name}{bits}{'_' + '_'.join(map(str, opts.values())) if opts else ''}"] = counts
    return report


def _rows_cases() -> dict:
    """``row_batch.encode_rows`` through the rows kernels against each row's own reference encode, bit for bit."""
    import torch

    from lightning_qcomm.codecs import derive_seed, get_codec, ops
    from lightning_qcomm.comm import row_batch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from test_codecs import extreme_values

    gen = torch.Generator().manual_seed(1)
    out = {}
    for name, bits, opts in FUSED_ENCODE:
        for bucket, n in ((512, 1037), (37, 300)):
            codec = get_codec(name, bits, bucket, **opts)
            rows = torch.randn(5, n, generator=gen) * 3
            rows[1, 7] = float("nan")
            ext = extreme_values()
            rows[2, : min(n, ext.numel())] = ext[: min(n, ext.numel())]
            rows[3, 40:80] = 0.0
            rows[3, 50:60] = -0.0
            seeds = [derive_seed(9, 1, j) for j in range(5)]
            assert ops.rows_kernel(codec, rows), "the rows kernels must take these rows"
            got = row_batch.encode_rows(codec, rows, seeds)
            want = torch.stack([codec.encode(rows[j], seed=s).to_bytes() for j, s in enumerate(seeds)])
            out[f"{_key(name, bits, opts)}_b{bucket}"] = torch.equal(got, want)
    for name, bits, opts in FUSED_ENCODE + OTHER:  # the rows decode kernel, every codec with kernels
        for bucket, n in ((512, 1037), (37, 300)):
            codec = get_codec(name, bits, None if name == "sign1" else bucket, **opts)
            rows = torch.randn(4, n, generator=gen)
            rows[1, 5] = float("inf")
            wire = torch.stack([codec.encode(rows[j], seed=j).to_bytes() for j in range(4)])
            assert ops.rows_kernel(codec, wire, encode=False), "the rows decode kernel must take these payloads"
            got = row_batch.decode_rows(codec, wire, n)
            want = torch.stack([codec.decode(codec.from_bytes(wire[j], (n,), torch.float32)) for j in range(4)])
            same = (got.view(torch.int32) == want.view(torch.int32)) | (got.isnan() & want.isnan())
            out[f"decode_{_key(name, bits, opts)}_b{bucket}"] = bool(same.all())
    return out


def _all_reduce_launches(Launches, triton_launches) -> dict:
    """Launches of one quantized all-reduce (uniform-8, 2^15 + 37 elements) on the fake process group at N = 2,
    4, 8, every codec call on the ops' CUDA kernels; and the same with the rows kernels switched off (the torch
    hooks of ``row_batch``): {"rows kernels" | "torch rows": {N: (triton, torch ops, collectives)}}."""
    from unittest import mock

    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from lightning_qcomm.codecs import get_codec, ops
    from lightning_qcomm.comm import quantized_all_reduce

    codec = get_codec("uniform", 8, 512)
    res = {}
    for label, rows_kernel in (("rows kernels", ops.rows_kernel), ("torch rows", lambda c, r, encode=True: False)):
        res[label] = {}
        with mock.patch.object(ops, "rows_kernel", rows_kernel):
            for world in (2, 4, 8):
                if dist.is_initialized():
                    dist.destroy_process_group()
                dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
                x = torch.randn(2**15 + 37, generator=torch.Generator().manual_seed(world))
                ef = torch.zeros_like(x)
                quantized_all_reduce(x, codec, op="avg", error_feedback=ef, seed=3, check=False)  # warm-up
                triton_launches.clear()
                with Launches() as mode:
                    quantized_all_reduce(x, codec, op="avg", error_feedback=ef, seed=3, check=False)
                coll = [o for o in mode.torch_ops if o.startswith(("allgather", "alltoall", "allreduce", "_c10d"))]
                res[label][world] = (len(triton_launches), len(mode.torch_ops) - len(coll), len(coll))
    dist.destroy_process_group()
    return res


@pytest.fixture(scope="module")
def report() -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", LIGHTNING_QCOMM_CPU_FUSED="0")
    env.pop("LIGHTNING_QCOMM_DISABLE_TRITON", None)
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__)], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"launch worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _key(name, bits, opts):
    return f"{name}{bits}{'_' + '_'.join(map(str, opts.values())) if opts else ''}"


@pytest.mark.parametrize("case", FUSED_ENCODE, ids=lambda c: _key(*c))
def test_fused_encode_is_two_launches(report, case):
    enc = report[_key(*case)]["encode"]
    assert enc["triton"] == ["wire", "encode"], enc
    assert enc["torch"] == [], enc


@pytest.mark.parametrize("case", FUSED_ENCODE + OTHER, ids=lambda c: _key(*c))
def test_decode_is_one_launch(report, case):
    dec = report[_key(*case)]["decode"]
    assert dec["triton"] == ["decode"], dec
    assert dec["torch"] == [], dec


def test_norm_codecs_launches_reported(report, capsys):
    """The norm codecs keep their scales in torch (a fixed-order fused norm is still to come): one Triton launch
    for the codes, and a figure for the torch ops around it."""
    for case in OTHER:
        enc = report[_key(*case)]["encode"]
        assert enc["triton"] == ["encode"], enc
        with capsys.disabled():
            print(f"\n{_key(*case)}: encode {1 + len(enc['torch'])} launches (1 Triton + {len(enc['torch'])} torch)")


def test_rows_kernels_equal_each_rows_own_encode(report):
    """R rows (NaN, extreme values, mixed zeros among them) coded in one go by the rows kernels: row j is
    ``codec.encode(rows[j], seed_j).to_bytes()``, bit for bit, for every uniform and FP8 configuration; and R
    payloads of every codec with kernels decoded in one launch equal each payload's own decode, bit for bit."""
    assert len(report["rows"]) == 2 * len(FUSED_ENCODE) + 2 * len(FUSED_ENCODE + OTHER)
    assert all(report["rows"].values()), report["rows"]


def test_all_reduce_launches_flat_in_world_size(report, capsys):
    """One quantized all-reduce on the CUDA code path: the launches do not grow with N, and the rows kernels
    take a fraction of the torch rows' launches."""
    fused, before = report["all_reduce"]["rows kernels"], report["all_reduce"]["torch rows"]
    with capsys.disabled():
        for label, counts in report["all_reduce"].items():
            print(f"\nquantized_all_reduce uniform-8, {label}: N -> (Triton, torch ops, collectives) {counts}")
    total = {w: sum(c) for w, c in fused.items()}
    assert total["8"] <= total["2"], total
    assert all(sum(fused[w]) * 4 <= sum(before[w]) for w in fused), (fused, before)


if __name__ == "__main__":
    print(json.dumps(_worker()))
