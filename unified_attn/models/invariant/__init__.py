"""Batch-invariant mode for the models: ops whose result for a row never depends on the rest
of the batch (`ops`, Triton kernels on CUDA), and the switch that swaps a `DecoderModel`'s
modules for them (`model`). See docs/batch-invariance.md."""

from unified_attn.models.invariant.invariant_ops import (
    elementwise,
    invariant_linear,
    invariant_matmul,
    l2_normalize,
    layer_norm,
    log_softmax,
    rms_norm,
    sigmoid,
    softmax,
)
from unified_attn.models.invariant.model import (
    batch_invariance_problems,
    make_batch_invariant,
    require_batch_invariant,
)

__all__ = [
    "batch_invariance_problems",
    "elementwise",
    "invariant_linear",
    "invariant_matmul",
    "l2_normalize",
    "layer_norm",
    "log_softmax",
    "make_batch_invariant",
    "require_batch_invariant",
    "rms_norm",
    "sigmoid",
    "softmax",
]
