"""`EncoderDecoderModel`: BART, whose encoder, decoder self-attention and cross-attention each
attend through their own backend instance.

Parameter names are transformers' `BartForConditionalGeneration`'s without the tied copies of
`model.shared` (the encoder's and decoder's `embed_tokens`, `lm_head`), so a checkpoint loads as
a plain state dict (`hf_encoders.load_bart`). Numerics follow transformers' `modeling_bart.py`
in eval mode: token embeddings scaled by `sqrt(d_model)` when `scale_embedding`, learned
positions offset by 2, `layernorm_embedding` after the embeddings, post-LN blocks, no final
norm; queries are not pre-scaled (the backend applies `head_size ** -0.5`).
"""

from __future__ import annotations

import math
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
    feed_forward,
    make_backend,
    post_ln,
    supported_activation,
)
from unified_attn.utils import positive, positive_int

POSITION_OFFSET = 2  # BART's learned positions: row `position + 2` (rows 0, 1 are unused)


def _eos_ids(config: BartConfig) -> tuple[int, ...]:
    return () if config.eos_token_id is None else (config.eos_token_id,)


@attrs.frozen(kw_only=True)
class BartConfig:
    """BART's shapes and special tokens; field names are `config.json`'s."""

    name: str = "bart"
    vocab_size: int = attrs.field(validator=positive_int)
    d_model: int = attrs.field(validator=positive_int)
    encoder_layers: int = attrs.field(validator=positive_int)
    decoder_layers: int = attrs.field(validator=positive_int)
    encoder_attention_heads: int = attrs.field(validator=positive_int)
    decoder_attention_heads: int = attrs.field(validator=positive_int)
    encoder_ffn_dim: int = attrs.field(validator=positive_int)
    decoder_ffn_dim: int = attrs.field(validator=positive_int)
    max_position_embeddings: int = attrs.field(default=1024, validator=positive_int)
    activation_function: str = attrs.field(default="gelu", validator=supported_activation)
    scale_embedding: bool = False
    layer_norm_eps: float = attrs.field(default=1e-5, validator=positive)
    pad_token_id: int | None = 1
    bos_token_id: int | None = 0
    eos_token_id: int | None = 2
    decoder_start_token_id: int = 2
    forced_bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = attrs.field(default=attrs.Factory(_eos_ids, takes_self=True))

    def __attrs_post_init__(self) -> None:
        for side in ("encoder", "decoder"):
            require_multiple(f"BartConfig {self.name}", self, "d_model", f"{side}_attention_heads")

    @property
    def hidden_size(self) -> int:
        return self.d_model

    @property
    def num_heads(self) -> int:
        """The decoder's (as `head_size` and `num_kv_heads`)."""
        return self.decoder_attention_heads

    @property
    def num_kv_heads(self) -> int:
        return self.decoder_attention_heads

    @property
    def head_size(self) -> int:
        return self.d_model // self.decoder_attention_heads

    @property
    def encoder_head_size(self) -> int:
        return self.d_model // self.encoder_attention_heads

    @property
    def embed_scale(self) -> float:
        return math.sqrt(self.d_model) if self.scale_embedding else 1.0


class _Attention(nn.Module):
    """BART's attention projections; the attention itself in the backend. Keys and values
    project `kv_source`: the same rows as the queries (self-attention) or the encoder output
    rows written this step (cross-attention)."""

    def __init__(self, d_model: int, layer: LayerConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.layer_config, self.backend = layer, backend
        self.k_proj = nn.Linear(d_model, d_model)
        self.v_proj = nn.Linear(d_model, d_model)
        self.q_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)

    def forward(self, hidden: torch.Tensor, kv_source: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q_proj(hidden), self.k_proj(kv_source), self.v_proj(kv_source)
        return cast(torch.Tensor, self.out_proj(attend(self.backend, self.layer_config, q, k, v)))


class _EncoderLayer(nn.Module):
    def __init__(self, config: BartConfig, layer: LayerConfig, backend: AttentionBackend) -> None:
        super().__init__()
        d, eps = config.d_model, config.layer_norm_eps
        self.self_attn = _Attention(d, layer, backend)
        self.self_attn_layer_norm = nn.LayerNorm(d, eps=eps)
        self.fc1 = nn.Linear(d, config.encoder_ffn_dim)
        self.fc2 = nn.Linear(config.encoder_ffn_dim, d)
        self.final_layer_norm = nn.LayerNorm(d, eps=eps)
        self.activation = ACTIVATIONS[config.activation_function]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = post_ln(self.self_attn_layer_norm, hidden, self.self_attn(hidden, hidden))
        mlp = feed_forward(hidden, self.fc1, self.fc2, self.activation)
        return post_ln(self.final_layer_norm, hidden, mlp)


class _DecoderLayer(nn.Module):
    def __init__(
        self,
        config: BartConfig,
        index: int,
        backends: dict[str, AttentionBackend],
    ) -> None:
        super().__init__()
        d, eps = config.d_model, config.layer_norm_eps
        self_layer, cross_layer = decoder_layer_configs(config, index)
        self.self_attn = _Attention(d, self_layer, backends["decoder"])
        self.self_attn_layer_norm = nn.LayerNorm(d, eps=eps)
        self.encoder_attn = _Attention(d, cross_layer, backends["cross"])
        self.encoder_attn_layer_norm = nn.LayerNorm(d, eps=eps)
        self.fc1 = nn.Linear(d, config.decoder_ffn_dim)
        self.fc2 = nn.Linear(config.decoder_ffn_dim, d)
        self.final_layer_norm = nn.LayerNorm(d, eps=eps)
        self.activation = ACTIVATIONS[config.activation_function]

    def forward(self, hidden: torch.Tensor, encoder_rows: torch.Tensor) -> torch.Tensor:
        hidden = post_ln(self.self_attn_layer_norm, hidden, self.self_attn(hidden, hidden))
        cross = self.encoder_attn(hidden, encoder_rows)
        hidden = post_ln(self.encoder_attn_layer_norm, hidden, cross)
        mlp = feed_forward(hidden, self.fc1, self.fc2, self.activation)
        return post_ln(self.final_layer_norm, hidden, mlp)


class _Stack(nn.Module):
    """The encoder or the decoder: learned positions, `layernorm_embedding`, the layers."""

    def __init__(self, config: BartConfig, layers: list[nn.Module]) -> None:
        super().__init__()
        d = config.d_model
        self.embed_positions = nn.Embedding(config.max_position_embeddings + POSITION_OFFSET, d)
        self.layers = nn.ModuleList(layers)
        self.layernorm_embedding = nn.LayerNorm(d, eps=config.layer_norm_eps)

    def embed(self, token_embeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """token_embeds `[T, d_model]` (scaled), positions `[T]` -> the first layer's input."""
        hidden = token_embeds + self.embed_positions(positions + POSITION_OFFSET)
        return cast(torch.Tensor, self.layernorm_embedding(hidden))


class _Backbone(nn.Module):
    """The `model.` prefix of the parameter names."""

    def __init__(self, config: BartConfig, backends: dict[str, AttentionBackend]) -> None:
        super().__init__()
        self.shared = nn.Embedding(config.vocab_size, config.d_model)
        encoder_layers: list[nn.Module] = [
            _EncoderLayer(config, encoder_layer_config(config, i), backends["encoder"])
            for i in range(config.encoder_layers)
        ]
        decoder_layers: list[nn.Module] = [
            _DecoderLayer(config, i, backends) for i in range(config.decoder_layers)
        ]
        self.encoder = _Stack(config, encoder_layers)
        self.decoder = _Stack(config, decoder_layers)


def encoder_layer_config(config: BartConfig, index: int) -> LayerConfig:
    return attention_layer_config(
        f"model.encoder.layers.{index}.self_attn",
        config.encoder_attention_heads,
        config.encoder_head_size,
        AttentionType.ENCODER,
    )


def decoder_layer_configs(config: BartConfig, index: int) -> tuple[LayerConfig, LayerConfig]:
    """Decoder layer `index`'s self-attention and cross-attention."""
    prefix, heads, size = f"model.decoder.layers.{index}", config.num_heads, config.head_size
    return (
        attention_layer_config(f"{prefix}.self_attn", heads, size, AttentionType.DECODER),
        attention_layer_config(
            f"{prefix}.encoder_attn", heads, size, AttentionType.ENCODER_DECODER
        ),
    )


class EncoderDecoderModel(EncoderModel[BartConfig]):
    """Inference-only BART. Weights start constant (LayerNorms the identity, the rest 0): call
    `init_random_weights` or load a state dict (see `hf_encoders.load_bart`).

    Backends: "encoder" (the encoder's self-attention), "decoder" (the decoder's causal
    self-attention over the paged KV cache) and "cross" (cross-attention over each request's
    encoder output, kept in the cross cache)."""

    final_logits_bias: torch.Tensor

    def _make_backends(
        self, backend_cls: type[AttentionBackend], options: dict[str, Any], device: torch.device
    ) -> dict[str, AttentionBackend]:
        config, dtype = self.config, self.dtype
        heads, size = config.num_heads, config.head_size
        encoder_heads, encoder_size = config.encoder_attention_heads, config.encoder_head_size
        return {
            "encoder": make_backend(
                backend_cls, encoder_heads, encoder_size, dtype, AttentionType.ENCODER, options
            ),
            "decoder": make_backend(
                backend_cls, heads, size, dtype, AttentionType.DECODER, options
            ),
            "cross": make_backend(
                backend_cls,
                heads,
                size,
                dtype,
                AttentionType.ENCODER_DECODER,
                options,
                max_encoder_len=config.max_position_embeddings,
            ),
        }

    def _build(self) -> None:
        self.model = _Backbone(self.config, self.backends)
        self.register_buffer("final_logits_bias", torch.zeros(1, self.config.vocab_size))

    @property
    def device(self) -> torch.device:
        return self.model.shared.weight.device

    def attention_layers(self) -> Iterator[tuple[LayerConfig, AttentionBackend]]:
        """Every encoder layer's, then each decoder layer's self- and cross-attention."""
        for layer in self.model.encoder.layers:
            yield _layer_of(cast(_EncoderLayer, layer).self_attn)
        for layer in self.model.decoder.layers:
            decoder_layer = cast(_DecoderLayer, layer)
            yield _layer_of(decoder_layer.self_attn)
            yield _layer_of(decoder_layer.encoder_attn)

    def _embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.shared(input_ids) * self.config.embed_scale

    @torch.no_grad()
    def encode(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions `[E]` int64 (positions from 0 per request) -> encoder output
        `[E, d_model]`. The "encoder" backend must hold this batch's metadata (`prep_forward`)."""
        encoder = self.model.encoder
        hidden = encoder.embed(self._embed_tokens(input_ids), positions)
        for layer in encoder.layers:
            hidden = layer(hidden)
        return hidden

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        encoder_hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Decoder tokens: input_ids, positions `[T]` int64 (positions from 0 per request) ->
        hidden `[T, d_model]`. `encoder_hidden [E, d_model]`: the encoder output of the requests
        whose cross keys and values this step writes (None: no request's)."""
        decoder = self.model.decoder
        hidden = decoder.embed(self._embed_tokens(input_ids), positions)
        rows = (
            hidden.new_empty(0, self.config.d_model) if encoder_hidden is None else encoder_hidden
        )
        for layer in decoder.layers:
            hidden = layer(hidden, rows)
        return hidden

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden `[N, d_model]` -> logits `[N, vocab_size]` float32 (the LM head is tied to
        `model.shared`, plus `final_logits_bias`)."""
        logits = nn.functional.linear(hidden, self.model.shared.weight)
        return (logits + self.final_logits_bias).float()


def _layer_of(attn: _Attention) -> tuple[LayerConfig, AttentionBackend]:
    return attn.layer_config, attn.backend
