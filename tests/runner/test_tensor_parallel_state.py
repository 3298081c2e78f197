"""Tensor parallelism over state layers on CPU (gloo, one process per rank, float32): Mamba-2
hybrids and Qwen3-Next split by heads give one device's greedy tokens and logprobs, under
chunked prefill and with prefix hits ("align" mode); each rank plans its state blocks from its
own heads; what the ranks cannot split is refused before any process starts."""

from __future__ import annotations

import attrs
import pytest
import torch

from tests.models.hf_models import make_family_model, save_hf_model
from tests.runner.test_tensor_parallel import PARAMS, check_equal_to_one_device
from unified_attn import LLMEngine
from unified_attn.managers.state import StateManager
from unified_attn.models.families import family_of
from unified_attn.models.hybrid_shapes import HYBRID_PRESETS
from unified_attn.models.real_shapes import REAL_SHAPES

# float32 transformers checkpoints (tests/models/hf_models.py, 8 Mamba heads of 16, state 16)
CHECKPOINTS = {
    # one group: B and C replicated, the gated norm summed across the ranks
    "mamba2-one-group": lambda: make_family_model("mamba2", n_groups=1),
    # two groups split; an attention block with partial RoPE
    "bamba": lambda: make_family_model("bamba"),
    # squared-ReLU experts with grouped sigmoid routing and a shared expert, NoPE attention
    "nemotron-h-moe": lambda: make_family_model("nemotron-h-moe"),
    # one group; SwiGLU experts plus the shared MLP, Granite's multipliers
    "granite-4.0-h-one-group": lambda: make_family_model("granite-4.0-h", mamba_n_groups=1),
    # gated delta-nets (2 key heads, 4 value heads) and a gated attention layer, MoE
    "qwen3-next": lambda: make_family_model("qwen3-next"),
}
MEMORY = "2MiB"


def state_page_bytes(engine: LLMEngine) -> set[int]:
    """The page bytes of rank 0's state groups (one layer each, or a few of one shape)."""
    groups = engine.worker.plan.groups
    return {g.page_bytes() // len(g.layers) for g in groups if g.manager_cls is StateManager}


@pytest.mark.parametrize("family", sorted(CHECKPOINTS))
def test_state_layers_split_by_heads_give_the_tokens_of_one_device(family, tmp_path):
    """Prompts of 48, 50 and 24 tokens in steps of 48: the 50-token one is chunked."""
    path = save_hf_model(CHECKPOINTS[family](), tmp_path / family)
    engine = check_equal_to_one_device(str(path), 2, kv_cache_memory=MEMORY,
                                       max_num_batched_tokens=48)  # fmt: skip
    assert len(engine.rank_num_blocks) == 2


def test_a_rank_sizes_its_state_blocks_for_its_heads(tmp_path):
    """Mamba2 with one group on 2 ranks: a rank's block holds 4 heads' `[16, 16]` SSM states
    and the convolution inputs of its 64 x channels and the replicated B and C (16 each)."""
    path = save_hf_model(CHECKPOINTS["mamba2-one-group"](), tmp_path / "mamba2")
    engine = LLMEngine(str(path), tensor_parallel_size=2, kv_cache_memory=MEMORY)
    try:
        ranks = state_page_bytes(engine)
    finally:
        engine.shutdown()
    one = state_page_bytes(LLMEngine(str(path), kv_cache_memory=MEMORY))
    conv, ssm = 3 * (64 + 2 * 16) * 4, 4 * 16 * 16 * 4  # float32
    assert ranks == {conv + ssm} and one == {3 * (128 + 2 * 16) * 4 + 2 * ssm}


def test_prefix_hits_over_split_states_give_the_tokens_of_one_device(tmp_path):
    """Qwen3-Next in "align" mode, chunks of 13 tokens: a second batch sharing 32, 40 and 64
    tokens of the first resumes from the ranks' cached states."""
    path = str(save_hf_model(CHECKPOINTS["qwen3-next"](), tmp_path / "qwen3-next"))
    gen = torch.Generator().manual_seed(7)
    prefix = torch.randint(0, 128, (64,), generator=gen).tolist()
    tails = [torch.randint(0, 128, (5,), generator=gen).tolist() for _ in range(3)]
    batches = [
        [prefix + tails[0]],
        [prefix[:n] + t for n, t in zip((32, 40, 64), tails, strict=True)],
    ]
    options = dict(kv_cache_memory=MEMORY, block_size=8, max_num_batched_tokens=13,
                   mamba_cache_mode="align")  # fmt: skip
    single = LLMEngine(path, **options)
    want = [single.generate(batch, PARAMS[0]) for batch in batches]
    engine = LLMEngine(path, tensor_parallel_size=2, **options)
    try:
        got = [engine.generate(batch, PARAMS[0]) for batch in batches]
        hits = engine.kv_cache_manager.group_stats()
    finally:
        engine.shutdown()
    assert sum(o.num_cached_tokens for o in got[1]) > 0
    assert all(g["hit_blocks"] > 0 for g in hits), hits  # state and attention groups
    for a, b in zip([*got[0], *got[1]], [*want[0], *want[1]], strict=True):
        assert a.output_token_ids == b.output_token_ids
        for x, y in zip(a.outputs[0].logprobs or [], b.outputs[0].logprobs or [], strict=True):
            assert all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in y)


def test_four_ranks_share_replicated_groups_and_norms():
    """The preset's 8 Mamba heads in 2 groups on 4 ranks: each group (B, C and its gated norm)
    spans two ranks, as does each of its 2 KV heads."""
    check_equal_to_one_device("tiny-mamba-hybrid", 4, max_num_batched_tokens=48)


@pytest.mark.parametrize(
    "model, size, message",
    [
        ("tiny-mamba-hybrid", 3, r"tensor_parallel_size=3 does not divide the 8 Mamba-2 heads "
                                 r"of 'tiny-mamba-hybrid' \(num_heads\); use a divisor"),
        ("tiny-mamba-hybrid", 8, "does not divide the 4 attention heads"),
    ],
)  # fmt: skip
def test_what_cannot_be_split_is_refused_before_any_process_starts(model, size, message):
    with pytest.raises(ValueError, match=message):
        LLMEngine(model, tensor_parallel_size=size)


def test_check_names_the_groups_and_the_key_heads():
    """Groups that neither divide nor are divided by the ranks; Qwen3-Next's key heads."""
    hybrid = HYBRID_PRESETS["tiny-mamba-hybrid"]
    odd = attrs.evolve(hybrid, mamba=attrs.evolve(hybrid.mamba, num_heads=12, num_groups=3,
                                                  norm_groups=3))  # fmt: skip
    with pytest.raises(ValueError, match=r"Mamba-2 num_groups=3 of 'odd': one must divide"):
        family_of(odd).check_tensor_parallel(odd, 2, "odd")
    qwen = REAL_SHAPES["qwen3-next-80b-a3b"]
    few = attrs.evolve(qwen, gated_delta=attrs.evolve(qwen.gated_delta, num_k_heads=2))
    with pytest.raises(ValueError, match=r"does not divide the 2 key heads of .* gated delta"):
        family_of(few).check_tensor_parallel(few, 4, "few")
