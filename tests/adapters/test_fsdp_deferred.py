"""DeferredReduceScatters on its own: the flush callback (adapters.fsdp2.deferred), without FSDP."""

import pytest
import torch

from lightning_qcomm.adapters.fsdp2.deferred import DeferredReduceScatters


def _done() -> torch.futures.Future:
    future = torch.futures.Future()
    future.set_result(None)
    return future


class _Defer(torch.autograd.Function):
    """Identity whose backward defers writing ``out`` (= ``total`` / 2) to the end of backward."""

    @staticmethod
    def forward(ctx, x, deferred, out, total):
        ctx.deferred, ctx.out, ctx.total = deferred, out, total
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.deferred.add(_done(), ctx.out, ctx.total, post_divide=2.0)
        return grad, None, None, None


class _Raise(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("backward failed")


def test_flush_runs_at_the_end_of_backward_and_divides():
    deferred = DeferredReduceScatters()
    out, total = torch.zeros(3), torch.tensor([2.0, 4.0, 6.0])
    x = torch.ones(3, requires_grad=True)
    _Defer.apply(x, deferred, out, total).sum().backward()
    assert torch.equal(out, torch.tensor([1.0, 2.0, 3.0]))
    assert len(deferred) == 0


def _left_by_a_failed_backward(deferred: DeferredReduceScatters, total: torch.Tensor) -> torch.Tensor:
    """A backward that defers a call (output = ``total`` / 2) and then raises: autograd runs no final callback, so
    the call stays pending and its output unwritten (returned)."""
    out = torch.zeros_like(total)
    x = torch.ones_like(total, requires_grad=True)
    with pytest.raises(RuntimeError, match="backward failed"):  # the deferred call's backward runs first
        _Defer.apply(_Raise.apply(x), deferred, out, total).sum().backward()
    assert len(deferred) == 1 and torch.equal(out, torch.zeros_like(total))
    return out


def test_a_backward_that_raised_does_not_stop_the_next_one_from_flushing():
    deferred = DeferredReduceScatters()
    _left_by_a_failed_backward(deferred, torch.tensor([8.0, 8.0]))
    out, total = torch.zeros(2), torch.tensor([2.0, 6.0])
    _Defer.apply(torch.ones(2, requires_grad=True), deferred, out, total).sum().backward()
    assert torch.equal(out, torch.tensor([1.0, 3.0]))
    assert len(deferred) == 0


def test_settle_stale_writes_the_calls_of_a_backward_that_raised_and_only_those():
    deferred = DeferredReduceScatters()
    stale_out = _left_by_a_failed_backward(deferred, torch.tensor([8.0, 4.0]))
    seen = {}

    class _SettleInside(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):  # runs after this backward deferred its own call (the _Defer below it)
            deferred.settle_stale()
            seen.update(stale=stale_out.clone(), current=out.clone(), left=len(deferred))
            return grad

    out, total = torch.zeros(2), torch.tensor([2.0, 6.0])
    _Defer.apply(_SettleInside.apply(torch.ones(2, requires_grad=True)), deferred, out, total).sum().backward()
    assert torch.equal(seen["stale"], torch.tensor([4.0, 2.0]))  # the failed backward's call: written
    assert torch.equal(seen["current"], torch.zeros(2)) and seen["left"] == 1  # this backward's: still deferred
    assert torch.equal(out, torch.tensor([1.0, 3.0])) and len(deferred) == 0  # ... until its flush


def test_settle_stale_outside_backward_writes_everything_left():
    deferred = DeferredReduceScatters()
    out = _left_by_a_failed_backward(deferred, torch.tensor([8.0, 4.0]))
    deferred.settle_stale()
    assert torch.equal(out, torch.tensor([4.0, 2.0])) and len(deferred) == 0


def test_one_call_in_flight_the_earlier_ones_are_written_when_the_next_is_added():
    """Each pending call holds its padded input and fp32 sum: a call added writes the ones before it (their values
    are the flush's), so a worker slower than backward never keeps more than one group's buffers."""
    deferred = DeferredReduceScatters()
    first_out, first_total = torch.zeros(2), torch.tensor([2.0, 6.0])
    second_out, second_total = torch.zeros(2), torch.tensor([4.0, 8.0])
    seen = {}

    class _SecondCall(torch.autograd.Function):  # runs after the first call was deferred (the _Defer below it)
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            deferred.add(_done(), second_out, second_total, post_divide=2.0)
            seen.update(first=first_out.clone(), second=second_out.clone(), left=len(deferred))
            return grad

    x = torch.ones(2, requires_grad=True)
    _Defer.apply(_SecondCall.apply(x), deferred, first_out, first_total).sum().backward()
    assert torch.equal(seen["first"], torch.tensor([1.0, 3.0])) and seen["left"] == 1  # written at the next add
    assert torch.equal(seen["second"], torch.zeros(2))  # the newest call stays in flight ...
    assert torch.equal(second_out, torch.tensor([2.0, 4.0])) and len(deferred) == 0  # ... until the flush
