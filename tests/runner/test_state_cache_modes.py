"""Prefix caching of state-space hybrids in each `mamba_cache_mode` against transformers:
"align" and "all" restore a cached state and report hits in every group, "none" caches no
state (so no hit at all); prompt chunks that do not line up with the scan's chunks.

The tiny model's pages balance at 32-token blocks (a 10 KiB state next to 256 bytes of keys and
values per token), so hits come in multiples of 32 tokens."""

import pytest
import torch

from tests.models.hf_models import make_family_model, save_hf_model
from tests.runner.test_engine_hf_parity import PARAMS, check_against_hf, prompts
from unified_attn import LLMEngine

MEMORY = "2MiB"
SHARED = (32, 40, 64)  # tokens each prompt of the second batch shares with the first
ALIGNMENT = 32
EXPECTED_HITS = sum(n // ALIGNMENT * ALIGNMENT for n in SHARED)


@pytest.fixture(scope="module")
def nemotron(tmp_path_factory):
    hf = make_family_model("nemotron-h")
    return hf, save_hf_model(hf, tmp_path_factory.mktemp("nemotron-h"))


def run_shared_prefixes(path, mode, budget):
    """A 64-token prefix, then prompts sharing SHARED of its tokens."""
    engine = LLMEngine(str(path), kv_cache_memory=MEMORY, block_size=8,
                       max_num_batched_tokens=budget, mamba_cache_mode=mode)  # fmt: skip
    assert engine.kv_cache_manager.coordinator.alignment == ALIGNMENT
    first = prompts([3], seed=1, shared=64)
    prefix = first[0][:64]
    gen = torch.Generator().manual_seed(7)
    second = [prefix[:n] + torch.randint(0, 128, (5,), generator=gen).tolist() for n in SHARED]
    return engine, [first, second]


@pytest.mark.parametrize("mode", ["align", "all"])
@pytest.mark.parametrize("budget", [13, 80])  # chunks of 13 (not the scan's 8), or one step
def test_state_prefix_hits_match_transformers(nemotron, mode, budget):
    hf, path = nemotron
    engine, batches = run_shared_prefixes(path, mode, budget)
    for batch in batches:
        outputs = engine.generate(batch, PARAMS)
        check_against_hf(hf, outputs, batch, prompt_logits=False)
    stats = engine.kv_cache_manager.group_stats()
    assert sum(o.num_cached_tokens for o in outputs) >= EXPECTED_HITS - ALIGNMENT
    assert all(g["hit_blocks"] > 0 for g in stats), stats  # state and attention groups


def test_all_mode_checkpoints_every_boundary_of_a_one_step_prompt(nemotron):
    """A 67-token prompt in one step (cut at 64): "all" leaves checkpoints at 32 and 64, so the
    second batch hits every shared block; "align" only where steps end (64, and 32 once the
    second batch's first prompt has run to it)."""
    _, path = nemotron
    hits = {}
    for mode in ("align", "all"):
        engine, batches = run_shared_prefixes(path, mode, 80)
        for batch in batches:
            outputs = engine.generate(batch, PARAMS)
        hits[mode] = [o.num_cached_tokens for o in outputs]
    assert hits["all"] == [32, 32, 64]
    assert hits["align"] == [0, 32, 64]


def test_none_mode_caches_no_state(nemotron):
    hf, path = nemotron
    engine, batches = run_shared_prefixes(path, "none", 80)
    for batch in batches:
        check_against_hf(hf, engine.generate(batch, PARAMS), batch, prompt_logits=False)
    assert engine.kv_cache_manager.prefix_cache_stats.hits == 0


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="mamba_cache_mode='some' is not a mode"):
        LLMEngine("tiny-mamba-hybrid", mamba_cache_mode="some")
