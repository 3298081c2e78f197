"""DeepSeek-V3.2 against transformers on a saved checkpoint (CPU, float32, reference backends):
prompt logits and 32 greedy tokens through the paged runner, then through the engine with
chunked prefill not aligned to blocks, forced preemption and prefix-cache hits; the indexer's
selection bites (top 12 of up to 96 keys); config translation and loading errors."""

from __future__ import annotations

import pytest
import torch

from tests.models.hf_models import hf_logits, make_hf_model, save_hf_model
from tests.models.prefill import greedy_decode, prefill_logits
from tests.models.test_deepseek_hf import (  # the same checks as DeepSeek-V2/V3's
    MLA,
    NUM_TOKENS,
    PARAMS,
    PROMPT_PARAMS,
    YARN,
    check_engine,
    check_tokens,
    edited,
    prompts,
)
from unified_attn import LLMEngine, SamplingParams
from unified_attn.backends.sparse_mla import DeepseekV32IndexerBackend, SparseMLABackend
from unified_attn.models.deepseek_v32 import DeepseekV32ForCausalLM
from unified_attn.models.deepseek_v32_hf import deepseek_v32_config_from_hf, load_deepseek_v32
from unified_attn.models.families import family_of, family_of_preset
from unified_attn.models.hf_config import read_hf_config

TOPK = 12
V32 = dict(
    num_hidden_layers=2, q_lora_rank=48, n_routed_experts=8, n_group=4, topk_group=2,
    num_experts_per_tok=2, first_k_dense_replace=1, rope_parameters=YARN,
    index_topk=TOPK, index_head_dim=32,
    index_n_heads=16,  # many heads: exact-zero index scores (ties in top-k) stay unlikely
)  # fmt: skip
MEMORY = "2MiB"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The random transformers model (routers scaled so routing is decided, a random
    correction bias) and its saved checkpoint."""
    hf = make_hf_model("deepseek_v32", **MLA, **V32)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.mul_(10.0)
        for name, buffer in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=gen) * 0.5)
    return hf, save_hf_model(hf, tmp_path_factory.mktemp("v32"))


def test_the_selection_changes_the_logits(checkpoint):
    """Keeping every key (transformers' indexer with a large top-k) gives other logits: the
    parity checks below test sparse attention, not dense."""
    hf, _ = checkpoint
    prompt = prompts([64], seed=4)[0]
    sparse = hf_logits(hf, prompt)
    indexers = [layer.self_attn.indexer for layer in hf.model.layers]
    for indexer in indexers:
        indexer.index_topk = 1024
    try:
        dense = hf_logits(hf, prompt)
    finally:
        for indexer in indexers:
            indexer.index_topk = TOPK
    assert (sparse - dense)[TOPK:].abs().max() > 1e-2
    assert (sparse - dense)[:TOPK].abs().max() < 1e-5  # the first queries see every key


def test_prompt_logits_and_greedy_tokens_match_transformers(checkpoint):
    hf, path = checkpoint
    ours, tokenizer = load_deepseek_v32(path, SparseMLABackend)
    assert tokenizer is None and isinstance(ours, DeepseekV32ForCausalLM)
    batch = prompts([64, 23, 5, 1], seed=5)
    for prompt, logits in zip(batch, prefill_logits(ours, batch), strict=True):
        assert (logits - hf_logits(hf, prompt)).abs().max() < 1e-4
    for prompt, tokens in zip(batch[:2], greedy_decode(ours, batch[:2], NUM_TOKENS), strict=True):
        check_tokens(hf, prompt, tokens)


def test_engine_chunked_prefill_and_preemption_match_transformers(checkpoint):
    # 13-token chunks over 8-token blocks, and room for one request of max_model_len plus two
    # spare blocks: the requests take turns, preempted and recomputed from cached prefixes.
    hf, path = checkpoint
    options = dict(max_model_len=104, max_num_batched_tokens=13, block_size=8)
    probe = LLMEngine(str(path), kv_cache_memory=MEMORY, **options)
    assert probe.backend_cls is SparseMLABackend
    groups = probe.kv_cache_report.groups
    assert any(name.endswith(".indexer") for g in groups for name in g["layers"])
    memory = probe.worker.plan.bytes_per_block * (sum(probe.worker.blocks_per_request) + 2)
    engine = LLMEngine(str(path), kv_cache_memory=memory, **options)
    batch = prompts([64, 5, 40], seed=6)
    check_engine(hf, engine.generate(batch, PROMPT_PARAMS), batch)
    assert engine.scheduler.num_preemptions > 0


def test_engine_prefix_cache_hits_match_transformers(checkpoint):
    hf, path = checkpoint
    engine = LLMEngine(str(path), max_num_batched_tokens=64, block_size=8, kv_cache_memory=MEMORY)
    for shared, tails, seed in [(40, [24, 2], 1), (21, [43], 3)]:
        first = prompts([3], seed=seed, shared=shared)
        check_engine(hf, engine.generate(first, PROMPT_PARAMS), first)
        hits = engine.kv_cache_manager.prefix_cache_stats.hits
        batch = prompts(tails, seed=seed, shared=shared)  # the same prefix, new tails
        check_engine(hf, engine.generate(batch, PARAMS), batch, prompt_logits=False)
        cached = shared // 8 * 8  # the prefix's full blocks
        assert engine.kv_cache_manager.prefix_cache_stats.hits - hits >= len(tails) * cached > 0


# ---- configs, errors, presets and shapes ------------------------------------------------------


def test_config_translation(checkpoint):
    _, path = checkpoint
    cfg = deepseek_v32_config_from_hf(read_hf_config(path), name="x")
    assert (cfg.index_topk, cfg.index_head_dim, cfg.index_n_heads) == (TOPK, 32, 16)
    assert (cfg.version, cfg.rope_layout, cfg.first_k_dense_replace, cfg.q_lora_rank) == (
        "v3", "interleave", 1, 48,
    )  # fmt: skip
    assert family_of(cfg).name == "deepseek-v3.2"


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(mlp_layer_types=["sparse", "dense"]), r"mlp_layer_types=\['sparse', 'dense'\]"),
        (dict(layer_types=["full_attention"] * 2), r"layer_types=.*'indexed_attention'"),
        (dict(q_lora_rank=None), r"q_lora_rank=None, expected an int"),
        (dict(index_head_dim=8), r"index_head_dim=8, expected >= qk_rope_head_dim=16"),
        (dict(index_n_heads=8), r"indexer\.weights_proj\.weight .*has shape \(16, 64\)"),
    ],
)
def test_loading_errors_say_what_to_fix(checkpoint, tmp_path, changes, message):
    _, path = checkpoint
    with pytest.raises(ValueError, match=message):
        load_deepseek_v32(edited(path, tmp_path, **changes), SparseMLABackend)


def test_a_backend_of_another_kind_is_refused(checkpoint):
    _, path = checkpoint
    with pytest.raises(ValueError, match=r"deepseek-v3\.2-reference"):
        LLMEngine(str(path), kv_cache_memory=MEMORY, backend="mla-reference")


def test_preset_runs_in_the_engine_and_the_real_shape_plans():
    engine = LLMEngine("deepseek-v3.2-like", kv_cache_memory=MEMORY, max_model_len=128)
    assert isinstance(engine.model, DeepseekV32ForCausalLM)
    indexers = {type(b) for _, b in engine.model.attention_layers()} - {SparseMLABackend}
    assert indexers == {DeepseekV32IndexerBackend}
    (out,) = engine.generate([list(range(40))], SamplingParams(max_tokens=4))
    assert len(out.output_token_ids) == 4
    (group,) = engine.kv_cache_report.groups  # latents and indexer keys: full attention
    assert group["page_bytes"] == 4 * 16 * (32 + 16 + 32) * 4  # 4 layers, block 16, float32
    family = family_of_preset("deepseek-v3.2")
    assert family is not None and family.name == "deepseek-v3.2"
    shape = family.shapes["deepseek-v3.2"]
    assert (shape.num_layers, shape.latent_size, shape.index_head_dim) == (61, 576, 128)
    assert family.theoretical_ratio(shape, 4096, 1024, 0.0) == pytest.approx(
        2 * 128 * 192 / (576 + 128)
    )
