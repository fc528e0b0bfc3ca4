"""DDP communication hook that all-reduces gradient buckets with a codec (adapter layer; docs/design.md, "QuantDDP").

The state (``QuantDDPHookState``: codec, step counter, error-feedback buffers) and the hook
``quant_ddp_comm_hook(state, bucket)``; nothing of Lightning. Per bucket and optimizer step t the elements of
tensors with ``numel < min_quant_numel`` (and every element before ``start_step``) take the plain fp32 average,
the others ``quantized_all_reduce(op="avg", error_feedback=e_bucket, seed=derive_seed(seed, t, bucket, round))``
(``collectives.quantized``), so every rank ends with the same averaged gradient. ``codec="auto"``: the width of
step t is ``state.trial.width(t)`` (``comm.auto_trial``).

Invariants: every path (inline, on a ``CommWorker``, on a CUDA side stream) gives bit-identical results; the
quantized elements are laid out in a canonical parameter order, so the result does not depend on DDP's bucket
order; error feedback is one fp32 buffer per bucket, kept in unscaled units under a loss scaler and saved per
parameter name (``ef_state_dict``); a resumed run replays the saved bucket layout (``relayout.LayoutReplay``) and
is bit-identical to an uninterrupted one; a non-finite gradient stays non-finite and leaves the residual as it
was. Hierarchical (``node_groups``): ``collectives.hierarchical`` on ``ParamShards``-laid-out buckets. The long
form: docs/design.md, "Module notes".

Example::

    names = {p: n for n, p in ddp_model.module.named_parameters()}
    state = QuantDDPHookState(QuantDDPConfig(codec="uniform", bits=8), names)
    ddp_model.register_comm_hook(state, quant_ddp_comm_hook)
"""

import functools
import logging
from collections.abc import Callable

import torch
import torch.distributed as dist

from lightning_qcomm.adapters.ddp.config import QuantDDPConfig
from lightning_qcomm.adapters.ddp.plan import BucketPlan, append_segment, gather_segments, scatter_segments
from lightning_qcomm.adapters.ddp.relayout import LayoutReplay, VirtualBucket
from lightning_qcomm.codecs import Codec, derive_seed
from lightning_qcomm.collectives.hierarchical import ParamShards, hierarchical_all_reduce, local_index, shard_numel
from lightning_qcomm.collectives.quantized import quantized_all_reduce
from lightning_qcomm.comm.agree import max_over_ranks_each
from lightning_qcomm.comm.auto_trial import UNCOMPRESSED, WidthTrial, candidate_widths
from lightning_qcomm.comm.comm_worker import CommWorker
from lightning_qcomm.comm.side_stream import SideStream
from lightning_qcomm.comm.topology import NodeGroups

log = logging.getLogger(__name__)


class QuantDDPHookState:
    """State of ``quant_ddp_comm_hook`` for one DDP instance on one rank.

    Args:
        config: ``QuantDDPConfig`` (``adapters.ddp.config``).
        param_names: maps each trainable parameter to a stable name (checkpoint keys), in the
            module's definition order (``named_parameters``).
        process_group: the group the hook's collectives use (None: default group). With a ``worker``,
            a group nothing else uses (``comm_worker.dedicated_group``).
        worker: run CPU buckets' collectives on this background thread (overlap with backward).
        loss_scale: returns the loss scale the current gradients carry (a tensor, e.g. a GradScaler's
            scale), or None when they are unscaled; read once per bucket on the autograd thread.
        node_groups: reduce hierarchically over these intra-/inter-node groups (``comm.topology.node_groups``
            over the default group, which must be DDP's); None: flat over ``process_group``.
    """

    def __init__(
        self,
        config: QuantDDPConfig,
        param_names: dict[torch.nn.Parameter, str],
        process_group: dist.ProcessGroup | None = None,
        worker: CommWorker | None = None,
        loss_scale: Callable[[], torch.Tensor | None] | None = None,
        node_groups: NodeGroups | None = None,
    ) -> None:
        self.config = config
        self.node_groups = node_groups
        self.loss_scale = loss_scale
        self.process_group = process_group
        self.worker = worker
        self.trial: WidthTrial | None = None  # codec="auto": the width of each step
        if config.codec == "auto":
            many = dist.is_available() and dist.is_initialized() and dist.get_world_size(process_group) > 1
            widths = candidate_widths(config.min_bits) if many else (UNCOMPRESSED,)
            self._auto_codecs = {b: config.resolve_auto(b).build_codec() for b in widths}
            self.trial = WidthTrial(
                widths, config.auto_trial_steps, recheck_steps=config.auto_recheck_steps, start=config.start_step,
                owner="QuantDDP(codec='auto')",
            )  # fmt: skip
        self._codec = None if self.trial is not None else config.build_codec()
        self._device = torch.device("cpu")  # the buckets' (the trial's all-reduce runs there)
        self._ef_live = False  # residuals may be non-zero (auto flushes them at a 32-bit step)
        self.side_stream = SideStream() if config.overlap_comm else None  # CUDA buckets' overlap
        self._names = {id(p): n for p, n in param_names.items()}
        self._params_by_name = {n: p for p, n in param_names.items()}
        self._numel_by_name = {n: p.numel() for p, n in param_names.items()}
        node = 1 if node_groups is None else node_groups.topology.node_size
        self._ef_numel_by_name = {n: shard_numel(k, node) if node_groups else k for n, k in self._numel_by_name.items()}
        # Canonical order of quantized elements: reverse definition order (what DDP's rebuilt buckets
        # usually are, so the common case needs no copy). See "Canonical order" in the module doc.
        self._canonical = {id(p): -i for i, p in enumerate(param_names)}
        self.step = 0  # optimizer steps completed; the owner calls ``next_step``
        self.round = 0  # all-reduce rounds inside the current step (several backward passes per step)
        self._plans: dict[tuple[int, tuple[int, ...]], BucketPlan] = {}
        # bucket index -> (quantized parameter names, flat residual of their elements)
        self._ef: dict[int, tuple[tuple[str, ...], torch.Tensor]] = {}
        # per-parameter residuals waiting for a bucket (after a layout change or a checkpoint load)
        self._pending: dict[str, torch.Tensor] = {}
        # bucket index -> member names of the last bucket reduced with that index (saved with the state)
        self._members: dict[int, tuple[str, ...]] = {}
        self._replay: LayoutReplay | None = None  # a loaded layout, replayed until DDP's buckets match it

    # ---------------------------------------------------------------- step bookkeeping
    def next_step(self) -> None:
        """Call once per optimizer step (after it)."""
        if self.trial is not None:
            self._ef_live &= self.compressing()  # an uncompressed step sent every residual
            self.trial.step_done(self.step, self._agree)
        self.step += 1
        self.round = 0

    @property
    def codec(self) -> Codec | None:
        """The codec of the current step (None: uncompressed)."""
        return self._codec if self.trial is None else self._auto_codecs[self.trial.width(self.step)]

    def _agree(self, seconds: list[float]) -> list[float]:
        """The trial's figures, the maximum over the ranks, on the thread that owns ``process_group``."""
        job = functools.partial(max_over_ranks_each, seconds, self.process_group, self._device)
        return job() if self.worker is None else self.worker.submit(job).wait()

    def advance_round(self) -> None:
        """After the last bucket of a backward pass: the next pass of this step is a new round."""
        self.round += 1

    def compressing(self) -> bool:
        return self.codec is not None and self.step >= self.config.start_step

    # ---------------------------------------------------------------- layout
    def plan(self, bucket: dist.GradBucket) -> BucketPlan:
        params = bucket.parameters()
        key = (bucket.index(), tuple(id(p) for p in params))
        plan = self._plans.get(key)
        if plan is None:
            small: list[tuple[int, int]] = []
            quant: list[tuple[int, int, torch.nn.Parameter]] = []  # (canonical rank, offset, param)
            offset = 0
            for p in params:
                n = p.numel()
                if n >= self.config.min_quant_numel:
                    quant.append((self._canonical[id(p)], offset, p))
                else:
                    append_segment(small, offset, n)
                offset += n
            big: list[tuple[int, int]] = []
            for _, off, p in sorted(quant, key=lambda t: t[0]):
                append_segment(big, off, p.numel())
            names = tuple(self._names[id(p)] for _, _, p in sorted(quant, key=lambda t: t[0]))
            numels = tuple(self._numel_by_name[n] for n in names)
            members = tuple(self._names[id(p)] for p in params)
            plan = BucketPlan(big, small, names, numels, sum(numels), members)
            if self.node_groups is not None:
                plan.shards = ParamShards(numels, self.node_groups.topology.node_size)
            self._plans[key] = plan
        return plan

    # ---------------------------------------------------------------- error feedback
    def _explode(self) -> None:
        """Move every bucket's residual into per-parameter pieces (``_pending``)."""
        for names, buf in self._ef.values():
            numels = [self._ef_numel_by_name[n] for n in names]
            for name, piece in zip(names, torch.split(buf, numels)):
                self._pending[name] = piece.clone()
        self._ef.clear()

    def error_buffer(self, bucket_index: int, plan: BucketPlan, like: torch.Tensor) -> torch.Tensor:
        """The fp32 residual buffer of this bucket layout (on ``like``'s device), rebuilt from per-parameter
        pieces if needed."""
        entry = self._ef.get(bucket_index)
        if entry is not None and entry[0] == plan.big_names:
            return entry[1]
        if entry is not None:  # layout changed (DDP rebuilt its buckets): re-key every residual
            log.debug("quant_ddp: bucket %d layout changed; re-assembling error-feedback buffers", bucket_index)
            self._explode()
        pieces = []
        for name, n in zip(plan.big_names, plan.ef_numels):
            piece = self._pending.pop(name, None)
            if piece is None or piece.numel() != n:
                if piece is not None:
                    log.warning(
                        "quant_ddp: error-feedback residual of %r has %d elements, expected %d; reset to 0",
                        name,
                        piece.numel(),
                        n,
                    )
                piece = torch.zeros(n, dtype=torch.float32, device=like.device)
            pieces.append(piece.reshape(-1).to(device=like.device, dtype=torch.float32))
        buf = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.float32, device=like.device)
        self._ef[bucket_index] = (plan.big_names, buf)
        return buf

    def ef_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's residuals per parameter name (CPU fp32), independent of DDP's bucketing."""
        out = {name: t.detach().to("cpu", torch.float32).clone() for name, t in self._pending.items()}
        for names, buf in self._ef.values():
            numels = [self._ef_numel_by_name[n] for n in names]
            for name, piece in zip(names, torch.split(buf, numels)):
                out[name] = piece.detach().to("cpu", torch.float32).clone()
        return out

    def load_ef_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Replace this rank's residuals; they are placed into buckets when each bucket next runs."""
        self._ef.clear()
        self._pending = {str(k): v.detach().reshape(-1).to(torch.float32).clone() for k, v in state.items()}
        self._ef_live = bool(self._pending)

    def bucket_layout(self) -> list[tuple[str, ...]]:
        """Member names of each bucket by index, as last reduced (the replayed layout while a replay runs)."""
        if self._replay is not None and self._replay.active:
            return list(self._replay.layout)
        if sorted(self._members) != list(range(len(self._members))):
            return []
        return [self._members[i] for i in range(len(self._members))]

    def state_dict(self) -> dict:
        """Everything this rank needs to continue: step counter, residuals, DDP's bucket layout, the topology."""
        return {
            "step": self.step,
            "error_feedback": self.ef_state_dict() if self.config.error_feedback else {},
            "bucket_layout": [list(m) for m in self.bucket_layout()],
            "topology": self.topology(),
            **({} if self.trial is None else {"auto": self.trial.state_dict()}),
        }

    def topology(self) -> list[int] | None:
        """[num_nodes, node_size] of the hierarchical reduction the residuals belong to; None when flat."""
        t = None if self.node_groups is None else self.node_groups.topology
        return None if t is None else [t.num_nodes, t.node_size]

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.round = 0
        if self.trial is not None:  # a new trial, if any, starts after the uncompressed warm-up
            self.trial.load_state_dict(state.get("auto"), max(self.step, self.config.start_step))
        if self.config.error_feedback:
            self.load_ef_state_dict(state.get("error_feedback", {}))
        layout = [tuple(m) for m in state.get("bucket_layout", [])]
        self._replay = None
        if layout and LayoutReplay.matches(layout, set(self._params_by_name)):
            self._replay = LayoutReplay(layout, self._params_by_name)
        elif layout:
            log.warning(
                "quant_ddp: the checkpoint's bucket layout names other parameters than this model's; "
                "compressing by DDP's own buckets (the first resumed step may differ from an uninterrupted run)"
            )


def _bucket_job(state: QuantDDPHookState, bucket: dist.GradBucket) -> Callable[[], torch.Tensor]:
    """Bookkeeping on the calling (autograd) thread; the returned job does the communication."""
    buf = bucket.buffer()
    group = state.process_group
    plan = state.plan(bucket)
    codec = state.codec
    compress = state.compressing() and plan.big_numel > 0
    # Bucket shapes agree across ranks by construction; verify once per layout and width, then skip the check.
    width = codec.bits if compress else UNCOMPRESSED
    check = width not in plan.checked
    plan.checked.add(width)
    state._device = buf.device
    seed = derive_seed(state.config.seed, state.step, bucket.index(), state.round)
    if not isinstance(bucket, VirtualBucket):
        state._members[bucket.index()] = plan.members
    # codec="auto" at 32 bits after compressed steps: send their residual with g, exactly (the residual becomes 0)
    flush = not compress and state.trial is not None and state._ef_live and plan.big_numel > 0
    ef = state.error_buffer(bucket.index(), plan, buf) if (compress or flush) and state.config.error_feedback else None
    state._ef_live |= ef is not None and compress
    scale = None if ef is None or state.loss_scale is None else state.loss_scale()
    if scale is not None:
        scale = torch.as_tensor(scale).to(device=ef.device, dtype=torch.float32)
    if bucket.is_last():
        state.advance_round()

    groups = state.node_groups
    # codec="auto" averages uncompressed elements as DDP does (one flat fp32 all-reduce: "no compression" is what
    # the trial measures against); a fixed hierarchical config keeps its exact two-level path
    flat_plain = groups is None or state.trial is not None

    def plain_average(t: torch.Tensor) -> None:
        if flat_plain:
            quantized_all_reduce(t, None, group=group, op="avg", tag="grads", check=check)
        else:
            hierarchical_all_reduce(t, None, groups, op="avg", tag="grads", check=check)

    def job() -> torch.Tensor:
        if not compress:
            if ef is not None:
                big = gather_segments(buf, plan.big)
                residual = ef if scale is None else ef * scale
                if plan.shards is None:
                    big.add_(residual)
                else:  # hierarchical: this rank's residual is of its shard of the node's sum: add it at that place
                    plan.shards.add_to_shard(big, local_index(groups), residual)
                scatter_segments(buf, plan.big, big)
                ef.zero_()
            plain_average(buf)
            return buf
        if plan.small:
            plain = gather_segments(buf, plan.small)
            plain_average(plain)
            scatter_segments(buf, plan.small, plain)
        big = gather_segments(buf, plan.big)
        if scale is not None:
            ef.mul_(scale)  # into the gradients' (scaled) units for the collective ...
        if plan.shards is None:
            quantized_all_reduce(
                big, codec, group=group, op="avg", error_feedback=ef, seed=seed, tag="grads", check=check
            )
        else:
            rows = plan.shards.to_rows(big)
            hierarchical_all_reduce(rows, codec, groups, "avg", ef, seed, tag="grads", check=check)
            plan.shards.from_rows(rows, big)
        if scale is not None:
            ef.div_(scale)  # ... and back: the residual outlives this step's scale
        scatter_segments(buf, plan.big, big)
        return buf

    return job


def quant_ddp_comm_hook(state: QuantDDPHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: average the bucket over ranks, compressing large tensors with ``state.codec``.

    Register with ``ddp_model.register_comm_hook(state, quant_ddp_comm_hook)``. Returns a future holding
    the bucket buffer, averaged in place: completed on return, completed by ``state.worker`` (CPU), or
    ordered after the side stream's work (CUDA, see ``comm.side_stream``).
    """
    buf = bucket.buffer()
    on_worker = state.worker is not None and buf.device.type == "cpu"
    on_side = state.side_stream is not None and buf.is_cuda
    replay = state._replay
    if replay is not None and replay.active:
        names = [state._names[id(p)] for p in bucket.parameters()]
        submit = None
        if on_worker:
            submit = state.worker.submit
        elif on_side:
            submit = functools.partial(state.side_stream.run, device=buf.device)
        devices = [buf.device] if buf.is_cuda else None
        return replay.hook(bucket, names, lambda vb: _bucket_job(state, vb), submit, state.advance_round, devices)
    job = _bucket_job(state, bucket)
    if on_worker:
        return state.worker.submit(job)
    if on_side:
        return state.side_stream.submit(job, buf)
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(job())
    return fut


__all__ = ["QuantDDPHookState", "quant_ddp_comm_hook"]  # their config: adapters.ddp.config.QuantDDPConfig
