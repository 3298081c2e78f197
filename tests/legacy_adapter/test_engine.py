"""The engine through the adapter generates exactly what the native backend generates."""

import random

import pytest

from unified_attn import LLMEngine, SamplingParams

ADAPTER = "unified_attn.legacy_adapter.ports:LegacyReferenceAdapter"


def prompts(n=6, seed=0):
    rng = random.Random(seed)
    shared = [rng.randrange(256) for _ in range(40)]
    return [shared + [rng.randrange(256) for _ in range(rng.randint(3, 30))] for _ in range(n)]


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-hybrid"])
def test_generation_through_the_adapter_equals_native_reference(model):
    params = SamplingParams(max_tokens=8, ignore_eos=True, return_logits=True)
    outs = {
        backend: LLMEngine(model, backend=backend, max_num_batched_tokens=32).generate(
            prompts(), params
        )
        for backend in ("reference", ADAPTER)
    }
    for native, legacy in zip(outs["reference"], outs[ADAPTER], strict=True):
        assert legacy.output_token_ids == native.output_token_ids
        assert (legacy.logits - native.logits).abs().max() <= 1e-5


def test_the_engine_reports_the_adapter_and_its_groups():
    engine = LLMEngine("tiny-hybrid", backend=ADAPTER)
    assert engine.backend_cls.name == "legacy-reference"
    managers = [g["manager"] for g in engine.kv_cache_report.groups]
    assert managers == [
        "FullAttentionManager",
        "SlidingWindowManager",
        "SlidingWindowManager",
        "ChunkedLocalAttentionManager",
    ]
