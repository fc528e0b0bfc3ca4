"""netbench variants: what each benchmark row trains with (the one place to add a method).

Each ``Variant`` names a Lightning strategy (plus callbacks) built by ``build_variant`` inside the
worker. lightning_qcomm variants are looked up by import path so the harness runs whichever have
landed and lists the others as skipped. torch's own DDP comm hooks are registered on CPU by
``CPUHookDDPStrategy`` (Lightning's ``DDPStrategy`` registers them only on CUDA and would silently
all-reduce in fp32).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

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


@dataclass(frozen=True)
class Variant:
    """One benchmark row. ``family``: "floor", "torch" (torch/Lightning built-ins) or "lq" (ours)."""

    name: str
    family: str
    label: str
    needs: tuple[str, ...] = ()  # "module:Attr" candidates; one must import for the variant to run
    in_all: bool = True  # False: an ablation, run only when named in --variants
    multi_rank_only: bool = False  # needs several ranks per node (--ranks-per-node 2): hierarchical/HSDP rows


QSDP = ("lightning_qcomm.strategies:QSDPStrategy", "lightning_qcomm.strategies.qsdp:QSDPStrategy")
QDDP = ("lightning_qcomm.strategies:QuantDDPStrategy", "lightning_qcomm.strategies.quant_ddp:QuantDDPStrategy")
LSGD = ("lightning_qcomm.strategies:LocalSGDStrategy", "lightning_qcomm.strategies.local_sgd:LocalSGDStrategy")
ONEBIT = ("lightning_qcomm.callbacks:OneBitAdamCallback", "lightning_qcomm.callbacks.onebit_adam:OneBitAdamCallback")

VARIANTS: tuple[Variant, ...] = (
    Variant(
        "floor", "floor", "compute floor: the same two-node job, each rank training alone (no DDP wrapper, no traffic)"
    ),
    Variant("floor_ddp", "floor", "DDP with torch's no-op comm hook: the floor plus DDP's own bucket/hook overhead"),
    Variant("ddp_fp32", "torch", "DDP fp32 all-reduce (torch allreduce_hook = DDP's built-in reduction)"),
    Variant("ddp_fp16", "torch", "DDP + torch fp16_compress_hook"),
    Variant("ddp_bf16", "torch", "DDP + bf16 compress hook (torch's bf16_compress_hook math; torch's refuses gloo)"),
    Variant("powersgd_r4", "torch", "DDP + torch PowerSGD rank 4, error feedback, warm start, start iter 2"),
    Variant(
        "powersgd_r16", "torch", "the same with rank 16 (ablation: PowerSGD at a rank closer to DDP's loss)", (), False
    ),
    Variant("powersgd_r64", "torch", "the same with rank 64 (ablation)", (), False),
    Variant("fsdp2", "torch", "FSDP2 fp32 (ModelParallelStrategy; fully_shard per block, then the model)"),
    Variant("fsdp2_bf16", "torch", "FSDP2 with MixedPrecisionPolicy(param_dtype=reduce_dtype=bf16)"),
    Variant("post_local_sgd", "torch", "torch post-local SGD: local steps after warm-up, PeriodicModelAverager(4)"),
    Variant("qsdp_w8g8", "lq", "QSDPStrategy(weight_bits=8, grad_bits=8)", QSDP),
    Variant("qsdp_w4g4", "lq", "QSDPStrategy(weight_bits=4, grad_bits=4)", QSDP),
    Variant("qsdp_32", "lq", "QSDPStrategy(bits=32) (ablation: unquantized through our comms)", QSDP, False),
    Variant("qsdp_w8g8_inline", "lq", "QSDPStrategy(weight_bits=8, grad_bits=8, overlap_comm=False)", QSDP, False),
    Variant("qsdp_w4g4_inline", "lq", "QSDPStrategy(weight_bits=4, grad_bits=4, overlap_comm=False)", QSDP, False),
    *(
        Variant(
            f"qsdp_w{b}g{b}_rs_inline", "lq",
            f"QSDPStrategy(bits={b}) with its gradient reduce-scatters inline (ablation: all-gathers still overlapped)",
            QSDP, False,
        )
        for b in (8, 4)
    ),
    Variant("qddp_uniform8", "lq", "QuantDDPStrategy(codec='uniform', bits=8)", QDDP),
    Variant("qddp_fp8_e4m3", "lq", "QuantDDPStrategy(codec='fp8_e4m3', bits=8)", QDDP),
    Variant("qddp_nuqsgd4", "lq", "QuantDDPStrategy(codec='nuqsgd', bits=4)", QDDP),
    Variant("qddp_qsgd4", "lq", "QuantDDPStrategy(codec='qsgd', bits=4) (its default bucket: 128)", QDDP),
    Variant(
        "qddp_qsgd4_b512", "lq", "QuantDDPStrategy(codec='qsgd', bits=4, bucket_size=512) (ablation: the old default)",
        QDDP, False,
    ),
    Variant(
        "localsgd_qsr", "lq", "LocalSGDStrategy(sync='qsr', h_base=4, alpha=2*peak lr, warmup_steps=lr warm-up)", LSGD
    ),
    Variant("localsgd_h4", "lq", "LocalSGDStrategy(sync='constant', period=4)", LSGD),
    Variant(
        "localsgd_qsr_avgstate", "lq", "localsgd_qsr with average_optimizer_state=True (ablation: AdamW moments averaged too)",
        LSGD, False,
    ),
    Variant(
        "localsgd_qsr_overlap", "lq", "localsgd_qsr with overlap=True: each average applied a round later", LSGD, False
    ),
    Variant("localsgd_h4_overlap", "lq", "LocalSGDStrategy(sync='constant', period=4, overlap=True)", LSGD, False),
    Variant("localsgd_h1", "lq", "LocalSGDStrategy(sync='constant', period=1) (ablation: average every step)", LSGD, False),
    Variant("localsgd_h2", "lq", "LocalSGDStrategy(sync='constant', period=2) (ablation: the shortest period)", LSGD, False),
    Variant("localsgd_h8", "lq", "LocalSGDStrategy(sync='constant', period=8) (ablation: twice H=4's period)", LSGD, False),
    Variant(
        "localsgd_h12", "lq", "LocalSGDStrategy(sync='constant', period=12) (ablation: the overlapped H=4's mean drift)",
        LSGD, False,
    ),
    Variant(
        "localsgd_h2_overlap", "lq", "LocalSGDStrategy(sync='constant', period=2, overlap=True) (ablation)", LSGD, False
    ),
    Variant("onebit_adam", "lq", "DDP + OneBitAdamCallback(freeze_step=warm-up steps)", ONEBIT),
    Variant(
        "qddp_none", "lq", "QuantDDPStrategy(codec='none') (ablation: the hook's fp32 path against DDP's own)", QDDP,
        False,
    ),
    Variant("qddp_auto", "lq", "QuantDDPStrategy(codec='auto', min_bits=4): width chosen by timed trial steps (32, 8, 4 bits)", QDDP),
    Variant(
        "qsdp_auto", "lq",
        "QSDPStrategy(weight_bits='auto', grad_bits='auto', min_bits=4): width chosen by timed trial steps (32, 8, 4 bits)",
        QSDP,
    ),
    Variant(
        "qsdp_w8g8_nfprop", "lq", "QSDPStrategy(bits=8, nonfinite='propagate') (ablation: no per-step non-finite check)",
        QSDP, False,
    ),
    Variant(
        "qsdp_w4g4_nfprop", "lq", "QSDPStrategy(bits=4, nonfinite='propagate') (ablation: no per-step non-finite check)",
        QSDP, False,
    ),
    Variant(
        "onebit_adam_nfprop", "lq",
        "DDP + OneBitAdamCallback(freeze_step=warm-up steps, nonfinite='propagate') (ablation: no per-step non-finite check)",
        ONEBIT, False,
    ),
    Variant(
        "onebit_adam_inline", "lq", "DDP + OneBitAdamCallback(freeze_step=warm-up steps, overlap=False) (ablation)",
        ONEBIT, False,
    ),
    *(
        Variant(
            f"onebit_adam_b{mb}", "lq", f"DDP + OneBitAdamCallback(freeze_step=warm-up steps, bucket_mb={mb}) (ablation)",
            ONEBIT, False,
        )
        for mb in (1, 2, 4, 8)
    ),
    *(
        Variant(
            f"{name}_cap{mb}", "lq", f"QuantDDPStrategy(codec='{codec}', bits={bits}, bucket_cap_mb={mb}) (ablation: DDP bucket size)",
            QDDP, False,
        )
        for name, codec, bits in (("qddp_uniform8", "uniform", 8), ("qddp_nuqsgd4", "nuqsgd", 4))
        for mb in (1, 2, 4)
    ),
    *(
        Variant(
            f"{name}_p17", "lq", f"{name} with pipelined pieces of >= 2^17 elements per rank (ablation)", QDDP, False
        )
        for name in ("qddp_uniform8", "qddp_nuqsgd4", "qddp_uniform8_cap4", "qddp_nuqsgd4_cap4", "qddp_nuqsgd4_cap2")
    ),
    Variant(
        "qddp_nuqsgd4_nfprop", "lq",
        "QuantDDPStrategy(codec='nuqsgd', bits=4, nonfinite='propagate') (ablation: no per-step non-finite check)",
        QDDP, False,
    ),
    # --ranks-per-node 2 only: the hierarchical / HSDP counterparts of the flat rows above
    Variant(
        "fsdp2_hsdp", "torch", "FSDP2 HSDP fp32: fully_shard on a 2-D mesh (replicate across nodes x shard inside a node)",
        multi_rank_only=True,
    ),
    Variant("qsdp_w8g8_hsdp", "lq", "QSDPStrategy(weight_bits=8, grad_bits=8, hsdp=True)", QSDP, multi_rank_only=True),
    Variant(
        "qsdp_hsdp_auto", "lq", "QSDPStrategy(hsdp=True, grad_bits='auto', min_bits=4) (the trial's 12 steps: --warmup >= 12)",
        QSDP, False, multi_rank_only=True,
    ),
    Variant(
        "qsdp_w8g8_hsdp_inline", "lq",
        "QSDPStrategy(weight_bits=8, grad_bits=8, hsdp=True, overlap_comm=False) (ablation: averages across nodes inline)",
        QSDP, False, multi_rank_only=True,
    ),
    Variant(
        "qsdp_w8g8_hsdp_intra8", "lq", "QSDPStrategy(bits=8, hsdp=True, intra_node_bits=8) (ablation: quantized inside a node)",
        QSDP, False, multi_rank_only=True,
    ),
    Variant(
        "qddp_uniform8_hier", "lq", "QuantDDPStrategy(codec='uniform', bits=8, hierarchical=True)", QDDP,
        multi_rank_only=True,
    ),
    Variant(
        "qddp_nuqsgd4_hier", "lq", "QuantDDPStrategy(codec='nuqsgd', bits=4, hierarchical=True)", QDDP,
        multi_rank_only=True,
    ),
    Variant(
        "qddp_auto_hier", "lq",
        "QuantDDPStrategy(codec='auto', min_bits=4, hierarchical=True) (the trial's 12 steps: --warmup >= 12)", QDDP,
        False, multi_rank_only=True,
    ),
    Variant(
        "onebit_adam_hier", "lq", "DDP + OneBitAdamCallback(freeze_step=warm-up steps, hierarchical=True)", ONEBIT,
        multi_rank_only=True,
    ),
    Variant(
        "localsgd_qsr_inter", "lq", "LocalSGDStrategy(sync='qsr', scope='inter_node'): DDP inside a node, QSR across",
        LSGD, multi_rank_only=True,
    ),
    Variant(
        "diloco_qsr", "lq",
        "LocalSGDStrategy(sync='qsr', scope='inter_node', outer_optimizer='nesterov', outer_lr=0.7, outer_momentum=0.9)",
        LSGD, multi_rank_only=True,
    ),
)  # fmt: skip
VARIANT_BY_NAME = {v.name: v for v in VARIANTS}
BASELINE = "ddp_fp32"
# `--variants all` with --ranks-per-node 2 (the two-node benchmark): every flat row next to its hierarchical one
MULTI_RANK_ALL = (
    "floor", "ddp_fp32", "ddp_fp16", "powersgd_r4", "fsdp2", "fsdp2_hsdp", "qsdp_w8g8", "qsdp_w8g8_hsdp",
    "qddp_uniform8", "qddp_uniform8_hier", "qddp_nuqsgd4", "qddp_nuqsgd4_hier", "onebit_adam", "onebit_adam_hier",
    "localsgd_qsr", "localsgd_qsr_inter", "diloco_qsr", "post_local_sgd",
)  # fmt: skip
# torch's PowerSGD hook with more than one DDP bucket crashes on the 2x2 topology (a gloo collective-order
# mismatch), so multi-rank runs give it one bucket
ONE_BUCKET_MB = 10_000
QDDP_CODECS = {
    "qddp_none": ("none", 32),
    "qddp_uniform8": ("uniform", 8),
    "qddp_fp8_e4m3": ("fp8_e4m3", 8),
    "qddp_nuqsgd4": ("nuqsgd", 4),
    "qddp_qsgd4": ("qsgd", 4),
}


def label_for(name: str, ranks_per_node: int = 1) -> str:
    """The report's description of variant ``name`` under ``ranks_per_node`` (PowerSGD differs at 2)."""
    label = VARIANT_BY_NAME[name].label
    if ranks_per_node > 1 and name.startswith("powersgd_r"):
        label += (
            f"; ONE DDP bucket (bucket_cap_mb={ONE_BUCKET_MB}): torch's PowerSGD hook crashes on this topology "
            "with more than one bucket (gloo collective-order mismatch)"
        )
    return label


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
