"""Encoder models read from checkpoints: BERT (encoder-only, no KV cache) and BART
(encoder-decoder: a decoder KV cache and a cross-attention cache of each request's encoder
output). No presets; `plan`, which compares a decoder's layer kinds, refuses them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from unified_attn.backend import AttentionType
from unified_attn.models.bart import BartConfig
from unified_attn.models.bert import BertConfig
from unified_attn.models.families.base import AttentionKind, ModelFamily, register_family
from unified_attn.models.hf_config import encoder_family
from unified_attn.models.hf_encoders import (
    bart_config_from_hf,
    bert_config_from_hf,
    load_bart,
    load_bert,
)

REFUSAL = (
    "plan compares a decoder's layer kinds with full attention; {name} is {what} checkpoint: "
    "`unified-attn run --model {model}` reports its KV cache"
)


class EncoderFamily(ModelFamily):
    """What BERT and BART share: read from checkpoints only (no presets), offered a
    checkpoint before the decoders, found by `hf_config.encoder_family` under their name."""

    hf_priority = 5

    def reads_hf(self, hf: Mapping[str, Any]) -> bool:
        return encoder_family(dict(hf)) == self.name


class BertFamily(EncoderFamily):
    name = "bert"
    config_type = BertConfig
    model_kind = "encoder_only"
    plan_refusal = REFUSAL.replace("{what}", "an encoder-only (BERT)")
    loader = staticmethod(load_bert)
    hf_config_reader = staticmethod(bert_config_from_hf)

    def attention_kinds(self, config: BertConfig) -> list[AttentionKind]:
        return [(config.head_size, None, None, False, AttentionType.ENCODER_ONLY, 0)]


class BartFamily(EncoderFamily):
    name = "bart"
    config_type = BartConfig
    model_kind = "encoder_decoder"
    plan_refusal = REFUSAL.replace("{what}", "an encoder-decoder (BART)")
    loader = staticmethod(load_bart)
    hf_config_reader = staticmethod(bart_config_from_hf)

    def attention_kinds(self, config: BartConfig) -> list[AttentionKind]:
        return [
            (config.encoder_head_size, None, None, False, AttentionType.ENCODER, 0),
            (config.head_size, None, None, False, AttentionType.DECODER, 0),
            (config.head_size, None, None, False, AttentionType.ENCODER_DECODER, 0),
        ]

    def source_fields(self, config: BartConfig) -> dict[str, Any]:
        return {
            "decoder_start_token_id": config.decoder_start_token_id,
            "max_encoder_len": config.max_position_embeddings,
        }


BERT = register_family(BertFamily())
BART = register_family(BartFamily())
