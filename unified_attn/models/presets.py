"""Named model configurations small enough to run on CPU in tests."""

from __future__ import annotations

import attrs

from unified_attn.models.config import LayerKind, ModelConfig

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
}


def get_preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(
            f"unknown model preset {name!r}; valid presets: {', '.join(sorted(PRESETS))}"
        ) from None
