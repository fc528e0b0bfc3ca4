"""Running an entry point's per-step work from torch's optimizer step hooks (entry-point layer).

``Optimizer.register_step_pre_hook`` runs after the backward pass (the gradients are final) and before the
update reads them; ``register_step_post_hook`` runs right after the update. The entry points put their
per-step work there (the non-finite gradient check before, a step counter or an average after), so a plain
training loop calls ``optimizer.step()`` and nothing else. A closure passed to ``optimizer.step(closure)``
runs inside the step, after the pre-hook: compute the gradients before calling ``step`` instead.

Example::

    handles = attach_step_hooks(optimizer, before=lambda opt: guard.apply(opt, step), after=lambda opt: count())
    for h in handles:
        h.remove()
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle


def attach_step_hooks(
    optimizer: Optimizer,
    before: Callable[[Optimizer], Any] | None = None,
    after: Callable[[Optimizer], Any] | None = None,
) -> list[RemovableHandle]:
    """Call ``before(optimizer)`` ahead of and ``after(optimizer)`` behind every ``optimizer.step()``."""
    opt = getattr(optimizer, "optimizer", optimizer)  # Lightning's / Fabric's wrappers hold the torch optimizer
    if not isinstance(opt, Optimizer):
        raise TypeError(f"attach_step_hooks(optimizer={optimizer!r}) must be a torch.optim.Optimizer")
    handles = []
    if before is not None:

        def pre_hook(o: Optimizer, args: Any, kwargs: Any) -> None:  # None: step's arguments unchanged
            before(o)

        handles.append(opt.register_step_pre_hook(pre_hook))
    if after is not None:

        def post_hook(o: Optimizer, args: Any, kwargs: Any) -> None:
            after(o)

        handles.append(opt.register_step_post_hook(post_hook))
    return handles


__all__ = ["attach_step_hooks"]
