"""DeepSeek-V2 and DeepSeek-V3: multi-head latent attention (MLA) and DeepSeekMoE, numerically as
transformers' `DeepseekV2ForCausalLM` / `DeepseekV3ForCausalLM` (eval mode).

Attention projects to a low-rank latent: `kv_a_proj_with_mqa` gives `[c_kv (kv_lora_rank),
k_pe (qk_rope_head_dim)]`, `kv_a_layernorm` normalises `c_kv`, RoPE rotates `k_pe` (shared by
every head) and the roped part of each head's query (`q_proj`, or `q_a_proj` -> `q_a_layernorm`
-> `q_b_proj` with a `q_lora_rank`). The backend (a `layer_kind="mla"` one,
`unified_attn.backends.mla` states the contract) caches the latent `[c_kv, k_pe]` and expands it
with `kv_b_proj`. The softmax scale is `qk_head_dim ** -0.5`, times `mscale(factor,
mscale_all_dim) ** 2` under YaRN. RoPE pairs: V3 with `rope_interleave` rotates pairs
`(x[2i], x[2i+1])` and writes the rotated halves one after the other, V3 without it rotates
halves (`rotate_half`), V2 rotates pairs in float32 in place (complex multiplication); the scores
are those of transformers in every case.

MLPs: the first `first_k_dense_replace` layers are dense SwiGLU MLPs, the others DeepSeekMoE
(`models/deepseek_moe.py`); the config is `DeepseekConfig` (`models/deepseek_config.py`).

Parameter names are transformers' own, so a `save_pretrained` checkpoint loads as a state dict
(`load_deepseek` in `models/deepseek_hf.py`); multi-token-prediction layers
(`model.layers.{num_hidden_layers}.*` of real V3 checkpoints) are dropped, as transformers does.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import torch
from torch import nn

from unified_attn.backend import AttentionBackend, LayerConfig
from unified_attn.models.attention_model import CausalLM, fill_ones_and_zeros
from unified_attn.models.deepseek_config import DeepseekConfig, RopeLayout
from unified_attn.models.deepseek_moe import DeepseekMoE, DeepseekRouter
from unified_attn.models.layers import RMSNorm
from unified_attn.models.mlp import MLP
from unified_attn.models.rope import rope_attention_scaling, rope_inv_freq, rotate_half

SUB_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm: transformers' default, not rms_norm_eps


# ---- layers -----------------------------------------------------------------------------------


class DeepseekRotary(nn.Module):
    """cos and sin `[T, qk_rope_head_dim / 2]` float32 of each position (scaled by YaRN's
    attention factor); not a parameter, recomputed on the model's device."""

    def __init__(self, config: DeepseekConfig) -> None:
        super().__init__()
        self.dim, self.theta = config.qk_rope_head_dim, config.rope_theta
        self.scaling = config.rope_scaling
        self.attention_scaling = rope_attention_scaling(config.rope_scaling)
        self.reset("cpu")

    def reset(self, device: torch.device | str) -> None:
        """Recompute the inverse frequencies `[R / 2]` float32 on `device`."""
        self.inv_freq = rope_inv_freq(self.dim, self.theta, self.scaling).to(device)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq  # [T, R / 2]
        return freqs.cos() * self.attention_scaling, freqs.sin() * self.attention_scaling


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: RopeLayout
) -> torch.Tensor:
    """Rotate x `[T, heads, R]` by cos/sin `[T, R / 2]` float32 (see the module docstring)."""
    cos, sin = cos[:, None], sin[:, None]
    if layout == "pairs":  # V2: pairs rotated in float32, kept in place
        xf = x.float()
        even, odd = xf[..., 0::2], xf[..., 1::2]
        rotated = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1)
        return rotated.flatten(-2).to(x.dtype)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    if layout == "halves":
        cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
        return x * cos + rotate_half(x) * sin
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1)


class MLAAttention(nn.Module):
    """Projections, norms and RoPE here; the latent cache and attention in the backend."""

    q_proj: nn.Linear | None
    q_a_proj: nn.Linear | None
    q_a_layernorm: RMSNorm | None
    q_b_proj: nn.Linear | None

    def __init__(self, config: DeepseekConfig, layer: LayerConfig, backend: AttentionBackend):
        super().__init__()
        self.layer_config, self.backend = layer, backend
        self.layout = config.rope_layout
        hidden, heads, rank = config.hidden_size, config.num_heads, config.kv_lora_rank
        self.kv_lora_rank = rank
        q_size, bias = heads * config.qk_head_dim, config.attention_bias
        self.split = (config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim)
        q_rank = config.q_lora_rank
        self.q_proj = nn.Linear(hidden, q_size, bias=False) if q_rank is None else None
        self.q_a_proj = None if q_rank is None else nn.Linear(hidden, q_rank, bias=bias)
        self.q_a_layernorm = None if q_rank is None else RMSNorm(q_rank, SUB_NORM_EPS)
        self.q_b_proj = None if q_rank is None else nn.Linear(q_rank, q_size, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, config.latent_size, bias=bias)
        self.kv_a_layernorm = RMSNorm(rank, SUB_NORM_EPS)
        self.kv_b_proj = nn.Linear(rank, heads * (self.split[0] + self.split[2]), bias=False)
        self.o_proj = nn.Linear(heads * config.v_head_dim, hidden, bias=bias)

    def _query(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.q_proj is not None:
            return cast(torch.Tensor, self.q_proj(hidden))
        assert self.q_a_proj is not None and self.q_a_layernorm is not None
        assert self.q_b_proj is not None
        return cast(torch.Tensor, self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden))))

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """hidden `[T, hidden_size]` -> `[T, hidden_size]`."""
        nope, rope, v_dim = self.split
        num_tokens, heads = hidden.shape[0], self.layer_config.num_heads
        q = self._query(hidden).view(num_tokens, heads, nope + rope)
        q = torch.cat([q[..., :nope], apply_rope(q[..., nope:], cos, sin, self.layout)], -1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(hidden).split([self.kv_lora_rank, rope], dim=-1)
        k_pe = apply_rope(k_pe[:, None], cos, sin, self.layout)[:, 0]
        latent = torch.cat([self.kv_a_layernorm(c_kv), k_pe], dim=-1)  # [T, L + R]
        output = hidden.new_empty(num_tokens, heads * v_dim)
        self.backend.forward(
            self.layer_config, output, q, latent, latent, kv_b_proj=self.kv_b_proj.weight
        )
        return cast(torch.Tensor, self.o_proj(output))


class DeepseekDecoderLayer(nn.Module):
    def __init__(
        self, config: DeepseekConfig, index: int, layer: LayerConfig, backend: AttentionBackend
    ) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = MLAAttention(config, layer, backend)
        dense = index < config.first_k_dense_replace
        self.mlp: nn.Module = (
            MLP(hidden, config.intermediate_size, bias=config.mlp_bias)
            if dense
            else DeepseekMoE(config)
        )
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin)
        return cast(torch.Tensor, hidden + self.mlp(self.post_attention_layernorm(hidden)))


class _Backbone(nn.Module):
    """The `model.` prefix of the parameter names."""

    def __init__(self, config: DeepseekConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DeepseekDecoderLayer(config, i, mla_layer_config(config, i), backend)
            for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


def mla_layer_config(config: DeepseekConfig, index: int) -> LayerConfig:
    return LayerConfig(
        name=f"model.layers.{index}.self_attn",
        num_heads=config.num_heads,
        num_kv_heads=1,
        head_size=config.latent_size,
        scale=config.softmax_scale,
    )


# ---- the model ----------------------------------------------------------------------------------


class DeepseekForCausalLM(CausalLM[DeepseekConfig, str]):
    """Inference-only DeepSeek-V2/V3. Weights start constant (norms 1, the rest 0): call
    `init_random_weights` or load a checkpoint (`load_deepseek`). Every layer attends through
    one MLA backend instance (`backends["mla"]`)."""

    model: _Backbone

    def _make_backends(
        self, backend_cls: type[AttentionBackend], options: dict[str, Any], device: torch.device
    ) -> dict[str, AttentionBackend]:
        backend = backend_cls(
            num_kv_heads=1,
            head_size=self.config.latent_size,
            dtype=self.dtype,
            kv_lora_rank=self.config.kv_lora_rank,
            **options,
        )
        return {"mla": backend}

    def _prepare(self) -> None:
        self.rotary = DeepseekRotary(self.config)

    def _build(self) -> None:
        self.model = _Backbone(self.config, self.backends["mla"])
        self._build_lm_head()

    def _cast(self) -> None:
        super()._cast()
        for router in self._routers():  # transformers keeps the correction bias in float32
            if router.e_score_correction_bias is not None:
                router.e_score_correction_bias = router.e_score_correction_bias.float()

    def _reset_rotary(self, device: torch.device | str) -> None:
        self.rotary.reset(device)

    def _routers(self) -> Iterator[DeepseekRouter]:
        return (m for m in self.modules() if isinstance(m, DeepseekRouter))

    def attention_layers(self) -> Iterator[tuple[LayerConfig, AttentionBackend]]:
        for layer in self.model.layers:
            attn = cast(DeepseekDecoderLayer, layer).self_attn
            yield attn.layer_config, attn.backend

    def _fill_constant(self) -> None:
        fill_ones_and_zeros(self, _is_norm)

    @torch.no_grad()
    def init_random_weights(self, seed: int) -> None:
        """Deterministic on any device: normal(0, 0.02) drawn on CPU in float32, norms 1,
        the routers' correction biases 0 (as transformers initialises them)."""
        self._init_random_parameters(seed, lambda name: 1.0 if _is_norm(name) else None)
        for buffer in self.buffers():
            buffer.zero_()

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions `[T]` int64 -> final-normed hidden `[T, hidden_size]`. The
        step's metadata must already be in the backend (`prep_forward`)."""
        hidden = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary(positions)
        for layer in self.model.layers:
            hidden = layer(hidden, cos, sin)
        return cast(torch.Tensor, self.model.norm(hidden))


def _is_norm(name: str) -> bool:
    return name.endswith("norm.weight")
