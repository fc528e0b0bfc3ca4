"""The registry names of every strategy family: one table per family, used by the Trainer and the Fabric classes.

Registration runs one way, as in Lightning itself: each strategy class's ``register_strategies(registry)``
registers its family's table with itself as the class (``QSDPStrategy`` into Lightning's ``StrategyRegistry``,
``QSDPFabricStrategy`` into Fabric's), and ``import lightning_qcomm`` calls it for every class. A name
already in a registry (a second import, a user's own registration) is left alone, so this is idempotent. All
names are lowercase, as both registries look names up after ``str.lower()``.

Example::

    register_presets(StrategyRegistry, QSDPStrategy, QSDP_PRESETS)
    Trainer(strategy="qsdp_w4g4")                    # QSDPStrategy(bits=4)
    Fabric(strategy="qsdp_w4g4")                     # QSDPFabricStrategy(bits=4)
"""

from __future__ import annotations

from typing import Any

Presets = dict[str, tuple[str, dict[str, Any]]]  # name -> (description, constructor kwargs)

QSDP_PRESETS: Presets = {
    "qsdp": ("QSDP: FSDP2 with 8-bit quantized weights and gradients", {}),
    "qsdp_w8g8": ("QSDP: FSDP2 with 8-bit weight all-gather and 8-bit gradient reduce-scatter", {"bits": 8}),
    "qsdp_w4g4": ("QSDP: FSDP2 with 4-bit weight all-gather and 4-bit gradient reduce-scatter", {"bits": 4}),
    "qsdp_hsdp_g8": (
        "QSDP over HSDP: sharded inside a node, the gradient all-reduce across nodes in 8 bits",
        {"hsdp": True, "grad_bits": 8},
    ),
}

QUANT_DDP_PRESETS: Presets = {
    "quant_ddp": ("DDP with quantized gradient all-reduce (codec='qsgd', bits=8)", {}),
    "quant_ddp_nuqsgd4": (
        "DDP with quantized gradient all-reduce (codec='nuqsgd', bits=4)",
        {"codec": "nuqsgd", "bits": 4},
    ),
    "quant_ddp_qsgd4": ("DDP with quantized gradient all-reduce (codec='qsgd', bits=4)", {"codec": "qsgd", "bits": 4}),
    "quant_ddp_uniform8": (
        "DDP with quantized gradient all-reduce (codec='uniform', bits=8)",
        {"codec": "uniform", "bits": 8},
    ),
    "quant_ddp_fp8": (
        "DDP with quantized gradient all-reduce (codec='fp8_e4m3', bits=8)",
        {"codec": "fp8_e4m3", "bits": 8},
    ),
    "quant_ddp_hier_uniform8": (
        "Hierarchical DDP: fp32 inside a node, 8-bit uniform all-reduce across nodes",
        {"codec": "uniform", "bits": 8, "hierarchical": True},
    ),
    "quant_ddp_hier_nuqsgd4": (
        "Hierarchical DDP: fp32 inside a node, 4-bit NUQSGD all-reduce across nodes",
        {"codec": "nuqsgd", "bits": 4, "hierarchical": True},
    ),
}

LOCAL_SGD_PRESETS: Presets = {
    "local_sgd": ("Local SGD: average parameters every `period` optimizer steps", {"sync": "constant"}),
    "local_sgd_qsr": ("Local SGD with the Quadratic Synchronization Rule (Gu et al. 2024)", {"sync": "qsr"}),
}


def register_presets(registry: Any, strategy_cls: type, presets: Presets) -> None:
    """Register every name of ``presets`` with ``strategy_cls``, skipping names already present."""
    for name, (description, init_params) in presets.items():
        if name not in registry:
            registry.register(name, strategy_cls, description=description, **init_params)


def register_classes(registry: Any, classes: tuple[type, ...]) -> None:
    """Every class's ``register_strategies(registry)`` (Lightning's direction: the class registers itself)."""
    for cls in classes:
        cls.register_strategies(registry)


__all__ = ["LOCAL_SGD_PRESETS", "QSDP_PRESETS", "QUANT_DDP_PRESETS", "Presets", "register_classes", "register_presets"]
