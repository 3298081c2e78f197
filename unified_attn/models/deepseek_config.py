"""`DeepseekConfig`: the shapes, RoPE and expert routing of a DeepSeek-V2/V3 model (field names
follow `config.json`), validated on construction; the model is in `models/deepseek.py`."""

from __future__ import annotations

import math
from typing import Literal

import attrs

from unified_attn.models.config import RopeScaling, as_token_ids, check_choices
from unified_attn.utils import optional_positive_int, positive, positive_int

Version = Literal["v2", "v3"]
Routing = Literal["sigmoid_group_limited", "greedy", "group_limited_greedy"]
RopeLayout = Literal["interleave", "halves", "pairs"]


@attrs.frozen(kw_only=True)
class DeepseekConfig:
    """Shapes and routing of a DeepSeek-V2/V3 model; field names follow `config.json`."""

    name: str = "deepseek"
    version: Version = "v3"
    vocab_size: int = attrs.field(validator=positive_int)
    hidden_size: int = attrs.field(validator=positive_int)
    intermediate_size: int = attrs.field(validator=positive_int)  # the dense layers'
    moe_intermediate_size: int = attrs.field(validator=positive_int)  # each expert's
    num_layers: int = attrs.field(validator=positive_int)
    num_heads: int = attrs.field(validator=positive_int)
    q_lora_rank: int | None = attrs.field(validator=optional_positive_int)
    kv_lora_rank: int = attrs.field(validator=positive_int)
    qk_nope_head_dim: int = attrs.field(validator=positive_int)
    qk_rope_head_dim: int = attrs.field(validator=positive_int)
    v_head_dim: int = attrs.field(validator=positive_int)
    n_routed_experts: int = attrs.field(validator=positive_int)
    n_shared_experts: int = attrs.field(validator=positive_int)
    num_experts_per_tok: int = attrs.field(validator=positive_int)
    routing: Routing = "sigmoid_group_limited"
    n_group: int | None = attrs.field(default=None, validator=optional_positive_int)
    topk_group: int | None = attrs.field(default=None, validator=optional_positive_int)
    norm_topk_prob: bool = True
    routed_scaling_factor: float = attrs.field(default=1.0, validator=positive)
    first_k_dense_replace: int = 0
    rms_norm_eps: float = attrs.field(default=1e-6, validator=positive)
    rope_theta: float = attrs.field(default=10000.0, validator=positive)
    rope_scaling: RopeScaling | None = None
    rope_layout: RopeLayout = "interleave"
    max_position_embeddings: int = attrs.field(default=4096, validator=positive_int)
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = attrs.field(default=(), converter=as_token_ids)

    def __attrs_post_init__(self) -> None:
        choices = {
            "version": ("v2", "v3"),
            "routing": ("sigmoid_group_limited", "greedy", "group_limited_greedy"),
            "rope_layout": ("interleave", "halves", "pairs"),
        }
        check_choices(f"DeepseekConfig {self.name}", self, choices)
        if self.qk_rope_head_dim % 2:
            raise ValueError(
                f"DeepseekConfig {self.name}: RoPE needs an even qk_rope_head_dim, got "
                f"{self.qk_rope_head_dim}"
            )
        if not 0 <= self.first_k_dense_replace <= self.num_layers:
            raise ValueError(
                f"DeepseekConfig {self.name}: first_k_dense_replace={self.first_k_dense_replace}"
                f" is outside [0, num_layers={self.num_layers}]"
            )
        self._check_routing()

    def _check_routing(self) -> None:
        experts, k = self.n_routed_experts, self.num_experts_per_tok
        if self.routing == "greedy":
            if k > experts:
                raise ValueError(
                    f"DeepseekConfig {self.name}: num_experts_per_tok={k} exceeds "
                    f"n_routed_experts={experts}"
                )
            return
        groups, chosen = self.n_group, self.topk_group
        per_group = experts // groups if groups else 0
        minimum = 2 if self.routing == "sigmoid_group_limited" else 1
        if not groups or not chosen or experts % groups or chosen > groups or per_group < minimum:
            raise ValueError(
                f"DeepseekConfig {self.name}: routing {self.routing!r} needs n_group dividing "
                f"n_routed_experts={experts} into groups of at least {minimum} experts and "
                f"1 <= topk_group <= n_group; got n_group={groups}, topk_group={chosen}"
            )
        if k > chosen * per_group:
            raise ValueError(
                f"DeepseekConfig {self.name}: num_experts_per_tok={k} exceeds the "
                f"{chosen * per_group} experts of the topk_group={chosen} groups"
            )

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_size(self) -> int:
        """Values cached per token and layer: `kv_lora_rank + qk_rope_head_dim`."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """`qk_head_dim ** -0.5`, times YaRN's `mscale(factor, mscale_all_dim) ** 2`."""
        scale = self.qk_head_dim**-0.5
        scaling = self.rope_scaling
        if scaling is not None and scaling.mscale_all_dim:
            mscale = 0.1 * scaling.mscale_all_dim * math.log(scaling.factor) + 1.0
            scale *= mscale * mscale if scaling.factor > 1 else 1.0
        return float(scale)
