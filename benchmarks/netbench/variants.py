"""netbench variants: what each benchmark row trains with (the one place to add a method).

Each ``Variant`` names a Lightning strategy (plus callbacks), built inside the worker by
``netbench.build.build_variant``. lightning_qcomm variants are looked up by import path so the harness runs
whichever have landed and lists the others as skipped.
"""

from __future__ import annotations

from dataclasses import dataclass


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
