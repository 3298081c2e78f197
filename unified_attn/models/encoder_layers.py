"""What the encoder families (BERT, BART) share: activations by name, post-LN residual blocks
with LayerNorm, the backend call of an attention layer, and the model base (`EncoderModel`:
built on "meta", constant or random weights)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import attrs
import torch
from torch import nn

from unified_attn.backend import AttentionBackend, AttentionType, LayerConfig
from unified_attn.models.attention_model import AttentionModel, ConfigT

Activation = Callable[[torch.Tensor], torch.Tensor]

# transformers' ACT2FN names: "gelu" is the exact (erf) GELU, "gelu_new" and
# "gelu_pytorch_tanh" the tanh approximation.
ACTIVATIONS: dict[str, Activation] = {
    "gelu": nn.functional.gelu,
    "gelu_new": partial(nn.functional.gelu, approximate="tanh"),
    "gelu_pytorch_tanh": partial(nn.functional.gelu, approximate="tanh"),
    "relu": nn.functional.relu,
    "silu": nn.functional.silu,
}


def supported_activation(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    """attrs validator: `value` names one of `ACTIVATIONS`."""
    if value not in ACTIVATIONS:
        raise ValueError(
            f"{type(instance).__name__}.{attribute.name}={value!r} is not a supported "
            f"activation; supported: {', '.join(sorted(ACTIVATIONS))}"
        )


def post_ln(norm: nn.Module, residual: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
    """The post-LN residual block: `norm(residual + update)` (BERT, BART)."""
    return norm(residual + update)


def feed_forward(
    hidden: torch.Tensor, up: nn.Module, down: nn.Module, activation: Activation
) -> torch.Tensor:
    """`down(activation(up(hidden)))`, `[T, hidden_size]` -> `[T, hidden_size]`."""
    return down(activation(up(hidden)))


def attention_layer_config(
    name: str, num_heads: int, head_size: int, attn_type: AttentionType
) -> LayerConfig:
    """Multi-head attention (one KV head per query head), scaled by `head_size ** -0.5`."""
    return LayerConfig(
        name=name,
        num_heads=num_heads,
        num_kv_heads=num_heads,
        head_size=head_size,
        scale=head_size**-0.5,
        attn_type=attn_type,
    )


def attend(
    backend: AttentionBackend,
    layer: LayerConfig,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
) -> torch.Tensor:
    """The backend's attention of query `[T, H * D]` over key/value `[S, H * D]` (S = T for
    self-attention; for cross-attention the encoder rows written this step): `[T, H * D]`."""
    output = torch.empty(
        query.shape[0], layer.num_heads * layer.head_size, dtype=query.dtype, device=query.device
    )
    backend.forward(layer, output, query, key, value)
    return output


def make_backend(
    backend_cls: type[AttentionBackend],
    num_heads: int,
    head_size: int,
    dtype: torch.dtype,
    attn_type: AttentionType,
    options: dict[str, Any],
    **extra: Any,
) -> AttentionBackend:
    return backend_cls(
        num_kv_heads=num_heads,
        head_size=head_size,
        dtype=dtype,
        attn_type=attn_type,
        **extra,
        **options,
    )


def materialize(model: nn.Module, dtype: torch.dtype, device: torch.device | str) -> None:
    """Allocate a model built on "meta" on `device` in `dtype`, weights constant (LayerNorms
    the identity, the rest 0), frozen."""
    model.to(dtype=dtype)
    model.to_empty(device=device)
    with torch.no_grad():
        for tensor in (*model.parameters(), *model.buffers()):
            tensor.zero_()
        _layer_norms_identity(model)
    model.requires_grad_(False)


@torch.no_grad()
def init_random(model: nn.Module, seed: int) -> None:
    """Deterministic on any device: parameters normal(0, 0.02) drawn on CPU in float32 in
    `parameters()` order, LayerNorms the identity, buffers 0."""
    gen = torch.Generator().manual_seed(seed)
    norms = {id(p) for m in _layer_norms(model) for p in m.parameters()}
    for param in model.parameters():
        if id(param) not in norms:
            param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
    for buffer in model.buffers():
        buffer.zero_()
    _layer_norms_identity(model)


class EncoderModel(AttentionModel[ConfigT, str]):
    """A BERT or BART model: LayerNorms the identity, the rest 0 until weights are loaded or
    `init_random_weights` draws them."""

    def _materialize(self, device: torch.device | str, options: dict[str, Any]) -> None:
        materialize(self, self.dtype, device)

    def init_random_weights(self, seed: int) -> None:
        """normal(0, 0.02) drawn on CPU in float32, LayerNorms the identity, buffers (BART's
        logits bias) 0."""
        init_random(self, seed)


def _layer_norms(model: nn.Module) -> list[nn.LayerNorm]:
    return [m for m in model.modules() if isinstance(m, nn.LayerNorm)]


def _layer_norms_identity(model: nn.Module) -> None:
    for norm in _layer_norms(model):
        norm.weight.fill_(1.0)
        norm.bias.fill_(0.0)
