"""Building blocks of a Llama-family decoder layer, numerically matching Hugging Face's Llama."""

from __future__ import annotations

import math

import torch
from torch import nn

from unified_attn.backend import AttentionBackend, LayerConfig
from unified_attn.models.config import LayerKind, ModelConfig, RopeScaling


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32, scale in the input dtype (as transformers does).
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(head_size: int, theta: float, scaling: RopeScaling | None = None) -> torch.Tensor:
    """Inverse frequencies `[head_size // 2]` float32, computed exactly as transformers does."""
    exponents = torch.arange(0, head_size, 2, dtype=torch.int64).float() / head_size
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    return _llama3_scale(inv_freq, scaling)


def _llama3_scale(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    # Long wavelengths are divided by `factor`, short ones kept, the band between interpolated.
    old_len = s.original_max_position_embeddings
    low_freq_wavelen = old_len / s.low_freq_factor
    high_freq_wavelen = old_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate_half) RoPE over the whole head."""

    inv_freq: torch.Tensor

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.register_buffer("inv_freq", self._compute(), persistent=False)

    def _compute(self) -> torch.Tensor:
        cfg = self.config
        return rope_inv_freq(cfg.head_size, cfg.rope_theta, cfg.rope_scaling)

    def reset_buffers(self, device: torch.device | str) -> None:
        """Recompute `inv_freq` in float32 on `device` (after meta construction or a cast)."""
        self.inv_freq = self._compute().to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        freqs = positions[:, None].float() * self.inv_freq.float()  # [T, D / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q `[T, Hq, D]`, k `[T, Hkv, D]` -> rotated, same shapes and dtype."""
        cos, sin = self.cos_sin(positions, q.dtype)
        cos, sin = cos[:, None, :], sin[:, None, :]
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class MLP(nn.Module):
    """SwiGLU: `down(silu(gate(x)) * up(x))`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, inter, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


def make_layer_config(config: ModelConfig, index: int, kind: LayerKind) -> LayerConfig:
    return LayerConfig(
        name=f"model.layers.{index}.self_attn",
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        head_size=config.head_size,
        scale=config.head_size**-0.5,
        sliding_window=kind.window,
        chunk_size=kind.chunk,
    )


class Attention(nn.Module):
    """Projections and RoPE here; the attention itself (and the KV cache) in the backend."""

    def __init__(
        self,
        config: ModelConfig,
        layer_config: LayerConfig,
        backend: AttentionBackend,
        rotary_emb: RotaryEmbedding,
    ) -> None:
        super().__init__()
        self.layer_config = layer_config
        self.backend = backend
        self.rotary_emb = rotary_emb  # shared by all layers
        hidden, d = config.hidden_size, config.head_size
        q_size, kv_size = config.num_heads * d, config.num_kv_heads * d
        qkv_bias, o_bias = config.attention_bias, config.attention_output_bias
        self.q_proj = nn.Linear(hidden, q_size, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, kv_size, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(q_size, hidden, bias=o_bias)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """positions `[T]`, hidden `[T, hidden_size]` -> `[T, hidden_size]`."""
        lc = self.layer_config
        num_tokens = hidden.shape[0]
        q = self.q_proj(hidden).view(num_tokens, lc.num_heads, lc.head_size)
        k = self.k_proj(hidden).view(num_tokens, lc.num_kv_heads, lc.head_size)
        v = self.v_proj(hidden).view(num_tokens, lc.num_kv_heads, lc.head_size)
        q, k = self.rotary_emb(positions, q, k)
        output = torch.empty(
            num_tokens, lc.num_heads * lc.head_size, dtype=hidden.dtype, device=hidden.device
        )
        self.backend.forward(lc, output, q, k, v)
        return self.o_proj(output)


class DecoderLayer(nn.Module):
    """Pre-norm residual block: attention, then SwiGLU MLP."""

    def __init__(
        self,
        config: ModelConfig,
        layer_config: LayerConfig,
        backend: AttentionBackend,
        rotary_emb: RotaryEmbedding,
    ) -> None:
        super().__init__()
        eps, hidden = config.rms_norm_eps, config.hidden_size
        self.self_attn = Attention(config, layer_config, backend, rotary_emb)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.self_attn(positions, self.input_layernorm(hidden))
        return hidden + self.mlp(self.post_attention_layernorm(hidden))
