"""Small random-weight transformers models saved in Hugging Face layout, for parity tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

transformers = __import__("pytest").importorskip("transformers")

SMALL = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
)


def make_hf_model(model_type: str, seed: int = 0, **overrides: Any) -> Any:
    """An eager float32 transformers model with every parameter random (biases, norms too)."""
    config = transformers.AutoConfig.for_model(model_type, **{**SMALL, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", dtype=torch.float32
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1 + 0.1 * noise if "norm" in name else 0.1 * noise)
    return model.eval()


def save_hf_model(model: Any, path: Path, **save_kwargs: Any) -> Path:
    model.save_pretrained(path, **save_kwargs)
    return path


@torch.no_grad()
def hf_logits(model: Any, prompt: list[int]) -> torch.Tensor:
    """`[len, vocab]` float32, one unpadded sequence."""
    return model(torch.tensor([prompt])).logits[0].float()


@torch.no_grad()
def hf_greedy(model: Any, prompt: list[int], num_tokens: int) -> list[int]:
    """Argmax loop with full recompute each step (no transformers cache involved)."""
    seq = list(prompt)
    for _ in range(num_tokens):
        seq.append(int(hf_logits(model, seq)[-1].argmax()))
    return seq[len(prompt) :]
