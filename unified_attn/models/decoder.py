"""`DecoderModel`: a Llama-family decoder whose layers attend through shared backend instances.

Parameter names are Hugging Face's Llama names, so a checkpoint loads as a plain state dict.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import torch
from torch import nn

from unified_attn.backend import AttentionBackend, LayerConfig
from unified_attn.models.config import LayerKind, ModelConfig
from unified_attn.models.layers import DecoderLayer, RMSNorm, RotaryEmbedding, make_layer_config

BackendKey = tuple[int | None, int | None]  # (sliding_window, attention_chunk_size)


def _backend_key(kind: LayerKind) -> BackendKey:
    return kind.window, kind.chunk


class _Backbone(nn.Module):
    """The `model.` prefix of the parameter names."""

    def __init__(self, config: ModelConfig, backends: dict[BackendKey, AttentionBackend]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = RotaryEmbedding(config)
        self.layers = nn.ModuleList(
            DecoderLayer(
                config,
                make_layer_config(config, i, kind),
                backends[_backend_key(kind)],
                self.rotary_emb,
            )
            for i, kind in enumerate(config.layer_kinds)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DecoderModel(nn.Module):
    """Inference-only decoder. Weights start as zeros (norms as ones): call
    `init_random_weights` or load a state dict (see `load_hf_model`)."""

    def __init__(
        self,
        config: ModelConfig,
        backend_cls: type[AttentionBackend],
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        backend_options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.backends = self._make_backends(config, backend_cls, dtype, backend_options or {})
        with torch.device("meta"):  # no init cost, no global RNG use
            self.model = _Backbone(config, self.backends)
            self.lm_head = (
                None
                if config.tie_word_embeddings
                else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            )
        self.to(dtype=dtype).to_empty(device=device)
        self.model.rotary_emb.reset_buffers(device)
        self._fill_constant()
        self.requires_grad_(False)

    @staticmethod
    def _make_backends(
        config: ModelConfig,
        backend_cls: type[AttentionBackend],
        dtype: torch.dtype,
        options: dict[str, Any],
    ) -> dict[BackendKey, AttentionBackend]:
        """One instance per distinct (window, chunk), in first-seen layer order."""
        backends: dict[BackendKey, AttentionBackend] = {}
        for kind in config.layer_kinds:
            if _backend_key(kind) not in backends:
                backends[_backend_key(kind)] = backend_cls(
                    num_kv_heads=config.num_kv_heads,
                    head_size=config.head_size,
                    dtype=dtype,
                    sliding_window=kind.window,
                    attention_chunk_size=kind.chunk,
                    **options,
                )
        return backends

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def attention_layers(self) -> Iterator[tuple[LayerConfig, AttentionBackend]]:
        for layer in self.model.layers:
            attn = cast(DecoderLayer, layer).self_attn
            yield attn.layer_config, attn.backend

    def _fill_constant(self) -> None:
        for name, param in self.named_parameters():
            param.data.fill_(1.0 if _is_norm(name) else 0.0)

    @torch.no_grad()
    def init_random_weights(self, seed: int) -> None:
        """Deterministic on any device: normal(0, 0.02) drawn on CPU in float32, norms = 1."""
        gen = torch.Generator().manual_seed(seed)
        for name, param in self.named_parameters():
            if _is_norm(name):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.02)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions `[T]` int64 -> final-normed hidden `[T, hidden_size]`.

        The step's metadata must already be in the backends (`prep_forward`)."""
        hidden = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            hidden = layer(positions, hidden)
        return self.model.norm(hidden)

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden `[N, hidden_size]` -> logits `[N, vocab_size]` float32."""
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        return nn.functional.linear(hidden, head.weight).float()


def _is_norm(param_name: str) -> bool:
    return param_name.endswith("norm.weight")
