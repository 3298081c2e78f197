"""Family checkpoints (Gemma 2, GPT-OSS, Qwen 3, Phi-3, Gemma 3, Mixtral, Qwen2-MoE) against
transformers: prompt logits, greedy tokens, config translation, and that each family feature is
live (dropping it changes the logits)."""

import json
import shutil

import attrs
import pytest
import torch

from tests.models.hf_models import (
    FAMILIES,
    GEMMA3_ROPE,
    LLAMA4_ROPE,
    YARN,
    hf_logits,
    make_family_model,
    save_hf_model,
)
from tests.models.prefill import greedy_decode, prefill_logits
from tests.models.test_hf import edit_config, prompts
from unified_attn.backends.reference import ReferenceAttentionBackend
from unified_attn.models import LayerKind, MoEConfig, RopeScaling, load_hf_model
from unified_attn.models.hf_config import config_from_hf

# Every family of hf_models.FAMILIES: Gemma 2, GPT-OSS, Qwen 3, Phi-3 (with and without a window),
# Gemma 3, Mixtral, Qwen2-MoE, Qwen3-MoE.
CASES = sorted(FAMILIES)
# Families whose prompt logits are also checked through the Triton kernel: all of them on a GPU;
# on CPU (the kernel's slow interpreter) the ones with kernel features of their own, soft caps
# and sinks.
TRITON_CASES = CASES if torch.cuda.is_available() else ["gemma2", "gpt-oss"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (name, transformers model, our model, checkpoint path), built once per module."""
    built = {}

    def get(name):
        if name not in built:
            hf = make_family_model(name)
            path = save_hf_model(hf, tmp_path_factory.mktemp(name))
            built[name] = (name, hf, load_hf_model(path, ReferenceAttentionBackend)[0], path)
        return built[name]

    return get


@pytest.fixture(params=CASES)
def checkpoint(request, checkpoints):
    return checkpoints(request.param)


@pytest.fixture
def gemma2(checkpoints):
    return checkpoints("gemma2")


@pytest.fixture
def gpt_oss(checkpoints):
    return checkpoints("gpt-oss")


def test_prompt_logits_match_transformers(checkpoint):
    _, hf, ours, _ = checkpoint
    batch = prompts()  # 23, 5, 31, 1, 20 tokens: windows of 8 are crossed
    for prompt, logits in zip(batch, prefill_logits(ours, batch), strict=True):
        assert (logits - hf_logits(hf, prompt)).abs().max() < 1e-4


def test_greedy_tokens_match_transformers(checkpoint):
    # Identical greedy tokens: each of ours is transformers' argmax after the ones before it
    # (one transformers forward over prompt + our tokens, instead of a recompute per token).
    _, hf, ours, _ = checkpoint
    batch = prompts([21, 4, 12], seed=1)
    for prompt, tokens in zip(batch, greedy_decode(ours, batch, num_tokens=16), strict=True):
        expected = hf_logits(hf, prompt + tokens)[len(prompt) - 1 : -1].argmax(-1)
        assert tokens == expected.tolist()


def test_gemma2_config_translates(gemma2):
    cfg = gemma2[2].config
    assert cfg.layer_kinds == (LayerKind.sliding(8), LayerKind.full(), LayerKind.sliding(8))
    assert (cfg.mlp_kind, cfg.norm_style, cfg.post_norms) == ("geglu", "gemma", True)
    assert cfg.attention_scale == 24**-0.5 and cfg.embed_scale == 8.0
    assert (cfg.attn_logit_softcap, cfg.final_logit_softcap) == (5.0, 3.0)
    assert cfg.tie_word_embeddings and cfg.moe is None and cfg.rope_scaling is None


def test_gpt_oss_config_translates(gpt_oss):
    cfg = gpt_oss[2].config
    sliding, full = LayerKind.sliding(8, has_sinks=True), LayerKind.full(has_sinks=True)
    assert cfg.layer_kinds == (sliding, full, sliding)
    assert cfg.moe == MoEConfig(num_experts=4, top_k=2, swiglu_alpha=1.702, swiglu_limit=7.0)
    assert (cfg.mlp_kind, cfg.norm_style, cfg.post_norms) == ("moe", "float32", False)
    assert cfg.attention_bias and cfg.attention_output_bias and not cfg.tie_word_embeddings
    assert cfg.rope_scaling == RopeScaling(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=64, truncate=False
    )
    assert cfg.rope_theta == 150000.0 and cfg.attention_scale == 16**-0.5


def test_qwen3_config_translates(checkpoints):
    cfg = checkpoints("qwen3")[2].config
    assert cfg.layer_kinds == (LayerKind.full(), LayerKind.sliding(8))
    assert cfg.qk_norm and cfg.norm_style == "llama" and not cfg.attention_bias


@pytest.mark.parametrize("name", ["phi3", "phi3-sliding"])
def test_phi3_config_translates(checkpoints, name):
    cfg = checkpoints(name)[2].config
    kind = LayerKind.sliding(8) if name == "phi3-sliding" else LayerKind.full()
    assert cfg.layer_kinds == (kind, kind)
    assert cfg.fused_qkv and cfg.fused_gate_up and not cfg.qk_norm


def test_gemma3_config_translates(checkpoints):
    cfg = checkpoints("gemma3")[2].config
    assert cfg.layer_kinds == (LayerKind.sliding(8), LayerKind.full())
    assert (cfg.mlp_kind, cfg.norm_style, cfg.post_norms, cfg.qk_norm) == (
        "geglu",
        "gemma",
        True,
        True,
    )
    assert cfg.attention_scale == 24**-0.5 and cfg.embed_scale == 8.0
    assert cfg.rope_theta == 1e6 and cfg.rope_scaling == RopeScaling(rope_type="linear", factor=4)
    assert cfg.local_rope_theta == 1e4 and cfg.local_rope_scaling is None
    assert cfg.rope_of(LayerKind.sliding(8)) == (1e4, None)
    assert cfg.tie_word_embeddings and cfg.attn_logit_softcap is None


def test_mixtral_config_translates(checkpoints):
    cfg = checkpoints("mixtral")[2].config
    assert cfg.moe == MoEConfig(
        num_experts=4, top_k=2, expert_kind="swiglu", router_softmax="all", norm_topk_prob=True
    )
    assert cfg.layer_kinds == (LayerKind.full(),) * 2 and cfg.dense_mlp_layers == ()


def test_qwen2_moe_config_translates(checkpoints):
    cfg = checkpoints("qwen2-moe")[2].config
    assert cfg.moe == MoEConfig(
        num_experts=4,
        top_k=2,
        expert_kind="swiglu",
        router_softmax="all",
        norm_topk_prob=False,
        routing_weights_dtype="model",
        intermediate_size=32,
        shared_expert_intermediate_size=48,
    )
    assert cfg.dense_mlp_layers == (1,) and cfg.attention_bias and not cfg.attention_output_bias


def test_qwen3_moe_config_translates(checkpoints):
    cfg = checkpoints("qwen3-moe")[2].config
    assert cfg.moe == MoEConfig(
        num_experts=4,
        top_k=2,
        expert_kind="swiglu",
        router_softmax="all",
        norm_topk_prob=True,
        routing_weights_dtype="model",
        intermediate_size=32,
        shared_expert_intermediate_size=None,
    )
    assert cfg.qk_norm and cfg.dense_mlp_layers == (1,) and not cfg.attention_bias
    assert cfg.layer_kinds == (LayerKind.sliding(8),) * 2


def test_mixtral_expert_weights_load_under_their_checkpoint_names(checkpoints):
    # Mixtral checkpoints name the experts block_sparse_moe.experts.{e}.w1/w3/w2; the loader
    # stacks them into mlp.experts.gate_up_proj [E, 2I, H] (gate rows, then up) and down_proj.
    _, _, ours, path = checkpoints("mixtral")
    from safetensors.torch import load_file

    saved = load_file(path / "model.safetensors")
    ours_state = ours.state_dict()
    prefix = "model.layers.1."
    saved_expert = prefix + "block_sparse_moe.experts.3."
    gate_up, down = (ours_state[prefix + f"mlp.experts.{n}"] for n in ("gate_up_proj", "down_proj"))
    inter = gate_up.shape[1] // 2
    for theirs, ours_part in [
        (prefix + "block_sparse_moe.gate.weight", ours_state[prefix + "mlp.gate.weight"]),
        (saved_expert + "w1.weight", gate_up[3, :inter]),
        (saved_expert + "w3.weight", gate_up[3, inter:]),
        (saved_expert + "w2.weight", down[3]),
    ]:
        assert torch.equal(saved[theirs], ours_part)


# Config variants beyond the families' own (one transformers model each, prompt logits only).
VARIANTS = {
    "qwen2-moe-norm-topk": ("qwen2-moe", dict(norm_topk_prob=True)),
    # decoder_sparse_step=2: layer 0 dense, layer 1 sparse
    "qwen2-moe-sparse-step": ("qwen2-moe", dict(decoder_sparse_step=2, mlp_only_layers=[])),
    "qwen3-bias": ("qwen3", dict(attention_bias=True, use_sliding_window=False)),
    "mixtral-sliding": ("mixtral", dict(sliding_window=8)),
    # the real models' routing: top 1; Scout: MoE on every layer; Maverick: no q/k norm
    "llama4-scout-like": ("llama4", dict(num_experts_per_tok=1, interleave_moe_layer_step=1)),
    "llama4-maverick-like": ("llama4", dict(num_experts_per_tok=1, use_qk_norm=False)),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variant_prompt_logits_match_transformers(variant, tmp_path):
    family, overrides = VARIANTS[variant]
    hf = make_family_model(family, **overrides)
    ours, _ = load_hf_model(save_hf_model(hf, tmp_path), ReferenceAttentionBackend)
    batch = prompts([23, 5, 20])
    for prompt, logits in zip(batch, prefill_logits(ours, batch), strict=True):
        assert (logits - hf_logits(hf, prompt)).abs().max() < 1e-4


def test_gemma3_4x_config_matches_transformers(checkpoints, tmp_path):
    # transformers 4.x wrote Gemma 3's RoPE as rope_theta (global), rope_scaling (global) and
    # rope_local_base_freq, and the layer pattern as sliding_window_pattern.
    _, hf, _, path = checkpoints("gemma3")
    edited = shutil.copytree(path, tmp_path / "gemma3-4x")
    config = json.loads((edited / "config.json").read_text())
    for key in ("rope_parameters", "layer_types", "_sliding_window_pattern"):
        config.pop(key, None)
    config.update(
        rope_theta=1_000_000.0,
        rope_scaling={"rope_type": "linear", "factor": 4.0},
        rope_local_base_freq=10000.0,
        sliding_window_pattern=2,
    )
    (edited / "config.json").write_text(json.dumps(config))
    ours, _ = load_hf_model(edited, ReferenceAttentionBackend)
    original = checkpoints("gemma3")[2].config
    assert attrs.evolve(ours.config, name=original.name) == original
    prompt = prompts([20])[0]
    assert (prefill_logits(ours, [prompt])[0] - hf_logits(hf, prompt)).abs().max() < 1e-4


# The shape of openai/gpt-oss-20b's config.json (transformers 4.55: `rope_scaling` beside a
# top-level `rope_theta`), shrunk.
GPT_OSS_4X = {
    "architectures": ["GptOssForCausalLM"],
    "attention_bias": True,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 256,
    "intermediate_size": 256,
    "layer_types": ["sliding_attention", "full_attention"],
    "max_position_embeddings": 131072,
    "num_attention_heads": 8,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "num_local_experts": 32,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "rope_theta": 150000,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "vocab_size": 1000,
}


def test_gpt_oss_4x_config_translates():
    cfg = config_from_hf(GPT_OSS_4X)
    assert cfg.rope_theta == 150000.0 and cfg.rope_scaling == RopeScaling(
        rope_type="yarn", factor=32.0, original_max_position_embeddings=4096, truncate=False
    )
    sliding, full = LayerKind.sliding(128, has_sinks=True), LayerKind.full(has_sinks=True)
    assert cfg.layer_kinds == (sliding, full)
    assert cfg.moe == MoEConfig(num_experts=32, top_k=4)


def test_quantized_checkpoint_is_refused():
    hf = {**GPT_OSS_4X, "quantization_config": {"quant_method": "mxfp4"}}
    with pytest.raises(ValueError, match=r"'mxfp4'}.* is not supported; supported: "):
        config_from_hf(hf)


def test_unsupported_gemma2_activation_is_named():
    from tests.models.hf_models import SMALL

    hf = {**SMALL, "architectures": ["Gemma2ForCausalLM"], "num_hidden_layers": 2}
    with pytest.raises(ValueError, match=r"hidden_activation='relu' is not supported"):
        config_from_hf({**hf, "hidden_activation": "relu"})


def test_sinks_are_float32_in_a_bf16_model(gpt_oss):
    _, hf, _, path = gpt_oss
    ours, _ = load_hf_model(path, ReferenceAttentionBackend, dtype=torch.bfloat16)
    sinks = ours.state_dict()["model.layers.0.self_attn.sinks"]
    assert sinks.dtype == torch.float32
    assert torch.equal(sinks, hf.state_dict()["model.layers.0.self_attn.sinks"])  # not rounded
    assert ours.state_dict()["model.layers.0.mlp.experts.down_proj"].dtype == torch.bfloat16
    assert torch.isfinite(prefill_logits(ours, prompts([20]))[0]).all()


# Each edit removes one feature; the logits must move, or the parity above would not prove it.
FEATURE_EDITS = {
    "gemma2": [
        dict(attn_logit_softcapping=None),
        dict(final_logit_softcapping=None),
        dict(query_pre_attn_scalar=16),
        dict(sliding_window=9),
    ],
    "gpt-oss": [
        dict(sliding_window=9),
        dict(swiglu_limit=1000.0),
        dict(num_experts_per_tok=3),
        dict(rope_parameters={**YARN, "truncate": True}),
        dict(rope_parameters={**YARN, "factor": 2.0}),
    ],
    "qwen3": [dict(sliding_window=9), dict(use_sliding_window=False)],
    "phi3": [dict(rope_parameters={"rope_type": "default", "rope_theta": 5000.0})],
    "phi3-sliding": [dict(sliding_window=9), dict(sliding_window=None)],
    "gemma3": [
        dict(sliding_window=9),
        dict(query_pre_attn_scalar=16),
        # the local and the global RoPE each matter
        dict(rope_parameters={**GEMMA3_ROPE, "sliding_attention": {"rope_theta": 20000.0}}),
        dict(
            rope_parameters={
                **GEMMA3_ROPE,
                "full_attention": {**GEMMA3_ROPE["full_attention"], "factor": 2.0},
            }
        ),
    ],
    "mixtral": [dict(num_experts_per_tok=1), dict(num_experts_per_tok=3)],
    "qwen2-moe": [dict(norm_topk_prob=True), dict(num_experts_per_tok=3)],
    "qwen3-moe": [
        dict(norm_topk_prob=False),
        dict(num_experts_per_tok=3),
        dict(sliding_window=9),
        dict(use_sliding_window=False),
    ],
    "llama4": [
        dict(attention_chunk_size=9),
        dict(no_rope_layers=[1, 1, 1, 1]),  # layer 2 rotates (layer_types keeps it full)
        dict(no_rope_layers=[1, 0, 0, 1]),
        dict(use_qk_norm=False),
        dict(attn_temperature_tuning=False),
        dict(floor_scale=8),
        dict(num_experts_per_tok=1),
        dict(rope_parameters={**LLAMA4_ROPE, "factor": 2.0}),
    ],
}


def test_each_feature_changes_the_logits(checkpoint, tmp_path):
    name, hf, _, path = checkpoint
    prompt = prompts([20])[0]
    expected = hf_logits(hf, prompt)
    for i, edit in enumerate(FEATURE_EDITS[name]):
        edited = shutil.copytree(path, tmp_path / str(i))
        edit_config(edited, **edit)
        ours, _ = load_hf_model(edited, ReferenceAttentionBackend)
        diff = (prefill_logits(ours, [prompt])[0] - expected).abs().max()
        assert diff > 1e-3, edit


def test_sinks_without_mass_change_the_logits(gpt_oss):
    _, hf, _, path = gpt_oss
    ours, _ = load_hf_model(path, ReferenceAttentionBackend)
    for layer in ours.model.layers:
        layer.self_attn.sinks.fill_(-float("inf"))  # a sink that takes no probability mass
    prompt = prompts([20])[0]
    assert (prefill_logits(ours, [prompt])[0] - hf_logits(hf, prompt)).abs().max() > 1e-3


@pytest.mark.parametrize("name", TRITON_CASES)
def test_prompt_logits_match_transformers_through_triton(checkpoints, name):
    # Sinks and the attention soft cap reach the Triton kernel too (its interpreter on CPU).
    pytest.importorskip("triton")
    from unified_attn.backends.triton.backend import TritonAttentionBackend

    _, hf, _, path = checkpoints(name)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ours, _ = load_hf_model(path, TritonAttentionBackend, device=device)
    batch = prompts([23, 5, 31])
    for prompt, logits in zip(batch, prefill_logits(ours, batch, block_size=16), strict=True):
        assert (logits.cpu() - hf_logits(hf, prompt)).abs().max() < 1e-4
