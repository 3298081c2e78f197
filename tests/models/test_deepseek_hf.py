"""DeepSeek-V2/V3 against transformers on saved checkpoints (CPU, float32, MLA reference
backend): prompt logits and 32 greedy tokens, through the paged runner and through the engine
with chunked prefill, prefix-cache hits and preemption; config translation and loading errors."""

from __future__ import annotations

import json

import pytest
import torch

from tests.models.hf_models import hf_logits, make_hf_model, save_hf_model
from tests.models.prefill import greedy_decode, prefill_logits
from unified_attn import LLMEngine, SamplingParams
from unified_attn.backends.mla import MLAReferenceBackend
from unified_attn.models import MLA_PRESETS, DeepseekForCausalLM
from unified_attn.models.deepseek_hf import deepseek_config_from_hf, load_deepseek
from unified_attn.models.hf_config import config_from_hf, read_hf_config

MLA = dict(
    rms_norm_eps=1e-3,  # q_a_layernorm and kv_a_layernorm keep transformers' 1e-6
    num_key_value_heads=4,
    moe_intermediate_size=32,
    kv_lora_rank=32,
    qk_rope_head_dim=16,
    qk_nope_head_dim=32,
    v_head_dim=32,
)
# YaRN with mscale_all_dim: the softmax scale grows by mscale ** 2 (about 1.3 here)
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "mscale": 0.707,
    "mscale_all_dim": 1.0,
}
CASES = {
    # q_lora_rank, interleaved RoPE, sigmoid routing over 4 groups (2 chosen), correction bias
    "v3": (
        "deepseek_v3",
        dict(num_hidden_layers=3, q_lora_rank=48, n_routed_experts=8, n_group=4, topk_group=2,
             num_experts_per_tok=2, first_k_dense_replace=1, rope_parameters=YARN),
    ),
    # V2-Lite style: no q_lora_rank, complex-pair RoPE, softmax greedy top-2, 2 shared experts
    "v2": (
        "deepseek_v2",
        dict(num_hidden_layers=3, q_lora_rank=None, n_routed_experts=4, num_experts_per_tok=2,
             n_shared_experts=2, routed_scaling_factor=1.5, first_k_dense_replace=1),
    ),
    # the other routing and RoPE variants, checked without the engine
    "v3-halves": (
        "deepseek_v3",
        dict(num_hidden_layers=2, q_lora_rank=None, n_routed_experts=4, n_group=2, topk_group=1,
             num_experts_per_tok=2, first_k_dense_replace=0, rope_interleave=False,
             norm_topk_prob=False),
    ),
    "v2-group-limited": (
        "deepseek_v2",
        dict(num_hidden_layers=2, q_lora_rank=40, n_routed_experts=8, n_group=4, topk_group=2,
             num_experts_per_tok=3, topk_method="group_limited_greedy",
             first_k_dense_replace=0, rope_parameters=YARN),
    ),
}  # fmt: skip
NUM_TOKENS = 32
MEMORY = "2MiB"


def make_deepseek(name: str):
    """The random transformers model of `CASES[name]`: routers scaled so routing is decided,
    V3's correction bias random (transformers initialises it to 0)."""
    model_type, overrides = CASES[name]
    hf = make_hf_model(model_type, **MLA, **overrides)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param_name, param in hf.named_parameters():
            if param_name.endswith("mlp.gate.weight"):
                param.mul_(10.0)
        for buffer_name, buffer in hf.named_buffers():
            if buffer_name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=gen) * 0.5)
    return hf


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request, checkpoint_cache):
    return request.param, *checkpoint_cache(request.param)


@pytest.fixture(scope="module", params=["v2", "v3"])
def engine_checkpoint(request, checkpoint_cache):
    return checkpoint_cache(request.param)


@pytest.fixture(scope="module")
def checkpoint_cache(tmp_path_factory):
    saved: dict[str, tuple] = {}

    def get(name: str):
        if name not in saved:
            hf = make_deepseek(name)
            saved[name] = (hf, save_hf_model(hf, tmp_path_factory.mktemp(name)))
        return saved[name]

    return get


def prompts(lengths, seed=0, shared=0):
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, 128, (shared,), generator=gen).tolist()
    return [prefix + torch.randint(0, 128, (n,), generator=gen).tolist() for n in lengths]


def check_tokens(hf, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Our greedy tokens are transformers' argmax at every step; returns transformers' logits
    `[P + N, V]` of the whole sequence."""
    full = hf_logits(hf, prompt + tokens)
    assert tokens == full[len(prompt) - 1 : -1].argmax(-1).tolist()
    return full


def test_prompt_logits_and_greedy_tokens_match_transformers(checkpoint):
    _, hf, path = checkpoint
    ours, tokenizer = load_deepseek(path, MLAReferenceBackend)
    assert tokenizer is None
    batch = prompts([23, 5, 31, 1])
    for prompt, logits in zip(batch, prefill_logits(ours, batch), strict=True):
        assert (logits - hf_logits(hf, prompt)).abs().max() < 1e-4
    for prompt, tokens in zip(batch, greedy_decode(ours, batch, NUM_TOKENS), strict=True):
        check_tokens(hf, prompt, tokens)


def check_engine(hf, outputs, batch, prompt_logits=True):
    for prompt, out in zip(batch, outputs, strict=True):
        full = check_tokens(hf, prompt, out.output_token_ids)
        sampled = full[len(prompt) - 1 : len(prompt) - 1 + NUM_TOKENS]
        assert (out.logits - sampled).abs().max() < 1e-4
        if prompt_logits:
            assert (out.prompt_logits - full[: len(prompt)]).abs().max() < 1e-4


PARAMS = SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True, return_logits=True)
PROMPT_PARAMS = SamplingParams(
    max_tokens=NUM_TOKENS, ignore_eos=True, prompt_logits=True, return_logits=True
)


def test_engine_chunked_prefill_and_preemption_match_transformers(engine_checkpoint):
    # 13-token chunks over 8-token blocks, and room for one request of max_model_len plus two
    # spare blocks: the requests take turns, preempted and recomputed from cached prefixes.
    hf, path = engine_checkpoint
    options = dict(max_model_len=80, max_num_batched_tokens=13, block_size=8)
    probe = LLMEngine(str(path), kv_cache_memory=MEMORY, **options)
    assert probe.backend_cls is MLAReferenceBackend
    memory = probe.worker.plan.bytes_per_block * (sum(probe.worker.blocks_per_request) + 2)
    engine = LLMEngine(str(path), kv_cache_memory=memory, **options)
    batch = prompts([23, 5, 40, 1])
    check_engine(hf, engine.generate(batch, PROMPT_PARAMS), batch)
    assert engine.scheduler.num_preemptions > 0


def test_engine_prefix_cache_hits_match_transformers(engine_checkpoint):
    hf, path = engine_checkpoint
    engine = LLMEngine(str(path), max_num_batched_tokens=64, block_size=8, kv_cache_memory=MEMORY)
    for shared, tails, seed in [(40, [9, 2, 30], 1), (8, [3, 12], 2), (21, [1, 6], 3)]:
        first = prompts([3], seed=seed, shared=shared)
        check_engine(hf, engine.generate(first, PROMPT_PARAMS), first)
        hits = engine.kv_cache_manager.prefix_cache_stats.hits
        batch = prompts(tails, seed=seed, shared=shared)  # the same prefix, new tails
        check_engine(hf, engine.generate(batch, PARAMS), batch, prompt_logits=False)
        cached = shared // 8 * 8  # the prefix's full blocks
        assert engine.kv_cache_manager.prefix_cache_stats.hits - hits >= len(tails) * cached


# ---- configs and errors -----------------------------------------------------------------------


def test_config_translation(checkpoint_cache):
    _, path = checkpoint_cache("v3")
    cfg = deepseek_config_from_hf(read_hf_config(path), name="x")
    assert (cfg.version, cfg.routing) == ("v3", "sigmoid_group_limited")
    assert cfg.rope_layout == "interleave"
    assert (cfg.q_lora_rank, cfg.latent_size, cfg.n_group, cfg.topk_group) == (48, 48, 4, 2)
    scaling = cfg.rope_scaling
    assert scaling is not None and scaling.mscale_all_dim == 1.0
    mscale = 0.1 * 1.0 * torch.log(torch.tensor(4.0)).item() + 1.0
    assert cfg.softmax_scale == pytest.approx(48**-0.5 * mscale**2)
    _, path = checkpoint_cache("v2")
    cfg = deepseek_config_from_hf(read_hf_config(path))
    assert (cfg.version, cfg.routing, cfg.rope_layout, cfg.q_lora_rank) == (
        "v2", "greedy", "pairs", None,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"DeepSeek latent-attention model.*load_deepseek"):
        config_from_hf(read_hf_config(path))


def edited(path, tmp_path, **changes):
    target = tmp_path / "edited"
    target.mkdir()
    for file in path.iterdir():
        (target / file.name).write_bytes(file.read_bytes())
    config = json.loads((target / "config.json").read_text())
    config.update(changes)
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(num_hidden_layers=4), r"missing \['model\.layers\.3\."),
        (dict(q_lora_rank=24), r"q_a_layernorm\.weight .*has shape \(48,\), the config implies"),
        (dict(n_group=3), "needs n_group dividing n_routed_experts=8"),
        (dict(hidden_act="gelu"), "hidden_act='gelu'.*supported: hidden_act 'silu'"),
        (dict(quantization_config={"quant_method": "fp8"}), "weight_block_size"),
    ],
)
def test_loading_errors_say_what_to_fix(checkpoint_cache, tmp_path, changes, message):
    _, path = checkpoint_cache("v3")
    with pytest.raises(ValueError, match=message):
        load_deepseek(edited(path, tmp_path, **changes), MLAReferenceBackend)


def test_multi_token_prediction_layers_are_dropped(checkpoint_cache, tmp_path):
    from safetensors.torch import load_file, save_file

    hf, path = checkpoint_cache("v3")
    target = edited(path, tmp_path)
    state = load_file(target / "model.safetensors")
    state["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)  # an MTP module's weight
    save_file(state, target / "model.safetensors")
    ours, _ = load_deepseek(target, MLAReferenceBackend)
    (logits,) = prefill_logits(ours, [[5, 6, 7]])
    assert (logits - hf_logits(hf, [5, 6, 7])).abs().max() < 1e-4


def test_preset_runs_in_the_engine():
    cfg = MLA_PRESETS["deepseek-v3-like"]
    assert (cfg.num_layers, cfg.first_k_dense_replace, cfg.kv_lora_rank, cfg.qk_rope_head_dim) == (
        4, 1, 32, 16,
    )  # fmt: skip
    engine = LLMEngine("deepseek-v3-like", kv_cache_memory=MEMORY, max_model_len=128)
    assert isinstance(engine.model, DeepseekForCausalLM)
    (out,) = engine.generate(["The cache"], SamplingParams(max_tokens=4))
    assert len(out.output_token_ids) == 4
    (group,) = engine.kv_cache_report.groups
    assert group["page_bytes"] == 4 * 16 * (32 + 16) * 4  # 4 layers, block 16, float32
