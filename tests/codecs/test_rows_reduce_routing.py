"""Where the CUDA backend (``codecs.cuda``) sends the all-reduce's server step and error-feedback tail: the Triton
kernels only where Triton is there, the operands fit their int32 indexing and the kernels passed their own
first-use check on that device; else the eager ops (with one warning where a check failed). Run on CPU tensors
with the device test stood in."""

from __future__ import annotations

import builtins
import logging

import pytest
import torch

from lightning_qcomm import kernels
from lightning_qcomm.codecs import cuda, rows_reduce, triton_probe

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(triton_probe, "_verdicts", {})
    monkeypatch.setattr(triton_probe, "_failures", {})


def _case(n: int = 1037, c: int = 260):
    g = torch.Generator().manual_seed(1)
    y, dec, held, err = (torch.randn(n, generator=g) for _ in range(4))
    y[2] = float("nan")
    return y, dec, torch.randn(c, generator=g), held, err


def test_feedback_runs_the_eager_ops_where_triton_cannot_be_imported(monkeypatch):
    """A CUDA machine without Triton (the [triton] extra is optional): the tail runs in eager ops, and the kernel
    module (which imports triton) is never imported."""
    monkeypatch.setattr(kernels, "HAS_TRITON", False)
    real_import = builtins.__import__

    def no_triton(name, globals=None, locals=None, fromlist=(), level=0):
        wanted = [name, *(f"{name}.{f}" for f in fromlist or ())]
        if any(w.split(".")[0] == "triton" or w.endswith("reduce_kernels") for w in wanted):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, globals, locals, fromlist, level)

    monkeypatch.setattr(builtins, "__import__", no_triton)
    y, dec, red, held, err = _case()
    want = err.clone()
    rows_reduce.feedback_update_body(y, dec, red, held, 260, 4.0, torch.float32, want)
    cuda.feedback_update(y, dec, red, held, 260, 4.0, torch.float32, err)
    assert torch.equal(err.view(torch.int32), want.view(torch.int32))


def test_feedback_kernel_only_below_int32_indices(monkeypatch):
    monkeypatch.setattr(kernels, "HAS_TRITON", True)
    monkeypatch.delenv("LIGHTNING_QCOMM_DISABLE_TRITON", raising=False)
    monkeypatch.setattr(kernels.codec_kernels, "_is_interpreted", lambda: True, raising=False)
    monkeypatch.setattr(cuda, "_feedback_kernel_works", lambda device: True)
    small = [torch.empty(1 << 20, device="meta") for _ in range(5)]
    large = [torch.empty((1 << 31) - 1024, device="meta") for _ in range(5)]
    assert cuda._feedback_triton(small, torch.float32, CPU)
    assert not cuda._feedback_triton(large, torch.float32, CPU)  # its program * BLOCK + arange would wrap


@pytest.mark.parametrize("broken", ["raises", "one ulp"])
def test_a_feedback_kernel_that_fails_its_check_is_not_used(broken, monkeypatch, caplog):
    triton = pytest.importorskip("triton")  # noqa: F841
    from lightning_qcomm.kernels.cuda import reduce_kernels

    def kernel(y, dec, red, held, start, k, held_dtype, err):
        if broken == "raises":
            raise RuntimeError("Global variable _NAN has changed since we compiled this kernel")
        rows_reduce.feedback_update_body(y, dec, red, held, start, k, held_dtype, err)
        err.view(torch.int32)[-1] += 1

    monkeypatch.setattr(reduce_kernels, "feedback_update", kernel)
    with caplog.at_level(logging.WARNING, logger=triton_probe.__name__):
        assert cuda._feedback_kernel_works(CPU) is False
        assert cuda._feedback_kernel_works(CPU) is False  # checked once
    warnings = [r for r in caplog.records if "first-use check" in r.getMessage()]
    assert len(warnings) == 1 and "error-feedback" in warnings[0].getMessage()
    if broken == "one ulp":
        assert "errors differ" in warnings[0].getMessage()


def test_a_working_feedback_kernel_passes_its_check(monkeypatch):
    pytest.importorskip("triton")
    from lightning_qcomm.kernels.cuda import reduce_kernels

    monkeypatch.setattr(reduce_kernels, "feedback_update", rows_reduce.feedback_update_body)
    assert cuda._feedback_kernel_works(CPU) is True


@pytest.mark.parametrize("broken", ["raises", "one ulp"])
def test_a_wire_feedback_kernel_that_fails_its_check_is_not_used(broken, monkeypatch, caplog):
    """``feedback_rows``: a kernel that fails or differs in its first-use check leaves the tail to the rows decode
    and ``feedback_update`` (the same values), with one warning."""
    pytest.importorskip("triton")
    from lightning_qcomm.codecs import get_codec
    from lightning_qcomm.kernels.cuda import reduce_kernels

    def kernel(codec, y, wire, n, red, held, start, k, held_dtype, err):
        if broken == "raises":
            raise RuntimeError("no kernel here")
        rows_reduce.feedback_rows_body(codec, y, wire, n, red, held, start, k, held_dtype, err, eager=True)
        err.view(torch.int32)[-1] += 1

    monkeypatch.setattr(reduce_kernels, "feedback_rows", kernel)
    codec = get_codec("sign1", 1, 40)
    with caplog.at_level(logging.WARNING, logger=triton_probe.__name__):
        assert cuda._feedback_rows_works(codec, CPU) is False
        assert cuda._feedback_rows_works(codec, CPU) is False  # checked once
    warnings = [r for r in caplog.records if "first-use check" in r.getMessage()]
    assert len(warnings) == 1 and "wire-reading" in warnings[0].getMessage()
    from lightning_qcomm.codecs import decode_rows, encode_rows

    # what runs instead: the rows decode, then the tail (here on CPU tensors, where no kernel is reachable)

    x = torch.randn(2, 30, generator=torch.Generator().manual_seed(3))
    wire = encode_rows(codec, x, [0, 0])
    y, held, err = torch.randn(55), torch.randn(55), torch.randn(55)
    want, got = err.clone(), err.clone()
    rows_reduce.feedback_update_body(
        y, decode_rows(codec, wire, 30).view(-1)[:55], y[:0], held, 0, 1.0, torch.float32, want
    )
    cuda.feedback_rows(y, wire, 30, codec, y[:0], held, 0, 1.0, torch.float32, got)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
