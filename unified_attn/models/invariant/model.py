"""The switch of batch-invariant mode for a `DecoderModel`: every module that reduces across
features is swapped for its batch-invariant form, and anything the mode cannot vouch for is
reported, so the engine refuses it rather than running it silently.

The swap changes a module's class in place to a subclass that only overrides how it computes
(no new state): parameter names, shapes and loading stay those of the plain model.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from unified_attn.kernels.moe.grouped_experts import GroupedConfig, invariant_config
from unified_attn.models.config import AttnTemperature
from unified_attn.models.fused import set_fused_layers
from unified_attn.models.invariant.invariant_ops import (
    elementwise,
    invariant_linear,
    invariant_matmul,
    l2_normalize,
    rms_norm,
    sigmoid,
    softmax,
)
from unified_attn.models.layers import Attention, DecoderLayer, RMSNorm, temperature_scale
from unified_attn.models.linear_attention import LinearAttention
from unified_attn.models.mlp import MLP
from unified_attn.models.moe import (
    Experts,
    InputScaledMoEMLP,
    MoEMLP,
    RoutedExperts,
    SparseMoEMLP,
    StackedExperts,
    TopKRouter,
)
from unified_attn.models.rope import RotaryEmbedding


class InvariantLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return invariant_linear(x, self.weight, self.bias)


class InvariantRMSNorm(RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.style)


class InvariantTopKRouter(TopKRouter):
    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return invariant_linear(x, self.weight, self.bias)

    @staticmethod
    def _softmax(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return softmax(x, dtype=dtype)

    @staticmethod
    def _sigmoid(x: torch.Tensor) -> torch.Tensor:
        return sigmoid(x)

    @staticmethod
    def _sum(x: torch.Tensor) -> torch.Tensor:
        """Left to right over the k columns: element-wise adds in a fixed order."""
        total = x[:, :1]
        for j in range(1, x.shape[1]):
            total = total + x[:, j : j + 1]
        return total


class _InvariantTiles(StackedExperts):
    """On CUDA the grouped kernels with the mode's one tile configuration for every batch;
    elsewhere `reference`, whose products the expert classes below make invariant."""

    def _tile_config(self, x: torch.Tensor) -> GroupedConfig | None:
        return invariant_config(x.element_size())


class InvariantExperts(_InvariantTiles, Experts):
    @staticmethod
    def _project(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return invariant_matmul(x, w, bias)

    @staticmethod
    def _sigmoid(x: torch.Tensor) -> torch.Tensor:
        return sigmoid(x)


class InvariantRoutedExperts(_InvariantTiles, RoutedExperts):
    @staticmethod
    def _linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return invariant_linear(x, weight)

    @staticmethod
    def _silu(x: torch.Tensor) -> torch.Tensor:
        return elementwise(nn.functional.silu, x)


class InvariantMLP(MLP):
    def _activate(self, gate: torch.Tensor) -> torch.Tensor:
        return elementwise(self.act, gate)


class InvariantSparseMoEMLP(SparseMoEMLP):
    @staticmethod
    def _gate(logit: torch.Tensor) -> torch.Tensor:
        return sigmoid(logit)


class InvariantAttention(Attention):
    """Llama 4's weightless q/k norm and NoPE temperature, each row on its own."""

    @staticmethod
    def _l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, torch.ones(x.shape[-1], device=x.device), eps, "float32")

    @staticmethod
    def _temperature_scale(positions: torch.Tensor, tuning: AttnTemperature) -> torch.Tensor:
        return temperature_scale(positions, tuning, lambda x: elementwise(torch.log1p, x))


class InvariantLinearAttention(LinearAttention):
    @staticmethod
    def _normalize(x: torch.Tensor) -> torch.Tensor:
        return l2_normalize(x)


# plain class -> its batch-invariant form (exact types: a subclass may compute differently)
SWAPS: dict[type[nn.Module], type[nn.Module]] = {
    nn.Linear: InvariantLinear,
    RMSNorm: InvariantRMSNorm,
    TopKRouter: InvariantTopKRouter,
    Experts: InvariantExperts,
    RoutedExperts: InvariantRoutedExperts,
    LinearAttention: InvariantLinearAttention,
    SparseMoEMLP: InvariantSparseMoEMLP,
    MLP: InvariantMLP,
    Attention: InvariantAttention,
}

# Modules whose own forward only gathers, adds, multiplies element-wise or calls its children
# (and, for `Attention`, a backend checked on its own): invariant once their children are.
# The decoder's root and backbone join them in `_container_types` (decoder.py imports this).
CONTAINER_TYPES: tuple[type[nn.Module], ...] = (
    nn.ModuleList, nn.Embedding, RotaryEmbedding, DecoderLayer, MoEMLP, InputScaledMoEMLP,
)  # fmt: skip
INVARIANT_TYPES = frozenset(SWAPS.values())


def make_batch_invariant(model: nn.Module) -> nn.Module:
    """Swap, in place, every module of `model` that has a batch-invariant form (exact class
    match) and mark the model `batch_invariant` (its LM head then uses the invariant matmul).
    Idempotent. Returns `model`. Backends are not touched: build them with
    `batch_invariant=True` (`backend_options`), as `DecoderModel` does in this mode. Fused
    layers (`models/fused.py`) go back to their torch code, which the swaps make invariant."""
    set_fused_layers(model, False)
    for module in model.modules():
        swap = SWAPS.get(type(module))
        if swap is not None:
            module.__class__ = swap
    setattr(model, "batch_invariant", True)  # noqa: B010 (any module; DecoderModel reads it)
    return model


def batch_invariance_problems(model: Any) -> list[str]:
    """Why `model` may not be batch-invariant: [] when every module has an invariant form or
    is a plain container, every attention backend runs in invariant mode, and the logits are
    not gathered across ranks."""
    if not getattr(model, "batch_invariant", False):
        return [
            f"{type(model).__name__} has no batch-invariant mode (decoder models built by "
            "DecoderModel have: presets and Llama-family checkpoints)"
        ]
    problems = [
        f"{name or 'the model'} is a {type(module).__name__}, which has no batch-invariant form"
        for name, module in model.named_modules()
        if not _is_invariant_module(module)
    ]
    for layer, backend in model.attention_layers():
        if not (type(backend).supports_batch_invariance() and backend.batch_invariant):
            problems.append(
                f"layer {layer.name}: backend {type(backend).__name__} is not in batch-invariant "
                "mode (build it with batch_invariant=True, or pick one whose "
                "supports_batch_invariance() is true)"
            )
    if getattr(model, "gather_logits", None) is not None:
        problems.append("the logits are gathered across tensor-parallel ranks")
    return problems


def _container_types() -> tuple[type[nn.Module], ...]:
    from unified_attn.models.decoder import DecoderModel, _Backbone  # decoder imports us

    return (*CONTAINER_TYPES, DecoderModel, _Backbone)


def _is_invariant_module(module: nn.Module) -> bool:
    return type(module) in INVARIANT_TYPES or type(module) in _container_types()


def require_batch_invariant(model: Any) -> None:
    """Raise `ValueError` listing `batch_invariance_problems(model)`, if any."""
    problems = batch_invariance_problems(model)
    if problems:
        listed = "; ".join(problems[:8]) + (
            f"; and {len(problems) - 8} more" if len(problems) > 8 else ""
        )
        raise ValueError(
            f"batch-invariant mode cannot run this model: {listed}. Turn the mode off "
            "(batch_invariant=False, unset UNIFIED_ATTN_BATCH_INVARIANT) or serve a decoder "
            "model (see docs/batch-invariance.md)"
        )
