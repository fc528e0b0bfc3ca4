"""ActivationQuantizer: stores the saved activations of a forward pass in b bits (AGoQ LAAQ; memory layer;
docs/design.md, "Activation quantization").

What is quantized is decided by the op that saves a tensor (``memory.op_rules``, seen by a ``TorchFunctionMode``
while a forward runs under ``begin()`` / ``end()``): projections' inputs, norms' inputs, activation functions and
element-wise arithmetic, dropout's mask. Attention, losses, parameters, small or non-floating tensors and leaves
stay exact. Norms and GELU/SiLU recompute from their stored input (``memory.recompute``); every other quantized op
keeps torch's backward through a saved-tensor hook. A tensor saved by several ops is stored once.

Invariants: each quantized save is a *site* in forward order, its width from the policy's plan
(``memory.bit_allocation``; 8 bits before a plan exists) and its random bits from ``derive_seed(seed, step,
micro, rank, site)``, so runs are reproducible; regions under another owner's saved-tensor hooks (non-reentrant
checkpointing, ``save_on_cpu``) are left alone; ``stats`` counts the bytes with and without quantization. Not
supported: ``torch.compile``, double backward through a recomputed op, ops from another thread. The full rules:
docs/design.md, "Module notes".

Example::

    Trainer(callbacks=[ActivationQuantization(bits=4)])   # the callback drives an ActivationQuantizer per step
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial

import torch
from torch import nn

from lightning_qcomm.codecs import Codec, derive_seed, get_codec
from lightning_qcomm.memory import bit_allocation as alloc
from lightning_qcomm.memory.config import ActivationQuantConfig
from lightning_qcomm.memory.intercept import _bind, _norm_r2, _QuantMode
from lightning_qcomm.memory.op_rules import RECOMPUTABLE, OpRule
from lightning_qcomm.memory.recompute import bypass_active, recompute_from_stored
from lightning_qcomm.memory.save_batch import PendingSaves, batchable
from lightning_qcomm.memory.saved_tensors import (
    SavedBytes,
    SaveRecord,
    SharedSaves,
    derives_from,
    is_parameter_like,
    quantizable_reason,
    quantize_activation,
    restore,
    tensor_nbytes,
)
from lightning_qcomm.memory.site_plan import (
    CALIBRATION_BITS,
    _SiteCalibration,
    _Watch,
    agreed_budget_plan,
    plan_from_state,
    plan_state_dict,
    watch_output,
)

log = logging.getLogger(__name__)

MAX_RECORDS = 100_000
# private torch API: (pack, unpack) of the innermost active saved-tensor hooks (None if this torch lacks it)
_TOP_HOOKS = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


class ActivationQuantizer:
    """Quantize saved activations inside ``begin()`` ... ``end()`` (see module docstring).

    Example::

        q = ActivationQuantizer(ActivationQuantConfig(bits=4))
        q.attach(model)
        with q.forward_context(step=0):
            loss = model(x).sum()
        loss.backward()   # the quantized activations are restored here
        q.stats.ratio     # stored / baseline bytes of this forward's saved activations
    """

    def __init__(self, config: ActivationQuantConfig | None = None) -> None:
        self.config = config or ActivationQuantConfig()
        self.record = False
        self.records: list[SaveRecord] = []
        self.stats = SavedBytes()
        self.plan: list[int] | None = None
        self.calibration: list[_SiteCalibration] = []
        self.calibration_forwards = 0
        self.last_site_count = 0
        self._codecs: dict[int, Codec] = {}
        self._handles: list = []
        self._stack: list[tuple[str, bool]] = []
        self._attention_depth = 0
        self._mode: _QuantMode | None = None
        self._outer_pack: Callable | None = None
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        self._site = 0
        self._shared = SharedSaves()
        self._pending = PendingSaves()
        self._layers: set[int] = set()
        self._seed_prefix: tuple[int, ...] = (0, 0, 0)
        self._warned_sites = False
        self._warned_no_api = False
        self._warned_nonfinite = False
        self.nonfinite_grads = 0  # calibration measurements skipped since the last reset (non-finite gradient)

    # ------------------------------------------------------------------ policy
    @property
    def calibrating(self) -> bool:
        """True until the policy's plan exists (layer_aware: first forward; budget: ``finish_calibration``)."""
        return self.config.policy != "uniform" and self.plan is None

    def codec(self, bits: int) -> Codec:
        if bits not in self._codecs:
            self._codecs[bits] = get_codec(
                "uniform", bits=bits, bucket_size=self.config.block_size, stochastic=self.config.stochastic
            )
        return self._codecs[bits]

    def bits_for(self, site: int) -> int:
        cfg = self.config
        if cfg.policy == "uniform":
            return cfg.bits
        if self.plan is None:
            return max(CALIBRATION_BITS, cfg.edge_bits) if cfg.policy == "layer_aware" else CALIBRATION_BITS
        if site < len(self.plan):
            return self.plan[site]
        if not self._warned_sites:
            self._warned_sites = True
            log.warning(
                "ActivationQuantizer: this forward has more quantized saves than the %d of the plan; the extra ones use bits=%d",
                len(self.plan),
                cfg.bits,
            )
        return cfg.bits

    def reset_calibration(self) -> None:
        """Drop the budget statistics gathered so far (a rejected calibration step starts over)."""
        self.calibration = []
        self.nonfinite_grads = 0

    def finish_calibration(self, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> list[int]:
        """Fix the budget plan from the calibration statistics (``site_plan.agreed_budget_plan``: ``reduce``
        sums a float64 tensor over ranks; every rank gets the same plan or raises the same ``ValueError``)."""
        self.plan = agreed_budget_plan(self.calibration, self.config, reduce)
        return self.plan

    def state_dict(self) -> dict:
        return plan_state_dict(self.plan, self.config)

    def load_state_dict(self, state: dict) -> None:
        """Restore the plan. It is used only if it was made for this policy and these widths; otherwise (or
        from a version-1 state, which did not record them) a warning is logged and the policy calibrates anew.
        Widths outside 1..8 or an unknown version raise ``ValueError``."""
        self.plan = plan_from_state(state, self.config, log.warning)

    # ------------------------------------------------------------------ module scope
    def is_attention_module(self, name: str, module: nn.Module) -> bool:
        if isinstance(module, nn.MultiheadAttention):
            return True
        if not name:  # the root (the whole model) is never "attention"
            return False
        leaf, cls = name.rsplit(".", 1)[-1].lower(), type(module).__name__.lower()
        return any(fnmatch.fnmatchcase(leaf, p) or fnmatch.fnmatchcase(cls, p) for p in self.config.attention_patterns)

    def attach(self, root: nn.Module) -> None:
        """Track which module runs (for site names and the attention scope) with forward hooks on ``root``'s tree."""
        self.detach()
        self._layers = {id(m) for c in root.modules() if isinstance(c, nn.ModuleList) for m in c}
        for name, module in root.named_modules():
            attn = self.is_attention_module(name, module)
            label = name or type(module).__name__
            self._handles.append(module.register_forward_pre_hook(partial(self._enter, label, attn)))
            self._handles.append(module.register_forward_hook(partial(self._exit, attn), always_call=True))

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._layers = set()
        self._stack = []
        self._attention_depth = 0

    def _enter(self, label: str, attn: bool, module, args) -> None:
        self._stack.append((label, attn))
        self._attention_depth += attn

    def _exit(self, attn: bool, module, args, output) -> None:
        if self._stack:
            self._stack.pop()
            self._attention_depth -= attn
        if id(module) in self._layers and len(self._pending):
            self._pending.flush()  # a layer's forward ended: its saves are encoded together

    def _module_name(self) -> str:
        return self._stack[-1][0] if self._stack else ""

    # ------------------------------------------------------------------ activation
    @property
    def active(self) -> bool:
        return self._mode is not None

    def begin(self, step: int = 0, micro: int = 0, rank: int = 0) -> None:
        """Start quantizing this thread's saved activations (a new forward: stats and sites restart)."""
        if self.active:
            raise RuntimeError("ActivationQuantizer.begin() called twice without end()")
        if _TOP_HOOKS is None:
            if not self._warned_no_api:
                self._warned_no_api = True
                log.warning(
                    "ActivationQuantizer: this torch has no torch._C._autograd._top_saved_tensors_default_hooks, "
                    "so activation-checkpointed regions cannot be recognised; activation quantization is OFF"
                )
            return
        self.stats = SavedBytes()
        self.records = []
        self._site = 0
        self._shared.clear()
        self._seed_prefix = (int(step), int(micro), int(rank))
        self._outer_pack = self._pack_other  # the exact object registered, to recognise our hooks on top
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._outer_pack, restore)
        self._hooks.__enter__()
        self._mode = _QuantMode(self)
        self._mode.__enter__()

    def end(self) -> None:
        """Stop intercepting (saved tensors already quantized are restored in backward whenever it runs)."""
        if not self.active:
            return
        self._pending.flush()
        self._mode.__exit__(None, None, None)
        self._hooks.__exit__(None, None, None)
        self._mode = self._hooks = None
        self._shared.clear()  # backward holds what it needs; a new forward starts a new cache
        self.last_site_count = self._site
        if self.calibrating:
            self.calibration_forwards += 1
            if self.config.policy == "layer_aware":
                self.plan = alloc.layer_aware_plan(self._site, self.config.bits, self.config.edge_bits)

    @contextmanager
    def forward_context(self, step: int = 0, micro: int = 0, rank: int = 0) -> Iterator[ActivationQuantizer]:
        self.begin(step, micro, rank)
        try:
            yield self
        finally:
            self.end()

    # ------------------------------------------------------------------ saving
    def _record(self, t: torch.Tensor, op: str, action: str, reason: str, site=None, bits=None, param=False) -> None:
        if self.record and len(self.records) < MAX_RECORDS:
            self.records.append(
                SaveRecord(site, self._module_name(), op, tuple(t.shape), t.dtype, action, reason, bits, param)
            )

    def _keep(self, t: torch.Tensor, op: str, reason: str) -> torch.Tensor:
        if reason == "parameter":
            self._record(t, op, "kept", reason, param=True)
        elif self._shared.get(t) is not None:  # held already (exact or quantized): counted once
            self._record(t, op, "kept", "shared")
        else:
            self._shared.put(t, (None, None, t))
            self.stats.add_kept(tensor_nbytes(t), by_rule=reason in ("attention", "loss"))
            self._record(t, op, "kept", reason)
        return t

    def _pack_other(self, t: torch.Tensor) -> torch.Tensor:
        """Outermost hook: saves of ops that are not intercepted stay exact (counted)."""
        if bypass_active():
            return t
        return self._keep(t, "other", "parameter" if is_parameter_like(t) else "not a quantized op")

    def _next_site(self) -> tuple[int, int, int]:
        site = self._site
        self._site += 1
        return site, self.bits_for(site), derive_seed(self.config.seed, *self._seed_prefix, site)

    def _quantize(self, t: torch.Tensor, op: str, kind: str):
        site, bits, seed = self._next_site()
        codec = self.codec(bits)
        # batches need layers to end them (ModuleLists' children); the budget's calibration reads scales at once
        batch = (
            self.config.batch_saves
            and bool(self._layers)
            and not (self.config.policy == "budget" and self.plan is None)
        )
        if batch and batchable(t, codec):
            stored = self._pending.add(t, codec, seed)
        else:
            stored = quantize_activation(t, codec, seed)
        self.stats.add_quantized(tensor_nbytes(t), stored.nbytes, t.numel(), bits)
        self._record(t, op, "quantized", kind, site=site, bits=bits)
        return site, bits, stored

    def _op_pack(self, op: str, kind: str, x: torch.Tensor | None, watches: list | None, t: torch.Tensor):
        if bypass_active():
            return t
        reason = quantizable_reason(t, self.config.min_numel, temporary=kind == "dropout")
        if reason is None and x is not None and (t.numel() != x.numel() or not derives_from(t, x)):
            reason = "not the op input"
        if reason is not None:
            return self._keep(t, op, reason)
        shared = self._shared.get(t)
        if shared is not None:  # the same tensor saved by another op of this forward: one stored copy
            self._record(t, op, "quantized" if shared[0] is not None else "kept", "shared", shared[0], shared[1])
            return shared[2]
        site, bits, stored = self._quantize(t, op, kind)
        self._shared.put(t, (site, bits, stored))
        if watches is not None:
            watches.append(_Watch(site, kind, t.numel(), self._var_sum(stored, bits)))
        return stored

    def _foreign_hooks_on_top(self) -> bool:
        """True inside another owner's saved-tensor hooks (activation checkpointing, ``save_on_cpu``, ...):
        that region decides what is saved, so the quantizer must not intercept it."""
        top = _TOP_HOOKS(False)
        return top is not None and top[0] is not self._outer_pack

    def _handle(self, rule: OpRule, func, args: tuple, kwargs: dict):
        """Run one intercepted call with the saved-tensor rule of ``op_rules`` (or recompute a norm /
        activation from its quantized input)."""
        if self._foreign_hooks_on_top():
            return func(*args, **kwargs)
        op, kind, x = rule.op, rule.kind, rule.x
        if rule.exact is not None or self._attention_depth > 0:
            reason = rule.exact or "attention"
            with torch.autograd.graph.saved_tensors_hooks(partial(self._keep_exact, op, reason), restore):
                return func(*args, **kwargs)
        collect = self.config.policy == "budget" and self.plan is None
        if kind in RECOMPUTABLE and self.config.recompute:
            bound = _bind(kind, func, args, kwargs)
            if bound is not None and quantizable_reason(x, self.config.min_numel) is None:
                fn, params = bound
                site, bits, stored = self._quantize(x, op, kind)
                y = recompute_from_stored(fn, x, params, stored)
                if collect:
                    r2 = _norm_r2(kind, x, args, kwargs)
                    self._watch(y, [_Watch(site, kind, x.numel(), self._var_sum(stored, bits), r2)])
                return y
        watches: list[_Watch] | None = [] if collect else None
        with torch.autograd.graph.saved_tensors_hooks(partial(self._op_pack, op, kind, x, watches), restore):
            y = func(*args, **kwargs)
        if watches:
            r2 = _norm_r2(kind, x, args, kwargs)
            for w in watches:
                w.r2 = r2
            self._watch(y, watches)
        return y

    def _keep_exact(self, op: str, reason: str, t: torch.Tensor) -> torch.Tensor:
        if bypass_active():
            return t
        return self._keep(t, op, "parameter" if is_parameter_like(t) else reason)

    # ------------------------------------------------------------------ budget calibration
    def _var_sum(self, stored, bits: int) -> float:
        return alloc.rounding_variance_sum(stored.packed.scales, bits, stored.packed.numel, self.config.block_size)

    def _watch(self, y: torch.Tensor, watches: list[_Watch]) -> None:
        """Budget calibration of ``watches`` from y's gradient (``site_plan.watch_output``)."""
        watch_output(self.calibration, y, watches, self._on_nonfinite_grad)

    def _on_nonfinite_grad(self) -> None:
        self.nonfinite_grads += 1
        if not self._warned_nonfinite:
            self._warned_nonfinite = True
            log.warning("ActivationQuantizer: non-finite gradient during budget calibration; step rejected")


def _top_saved_tensors_hooks():
    """(pack, unpack) of the innermost active saved-tensor hooks, or None (also when the API is missing)."""
    return None if _TOP_HOOKS is None else _TOP_HOOKS(False)
