"""netbench: a variant row (``netbench.variants``) made into the strategy, model class and callbacks a worker
trains with, and the ablations' module patches, undone after each entry.

torch's own DDP comm hooks are registered on CPU by ``CPUHookDDPStrategy`` (Lightning's ``DDPStrategy`` registers
them only on CUDA and would silently all-reduce in fp32).

Example::

    strategy, module_cls, kwargs, callbacks = build_variant("qddp_uniform8", warmup=5, lr=1e-3, lr_warmup=5,
                                                            timeout_s=60)
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

from benchmarks.netbench.variants import LSGD, ONE_BUCKET_MB, ONEBIT, QDDP, QDDP_CODECS, QSDP, VARIANT_BY_NAME, Variant

# (object, attribute, original value) of every module attribute an ablation replaced in this process
_ABLATION_PATCHES: list[tuple[Any, str, Any]] = []


def ablation_patch(obj: Any, attr: str, value: Any) -> None:
    """Replace ``obj.attr`` for the current entry only: ``ablation_scope`` restores it. A worker runs a whole
    schedule in one process, so a patch left in place would turn every later entry into the ablation."""
    _ABLATION_PATCHES.append((obj, attr, getattr(obj, attr)))
    setattr(obj, attr, value)


@contextlib.contextmanager
def ablation_scope() -> Iterator[None]:
    """Undo, on exit, every ``ablation_patch`` made inside (latest first)."""
    depth = len(_ABLATION_PATCHES)
    try:
        yield
    finally:
        while len(_ABLATION_PATCHES) > depth:
            obj, attr, old = _ABLATION_PATCHES.pop()
            setattr(obj, attr, old)


def load_symbol(candidates: tuple[str, ...]) -> Any:
    """The first of ``"module:Attr"`` candidates that imports; ImportError naming all of them otherwise."""
    errors = []
    for cand in candidates:
        mod, _, attr = cand.partition(":")
        try:
            return getattr(__import__(mod, fromlist=[attr]), attr)
        except Exception as e:  # noqa: BLE001 - any import failure means "not landed (yet)"
            errors.append(f"{cand}: {type(e).__name__}: {e}")
    raise ImportError("; ".join(errors))


def variant_available(v: Variant) -> tuple[bool, str]:
    """Whether ``v.needs`` imports (lq variants land one by one), and the reason when not."""
    if not v.needs:
        return True, ""
    try:
        load_symbol(v.needs)
    except ImportError as e:
        return False, f"not importable ({e})"
    return True, ""


def build_variant(
    name: str, *, warmup: int, lr: float, lr_warmup: int, timeout_s: float, nodes: int = 2, ranks_per_node: int = 1
) -> tuple[Any, type, dict, list]:
    """(strategy, LightningModule class, extra module kwargs, callbacks) for variant ``name``.

    ``warmup`` is the number of untimed steps: PowerSGD and post-local SGD finish their own
    uncompressed warm-up inside it, so the timed window sees their steady state. ``lr`` is the peak
    learning rate and ``lr_warmup`` the model's linear lr warm-up length (QSR keeps H = h_base there).
    ``nodes`` x ``ranks_per_node`` is the job's shape (the FSDP2 meshes and PowerSGD's bucketing follow it).
    """
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
    from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks, default_hooks, powerSGD_hook
    from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as pls

    from benchmarks.bench_model import BenchLM, BenchLMFSDP2
    from benchmarks.netbench.baseline_hooks import bf16_hook

    timeout = timedelta(seconds=timeout_s)
    world = nodes * ranks_per_node

    class CPUHookDDPStrategy(DDPStrategy):
        """DDPStrategy that registers its comm hook on CPU too (Lightning registers hooks only on CUDA)."""

        def _register_ddp_hooks(self) -> None:
            from lightning.pytorch.overrides.distributed import _register_ddp_comm_hook

            if self._ddp_comm_hook is not None:
                _register_ddp_comm_hook(
                    model=self.model,
                    ddp_comm_state=self._ddp_comm_state,
                    ddp_comm_hook=self._ddp_comm_hook,
                    ddp_comm_wrapper=self._ddp_comm_wrapper,
                )

    class LocalOnlyStrategy(CPUHookDDPStrategy):
        """The DDP job without the DDP wrapper: each rank trains its own copy, nothing is synchronized."""

        def configure_ddp(self) -> None:
            pass  # self.model stays the plain LightningModule

    def ddp(**kw: Any) -> DDPStrategy:
        return CPUHookDDPStrategy(process_group_backend="gloo", timeout=timeout, **kw)

    if name == "floor":
        return LocalOnlyStrategy(process_group_backend="gloo", timeout=timeout), BenchLM, {}, []
    if name == "floor_ddp":
        return ddp(ddp_comm_hook=debugging_hooks.noop_hook), BenchLM, {}, []
    if name == "ddp_fp32":
        return ddp(ddp_comm_hook=default_hooks.allreduce_hook), BenchLM, {}, []
    if name == "ddp_fp16":
        return ddp(ddp_comm_hook=default_hooks.fp16_compress_hook), BenchLM, {}, []
    if name == "ddp_bf16":
        return ddp(ddp_comm_hook=bf16_hook), BenchLM, {}, []
    if name in ("powersgd_r4", "powersgd_r16", "powersgd_r64"):
        rank = int(name.rsplit("_r", 1)[1])
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=2, use_error_feedback=True
        )
        bucket = {"bucket_cap_mb": ONE_BUCKET_MB} if ranks_per_node > 1 else {}  # see ONE_BUCKET_MB
        return ddp(ddp_comm_state=state, ddp_comm_hook=powerSGD_hook.powerSGD_hook, **bucket), BenchLM, {}, []
    if name == "post_local_sgd":
        state = pls.PostLocalSGDState(
            process_group=None, subgroup=None, start_localSGD_iter=warmup, post_local_gradient_allreduce=False
        )
        strat = ddp(ddp_comm_state=state, ddp_comm_hook=pls.post_localSGD_hook, model_averaging_period=4)
        return strat, BenchLM, {}, []
    if name in ("fsdp2", "fsdp2_bf16"):
        strat = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1, timeout=timeout)
        return strat, BenchLMFSDP2, {"mp_dtype": "bfloat16" if name == "fsdp2_bf16" else None}, []
    if name == "fsdp2_hsdp":
        strat = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1, timeout=timeout)
        return strat, BenchLMFSDP2, {"hsdp_shape": (nodes, ranks_per_node)}, []
    if name in ("qsdp_w8g8_hsdp", "qsdp_w8g8_hsdp_intra8", "qsdp_w8g8_hsdp_inline"):
        extra = {"intra_node_bits": 8} if name.endswith("_intra8") else {}
        extra.update({"overlap_comm": False} if name.endswith("_inline") else {})
        strat = load_symbol(QSDP)(weight_bits=8, grad_bits=8, hsdp=True, timeout=timeout, **extra)
        return strat, BenchLM, {}, []
    if name in ("qddp_auto", "qddp_auto_hier"):
        hier = name.endswith("_hier")
        strat = load_symbol(QDDP)(
            codec="auto", min_bits=4, hierarchical=hier, process_group_backend="gloo", timeout=timeout
        )
        return strat, BenchLM, {}, []
    if name == "qsdp_hsdp_auto":
        strat = load_symbol(QSDP)(hsdp=True, grad_bits="auto", min_bits=4, timeout=timeout)
        return strat, BenchLM, {}, []
    if name == "qsdp_auto":
        strat = load_symbol(QSDP)(weight_bits="auto", grad_bits="auto", min_bits=4, timeout=timeout)
        return strat, BenchLM, {}, []
    if name in ("qsdp_w8g8_nfprop", "qsdp_w4g4_nfprop"):
        bits = 8 if name.startswith("qsdp_w8") else 4
        strat = load_symbol(QSDP)(weight_bits=bits, grad_bits=bits, nonfinite="propagate", timeout=timeout)
        return strat, BenchLM, {}, []
    if name == "onebit_adam_inline":
        return ddp(), BenchLM, {}, [load_symbol(ONEBIT)(freeze_step=warmup, overlap=False)]
    if name.startswith("onebit_adam_b"):
        mb = float(name.removeprefix("onebit_adam_b"))
        return ddp(), BenchLM, {}, [load_symbol(ONEBIT)(freeze_step=warmup, bucket_mb=mb)]
    if name == "onebit_adam_nfprop":
        return ddp(), BenchLM, {}, [load_symbol(ONEBIT)(freeze_step=warmup, nonfinite="propagate")]
    if name == "qddp_nuqsgd4_nfprop":
        strat = load_symbol(QDDP)(
            codec="nuqsgd", bits=4, nonfinite="propagate", process_group_backend="gloo", timeout=timeout
        )
        return strat, BenchLM, {}, []
    if name in ("qsdp_w8g8_rs_inline", "qsdp_w4g4_rs_inline"):
        # the ablation: weight all-gathers overlapped, gradient reduce-scatters inline (nothing deferred)
        import lightning_qcomm.adapters.fsdp2.install as fsdp_install

        ablation_patch(fsdp_install, "deferrable", lambda module: lambda input_tensor: False)
        bits = 8 if name.startswith("qsdp_w8") else 4
        return load_symbol(QSDP)(weight_bits=bits, grad_bits=bits, timeout=timeout), BenchLM, {}, []
    if name in ("qsdp_w8g8", "qsdp_w4g4", "qsdp_w8g8_inline", "qsdp_w4g4_inline", "qsdp_32"):
        bits = {"qsdp_w8": 8, "qsdp_w4": 4, "qsdp_32": 32}[name[:7]]
        overlap = not name.endswith("_inline")  # the ablation: weight all-gathers inline, no prefetch
        strat = load_symbol(QSDP)(weight_bits=bits, grad_bits=bits, overlap_comm=overlap, timeout=timeout)
        return strat, BenchLM, {}, []
    if name.endswith("_p17"):  # the ablation: quantized_all_reduce's pieces >= 2^17 elements per rank
        import functools

        import lightning_qcomm.adapters.ddp.hooks as ddp_hooks

        ablation_patch(
            ddp_hooks, "quantized_all_reduce", functools.partial(ddp_hooks.quantized_all_reduce, piece_numel=1 << 17)
        )
        name = name.removesuffix("_p17")
    if "_cap" in name and name.split("_cap")[0] in QDDP_CODECS:
        base, mb = name.split("_cap")
        codec, bits = QDDP_CODECS[base]
        strat = load_symbol(QDDP)(
            codec=codec, bits=bits, bucket_cap_mb=float(mb), process_group_backend="gloo", timeout=timeout
        )
        return strat, BenchLM, {}, []
    if re.fullmatch(r".+_b\d+", name) and name.rsplit("_b", 1)[0] in QDDP_CODECS:
        base, bucket = name.rsplit("_b", 1)
        codec, bits = QDDP_CODECS[base]
        strat = load_symbol(QDDP)(
            codec=codec, bits=bits, bucket_size=int(bucket), process_group_backend="gloo", timeout=timeout
        )
        return strat, BenchLM, {}, []
    if name in QDDP_CODECS or name.removesuffix("_hier") in QDDP_CODECS:
        codec, bits = QDDP_CODECS[name.removesuffix("_hier")]
        hier = name.endswith("_hier")
        strat = load_symbol(QDDP)(
            codec=codec, bits=bits, hierarchical=hier, process_group_backend="gloo", timeout=timeout
        )
        return strat, BenchLM, {}, []
    if name in ("localsgd_qsr", "localsgd_qsr_overlap", "localsgd_qsr_avgstate"):
        # alpha = 2 * peak lr: H = h_base = 4 while lr >= peak/2, then floor((alpha/lr)^2) as the cosine decays
        strat = load_symbol(LSGD)(
            sync="qsr",
            h_base=4,
            alpha=2.0 * lr,
            warmup_steps=lr_warmup,
            overlap=name.endswith("_overlap"),
            average_optimizer_state=name.endswith("_avgstate"),
            timeout=timeout,
        )
        return strat, BenchLM, {}, []
    if name in ("localsgd_qsr_inter", "diloco_qsr"):
        outer = {"outer_optimizer": "nesterov", "outer_lr": 0.7, "outer_momentum": 0.9} if name == "diloco_qsr" else {}
        strat = load_symbol(LSGD)(
            sync="qsr", h_base=4, alpha=2.0 * lr, warmup_steps=lr_warmup, scope="inter_node", timeout=timeout, **outer
        )
        return strat, BenchLM, {}, []
    if name in (
        "localsgd_h1",
        "localsgd_h2",
        "localsgd_h4",
        "localsgd_h4_overlap",
        "localsgd_h8",
        "localsgd_h12",
        "localsgd_h2_overlap",
    ):
        period = int(name.removeprefix("localsgd_h").removesuffix("_overlap"))
        strat = load_symbol(LSGD)(sync="constant", period=period, overlap=name.endswith("_overlap"), timeout=timeout)
        return strat, BenchLM, {}, []
    if name in ("onebit_adam", "onebit_adam_hier"):
        hier = name.endswith("_hier")
        return ddp(), BenchLM, {}, [load_symbol(ONEBIT)(freeze_step=warmup, hierarchical=hier)]
    raise ValueError(f"unknown variant {name!r}; known: {sorted(VARIANT_BY_NAME)}")
