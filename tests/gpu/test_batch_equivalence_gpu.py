"""Requests generated together on the Triton backends of CUDA give each request what it gets
alone (tests/runner/test_batch_equivalence.py on the GPU): DeepSeek-V4 (`triton-deepseek-v4`,
its indexer scores and gathered attention) and DeepSeek-V3 (`triton-mla`), with the decode
steps in CUDA graphs.

float32: within 1e-4 of alone (the kernels' float32 products). bf16: batching moves a
request's logits no further than bf16 itself does, measured in the same run as the distance
of the request alone in bf16 to the request alone in float32 (mean and max), with the same
greedy tokens up to the first step where the alone run's top two are within that distance.
"""

from __future__ import annotations

import random

import pytest
import torch

from unified_attn import LLMEngine, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

LENGTHS = (61, 35, 79, 46, 7, 200)
PARAMS = SamplingParams(max_tokens=12, ignore_eos=True, return_logits=True, prompt_logits=True)
PRESETS = {"deepseek-v4-like": "triton-deepseek-v4", "deepseek-v3-like": "triton-mla"}


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 250) for _ in range(n)] for n in LENGTHS]


def run(preset: str, dtype: str, budget: int, batch: list[list[int]]) -> list:
    engine = LLMEngine(preset, device="cuda", dtype=dtype, max_model_len=320, block_size=32,
                       max_num_batched_tokens=budget, kv_cache_memory="512MiB",
                       enable_prefix_caching=False)  # fmt: skip
    assert engine.backend_cls.name == PRESETS[preset]
    return engine.generate(batch, PARAMS)


def alone(preset: str, dtype: str) -> list:
    return [run(preset, dtype, 512, [p])[0] for p in prompts()]


def logits_while_tokens_agree(mine, ref, tie: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt and sampled logits of both runs, as long as their greedy tokens agree; a
    different token is allowed only where `ref`'s top two were within `tie`."""
    n = len(ref.output_token_ids)
    for j, (a, b) in enumerate(zip(mine.output_token_ids, ref.output_token_ids, strict=True)):
        if a != b:
            top = ref.logits[j].float().topk(2).values
            assert top[0] - top[1] <= tie, f"token {j}: {a} != {b} without a tie"
            n = j + 1
            break
    mine_all = torch.cat([mine.prompt_logits.float(), mine.logits[:n].float()])
    ref_all = torch.cat([ref.prompt_logits.float(), ref.logits[:n].float()])
    return mine_all, ref_all


@pytest.mark.parametrize("budget", [512, 24])
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_float32_batch_equals_each_request_alone(preset, budget):
    for mine, ref in zip(run(preset, "float32", budget, prompts()), alone(preset, "float32"),
                         strict=True):  # fmt: skip
        assert mine.output_token_ids == ref.output_token_ids
        gap = (torch.cat([mine.prompt_logits, mine.logits])
               - torch.cat([ref.prompt_logits, ref.logits])).abs().max().item()  # fmt: skip
        assert gap < 1e-4, f"{preset}: batch differs from alone by {gap:.2e}"


@pytest.mark.parametrize("budget", [512, 24])
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_bf16_batch_is_as_close_to_alone_as_bf16_is_to_float32(preset, budget):
    exact, single = alone(preset, "float32"), alone(preset, "bfloat16")
    # bf16's own distance, on the prompt logits (teacher-forced: no divergence)
    rounding = torch.cat([(s.prompt_logits.float() - e.prompt_logits.float()).abs().flatten()
                          for s, e in zip(single, exact, strict=True)])  # fmt: skip
    tie = rounding.max().item()
    gaps = []
    for mine, ref in zip(run(preset, "bfloat16", budget, prompts()), single, strict=True):
        a, b = logits_while_tokens_agree(mine, ref, tie)
        gaps.append((a - b).abs().flatten())
    gap = torch.cat(gaps)
    print(
        f"{preset} budget {budget}: batch vs alone mean {gap.mean():.3g} max {gap.max():.3g};"
        f" bf16 vs float32 mean {rounding.mean():.3g} max {rounding.max():.3g}"
    )
    assert gap.mean() <= rounding.mean() and gap.max() <= rounding.max()
