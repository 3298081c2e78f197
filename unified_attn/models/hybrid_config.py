"""Configuration of the state-space hybrids: a stack of pre-norm residual blocks, each with one
mixer (a Mamba-2 state layer, attention, or a feed-forward network). Mamba2ForCausalLM is all
Mamba blocks; Nemotron-H declares its blocks one by one; Bamba's decoder layers are two blocks
each (the mixer, then the MLP)."""

from __future__ import annotations

import math
from typing import Any, Literal

import attrs

from unified_attn.models.config import check_choices, require_multiple
from unified_attn.utils import optional_positive_int, positive, positive_int

BlockKind = Literal["mamba", "attention", "mlp"]
MLPActivation = Literal["silu_gated", "relu2"]
BLOCK_KINDS = ("mamba", "attention", "mlp")


def _as_limit(value: Any) -> tuple[float, float]:
    low, high = value
    return float(low), float(high)


def _as_blocks(value: Any) -> tuple[BlockKind, ...]:
    return tuple(value)


@attrs.frozen(kw_only=True)
class Mamba2Config:
    """The Mamba-2 mixer: `num_heads` heads of `head_size` channels, B and C in `num_groups`
    groups of `state_size`, a causal depthwise convolution of `conv_kernel` taps over
    `[x, B, C]`, the SSD scan in chunks of `chunk_size`, dt clamped to `time_step_limit`, the
    output gated (`y * silu(z)`) and normed per group (`norm_groups` groups)."""

    num_heads: int = attrs.field(validator=positive_int)
    head_size: int = attrs.field(validator=positive_int)
    num_groups: int = attrs.field(validator=positive_int)
    state_size: int = attrs.field(validator=positive_int)
    conv_kernel: int = attrs.field(default=4, validator=positive_int)
    chunk_size: int = attrs.field(default=256, validator=positive_int)
    conv_bias: bool = True
    proj_bias: bool = False
    norm_groups: int = attrs.field(validator=positive_int)
    time_step_limit: tuple[float, float] = attrs.field(
        default=(0.0, math.inf), converter=_as_limit
    )

    @norm_groups.default
    def _norm_groups(self) -> int:
        return self.num_groups

    def __attrs_post_init__(self) -> None:
        require_multiple("Mamba2Config", self, "num_heads", "num_groups")
        if self.conv_kernel < 2:
            raise ValueError(
                f"Mamba2Config: conv_kernel must be at least 2, got {self.conv_kernel}"
            )
        if self.inner_size % self.norm_groups:
            raise ValueError(
                f"Mamba2Config: norm_groups={self.norm_groups} does not divide the inner size "
                f"num_heads * head_size = {self.inner_size}"
            )

    @property
    def inner_size(self) -> int:
        return self.num_heads * self.head_size

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: x, then B, then C."""
        return self.inner_size + 2 * self.num_groups * self.state_size

    @property
    def in_proj_size(self) -> int:
        """Rows of `in_proj`: the gate z, the convolution's input, dt."""
        return self.inner_size + self.conv_dim + self.num_heads


@attrs.frozen(kw_only=True)
class HybridConfig:
    """A state-space hybrid. `blocks`: one kind per block; `attention_*` and `rotary_dim` (None:
    no RoPE, Nemotron-H) shape the attention blocks, `mlp_*` the feed-forward ones.
    `residual_in_fp32`: the residual stream is kept in float32 (Mamba2ForCausalLM)."""

    vocab_size: int = attrs.field(validator=positive_int)
    hidden_size: int = attrs.field(validator=positive_int)
    blocks: tuple[BlockKind, ...] = attrs.field(converter=_as_blocks)
    mamba: Mamba2Config
    rms_norm_eps: float = attrs.field(default=1e-5, validator=positive)
    num_heads: int = attrs.field(default=1, validator=positive_int)
    num_kv_heads: int = attrs.field(default=1, validator=positive_int)
    head_size: int = attrs.field(default=2, validator=positive_int)
    attention_bias: bool = False
    rope_theta: float = attrs.field(default=10000.0, validator=positive)
    rotary_dim: int | None = attrs.field(default=None, validator=optional_positive_int)
    intermediate_size: int = attrs.field(default=1, validator=positive_int)
    mlp_activation: MLPActivation = "silu_gated"
    mlp_bias: bool = False
    residual_in_fp32: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = attrs.field(default=4096, validator=positive_int)
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    name: str = "hybrid"

    def __attrs_post_init__(self) -> None:
        owner = f"model {self.name}"
        for kind in self.blocks:
            if kind not in BLOCK_KINDS:
                raise ValueError(f"{owner}: block kinds must be in {BLOCK_KINDS}, got {kind!r}")
        check_choices(owner, self, {"mlp_activation": ("silu_gated", "relu2")})
        require_multiple(owner, self, "num_heads", "num_kv_heads")
        rotary = self.rotary_dim
        if rotary is not None and (rotary % 2 or rotary > self.head_size):
            raise ValueError(
                f"{owner}: rotary_dim={self.rotary_dim} must be even and at most "
                f"head_size={self.head_size}"
            )

    @property
    def num_layers(self) -> int:
        return len(self.blocks)

    @property
    def attention_scale(self) -> float:
        return float(self.head_size**-0.5)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)
