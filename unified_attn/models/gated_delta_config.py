"""The shapes of a gated delta-net layer (Qwen3-Next's linear attention), one per model."""

from __future__ import annotations

import attrs

from unified_attn.utils import positive_int


@attrs.frozen(kw_only=True)
class GatedDeltaConfig:
    """`num_k_heads` query/key heads of `k_head_size`, each shared by `num_v_heads /
    num_k_heads` value heads of `v_head_size`; a causal convolution of `conv_kernel` taps over
    `[q, k, v]`; prefill in chunks of `chunk_size` tokens (transformers' 64)."""

    num_k_heads: int = attrs.field(validator=positive_int)
    num_v_heads: int = attrs.field(validator=positive_int)
    k_head_size: int = attrs.field(validator=positive_int)
    v_head_size: int = attrs.field(validator=positive_int)
    conv_kernel: int = attrs.field(default=4, validator=positive_int)
    chunk_size: int = attrs.field(default=64, validator=positive_int)

    def __attrs_post_init__(self) -> None:
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(
                f"GatedDeltaConfig: num_v_heads={self.num_v_heads} is not a multiple of "
                f"num_k_heads={self.num_k_heads}"
            )
        if self.conv_kernel < 2:
            raise ValueError(
                f"GatedDeltaConfig: conv_kernel must be at least 2, got {self.conv_kernel}"
            )

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_head_size

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_size

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: q, k, then v."""
        return 2 * self.key_dim + self.value_dim
