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
    report = {}
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


@pytest.fixture(scope="module")
def report() -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
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


if __name__ == "__main__":
    print(json.dumps(_worker()))
