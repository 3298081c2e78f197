"""Batch-invariant mode end to end on the CPU: for every preset (float32, the reference
attention backend), one request's prompt logits and 8 generated-token logits are bitwise the
same alone, inside a batch of 8 mixed requests, under two chunked-prefill budgets, and when its
prefix comes from the prefix cache.

Prompt chunks of 1-3 tokens would take MKL's GEMV/small-GEMM paths in the reference backend's
einsums; in batch-invariant mode it pads them to 4 query rows (a test below ends the prompt
with such chunks). Its learned sinks join the softmax as the first column, whose place does not
move with a chunk's number of keys: gpt-oss-like is invariant under chunking and prefix hits.
"""

from __future__ import annotations

import functools

import attrs
import pytest
import torch

from unified_attn import LLMEngine, SamplingParams
from unified_attn.models import PRESETS

# 150 tokens + 8 generated: longer than every preset's window (64, 128) and chunk (64)
TARGET = [(99 * 31 + j * 7) % 250 + 1 for j in range(150)]
WANT_LOGITS = SamplingParams(max_tokens=8, ignore_eos=True, prompt_logits=True, return_logits=True)


@attrs.frozen
class Logits:
    prompt: torch.Tensor | None  # [150, vocab]
    generated: torch.Tensor  # [8, vocab]


def make_engine(preset: str, budget: int, invariant: bool = True) -> LLMEngine:
    return LLMEngine(
        preset,
        backend="reference",
        batch_invariant=invariant,
        max_num_batched_tokens=budget,
        block_size=16,
        max_num_seqs=16,
    )


def companions(
    count: int, seed: int, low: int = 1, high: int = 250
) -> tuple[list[list[int]], list[SamplingParams]]:
    """`count` prompts of mixed lengths (3-70 tokens, ids in [low, high)), each generating 1-12
    tokens."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 71, (count,), generator=gen).tolist()
    prompts = [torch.randint(low, high, (n,), generator=gen).tolist() for n in lengths]
    params = [
        SamplingParams(max_tokens=int(m), ignore_eos=True)
        for m in torch.randint(1, 13, (count,), generator=gen)
    ]
    return prompts, params


def target_logits(engine: LLMEngine, others: int = 0, seed: int = 0, **params) -> Logits:
    """The target's logits, generated first among `others` companion requests."""
    prompts, companion_params = companions(others, seed)
    wanted = attrs.evolve(WANT_LOGITS, **params)
    out = engine.generate([TARGET, *prompts], [wanted, *companion_params])[0]
    return Logits(out.prompt_logits, out.logits)


@functools.cache
def alone(preset: str, invariant: bool = True) -> Logits:
    return target_logits(make_engine(preset, 512, invariant))


def assert_same(got: Logits, want: Logits) -> None:
    if got.prompt is not None:
        assert want.prompt is not None and torch.equal(got.prompt, want.prompt)
    assert torch.equal(got.generated, want.generated)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_logits_alone_equal_logits_in_a_batch_of_8(preset):
    batch = target_logits(make_engine(preset, 512), others=7)
    assert_same(batch, alone(preset))


@pytest.mark.parametrize(
    "preset",
    [p for p in sorted(PRESETS)],
)
def test_prompt_chunking_and_prefix_hits_keep_the_logits(preset):
    want = alone(preset)
    engine = make_engine(preset, 16)  # the prompt in chunks of 16 (9 of them), then 6
    assert_same(target_logits(engine), want)
    hits = engine.kv_cache_manager.prefix_cache_stats.hits
    hit = target_logits(engine, prompt_logits=False)  # reads the blocks the first run cached
    assert engine.kv_cache_manager.prefix_cache_stats.hits - hits >= 32
    assert_same(hit, want)
    mixed = make_engine(preset, 40)  # 40, 40, 40, 30 beside 3 companions, then decode
    assert_same(target_logits(mixed, others=3, seed=1), want)


@pytest.mark.parametrize("last", [1, 2, 3])
def test_a_short_last_prompt_chunk_keeps_the_logits(last):
    """The prompt's last chunk has 1-3 tokens: attended with copies of its last query as padding
    (below 4 rows MKL's einsums round differently)."""
    engine = make_engine("tiny-llama", 150 - last)
    assert_same(target_logits(engine), alone("tiny-llama"))


# ---- the same checks fail without the mode: they can tell -------------------------------------


def test_without_the_mode_a_batch_changes_the_decode_logits():
    """MKL rounds a decode row differently with 1 and with 8 rows."""
    batch = target_logits(make_engine("tiny-llama", 512, invariant=False), others=7)
    assert not torch.equal(batch.generated, alone("tiny-llama", invariant=False).generated)


def test_without_the_mode_chunking_changes_the_state_layers():
    """The chunkwise linear-attention form rounds by where a step's chunk begins."""
    chunked = target_logits(make_engine("hybrid-linear", 16, invariant=False))
    assert chunked.prompt is not None
    assert not torch.equal(chunked.prompt, alone("hybrid-linear", invariant=False).prompt)
