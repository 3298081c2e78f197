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
# Llama 4's llama3-type scaling, shrunk: wavelengths above 32 tokens interpolated.
LLAMA4_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
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
    # Llama 4: chunked (8) RoPE layers 0, 1, 3 with L2 q/k norms, NoPE full layer 2 with a
    # temperature that grows every 4 tokens, interleaved llama3-scaled RoPE; layers 1 and 3
    # MoE (4 experts, top 2, sigmoid routing into the experts' input, shared expert), 0 and 2
    # dense of intermediate_size_mlp
    "llama4": (
        "llama4_text",
        dict(
            num_hidden_layers=4,
            head_dim=16,
            intermediate_size=32,
            intermediate_size_mlp=96,
            attention_chunk_size=8,
            no_rope_layers=[1, 1, 0, 1],
            floor_scale=4,
            attn_scale=0.5,
            interleave_moe_layer_step=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            rope_parameters=LLAMA4_ROPE,
        ),
        {"feed_forward.router.weight": 10.0},
    ),
}

# The state-space hybrids (`HybridModel`, not the Llama line of FAMILIES): engine parity in
# tests/runner/test_engine_hf_parity.py and test_state_cache_modes.py.
STATE_FAMILIES: dict[str, tuple[str, dict[str, Any], dict[str, float]]] = {
    # Mamba-2 state-space models: 8 heads of 16 in 2 groups, state 16, scan chunks of 8 (prompts
    # cross several), a 4-tap convolution
    "mamba2": (
        "mamba2",
        dict(num_hidden_layers=2, num_heads=8, head_dim=16, n_groups=2, state_size=16,
             expand=2, chunk_size=8),
        {},
    ),
    # Bamba: Mamba layer 0, attention layer 1 with RoPE on half of each head, SwiGLU MLPs
    "bamba": (
        "bamba",
        dict(num_hidden_layers=2, attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=16,
             mamba_n_groups=2, mamba_d_state=16, mamba_chunk_size=8),
        {},
    ),
    # Nemotron-H: Mamba, squared-ReLU MLP, attention without RoPE, Mamba blocks
    "nemotron-h": (
        "nemotron_h",
        dict(layers_block_type=["mamba", "mlp", "attention", "mamba"], head_dim=16,
             mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=16,
             chunk_size=8),
        {},
    ),
    # Qwen3-Next: gated delta-net layers (2 key heads of 16, each shared by 2 value heads of
    # 16, a 4-tap convolution) around a gated attention layer (heads of 32, RoPE on a quarter
    # of each; its pages balance the states' at 32-token blocks); every MLP sparse (4
    # experts, top 2, a sigmoid-gated shared expert). The larger dt_bias spread gives some
    # heads a slow decay (a long memory), others a fast one; the zero-centred norms scale by
    # about 1.1, not 2 (as trained ones: small weights).
    "qwen3-next": (
        "qwen3_next",
        dict(num_hidden_layers=4, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
             layer_types=["linear_attention", "full_attention", "linear_attention",
                          "linear_attention"],
             num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
             shared_expert_intermediate_size=48),
        {"layernorm.weight": 0.1, "_norm.weight": 0.1, "model.norm.weight": 0.1,
         "mlp.gate.weight": 3.0, "mlp.shared_expert_gate.weight": 3.0, "dt_bias": 20.0},
    ),
    # Nemotron-H with MoE blocks (Nemotron-3-Nano): M, E, *, E; 4 squared-ReLU experts in 2
    # groups, top 2 from the best group, sigmoid scores renormalised and scaled, shared expert
    "nemotron-h-moe": (
        "nemotron_h",
        dict(layers_block_type=["mamba", "moe", "attention", "moe"], head_dim=16,
             mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=16,
             chunk_size=8, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
             moe_intermediate_size=32, moe_shared_expert_intermediate_size=48,
             routed_scaling_factor=2.5),
        {"mixer.gate.weight": 3.0},
    ),
    # Granite-4.0-H: a Mamba layer and a NoPE attention layer (as the released models), each
    # with an MoE (4 experts, top 2) plus a shared SwiGLU MLP; Granite's four multipliers
    "granite-4.0-h": (
        "granitemoehybrid",
        dict(num_hidden_layers=2, layer_types=["mamba", "attention"], mamba_n_heads=8,
             mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16, mamba_chunk_size=8,
             num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
             shared_intermediate_size=48, embedding_multiplier=4.0, residual_multiplier=0.5,
             attention_multiplier=0.125, logits_scaling=2.0),
        {"block_sparse_moe.router.weight": 10.0},
    ),
    # Granite-4.0-H dense (num_local_experts=0: the shared MLP alone) with RoPE, attention first
    "granite-4.0-h-dense-rope": (
        "granitemoehybrid",
        dict(num_hidden_layers=2, layer_types=["attention", "mamba"], mamba_n_heads=8,
             mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16, mamba_chunk_size=8,
             num_local_experts=0, shared_intermediate_size=48, position_embedding_type="rope",
             embedding_multiplier=4.0, residual_multiplier=0.5, attention_multiplier=0.125,
             logits_scaling=2.0),
        {},
    ),
}


def make_family_model(name: str, seed: int = 0, **overrides: Any) -> Any:
    """The tiny random model of family `name` (FAMILIES), with config `overrides` on top."""
    model_type, family_overrides, scales = (FAMILIES | STATE_FAMILIES)[name]
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
