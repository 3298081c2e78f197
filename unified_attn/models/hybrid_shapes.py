"""The state-space hybrids' preset (random weights, the byte tokenizer) and the real models'
shapes `plan` knows, from their config.json."""

from __future__ import annotations

from unified_attn.models.hybrid_config import BlockKind, HybridConfig, Mamba2Config
from unified_attn.models.presets import BYTE_BOS_ID, BYTE_EOS_ID


def nemotron_pattern(pattern: str) -> list[BlockKind]:
    """Nemotron-H's `hybrid_override_pattern`: M Mamba, * attention, - MLP."""
    kinds: dict[str, BlockKind] = {"M": "mamba", "*": "attention", "-": "mlp"}
    return [kinds[c] for c in pattern]


# Nemotron-H's layout at tiny-llama's scale: Mamba, MLP and attention blocks, a 16-token scan
# chunk so prompts cross chunks.
_TINY_MAMBA_HYBRID = HybridConfig(
    name="tiny-mamba-hybrid", vocab_size=384, hidden_size=128,
    blocks=nemotron_pattern("M-M*-M-"),
    mamba=Mamba2Config(num_heads=8, head_size=16, num_groups=2, state_size=16, chunk_size=16),
    num_heads=4, num_kv_heads=2, head_size=32, rotary_dim=32, intermediate_size=352,
    mlp_activation="relu2", max_position_embeddings=2048, tie_word_embeddings=True,
    bos_token_id=BYTE_BOS_ID, eos_token_id=BYTE_EOS_ID,
)  # fmt: skip

HYBRID_PRESETS: dict[str, HybridConfig] = {"tiny-mamba-hybrid": _TINY_MAMBA_HYBRID}

HYBRID_SHAPES: dict[str, HybridConfig] = {
    # nvidia/Nemotron-H-8B-Base-8K
    "nemotron-h-8b": HybridConfig(
        name="nemotron-h-8b", vocab_size=131072, hidden_size=4096,
        blocks=nemotron_pattern("M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"),
        mamba=Mamba2Config(num_heads=128, head_size=64, num_groups=8, state_size=128,
                           chunk_size=128),
        num_heads=32, num_kv_heads=8, head_size=128, intermediate_size=21504,
        mlp_activation="relu2", max_position_embeddings=8192,
    ),
    # state-spaces/mamba2-2.7b (no positional limit: `plan` defaults to its 2,048-token
    # training context, `--max-model-len` plans others)
    "mamba2-2.7b": HybridConfig(
        name="mamba2-2.7b", vocab_size=50288, hidden_size=2560, blocks=["mamba"] * 64,
        mamba=Mamba2Config(num_heads=80, head_size=64, num_groups=1, state_size=128),
        residual_in_fp32=True, max_position_embeddings=2048,
    ),
}  # fmt: skip
