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


# ---- the families: name -> (transformers model_type, config overrides, parameter scales) -------

YARN = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 4.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 64,
}
# Gemma 3: local layers on their own base, global layers on another base with linear scaling.
GEMMA3_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0},
}
FAMILIES: dict[str, tuple[str, dict[str, Any], dict[str, float]]] = {
    "gemma2": (
        "gemma2",
        dict(
            num_hidden_layers=3,
            head_dim=16,
            sliding_window=8,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
        ),
        {},
    ),
    # Larger than the 0.1 noise where it makes a feature bite: sinks that take real mass,
    # expert projections whose gate/up values reach the SwiGLU clamp (7.0).
    "gpt-oss": (
        "gpt_oss",
        dict(
            num_hidden_layers=3,
            head_dim=16,
            sliding_window=8,
            num_local_experts=4,
            num_experts_per_tok=2,
            rope_parameters=YARN,
        ),
        {"self_attn.sinks": 10.0, "mlp.experts.gate_up_proj": 6.0},
    ),
    # q/k norms; layer 1 slides (max_window_layers=1), as Qwen3Config derives it
    "qwen3": (
        "qwen3",
        dict(
            num_hidden_layers=2,
            head_dim=16,
            use_sliding_window=True,
            sliding_window=8,
            max_window_layers=1,
        ),
        {},
    ),
    # fused qkv_proj and gate_up_proj, without and with a window on every layer
    "phi3": ("phi3", dict(num_hidden_layers=2, pad_token_id=0), {}),
    "phi3-sliding": ("phi3", dict(num_hidden_layers=2, pad_token_id=0, sliding_window=8), {}),
    # local (window 8, base 1e4) then global (base 1e6, linear x4) layer, q/k norms, Gemma norms
    "gemma3": (
        "gemma3_text",
        dict(
            num_hidden_layers=2,
            head_dim=16,
            sliding_window=8,
            query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters=GEMMA3_ROPE,
        ),
        {},
    ),
    # 4 experts, top 2; routers scaled so routing weights are far from uniform
    "mixtral": (
        "mixtral",
        dict(num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2),
        {"mlp.gate.weight": 10.0},
    ),
    # layer 0 sparse (4 experts, top 2, sigmoid-gated shared expert), layer 1 dense
    "qwen2-moe": (
        "qwen2_moe",
        dict(
            num_hidden_layers=2,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            mlp_only_layers=[1],
        ),
        {"mlp.gate.weight": 10.0, "mlp.shared_expert_gate.weight": 10.0},
    ),
    # q/k norms; layer 0 sparse (4 experts, top 2, renormalised, no shared expert), layer 1
    # dense; a window of 8 on both layers (use_sliding_window)
    "qwen3-moe": (
        "qwen3_moe",
        dict(
            num_hidden_layers=2,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=[1],
            use_sliding_window=True,
            sliding_window=8,
        ),
        {"mlp.gate.weight": 10.0},
    ),
}


def make_family_model(name: str, seed: int = 0, **overrides: Any) -> Any:
    """The tiny random model of family `name` (FAMILIES), with config `overrides` on top."""
    model_type, family_overrides, scales = FAMILIES[name]
    hf = make_hf_model(model_type, seed=seed, **{**family_overrides, **overrides})
    with torch.no_grad():
        for param_name, param in hf.named_parameters():
            for suffix, scale in scales.items():
                if param_name.endswith(suffix):
                    param.mul_(scale)
    return hf


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
