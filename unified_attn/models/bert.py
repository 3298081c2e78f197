"""`BertEncoderModel`: BERT's encoder (no pooler, no task head), attending through one
encoder-only backend instance. It returns the last hidden state of every token.

Parameter names are transformers' `BertModel`'s without the pooler, so a checkpoint loads as a
plain state dict (`hf_encoders.load_bert`). Numerics follow transformers' `modeling_bert.py`
in eval mode: absolute position embeddings, token type 0 for every token, post-LN blocks.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import attrs
import torch
from torch import nn

from unified_attn.backend import AttentionBackend, AttentionType, LayerConfig
from unified_attn.models.config import require_multiple
from unified_attn.models.encoder_layers import (
    ACTIVATIONS,
    EncoderModel,
    attend,
    attention_layer_config,
    make_backend,
    post_ln,
    supported_activation,
)
from unified_attn.utils import positive, positive_int


@attrs.frozen(kw_only=True)
class BertConfig:
    """BERT's shapes; field names are `config.json`'s except `num_layers` and `num_heads`
    (`num_hidden_layers`, `num_attention_heads` there)."""

    name: str = "bert"
    vocab_size: int = attrs.field(validator=positive_int)
    hidden_size: int = attrs.field(validator=positive_int)
    num_layers: int = attrs.field(validator=positive_int)
    num_heads: int = attrs.field(validator=positive_int)
    intermediate_size: int = attrs.field(validator=positive_int)
    max_position_embeddings: int = attrs.field(default=512, validator=positive_int)
    type_vocab_size: int = attrs.field(default=2, validator=positive_int)
    layer_norm_eps: float = attrs.field(default=1e-12, validator=positive)
    hidden_act: str = attrs.field(default="gelu", validator=supported_activation)
    pad_token_id: int | None = 0
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __attrs_post_init__(self) -> None:
        require_multiple(f"BertConfig {self.name}", self, "hidden_size", "num_heads")

    @property
    def head_size(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def num_kv_heads(self) -> int:
        return self.num_heads


class _Embeddings(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, hidden)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, hidden)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # the same additions in the same order as transformers; token type 0 everywhere
        hidden = self.word_embeddings(input_ids) + self.token_type_embeddings.weight[0]
        return self.LayerNorm(hidden + self.position_embeddings(positions))


class _SelfAttention(nn.Module):
    """q/k/v projections (`attention.self`); the attention itself in the backend."""

    def __init__(self, config: BertConfig, layer: LayerConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.layer_config, self.backend = layer, backend
        hidden = config.hidden_size
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.query(hidden), self.key(hidden), self.value(hidden)
        return attend(self.backend, self.layer_config, q, k, v)


class _Output(nn.Module):
    """`dense` then the post-LN residual block (`attention.output` and `output`)."""

    def __init__(self, config: BertConfig, in_features: int) -> None:
        super().__init__()
        self.dense = nn.Linear(in_features, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return post_ln(self.LayerNorm, residual, self.dense(hidden))


class _Attention(nn.Module):
    def __init__(self, config: BertConfig, layer: LayerConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.self = _SelfAttention(config, layer, backend)
        self.output = _Output(config, config.hidden_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, self.output(self.self(hidden), hidden))


class _Intermediate(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)


class _Layer(nn.Module):
    def __init__(self, config: BertConfig, layer: LayerConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.attention = _Attention(config, layer, backend)
        self.intermediate = _Intermediate(config)
        self.output = _Output(config, config.intermediate_size)
        self.activation = ACTIVATIONS[config.hidden_act]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = self.attention(hidden)
        up = self.activation(self.intermediate.dense(hidden))
        return cast(torch.Tensor, self.output(up, hidden))


class _Encoder(nn.Module):
    def __init__(self, config: BertConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.layer = nn.ModuleList(
            _Layer(config, bert_layer_config(config, i), backend) for i in range(config.num_layers)
        )


def bert_layer_config(config: BertConfig, index: int) -> LayerConfig:
    return attention_layer_config(
        f"encoder.layer.{index}.attention.self",
        config.num_heads,
        config.head_size,
        AttentionType.ENCODER_ONLY,
    )


class BertEncoderModel(EncoderModel[BertConfig]):
    """Inference-only BERT encoder. Weights start constant (LayerNorms the identity, the rest
    0): call `init_random_weights` or load a state dict (see `hf_encoders.load_bert`)."""

    def _make_backends(
        self, backend_cls: type[AttentionBackend], options: dict[str, Any], device: torch.device
    ) -> dict[str, AttentionBackend]:
        config = self.config
        return {
            "encoder_only": make_backend(
                backend_cls,
                config.num_heads,
                config.head_size,
                self.dtype,
                AttentionType.ENCODER_ONLY,
                options,
            )
        }

    def _build(self) -> None:
        self.embeddings = _Embeddings(self.config)
        self.encoder = _Encoder(self.config, self.backends["encoder_only"])

    @property
    def device(self) -> torch.device:
        return self.embeddings.word_embeddings.weight.device

    def attention_layers(self) -> Iterator[tuple[LayerConfig, AttentionBackend]]:
        for layer in self.encoder.layer:
            attn = cast(_Layer, layer).attention.self
            yield attn.layer_config, attn.backend

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions `[T]` int64 -> last hidden state `[T, hidden_size]`.

        The step's metadata must already be in the backend (`prep_forward`)."""
        hidden = self.embeddings(input_ids, positions)
        for layer in self.encoder.layer:
            hidden = layer(hidden)
        return cast(torch.Tensor, hidden)
