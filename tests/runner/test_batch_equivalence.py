"""Requests generated together give each request what it gets alone.

For every preset (`PRESETS`, `MLA_PRESETS`, `V4_PRESETS`) and every Hugging Face family of the
parity tests, a mix of prompts of different lengths runs as one batch, with and without chunked
prefill, and each request's prompt logits and sampled-token logits are within 1e-5 of the same
request run alone (CPU, float32, the default backends), with the same greedy tokens. Nothing a
layer computes for one request may depend on its neighbours: not the step's longest request
(DeepSeek-V4's lightning indexer used to break top-k ties by the step's entry count), not the
row order, not the other requests' windows, entries or states.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.models.hf_models import FAMILIES, make_family_model, make_hf_model, save_hf_model
from unified_attn import LLMEngine, SamplingParams
from unified_attn.models import MLA_PRESETS, PRESETS, V4_PRESETS

TOLERANCE = 1e-5  # float32: batches change rounding in the last bits, nothing more
MAX_MODEL_LEN = 160
LENGTHS = (61, 35, 79, 46, 7)  # the soak's reduced case, plus a prompt shorter than a block
PARAMS = SamplingParams(max_tokens=12, ignore_eos=True, return_logits=True, prompt_logits=True)
# one step for every prompt, or 24-token chunks that mix prefills with decodes
BUDGETS = {"whole": 512, "chunked": 24}
HF_FAMILIES = {
    **{name: FAMILIES[name] for name in FAMILIES},
    "llama": ("llama", dict(num_hidden_layers=2), {}),
    "qwen2-sliding": (
        "qwen2",
        dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=8, max_window_layers=1),
        {},
    ),
}


def prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in LENGTHS]


def engine(model: str, budget: int) -> LLMEngine:
    # block 32: the soak's case (V4's groups of 16 and 64 tokens per block); no prefix cache,
    # so a request alone and in a batch compute the same tokens
    return LLMEngine(
        model,
        seed=2,
        max_model_len=MAX_MODEL_LEN,
        block_size=32,
        max_num_batched_tokens=budget,
        enable_prefix_caching=False,
    )


def check_batch_equals_alone(model: str, budget: int) -> None:
    batched_engine = engine(model, budget)
    batch = prompts(min(batched_engine.vocab_size, 250))
    together = batched_engine.generate(batch, PARAMS)
    alone_engine = engine(model, BUDGETS["whole"])
    for i, prompt in enumerate(batch):
        (alone,) = alone_engine.generate([prompt], PARAMS)
        mine = together[i]
        where = f"{model}: request {i} ({len(prompt)} tokens)"
        prompt_gap = (mine.prompt_logits - alone.prompt_logits).abs().max().item()
        assert prompt_gap < TOLERANCE, f"{where}: prompt logits differ by {prompt_gap:.2e}"
        assert mine.output_token_ids == alone.output_token_ids, f"{where}: greedy tokens differ"
        gap = (mine.logits - alone.logits).abs().max().item()
        assert gap < TOLERANCE, f"{where}: logits differ by {gap:.2e}"


PRESET_NAMES = sorted([*PRESETS, *MLA_PRESETS, *V4_PRESETS])


@pytest.mark.parametrize("budget", sorted(BUDGETS))
@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_preset_batch_equals_each_request_alone(preset, budget):
    check_batch_equals_alone(preset, BUDGETS[budget])


@pytest.fixture(scope="module")
def family_checkpoints(tmp_path_factory):
    built: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in built:
            model_type, overrides, _ = HF_FAMILIES[name]
            hf = (
                make_family_model(name)
                if name in FAMILIES
                else make_hf_model(model_type, **overrides)
            )
            built[name] = str(save_hf_model(hf, tmp_path_factory.mktemp(name)))
        return built[name]

    return get


@pytest.mark.parametrize("budget", sorted(BUDGETS))
@pytest.mark.parametrize("family", sorted(HF_FAMILIES))
def test_family_batch_equals_each_request_alone(family_checkpoints, family, budget):
    check_batch_equals_alone(family_checkpoints(family), BUDGETS[budget])


def test_v4_indexer_breaks_ties_toward_the_lower_entry():
    """Exact ties are common (relu zeroes every head of an entry); the pick must not depend on
    how many entries the step's longest request has."""
    from unified_attn.backends.deepseek_v4_compressed import top_entries

    scores = torch.tensor([[0.0, -0.0, 1.0, float("-inf"), -2.0, 0.0, 3e-38, -1e-38]])
    assert top_entries(scores, 8).tolist() == [[2, 6, 0, 1, 5, 7, 4, 3]]
    wider = torch.cat([scores, torch.zeros(1, 13)], dim=1)  # a longer neighbour's entries
    wider[:, 8:] = float("-inf")
    assert top_entries(wider, 4).tolist() == top_entries(scores, 4).tolist() == [[2, 6, 0, 1]]
    values = torch.randn(40, 300)
    assert torch.equal(top_entries(values, 7), values.topk(7).indices)  # no ties: topk's order
