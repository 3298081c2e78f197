"""Configuration of the state-space hybrids: a stack of pre-norm residual blocks, each with one
mixer (a Mamba-2 state layer, attention, a feed-forward network or a mixture of experts).
Mamba2ForCausalLM is all Mamba blocks; Nemotron-H declares its blocks one by one; Bamba's and
Granite-4.0-H's decoder layers are two blocks each (the mixer, then the MLP or MoE)."""

from __future__ import annotations

import math
from typing import Any, Literal

import attrs

from unified_attn.models.config import check_choices, require_multiple
from unified_attn.utils import optional_positive, optional_positive_int, positive, positive_int

BlockKind = Literal["mamba", "attention", "mlp", "moe"]
MLPActivation = Literal["silu_gated", "relu2"]
Routing = Literal["softmax_top_k", "sigmoid_grouped"]
BLOCK_KINDS = ("mamba", "attention", "mlp", "moe")


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
class HybridMoEConfig:
    """The "moe" blocks: `num_experts` routed experts of `intermediate_size` (`activation`:
    SwiGLU `gate_up_proj`/`down_proj` or squared-ReLU `up_proj`/`down_proj`), `top_k` per
    token, plus a shared expert of `shared_intermediate_size` on every token (None: none).

    `routing="softmax_top_k"` (Granite): a softmax over the top-k logits. `"sigmoid_grouped"`
    (Nemotron-H, DeepSeek-V3's): sigmoid scores plus a correction bias choose the experts
    within the `topk_group` best of `n_group` groups; the plain scores, renormalised with
    `norm_topk_prob`, times `routed_scaling_factor`, weight them."""

    num_experts: int = attrs.field(validator=positive_int)
    top_k: int = attrs.field(validator=positive_int)
    intermediate_size: int = attrs.field(validator=positive_int)
    shared_intermediate_size: int | None = attrs.field(
        default=None, validator=optional_positive_int
    )
    activation: MLPActivation = "silu_gated"
    routing: Routing = "softmax_top_k"
    n_group: int = attrs.field(default=1, validator=positive_int)
    topk_group: int = attrs.field(default=1, validator=positive_int)
    norm_topk_prob: bool = True
    routed_scaling_factor: float = attrs.field(default=1.0, validator=positive)

    def __attrs_post_init__(self) -> None:
        owner = "HybridMoEConfig"
        check_choices(owner, self, {"activation": ("silu_gated", "relu2"),
                                    "routing": ("softmax_top_k", "sigmoid_grouped")})  # fmt: skip
        if self.top_k > self.num_experts:
            raise ValueError(f"{owner}: top_k={self.top_k} exceeds num_experts={self.num_experts}")
        require_multiple(owner, self, "num_experts", "n_group")
        if self.topk_group > self.n_group:
            raise ValueError(
                f"{owner}: topk_group={self.topk_group} exceeds n_group={self.n_group}"
            )
        if self.routing == "sigmoid_grouped" and self.num_experts // self.n_group < 2:
            raise ValueError(
                f"{owner}: sigmoid_grouped routing scores each group by its two best experts; "
                f"num_experts / n_group must be at least 2, got {self.num_experts // self.n_group}"
            )


@attrs.frozen(kw_only=True)
class HybridConfig:
    """A state-space hybrid. `blocks`: one kind per block; `attention_*` and `rotary_dim` (None:
    no RoPE, Nemotron-H) shape the attention blocks, `mlp_*` the feed-forward ones, `moe` the
    mixtures of experts. `residual_in_fp32`: the residual stream is kept in float32
    (Mamba2ForCausalLM). Granite's multipliers: the embeddings are scaled by
    `embedding_multiplier`, each block's output by `residual_multiplier` before it is added,
    the attention scores by `attention_multiplier` (None: `head_size ** -0.5`), and the logits
    divided by `logits_scaling`."""

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
    moe: HybridMoEConfig | None = None
    residual_in_fp32: bool = False
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = attrs.field(default=None, validator=optional_positive)
    logits_scaling: float = attrs.field(default=1.0, validator=positive)
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
        if "moe" in self.blocks and self.moe is None:
            raise ValueError(f"{owner}: blocks has 'moe' blocks but moe (HybridMoEConfig) is None")
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
        if self.attention_multiplier is not None:
            return float(self.attention_multiplier)
        return float(self.head_size**-0.5)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)
