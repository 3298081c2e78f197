"""Gemma 2 and GPT-OSS checkpoints against transformers: prompt logits, greedy tokens, config
translation, and that each family feature is live (dropping it changes the logits)."""

import shutil

import pytest
import torch

from tests.models.hf_models import hf_greedy, hf_logits, make_hf_model, save_hf_model
from tests.models.prefill import greedy_decode, prefill_logits
from tests.models.test_hf import edit_config, prompts
from unified_attn.backends.reference import ReferenceAttentionBackend
from unified_attn.models import LayerKind, MoEConfig, RopeScaling, load_hf_model
from unified_attn.models.hf_config import config_from_hf

YARN = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 4.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 64,
}
GEMMA2 = dict(
    num_hidden_layers=3,
    head_dim=16,
    sliding_window=8,
    query_pre_attn_scalar=24,
    attn_logit_softcapping=5.0,
    final_logit_softcapping=3.0,
)
GPT_OSS = dict(
    num_hidden_layers=3,
    head_dim=16,
    sliding_window=8,
    num_local_experts=4,
    num_experts_per_tok=2,
    rope_parameters=YARN,
)
# Larger than hf_models' 0.1 noise where it makes a feature bite: sinks that take real mass,
# expert projections whose gate/up values reach the SwiGLU clamp (7.0).
GPT_OSS_SCALES = {"self_attn.sinks": 10.0, "mlp.experts.gate_up_proj": 6.0}
CASES = {
    "gemma2": ("gemma2", GEMMA2, {}),
    "gpt-oss": ("gpt_oss", GPT_OSS, GPT_OSS_SCALES),
}


def make_family_model(name: str, seed: int = 0):
    model_type, overrides, scales = CASES[name]
    hf = make_hf_model(model_type, seed=seed, **overrides)
    with torch.no_grad():
        for param_name, param in hf.named_parameters():
            for suffix, scale in scales.items():
                if param_name.endswith(suffix):
                    param.mul_(scale)
    return hf


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


@pytest.fixture(params=sorted(CASES))
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
    _, hf, ours, _ = checkpoint
    batch = prompts([21, 4, 12], seed=1)
    got = greedy_decode(ours, batch, num_tokens=12)
    assert got == [hf_greedy(hf, prompt, 12) for prompt in batch]


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
    with pytest.raises(ValueError, match=r"quant_method='mxfp4'\) are not supported"):
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


def test_prompt_logits_match_transformers_through_triton(checkpoint):
    # Sinks and the attention soft cap reach the Triton kernel too (its interpreter on CPU).
    pytest.importorskip("triton")
    from unified_attn.backends.triton.backend import TritonAttentionBackend

    _, hf, _, path = checkpoint
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ours, _ = load_hf_model(path, TritonAttentionBackend, device=device)
    batch = prompts([23, 5, 31])
    for prompt, logits in zip(batch, prefill_logits(ours, batch, block_size=16), strict=True):
        assert (logits.cpu() - hf_logits(hf, prompt)).abs().max() < 1e-4
