"""`HybridModel`: a state-space hybrid (Mamba2ForCausalLM, Bamba, Nemotron-H, Granite-4.0-H) as
a stack of pre-norm residual blocks, each with one mixer: a Mamba-2 state layer, attention
(through the selected backend), a feed-forward network or a mixture of experts
(`hybrid_ffn.py`).

Parameter names: `embed_tokens`, `layers.{i}.norm`, `layers.{i}.mixer.*` (the mixer's own names
are transformers'), `norm`, `lm_head`; the checkpoint loader maps each family's names onto them
(`hybrid_hf.py`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import attrs
import torch
from torch import nn

from unified_attn.backend import AttentionBackend, LayerConfig
from unified_attn.backend.state_layers import STATE_OPTIONS
from unified_attn.models.attention_model import CausalLM
from unified_attn.models.config import LayerKind, ModelConfig
from unified_attn.models.hybrid_config import HybridConfig
from unified_attn.models.hybrid_ffn import FeedForward, GroupedSigmoidRouter, HybridMoE
from unified_attn.models.layers import Attention, RMSNorm
from unified_attn.models.mamba2_mixer import Mamba2Mixer
from unified_attn.models.rope import RotaryEmbedding, rotate_half
from unified_attn.selector import SelectorConfig, select_backend


def attention_config(config: HybridConfig) -> ModelConfig:
    """The attention blocks' shapes as the Llama line's `Attention` reads them."""
    return ModelConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_layers=1,
        num_heads=config.num_heads, num_kv_heads=config.num_kv_heads,
        head_size=config.head_size, rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta, attention_bias=config.attention_bias,
        max_position_embeddings=config.max_position_embeddings, name=config.name,
    )  # fmt: skip


class PartialRotary(nn.Module):
    """Neox RoPE on the first `rotary_dim` channels of each head (Bamba); `rotary_dim=None`:
    none at all (Nemotron-H's attention has no positional encoding)."""

    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        self.rotary_dim = config.rotary_dim
        self.inner: RotaryEmbedding | None = None
        if config.rotary_dim is not None:
            rotary = attrs.evolve(attention_config(config), head_size=config.rotary_dim)
            self.inner = RotaryEmbedding(rotary)

    def reset_buffers(self, device: torch.device | str) -> None:
        if self.inner is not None:
            self.inner.reset_buffers(device)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inner is None or self.rotary_dim is None:
            return q, k
        d = self.rotary_dim
        cos, sin = self.inner.cos_sin(positions, q.dtype)
        cos, sin = cos[:, None, :], sin[:, None, :]

        def rotate(x: torch.Tensor) -> torch.Tensor:
            head = x[..., :d]
            return torch.cat([head * cos + rotate_half(head) * sin, x[..., d:]], dim=-1)

        return rotate(q), rotate(k)


class HybridBlock(nn.Module):
    def __init__(self, config: HybridConfig, mixer: nn.Module) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mixer = mixer
        self.residual_in_fp32 = config.residual_in_fp32
        self.residual_multiplier = config.residual_multiplier

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        mixed = self.mixer(positions, self.norm(hidden.to(self.norm.weight.dtype)))
        if self.residual_multiplier != 1.0:  # Granite
            mixed = mixed * self.residual_multiplier
        return (hidden.float() if self.residual_in_fp32 else hidden) + mixed


class _Backbone(nn.Module):
    def __init__(self, config: HybridConfig, layers: list[nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class HybridModel(CausalLM[HybridConfig, str]):
    """Inference-only; weights start as zeros with norms the identity (`init_random_weights`
    or a checkpoint, `hybrid_hf.load_hybrid`). Backends: "mamba" (the state backend for the
    layer kind "mamba2") and "attention" (the selected class)."""

    model: _Backbone
    rotary: PartialRotary

    def _make_backends(
        self, backend_cls: type[AttentionBackend], options: dict[str, Any], device: torch.device
    ) -> dict[str, AttentionBackend]:
        config, m = self.config, self.config.mamba
        state_cls = select_backend(SelectorConfig(
            head_size=m.head_size, dtype=self.dtype, layer_kind="mamba2",
            device="cpu" if device.type == "meta" else device.type,
        ))  # fmt: skip
        attention_options = {k: v for k, v in options.items() if k not in STATE_OPTIONS}
        backends = {
            "mamba": state_cls(
                num_heads=m.num_heads, head_size=m.head_size, dtype=self.dtype,
                num_groups=m.num_groups, state_size=m.state_size, conv_kernel=m.conv_kernel,
                chunk_size=m.chunk_size, time_step_limit=m.time_step_limit,
                **{k: v for k, v in options.items() if k in STATE_OPTIONS},
            )
        }  # fmt: skip
        if "attention" in config.blocks:
            backends["attention"] = backend_cls(
                num_kv_heads=config.num_kv_heads, head_size=config.head_size, dtype=self.dtype,
                **attention_options,
            )  # fmt: skip
        return backends

    def _build(self) -> None:
        self.rotary = PartialRotary(self.config)
        self.model = _Backbone(self.config, [self._block(i, kind)
                                             for i, kind in enumerate(self.config.blocks)])
        self._build_lm_head()

    def _block(self, index: int, kind: str) -> HybridBlock:
        config = self.config
        mixer: nn.Module
        if kind == "mamba":
            m = config.mamba
            layer = LayerConfig(f"layers.{index}.mixer", m.num_heads, m.num_heads, m.head_size,
                                1.0)  # fmt: skip
            mixer = Mamba2Mixer(m, config.hidden_size, config.rms_norm_eps, layer,
                                self.backends["mamba"])  # fmt: skip
        elif kind == "attention":
            layer = LayerConfig(f"layers.{index}.mixer", config.num_heads, config.num_kv_heads,
                                config.head_size, config.attention_scale)  # fmt: skip
            mixer = Attention(attention_config(config), LayerKind.full(), layer,
                              self.backends["attention"], cast(RotaryEmbedding, self.rotary))
        elif kind == "moe":
            assert config.moe is not None  # HybridConfig checks it
            mixer = HybridMoE(config.hidden_size, config.moe, config.mlp_bias)
        else:
            mixer = FeedForward(config.hidden_size, config.intermediate_size,
                                config.mlp_activation, config.mlp_bias)  # fmt: skip
        return HybridBlock(config, mixer)

    def _reset_rotary(self, device: torch.device | str) -> None:
        self.rotary.reset_buffers(device)

    def _cast(self) -> None:
        super()._cast()
        for router in self._routers():  # transformers keeps the correction bias in float32
            router.e_score_correction_bias = router.e_score_correction_bias.float()

    def _routers(self) -> Iterator[GroupedSigmoidRouter]:
        return (m for m in self.modules() if isinstance(m, GroupedSigmoidRouter))

    def _fill_constant(self) -> None:
        for name, param in self.named_parameters():
            param.data.fill_(1.0 if _starts_at_one(name) else 0.0)
        for router in self._routers():
            router.e_score_correction_bias.zero_()

    @torch.no_grad()
    def init_random_weights(self, seed: int) -> None:
        """normal(0, 0.02) drawn on CPU; norms, D and dt_bias 1; A_log 0 (A = -1)."""
        self._init_random_parameters(
            seed, lambda n: 1.0 if _starts_at_one(n) else 0.0 if n.endswith("A_log") else None
        )

    def attention_layers(self) -> Iterator[tuple[LayerConfig, AttentionBackend]]:
        for block in self.model.layers:
            mixer = cast(HybridBlock, block).mixer
            if isinstance(mixer, Mamba2Mixer | Attention):
                yield mixer.layer_config, mixer.backend

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.model.embed_tokens(input_ids)
        if self.config.embedding_multiplier != 1.0:  # Granite
            hidden = hidden * self.config.embedding_multiplier
        for block in self.model.layers:
            hidden = block(positions, hidden)
        return self.model.norm(hidden.to(self.dtype))

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """As `CausalLM`'s, divided by `logits_scaling` (Granite)."""
        logits = super().compute_logits(hidden)
        scaling = self.config.logits_scaling
        return logits if scaling == 1.0 else logits / scaling


def _starts_at_one(name: str) -> bool:
    return name.endswith(("norm.weight", ".D", ".dt_bias"))
