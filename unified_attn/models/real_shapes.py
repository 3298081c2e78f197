"""The attention shapes of real models that `unified-attn plan` knows without weights: layer
counts, heads, head sizes, layer patterns and context lengths from their config.json (the
other dimensions do not affect the KV cache). Each family lists its own (`shapes`)."""

from __future__ import annotations

import attrs

from unified_attn.models.config import LayerKind, ModelConfig
from unified_attn.models.deepseek_config import DeepseekConfig
from unified_attn.models.deepseek_v4 import DeepseekV4Config
from unified_attn.models.deepseek_v32 import DeepseekV32Config
from unified_attn.models.gated_delta_config import GatedDeltaConfig


def _shape(
    name: str, layers: int, heads: int, kv_heads: int, head: int, kinds: list, context: int
) -> ModelConfig:
    return ModelConfig(
        name=name, vocab_size=1024, hidden_size=heads * head, intermediate_size=4 * heads * head,
        num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_size=head,
        max_position_embeddings=context, layer_kinds=kinds,
    )  # fmt: skip


def _alternate(first: LayerKind, second: LayerKind, layers: int) -> list[LayerKind]:
    return [first if i % 2 == 0 else second for i in range(layers)]


# Real models' attention shapes (layer counts, heads, head sizes, layer patterns) and context
# lengths (`max_position_embeddings` of their config.json); the other dimensions do not affect
# the KV cache.
REAL_SHAPES: dict[str, ModelConfig] = {
    "gpt-oss-20b": _shape("gpt-oss-20b", 24, 64, 8, 64,
                          _alternate(LayerKind.sliding(128), LayerKind.full(), 24), 131072),
    "gpt-oss-120b": _shape("gpt-oss-120b", 36, 64, 8, 64,
                           _alternate(LayerKind.sliding(128), LayerKind.full(), 36), 131072),
    "gemma2-9b": _shape("gemma2-9b", 42, 16, 8, 256,
                        _alternate(LayerKind.sliding(4096), LayerKind.full(), 42), 8192),
    "gemma2-27b": _shape("gemma2-27b", 46, 32, 16, 128,
                         _alternate(LayerKind.sliding(4096), LayerKind.full(), 46), 8192),
    "llama4-scout": _shape("llama4-scout", 48, 40, 8, 128,
                           [LayerKind.full() if i % 4 == 3 else LayerKind.chunked(8192)
                            for i in range(48)], 10485760),
    # Llama 4 Maverick (128 experts on every other layer): Scout's attention, a 1M context
    "llama4-maverick": _shape("llama4-maverick", 48, 40, 8, 128,
                              [LayerKind.full() if i % 4 == 3 else LayerKind.chunked(8192)
                               for i in range(48)], 1048576),
    "mistral-7b-v0.1": _shape("mistral-7b-v0.1", 32, 32, 8, 128, [LayerKind.sliding(4096)] * 32,
                              32768),
    # Qwen3-MoE (128 experts, 8 active): the experts do not touch the KV cache
    "qwen3-30b-a3b": _shape("qwen3-30b-a3b", 48, 32, 4, 128, [LayerKind.full()] * 48, 40960),
    # Qwen3-Next-80B-A3B: 3 gated delta-net layers (16 q/k heads, 32 value heads, x 128,
    # 4-tap convolution) per gated attention layer (16 / 2 KV x 256, RoPE on 64 channels);
    # its 512 experts do not touch the KV cache
    "qwen3-next-80b-a3b": ModelConfig(
        name="qwen3-next-80b-a3b", vocab_size=151936, hidden_size=2048,
        intermediate_size=5120, num_layers=48, num_heads=16, num_kv_heads=2, head_size=256,
        layer_kinds=[LayerKind.full() if i % 4 == 3 else LayerKind.gated_delta()
                     for i in range(48)],
        attn_output_gate=True, qk_norm=True, norm_style="gemma", partial_rotary_factor=0.25,
        gated_delta=GatedDeltaConfig(num_k_heads=16, num_v_heads=32, k_head_size=128,
                                     v_head_size=128, conv_kernel=4),
        max_position_embeddings=262144,
    ),
}  # fmt: skip


def _flash_layer_types(layers: int) -> list[str]:
    """DeepSeek-V4-Flash's schedule: two sliding-only layers, then CSA (ratio 4) on even and
    HCA (ratio 128) on odd layers (the model card's `compress_ratios`)."""
    tail = ["compressed_sparse_attention" if i % 2 == 0 else "heavily_compressed_attention"
            for i in range(2, layers)]  # fmt: skip
    return ["sliding_attention"] * 2 + tail


# DeepSeek-V4-Flash's attention and cache shapes (config.json of deepseek-ai/DeepSeek-V4-Flash;
# the MoE and vocabulary sizes do not affect the KV cache).
REAL_V4_SHAPES: dict[str, DeepseekV4Config] = {
    "deepseek-v4-flash": DeepseekV4Config(
        name="deepseek-v4-flash", vocab_size=129280, hidden_size=4096,
        moe_intermediate_size=2048, num_layers=43, num_heads=64, head_dim=512,
        qk_rope_head_dim=64, q_lora_rank=1024, o_groups=8, o_lora_rank=1024, sliding_window=128,
        layer_types=_flash_layer_types(43), mlp_layer_types=["hash_moe"] * 3 + ["moe"] * 40,
        csa_compress_rate=4, hca_compress_rate=128, index_n_heads=64, index_head_dim=128,
        index_topk=512, n_routed_experts=256, num_experts_per_tok=6,
        max_position_embeddings=1048576,
    ),
}  # fmt: skip
# DeepSeek-V2/V3's attention shapes (config.json of deepseek-ai/DeepSeek-V3 and
# deepseek-ai/DeepSeek-V2-Lite; the expert and vocabulary sizes do not affect the KV cache).
REAL_MLA_SHAPES: dict[str, DeepseekConfig] = {
    "deepseek-v3": DeepseekConfig(
        name="deepseek-v3", version="v3", vocab_size=129280, hidden_size=7168,
        intermediate_size=18432, moe_intermediate_size=2048, num_layers=61, num_heads=128,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8,
        n_group=8, topk_group=4, routed_scaling_factor=2.5, first_k_dense_replace=3,
        max_position_embeddings=163840,
    ),
    "deepseek-v2-lite": DeepseekConfig(
        name="deepseek-v2-lite", version="v2", vocab_size=102400, hidden_size=2048,
        intermediate_size=10944, moe_intermediate_size=1408, num_layers=27, num_heads=16,
        q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
        routing="greedy", norm_topk_prob=False, first_k_dense_replace=1,
        max_position_embeddings=163840,
    ),
}  # fmt: skip
# DeepSeek-V3.2's attention and cache shapes (config.json of deepseek-ai/DeepSeek-V3.2-Exp):
# DeepSeek-V3's latent plus the lightning indexer's key (128 values) per token and layer.
REAL_V32_SHAPES: dict[str, DeepseekV32Config] = {
    "deepseek-v3.2": DeepseekV32Config(
        **{**attrs.asdict(REAL_MLA_SHAPES["deepseek-v3"], recurse=False), "name": "deepseek-v3.2"},
        index_topk=2048, index_head_dim=128, index_n_heads=64,
    ),
}  # fmt: skip
