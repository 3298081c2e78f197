"""Prefix caching of Qwen3-Next's gated delta-net layers in each `mamba_cache_mode` against
transformers: "align" and "all" restore cached convolution and recurrent states and report hits
in every group; "all" checkpoints every block boundary a one-step prompt crosses.

The tiny model's pages balance at 32-token blocks (three 5.5 KiB states next to 512 bytes of
keys and values per token), so hits come in multiples of 32 tokens."""

import pytest
import torch

from tests.models.hf_models import make_family_model, save_hf_model
from tests.runner.test_engine_hf_parity import PARAMS, check_against_hf, prompts
from unified_attn import LLMEngine

MEMORY = "2MiB"
SHARED = (32, 40, 64)  # tokens each prompt of the second batch shares with the first
ALIGNMENT = 32


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    hf = make_family_model("qwen3-next")
    return hf, save_hf_model(hf, tmp_path_factory.mktemp("qwen3-next"))


def run_shared_prefixes(hf, path, mode, budget):
    """A 67-token prompt, then prompts sharing SHARED of its tokens; the hits of the second."""
    engine = LLMEngine(str(path), kv_cache_memory=MEMORY, block_size=8,
                       max_num_batched_tokens=budget, mamba_cache_mode=mode)  # fmt: skip
    assert engine.kv_cache_manager.coordinator.alignment == ALIGNMENT
    first = prompts([3], seed=1, shared=64)
    gen = torch.Generator().manual_seed(7)
    second = [first[0][:n] + torch.randint(0, 128, (5,), generator=gen).tolist() for n in SHARED]
    for batch in (first, second):
        outputs = engine.generate(batch, PARAMS)
        check_against_hf(hf, outputs, batch, prompt_logits=False)
    return engine, [o.num_cached_tokens for o in outputs]


@pytest.mark.parametrize("mode,budget,hits", [
    ("align", 13, [32, 32, 64]),  # chunks of 13: the scheduler ends one on each boundary
    ("align", 80, [0, 32, 64]),  # one step: a checkpoint only where it ends (64)
    ("all", 80, [32, 32, 64]),  # one step, checkpoints at 32 and 64
])  # fmt: skip
def test_state_prefix_hits_match_transformers(qwen3_next, mode, budget, hits):
    hf, path = qwen3_next
    engine, got = run_shared_prefixes(hf, path, mode, budget)
    assert got == hits
    stats = engine.kv_cache_manager.group_stats()
    assert all(g["hit_blocks"] > 0 for g in stats), stats  # state and attention groups
