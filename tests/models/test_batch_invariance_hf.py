"""Batch-invariant mode end to end on the CPU for the Hugging Face families loaded from saved
checkpoints (tests/models/hf_models.FAMILIES; float32, the reference attention backend): one
request's prompt logits and 8 generated-token logits are bitwise the same alone, as the first of a
batch of 8 mixed requests, under two chunked-prefill budgets, and when its prefix comes from the
prefix cache.

Mirrors tests/models/test_batch_invariance_engine.py (the presets), whose module docstring notes
the known gap (prompt chunks of 1-3 tokens): the budgets here give the target chunks of 4+.
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import attrs
import pytest
import torch

from tests.models.hf_models import FAMILIES, make_family_model, save_hf_model
from tests.models.test_batch_invariance_engine import companions
from unified_attn import LLMEngine, SamplingParams

# The tiny models have a vocabulary of 128: ids 0-2 are pad/bos/eos, so prompts use [3, 127].
LOW, HIGH = 3, 128
TARGET = [(99 * 31 + j * 7) % (HIGH - LOW) + LOW for j in range(45)]
WANT_LOGITS = SamplingParams(max_tokens=8, ignore_eos=True, prompt_logits=True, return_logits=True)
MEMORY = "2MiB"  # ample for the tiny models, and quick to set up (as test_engine_hf_parity)
CHECKPOINTS = tempfile.TemporaryDirectory(prefix="bi-hf-")  # removed with the module


@attrs.frozen
class Logits:
    prompt: torch.Tensor | None  # [45, vocab]
    generated: torch.Tensor  # [8, vocab]


@functools.cache
def checkpoint(family: str) -> str:
    """The family's tiny random checkpoint, saved once per session."""
    path = Path(CHECKPOINTS.name) / family
    return str(save_hf_model(make_family_model(family), path))


def make_engine(family: str, budget: int) -> LLMEngine:
    return LLMEngine(
        checkpoint(family),
        backend="reference",
        batch_invariant=True,
        max_num_batched_tokens=budget,
        block_size=16,
        max_num_seqs=16,
        kv_cache_memory=MEMORY,
    )


def target_logits(engine: LLMEngine, others: int = 0, seed: int = 0, **params) -> Logits:
    """The target's logits, generated first among `others` companion requests."""
    prompts, companion_params = companions(others, seed, LOW, HIGH)
    wanted = attrs.evolve(WANT_LOGITS, **params)
    out = engine.generate([TARGET, *prompts], [wanted, *companion_params])[0]
    assert out.logits is not None
    return Logits(out.prompt_logits, out.logits)


@functools.cache
def alone(family: str) -> Logits:
    return target_logits(make_engine(family, 512))


def differs(what: str, got: torch.Tensor, want: torch.Tensor) -> str | None:
    """None when bitwise equal, else which rows differ and by how much at most."""
    if torch.equal(got, want):
        return None
    rows = (got != want).any(-1).nonzero().flatten().tolist()
    return f"{what} logits differ in rows {rows}, by up to {(got - want).abs().max():.3g}"


def assert_same(got: Logits, want: Logits, case: str) -> None:
    problems = [differs("generated", got.generated, want.generated)]
    if got.prompt is not None:
        assert want.prompt is not None
        problems.insert(0, differs("prompt", got.prompt, want.prompt))
    found = [p for p in problems if p is not None]
    assert not found, f"{case}: " + "; ".join(found)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_alone_equal_logits_in_a_batch_of_8(family):
    batch = target_logits(make_engine(family, 512), others=7)
    assert_same(batch, alone(family), "in a batch of 8")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_prompt_chunking_and_prefix_hits_keep_the_logits(family):
    want = alone(family)
    engine = make_engine(family, 16)  # the prompt in chunks of 16, 16, 13
    assert_same(target_logits(engine), want, "budget 16")
    hits = engine.kv_cache_manager.prefix_cache_stats.hits
    hit = target_logits(engine, prompt_logits=False)  # reads the blocks the first run cached
    assert engine.kv_cache_manager.prefix_cache_stats.hits - hits >= 32
    assert_same(hit, want, "prefix-cache hit")
    mixed = make_engine(family, 37)  # 37 then 8, beside 3 companions prefilling in chunks
    assert_same(target_logits(mixed, others=3, seed=1), want, "budget 37")
