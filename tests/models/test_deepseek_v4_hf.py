"""DeepSeek-V4 against transformers on a saved checkpoint (CPU, float32, reference backends):
prompt logits and 32 greedy tokens through the paged runner, then through the engine with
chunked prefill that does not align with the compression rates, forced preemption, prefix-cache
hits of several lengths, and per-group block sizes; config translation and loading errors.

The tiny config makes every feature bite within 64 tokens: a window of 8, CSA every 4 tokens
(16 entries, the indexer keeps 4), HCA every 8, hash routing on layer 0, sinks and position
biases scaled up so they move the logits, and a YaRN "compress" RoPE.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.models.hf_models import hf_logits, make_hf_model, save_hf_model
from tests.models.prefill import greedy_decode, prefill_logits
from tests.models.test_deepseek_hf import (  # the same checks as DeepSeek-V2/V3's
    NUM_TOKENS,
    PARAMS,
    PROMPT_PARAMS,
    check_engine,
    check_tokens,
    prompts,
)
from unified_attn import LLMEngine, SamplingParams
from unified_attn.backends.deepseek_v4_window import DeepseekV4WindowBackend
from unified_attn.models import V4_PRESETS, DeepseekV4ForCausalLM
from unified_attn.models.deepseek_v4_hf import deepseek_v4_config_from_hf, load_deepseek_v4
from unified_attn.models.hf_config import config_from_hf, read_hf_config

SLIDING = "sliding_attention"
CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"
V4 = dict(
    num_hidden_layers=5,
    layer_types=[SLIDING, CSA, CSA, HCA, CSA],
    mlp_layer_types=["hash_moe", "moe", "moe", "moe", "moe"],
    num_key_value_heads=1,
    head_dim=32,
    partial_rotary_factor=0.25,  # 8 RoPE features of 32
    q_lora_rank=32,
    o_groups=2,
    o_lora_rank=16,
    sliding_window=8,
    compress_rates={CSA: 4, HCA: 8},
    index_n_heads=16,  # many heads: exact-zero index scores (ties in top-k) stay unlikely
    index_head_dim=16,
    index_topk=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    intermediate_size=32,  # transformers aliases it to moe_intermediate_size
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
)
SCALES = {"sinks": 10.0, "position_bias": 10.0, "mlp.gate.weight": 10.0}
MEMORY = "2MiB"


def make_v4(**overrides):
    """The random transformers model: sinks, position biases and routers scaled up, hash
    routing to 2 distinct random experts per token, a random correction bias."""
    hf = make_hf_model("deepseek_v4", **{**V4, **overrides})
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            for suffix, scale in SCALES.items():
                if name.endswith(suffix):
                    param.mul_(scale)
        for name, buffer in hf.named_buffers():
            if name.endswith("tid2eid"):
                order = torch.rand(buffer.shape[0], 4, generator=gen).argsort(dim=-1)
                buffer.copy_(order[:, : buffer.shape[1]])
            elif name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=gen) * 0.5)
    return hf


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    hf = make_v4()
    return hf, save_hf_model(hf, tmp_path_factory.mktemp("v4"))


def test_prompt_logits_and_greedy_tokens_match_transformers(checkpoint):
    hf, path = checkpoint
    ours, tokenizer = load_deepseek_v4(path, DeepseekV4WindowBackend)
    assert tokenizer is None
    batch = prompts([64, 23, 5, 1])
    for prompt, logits in zip(batch, prefill_logits(ours, batch, block_size=8), strict=True):
        assert (logits - hf_logits(hf, prompt)).abs().max() < 1e-4
    outputs = greedy_decode(ours, batch, NUM_TOKENS, block_size=8)
    for prompt, tokens in zip(batch, outputs, strict=True):
        check_tokens(hf, prompt, tokens)


def test_engine_chunked_prefill_and_preemption_match_transformers(checkpoint):
    # 13-token chunks: windows of 4 and 8 tokens close in a later step than they open. Room for
    # one request of max_model_len plus two spare blocks: requests are preempted and resume
    # from their cached prefixes.
    hf, path = checkpoint
    options = dict(max_model_len=112, max_num_batched_tokens=13, block_size=8)
    probe = LLMEngine(str(path), kv_cache_memory=MEMORY, **options)
    assert probe.backend_cls is DeepseekV4WindowBackend
    memory = probe.worker.plan.bytes_per_block * (sum(probe.worker.blocks_per_request) + 2)
    engine = LLMEngine(str(path), kv_cache_memory=memory, **options)
    batch = prompts([23, 5, 64, 1])
    check_engine(hf, engine.generate(batch, PROMPT_PARAMS), batch)
    assert engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("block_size", [8, 16])
def test_engine_prefix_cache_hits_match_transformers(checkpoint, block_size):
    # Hits are multiples of every group's block size (the plan mixes sizes: 8 and 32, or 16
    # and 64), and restore both the compressed entries and the compressors' raw windows.
    hf, path = checkpoint
    engine = LLMEngine(
        str(path), max_num_batched_tokens=64, block_size=block_size, kv_cache_memory=MEMORY
    )
    sizes = {g["block_size"] for g in engine.kv_cache_report.groups}
    assert sizes == {block_size, 4 * block_size}
    alignment = engine.kv_cache_manager.coordinator.alignment
    for shared, tails, seed in [(70, [9, 2], 1), (36, [3, 12], 2), (65, [1], 3)]:
        first = prompts([3], seed=seed, shared=shared)
        check_engine(hf, engine.generate(first, PROMPT_PARAMS), first)
        hits = engine.kv_cache_manager.prefix_cache_stats.hits
        batch = prompts(tails, seed=seed, shared=shared)  # the same prefix, new tails
        check_engine(hf, engine.generate(batch, PARAMS), batch, prompt_logits=False)
        cached = shared // alignment * alignment
        assert engine.kv_cache_manager.prefix_cache_stats.hits - hits >= len(tails) * cached


# ---- configs and errors -----------------------------------------------------------------------


def test_config_translation(checkpoint):
    _, path = checkpoint
    cfg = deepseek_v4_config_from_hf(read_hf_config(path), name="x")
    assert cfg.layer_types == tuple(V4["layer_types"])
    assert cfg.mlp_layer_types == tuple(V4["mlp_layer_types"])
    assert (cfg.csa_compress_rate, cfg.hca_compress_rate, cfg.qk_rope_head_dim) == (4, 8, 8)
    assert (cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk) == (16, 16, 4)
    assert cfg.rope_scaling is None and cfg.rope_theta == 10000.0
    scaling = cfg.compress_rope_scaling
    assert scaling is not None and (scaling.rope_type, scaling.factor) == ("yarn", 4.0)
    assert scaling.attention_factor == 1.0 and cfg.compress_rope_theta == 160000.0
    with pytest.raises(ValueError, match=r"DeepSeek-V4 model.*load_deepseek_v4"):
        config_from_hf(read_hf_config(path))


def test_legacy_config_fields_fold_in_as_transformers_does():
    hf = {
        "architectures": ["DeepseekV4ForCausalLM"], "num_hidden_layers": 4,
        "compress_ratios": [0, 4, 128, 4], "num_hash_layers": 1, "qk_rope_head_dim": 64,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 4096},
    }  # fmt: skip
    cfg = deepseek_v4_config_from_hf(hf)
    assert cfg.layer_types == (SLIDING, CSA, HCA, CSA)
    assert cfg.mlp_layer_types == ("hash_moe", "moe", "moe", "moe")
    assert cfg.qk_rope_head_dim == 64 and cfg.rope_scaling is None
    assert cfg.compress_rope_scaling is not None and cfg.compress_rope_scaling.factor == 16
    assert cfg.compress_rope_scaling.attention_factor == 1.0


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
        (dict(num_hidden_layers=6, layer_types=V4["layer_types"] + [SLIDING],
              mlp_layer_types=V4["mlp_layer_types"] + ["moe"]), r"missing \['model\.layers\.5\."),
        (dict(layer_types=[SLIDING] * 5), r"unexpected \['model\.layers\.1\.self_attn\.compress"),
        (dict(q_lora_rank=24), r"q_a_norm\.weight .*has shape \(32,\), the config implies"),
        (dict(num_key_value_heads=2), "shared-KV"),
        (dict(layer_types=["global"] * 5), r"layer_types needs num_layers=5 entries from"),
        (dict(quantization_config={"quant_method": "fp8"}), "weight_block_size"),
    ],
)  # fmt: skip
def test_loading_errors_say_what_to_fix(checkpoint, tmp_path, changes, message):
    _, path = checkpoint
    with pytest.raises(ValueError, match=message):
        load_deepseek_v4(edited(path, tmp_path, **changes), DeepseekV4WindowBackend)


def test_original_names_and_multi_token_prediction_weights_load(checkpoint, tmp_path):
    # transformers saves DeepSeek's own names (`attn.wq_a`, `ffn.experts.0.w1`, ...); real
    # checkpoints also carry `mtp.*` modules, which are dropped
    from safetensors.torch import load_file, save_file

    hf, path = checkpoint
    target = edited(path, tmp_path)
    state = load_file(target / "model.safetensors")
    assert "model.layers.1.attn.compressor.ape" in state
    state["mtp.0.eh_proj.weight"] = torch.zeros(64, 128)
    save_file(state, target / "model.safetensors")
    ours, _ = load_deepseek_v4(target, DeepseekV4WindowBackend)
    (logits,) = prefill_logits(ours, [[5, 6, 7]], block_size=8)
    assert (logits - hf_logits(hf, [5, 6, 7])).abs().max() < 1e-4


def test_preset_runs_in_the_engine_with_balanced_groups():
    cfg = V4_PRESETS["deepseek-v4-like"]
    assert {cfg.layer_count(kind) for kind in (SLIDING, CSA, HCA)} >= {1}
    engine = LLMEngine("deepseek-v4-like", kv_cache_memory="1MiB", max_model_len=128)
    assert isinstance(engine.model, DeepseekV4ForCausalLM)
    (out,) = engine.generate(["The cache"], SamplingParams(max_tokens=4))
    assert len(out.output_token_ids) == 4
    groups = engine.kv_cache_report.groups
    managers = [(g["manager"], g["block_size"]) for g in groups]
    assert managers == [("SlidingWindowManager", 16)] * 5 + [("FullAttentionManager", 64)]
    assert all(g["wasted_bytes_per_block"] == 0 for g in groups)


# ---- exact ties in the indexer's top-k ----------------------------------------------------------


class LowerEntryFirst:
    """transformers' indexer with `topk` ties broken toward the lower entry, the rule of
    `deepseek_v4_compressed.top_entries` (torch's own tie order depends on the tensor's width,
    so neither side of a tie is more right; this makes both sides take the same one). Counts
    the rows whose k-th and (k+1)-th visible scores tie."""

    def __init__(self, monkeypatch):
        from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf_v4

        self.ties = 0
        forward = hf_v4.DeepseekV4Indexer.forward
        plain_topk = torch.Tensor.topk

        def stable_topk(x, k, dim=-1, *args, **kwargs):
            order = x.sort(dim=dim, descending=True, stable=True)
            values, indices = order.values.narrow(dim, 0, k), order.indices.narrow(dim, 0, k)
            if x.shape[dim] > k:
                edge, after = values.select(dim, k - 1), order.values.select(dim, k)
                self.ties += int(((edge == after) & torch.isfinite(edge)).sum())
            return torch.return_types.topk((values, indices))

        def patched(module, *args, **kwargs):
            monkeypatch.setattr(torch.Tensor, "topk", stable_topk)
            try:
                return forward(module, *args, **kwargs)
            finally:
                monkeypatch.setattr(torch.Tensor, "topk", plain_topk)

        monkeypatch.setattr(hf_v4.DeepseekV4Indexer, "forward", patched)


@pytest.fixture(scope="module")
def tied_checkpoint(tmp_path_factory):
    # 4 indexer heads (the preset's): entries whose every head's relu is 0 score exactly 0
    hf = make_v4(index_n_heads=4)
    return hf, save_hf_model(hf, tmp_path_factory.mktemp("v4-ties"))


@pytest.mark.parametrize("budget", [512, 13])
def test_batched_requests_with_indexer_ties_match_transformers_per_prompt(
    tied_checkpoint, monkeypatch, budget
):
    """Prompts of different lengths generated together (one step each, or 13-token chunks
    mixed with decodes) give each prompt transformers' logits and greedy tokens, run alone,
    although many top-k choices are exact ties: a request's picks do not depend on its
    neighbours' entries."""
    hf, path = tied_checkpoint
    ties = LowerEntryFirst(monkeypatch)
    engine = LLMEngine(
        str(path), max_model_len=112, max_num_batched_tokens=budget, block_size=8,
        kv_cache_memory=MEMORY, enable_prefix_caching=False,
    )  # fmt: skip
    batch = prompts([61, 35, 79, 46, 5], seed=3)
    check_engine(hf, engine.generate(batch, PROMPT_PARAMS), batch)
    assert ties.ties > 0, "no top-k tie: the test no longer covers them"
