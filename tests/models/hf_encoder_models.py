"""Small random-weight transformers BERT and BART models saved in Hugging Face layout, for parity
tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

transformers = __import__("pytest").importorskip("transformers")

BERT_SMALL = dict(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=96,
    max_position_embeddings=64,
    type_vocab_size=2,
)
BART_SMALL = dict(
    vocab_size=128,
    d_model=64,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=2,
    encoder_ffn_dim=96,
    decoder_ffn_dim=80,
    max_position_embeddings=64,
)


def randomize(model: Any, seed: int) -> Any:
    """Every parameter random (LayerNorms about 1, the rest about 0), buffers that are weights
    too (BART's `final_logits_bias`); eval mode."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1 + 0.1 * noise if "norm" in name.lower() else 0.1 * noise)
        for name, buffer in model.named_buffers():
            if name == "final_logits_bias":
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=gen))
    return model.eval()


def make_hf_bert(seed: int = 0, cls: str = "BertModel", **overrides: Any) -> Any:
    """An eager float32 transformers BERT model of class `cls`, every parameter random."""
    config = transformers.BertConfig(**{**BERT_SMALL, **overrides})
    model = getattr(transformers, cls)._from_config(config, attn_implementation="eager")
    return randomize(model, seed)


def make_hf_bart(seed: int = 0, **overrides: Any) -> Any:
    """An eager float32 `BartForConditionalGeneration`, every parameter random."""
    config = transformers.BartConfig(**{**BART_SMALL, **overrides})
    model = transformers.BartForConditionalGeneration._from_config(
        config, attn_implementation="eager"
    )
    return randomize(model, seed)


def save_hf_model(model: Any, path: Path) -> Path:
    model.save_pretrained(path)
    return path


def packed(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and positions `[T]` of `prompts` packed back to back, positions from 0."""
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    return ids, positions


def prompts(lengths: list[int], vocab_size: int = 128, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in lengths]
