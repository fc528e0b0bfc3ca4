"""Memory adapters (layer 3; docs/design.md, "Layers and files"): quantized storage of saved activations (AGoQ LAAQ).

``config`` holds the validated settings, ``saved_tensors`` the quantized container and the rules for what
may be quantized, ``recompute`` the norm / activation ops that keep only their quantized input,
``bit_allocation`` the width policies, ``site_plan`` the per-site plan (calibration across ranks, checkpoint
state), ``intercept`` which torch functions are intercepted, ``quantizer`` the runtime that ties them to a
forward pass, and ``grad_storage`` FP8 gradients between accumulation micro-batches. The quantization math
is the codecs' (uniform; fp8 for gradients).
"""

from lightning_qcomm.memory.bit_allocation import POLICIES, budget_plan, layer_aware_plan, uniform_plan
from lightning_qcomm.memory.config import ActivationQuantConfig, parse_patterns
from lightning_qcomm.memory.grad_storage import FP8GradientStore
from lightning_qcomm.memory.quantizer import ActivationQuantizer
from lightning_qcomm.memory.recompute import recompute_from_stored
from lightning_qcomm.memory.saved_tensors import (
    QuantizedActivation,
    SavedBytes,
    SaveRecord,
    count_saved_tensors,
    is_parameter_like,
    quantize_activation,
)

__all__ = [
    "POLICIES",
    "ActivationQuantConfig",
    "ActivationQuantizer",
    "FP8GradientStore",
    "QuantizedActivation",
    "SaveRecord",
    "SavedBytes",
    "budget_plan",
    "count_saved_tensors",
    "is_parameter_like",
    "layer_aware_plan",
    "parse_patterns",
    "quantize_activation",
    "recompute_from_stored",
    "uniform_plan",
]
