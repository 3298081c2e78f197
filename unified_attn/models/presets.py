"""Named model configurations small enough to run on CPU in tests."""

from __future__ import annotations

from typing import Any

import attrs

from unified_attn.models.config import LayerKind, ModelConfig, MoEConfig, RopeScaling
from unified_attn.models.deepseek_config import DeepseekConfig
from unified_attn.models.deepseek_v4 import DeepseekV4Config

# Byte tokenizer layout shared by the presets: ids 0..255 are bytes, then the specials.
BYTE_BOS_ID = 256
BYTE_EOS_ID = 257

_TINY_LLAMA = ModelConfig(
    name="tiny-llama",
    vocab_size=384,
    hidden_size=128,
    intermediate_size=352,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_size=32,
    rope_theta=10000.0,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
    bos_token_id=BYTE_BOS_ID,
    eos_token_id=BYTE_EOS_ID,
)


def _tiny_yarn(**fields: Any) -> RopeScaling:
    """YaRN at the presets' scale: 4x a 512-token original context (`fields`: the family's
    own YaRN settings)."""
    return RopeScaling(rope_type="yarn", factor=4.0, original_max_position_embeddings=512, **fields)


# What the presets of other config types take from tiny-llama: its vocabulary (the byte
# tokenizer's), width and context, and the byte tokenizer's special tokens.
_TINY_SCALE: dict[str, Any] = dict(
    vocab_size=_TINY_LLAMA.vocab_size,
    hidden_size=_TINY_LLAMA.hidden_size,
    max_position_embeddings=_TINY_LLAMA.max_position_embeddings,
    bos_token_id=BYTE_BOS_ID,
    eos_token_ids=(BYTE_EOS_ID,),
)


def _alternate(
    local: LayerKind, full: LayerKind, num_layers: int, period: int = 2
) -> tuple[LayerKind, ...]:
    """`period - 1` local layers, then one full layer, repeated: the families' layer patterns."""
    return tuple(full if (i + 1) % period == 0 else local for i in range(num_layers))


# Real families' layer patterns and features at tiny-llama's sizes (windows and chunks scaled
# down, so prompts of a few hundred tokens cross them).
_MISTRAL_LIKE = attrs.evolve(
    _TINY_LLAMA,
    name="mistral-like",
    tie_word_embeddings=False,
    layer_kinds=(LayerKind.sliding(64),) * 4,
)
_GEMMA2_LIKE = attrs.evolve(
    _TINY_LLAMA,
    name="gemma2-like",
    mlp_kind="geglu",
    norm_style="gemma",
    post_norms=True,
    embed_scale=128**0.5,
    query_pre_attn_scalar=32.0,
    attn_logit_softcap=50.0,
    final_logit_softcap=30.0,
    layer_kinds=_alternate(LayerKind.sliding(64), LayerKind.full(), 4),
)
_GPT_OSS_LIKE = attrs.evolve(
    _TINY_LLAMA,
    name="gpt-oss-like",
    intermediate_size=128,
    tie_word_embeddings=False,
    attention_bias=True,
    attention_output_bias=True,
    mlp_kind="moe",
    moe=MoEConfig(num_experts=4, top_k=2),
    norm_style="float32",
    rope_theta=150000.0,
    rope_scaling=_tiny_yarn(truncate=False),
    layer_kinds=_alternate(
        LayerKind.sliding(128, has_sinks=True), LayerKind.full(has_sinks=True), 4
    ),
)
_LLAMA4_LIKE = attrs.evolve(
    _TINY_LLAMA,
    name="llama4-like",
    layer_kinds=_alternate(LayerKind.chunked(64), LayerKind.full(), 4, period=4),
)

# State layers (gated linear attention, `StateManager` in align mode) between full layers.
_HYBRID_LINEAR = attrs.evolve(
    _TINY_LLAMA,
    name="hybrid-linear",
    layer_kinds=(LayerKind.linear_state(), LayerKind.full()) * 2,
)

# StreamingLLM: every layer sees the first 4 tokens plus a 64-token window, so a request holds
# a bounded number of blocks however long it runs (`StreamingSinkManager`).
_STREAMING_LLM = attrs.evolve(
    _TINY_LLAMA, name="streaming-llm", layer_kinds=(LayerKind.streaming(64, 4),) * 4
)

PRESETS: dict[str, ModelConfig] = {
    "tiny-llama": _TINY_LLAMA,
    # Three backend instances: full, sliding 32 (layers 1 and 3), chunked 64.
    "tiny-hybrid": attrs.evolve(
        _TINY_LLAMA,
        name="tiny-hybrid",
        layer_kinds=(
            LayerKind.full(),
            LayerKind.sliding(32),
            LayerKind.chunked(64),
            LayerKind.sliding(32),
        ),
    ),
    "mistral-like": _MISTRAL_LIKE,
    "gemma2-like": _GEMMA2_LIKE,
    "gpt-oss-like": _GPT_OSS_LIKE,
    "llama4-like": _LLAMA4_LIKE,
    "hybrid-linear": _HYBRID_LINEAR,
    "streaming-llm": _STREAMING_LLM,
}


# DeepSeek-V3's shape at tiny-llama's scale: MLA (q_lora_rank 64, a 32 + 16 latent per token,
# no-RoPE 32 and value 32 per head), YaRN with mscale, the first layer dense, then DeepSeekMoE
# (8 routed experts in 2 groups, 1 group and 2 experts per token, 1 shared expert). Not a
# `ModelConfig` (those are Llama-family decoders): `DeepseekForCausalLM` builds it.
MLA_PRESETS: dict[str, DeepseekConfig] = {
    "deepseek-v3-like": DeepseekConfig(
        **_TINY_SCALE,
        name="deepseek-v3-like",
        version="v3",
        intermediate_size=352,
        moe_intermediate_size=64,
        num_layers=4,
        num_heads=4,
        q_lora_rank=64,
        kv_lora_rank=32,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        rope_scaling=_tiny_yarn(mscale=1.0, mscale_all_dim=1.0),
    ),
}


# DeepSeek-V4's shape at tiny-llama's scale: every layer slides over 8 tokens; layers 1, 2 and 4
# add compressed sparse attention (one entry per 4 tokens, the indexer's top 4), layer 3 heavily
# compressed attention (one entry per 8 tokens), so a 64-token prompt crosses every cache.
# Layer 0 routes by token hash, the others by top-2 of 4 experts; 4 hyper-connection streams.
# The cache users' bytes per token balance into equal pages: five sliding-window groups of 16
# tokens per block and one compressed group of 64 (`unified-attn plan --model deepseek-v4-like`).
V4_PRESETS: dict[str, DeepseekV4Config] = {
    "deepseek-v4-like": DeepseekV4Config(
        **_TINY_SCALE,
        name="deepseek-v4-like",
        moe_intermediate_size=64,
        num_layers=5,
        num_heads=4,
        head_dim=32,
        qk_rope_head_dim=8,
        q_lora_rank=64,
        o_groups=2,
        o_lora_rank=32,
        sliding_window=8,
        layer_types=(
            "sliding_attention",
            "compressed_sparse_attention",
            "compressed_sparse_attention",
            "heavily_compressed_attention",
            "compressed_sparse_attention",
        ),
        mlp_layer_types=("hash_moe", "moe", "moe", "moe", "moe"),
        csa_compress_rate=4,
        hca_compress_rate=8,
        index_n_heads=4,
        index_head_dim=16,
        index_topk=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        compress_rope_scaling=_tiny_yarn(attention_factor=1.0),
    ),
}


def get_preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(
            f"unknown model preset {name!r}; valid presets: {', '.join(sorted(PRESETS))}"
        ) from None
