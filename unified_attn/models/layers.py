"""Norm, attention and decoder layer, numerically matching transformers' Llama-family decoders
(Llama, Mistral, Qwen 2/3, Phi-3, Gemma 2/3, GPT-OSS, Mixtral, Qwen2-MoE, Llama 4)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from unified_attn.backend import AttentionBackend, LayerConfig
from unified_attn.kernels.layers import norm as norm_kernels
from unified_attn.models.config import AttnTemperature, LayerKind, ModelConfig, NormStyle
from unified_attn.models.fused import PackedLinear, project, skinny_row_limit
from unified_attn.models.gated_delta import GatedDeltaNet
from unified_attn.models.linear_attention import LinearAttention
from unified_attn.models.mlp import make_mlp
from unified_attn.models.rope import RotaryEmbedding

# Parameter-name suffixes kept in float32 whatever the model dtype (sinks: the backend contract).
FLOAT32_PARAMS = ("self_attn.sinks",)


def norm_identity(style: NormStyle) -> float:
    """The weight value that makes an RMSNorm of `style` a pure normalisation."""
    return 0.0 if style == "gemma" else 1.0


class RMSNorm(nn.Module):
    """Normalise in float32; `style` says how the weight scales, each as its transformers class:
    `llama`: `weight * x.to(dtype)`; `float32`: `(weight * x).to(dtype)` (GPT-OSS);
    `gemma`: `(x * (1 + weight)).to(dtype)` in float32, so a zero weight is the identity.
    Fused (`set_fused`): one kernel per call, the residual add included (`forward_residual`)."""

    def __init__(self, hidden_size: int, eps: float, style: NormStyle = "llama") -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((hidden_size,), norm_identity(style)))
        self.eps, self.style = eps, style
        self.fused = False

    def set_fused(self, enabled: bool) -> None:
        self.fused = enabled

    def forward_residual(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(norm(x + residual), x + residual)`, x and residual `[T, hidden_size]`."""
        if self.fused and x.dtype == residual.dtype:
            return norm_kernels.add_rms_norm(x, residual, self.weight, self.eps, self.style)
        residual = x + residual
        return self(residual), residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return norm_kernels.rms_norm(x, self.weight, self.eps, self.style)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.style == "gemma":
            return (xf * (1.0 + self.weight.float())).to(x.dtype)
        if self.style == "float32":
            return (self.weight * xf).to(x.dtype)
        return self.weight * xf.to(x.dtype)


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x divided by its RMS over the last dimension, in float32, without a weight (Llama 4's
    q/k norm)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def temperature_scale(
    positions: torch.Tensor,
    tuning: AttnTemperature,
    log1p: Callable[[torch.Tensor], torch.Tensor] = torch.log1p,
) -> torch.Tensor:
    """`[T]` float32: Llama 4's query scale at each position (its NoPE layers); `log1p`:
    batch-invariant mode passes its own."""
    steps = torch.floor((positions.float() + 1.0) / tuning.floor_scale)
    return log1p(steps) * tuning.attn_scale + 1.0


def make_layer_config(config: ModelConfig, index: int, kind: LayerKind) -> LayerConfig:
    name = f"model.layers.{index}.self_attn"
    delta = config.gated_delta
    if kind.kind == "gated_delta" and delta is not None:  # its value heads
        heads, size = delta.num_v_heads, delta.v_head_size
        return LayerConfig(name, heads, heads, size, delta.k_head_size**-0.5)
    linear = kind.kind == "linear_state"  # state layers: one "KV" head per query head, no window
    return LayerConfig(
        name=name,
        num_heads=config.num_heads,
        num_kv_heads=config.num_heads if linear else config.num_kv_heads,
        head_size=config.head_size,
        scale=config.attention_scale,
        sliding_window=kind.window,
        logits_soft_cap=config.attn_logit_softcap,
        chunk_size=kind.chunk,
    )


class Attention(nn.Module):
    """Projections, q/k norms and RoPE here; the attention itself (and the KV cache) in the
    backend. With `fused_qkv` one `qkv_proj` (rows: q, then k, then v) replaces q/k/v_proj.
    With `attn_output_gate` (Qwen3-Next) `q_proj` gives each head's query then its gate.
    `rotary_emb=None`: a NoPE layer (Llama 4), whose queries `attn_temperature` scales; the
    RoPE layers' q and k are L2-normed after RoPE with `qk_l2_norm`. Fused (`set_fused`):
    separate q/k/v_proj run as one GEMM (`PackedLinear`, their parameters keep their names);
    with `skinny` decode rows take the decode-row GEMM (`models/fused.project`)."""

    sinks: nn.Parameter | None
    kv_scales: torch.Tensor | None
    q_norm: RMSNorm | None
    k_norm: RMSNorm | None
    packed: PackedLinear | None

    def __init__(
        self,
        config: ModelConfig,
        kind: LayerKind,
        layer_config: LayerConfig,
        backend: AttentionBackend,
        rotary_emb: RotaryEmbedding | None,
    ) -> None:
        super().__init__()
        self.layer_config = layer_config
        self.backend = backend
        self.rotary_emb = rotary_emb  # shared by all layers of the same RoPE
        self.l2_eps = config.rms_norm_eps if config.qk_l2_norm else None
        self.temperature = config.attn_temperature if rotary_emb is None else None
        hidden, d = config.hidden_size, config.head_size
        q_size, kv_size = config.num_heads * d, config.num_kv_heads * d
        self.split_sizes = [q_size, kv_size, kv_size]
        qkv_bias, o_bias = config.attention_bias, config.attention_output_bias
        self.fused_qkv, self.output_gate = config.fused_qkv, config.attn_output_gate
        self.fused = False
        if self.fused_qkv:
            self.qkv_proj = nn.Linear(hidden, q_size + 2 * kv_size, bias=qkv_bias)
        else:
            gates = q_size if self.output_gate else 0
            self.q_proj = nn.Linear(hidden, q_size + gates, bias=qkv_bias)
            self.k_proj = nn.Linear(hidden, kv_size, bias=qkv_bias)
            self.v_proj = nn.Linear(hidden, kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(q_size, hidden, bias=o_bias)
        eps, style = config.rms_norm_eps, config.norm_style
        self.q_norm = RMSNorm(d, eps, style) if config.qk_norm else None
        self.k_norm = RMSNorm(d, eps, style) if config.qk_norm else None
        # [num_heads] learned sink logits (GPT-OSS), float32 (see FLOAT32_PARAMS)
        self.sinks = nn.Parameter(torch.zeros(config.num_heads)) if kind.has_sinks else None
        # [2] float32 (k_scale, v_scale) of an fp8 KV cache when the checkpoint gives them
        # (`hf.load_kv_scales`), passed to the backend as the `kv_scales` kwarg; not in the
        # state dict, so checkpoints without them load unchanged
        self.register_buffer("kv_scales", None, persistent=False)
        self.packed = None
        self.skinny = 0  # rows up to which projections take the decode-row GEMM

    def set_fused(self, enabled: bool) -> None:
        if enabled and not self.fused_qkv and self.packed is None:
            self.packed = PackedLinear([self.q_proj, self.k_proj, self.v_proj])
        self.fused = enabled
        self.skinny = skinny_row_limit() if enabled else 0

    def _project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden `[T, hidden_size]` -> q `[T, Hq * D]` (with its gates: `[T, Hq * 2D]`), k
        and v `[T, Hkv * D]`."""
        if self.fused_qkv:
            qkv = project(self.qkv_proj, hidden, self.skinny)
            q, k, v = qkv.split(self.split_sizes, dim=-1)
            return q, k, v
        if self.fused and self.packed is not None:
            q, k, v = project(self.packed, hidden, self.skinny).split(self.packed.sizes, dim=-1)
            return q, k, v
        return self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """positions `[T]`, hidden `[T, hidden_size]` -> `[T, hidden_size]`."""
        return self._attend(positions, hidden, *self._project(hidden))

    def _attend(
        self, positions: torch.Tensor, hidden: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
        v: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """The projected q, k, v of `hidden`'s rows through the backend and `o_proj`."""
        lc = self.layer_config
        num_tokens = hidden.shape[0]
        gate = None
        if self.output_gate:  # [T, Hq, 2D]: each head's query, then its gate
            q, gate = q.view(num_tokens, lc.num_heads, 2 * lc.head_size).chunk(2, dim=-1)
        q = q.reshape(num_tokens, lc.num_heads, lc.head_size)
        k = k.view(num_tokens, lc.num_kv_heads, lc.head_size)
        v = v.view(num_tokens, lc.num_kv_heads, lc.head_size)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self._position(positions, q, k)
        output = torch.empty(
            num_tokens, lc.num_heads * lc.head_size, dtype=hidden.dtype, device=hidden.device
        )
        extra: dict[str, torch.Tensor] = {} if self.sinks is None else {"sinks": self.sinks}
        if self.kv_scales is not None:
            extra["kv_scales"] = self.kv_scales
        self.backend.forward(lc, output, q, k, v, **extra)
        if gate is not None:
            output = output * torch.sigmoid(gate.reshape(num_tokens, -1))
        return project(self.o_proj, output, self.skinny)

    def _position(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE (then the L2 q/k norm), or on a NoPE layer the temperature-scaled query."""
        if self.rotary_emb is not None:
            q, k = self.rotary_emb(positions, q, k)
            if self.l2_eps is not None:
                q, k = self._l2_norm(q, self.l2_eps), self._l2_norm(k, self.l2_eps)
            return q, k
        if self.temperature is not None:
            scale = self._temperature_scale(positions, self.temperature)
            q = (q * scale[:, None, None]).to(q.dtype)
        return q, k

    # The ops batch-invariant mode replaces (`models/invariant/model.py`).
    @staticmethod
    def _l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
        return l2_norm(x, eps)

    @staticmethod
    def _temperature_scale(positions: torch.Tensor, tuning: AttnTemperature) -> torch.Tensor:
        return temperature_scale(positions, tuning)


class DecoderLayer(nn.Module):
    """Pre-norm residual block: attention, then the MLP of `mlp_kind`.

    With `post_norms` (Gemma 2) the attention and MLP outputs are normed as well, before their
    residual adds: `post_attention_layernorm` then norms the attention output and
    `pre_feedforward_layernorm` the MLP input (transformers' names)."""

    def __init__(
        self,
        config: ModelConfig,
        index: int,
        kind: LayerKind,
        layer_config: LayerConfig,
        backend: AttentionBackend,
        rotary_emb: RotaryEmbedding | None,
    ) -> None:
        super().__init__()
        eps, hidden, style = config.rms_norm_eps, config.hidden_size, config.norm_style
        self.post_norms = config.post_norms
        self.self_attn: nn.Module
        if kind.kind == "linear_state":
            self.self_attn = LinearAttention(config, layer_config, backend)
        elif kind.kind == "gated_delta" and config.gated_delta is not None:
            self.self_attn = GatedDeltaNet(config.gated_delta, hidden, eps, layer_config, backend)
        else:
            self.self_attn = Attention(config, kind, layer_config, backend, rotary_emb)
        self.mlp = make_mlp(config, index)
        self.input_layernorm = RMSNorm(hidden, eps, style)
        self.post_attention_layernorm = RMSNorm(hidden, eps, style)
        if self.post_norms:
            self.pre_feedforward_layernorm = RMSNorm(hidden, eps, style)
            self.post_feedforward_layernorm = RMSNorm(hidden, eps, style)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(out, residual)`: the layer's output before its last residual add, and the residual
        stream so far; the next norm adds them (`RMSNorm.forward_residual`, one kernel when
        fused). `residual=None` on the first layer: `hidden` is the stream itself."""
        if residual is None:
            residual, normed = hidden, self.input_layernorm(hidden)
        else:
            normed, residual = self.input_layernorm.forward_residual(hidden, residual)
        attn = self.self_attn(positions, normed)
        if not self.post_norms:
            normed, residual = self.post_attention_layernorm.forward_residual(attn, residual)
            return self.mlp(normed), residual
        attn = self.post_attention_layernorm(attn)
        normed, residual = self.pre_feedforward_layernorm.forward_residual(attn, residual)
        return self.post_feedforward_layernorm(self.mlp(normed)), residual
