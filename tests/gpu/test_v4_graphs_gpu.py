"""DeepSeek-V4 decode steps replay CUDA graphs on the GPU (run through the device tool) and give
what eager steps give: the padded graph steps (docs/deepseek.md) on the reference backends and
on the Triton backends, the latter in bf16 with 128-wide heads, where each layer's attention is
one launch of the Hopper kernel. (The same steps against transformers on the CPU:
tests/models/test_deepseek_v4_graph_steps.py.)"""

from __future__ import annotations

import pytest
import torch

from tests.models.hf_models import save_hf_model
from tests.models.test_deepseek_v4_hf import make_v4
from unified_attn import LLMEngine, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPTS = [[(7 * i + 3 * j) % 120 + 3 for j in range(n)] for i, n in enumerate([70, 9, 33, 1])]
MAX_TOKENS = [24, 12, 24, 5]  # the batch shrinks: steps of 4, 3 (padded to 4), 2 and 1


def generate(path: str, backend: str, dtype: str, graphs: bool):
    engine = LLMEngine(path, backend=backend, device="cuda", dtype=dtype, block_size=8,
                       max_num_seqs=4, max_model_len=128, kv_cache_memory="64MiB",
                       cuda_graphs=graphs)  # fmt: skip
    params = [SamplingParams(max_tokens=n, ignore_eos=True, return_logits=True)
              for n in MAX_TOKENS]  # fmt: skip
    return engine, engine.generate(PROMPTS, params)


@pytest.mark.parametrize(
    ("backend", "dtype", "head_dim", "tolerance"),
    [
        ("deepseek-v4-reference", "float32", 32, 1e-4),
        ("triton-deepseek-v4", "float32", 32, 1e-4),
        ("triton-deepseek-v4", "bfloat16", 128, 0.05),
    ],
)
def test_decode_steps_replay_graphs_and_match_eager_steps(tmp_path, backend, dtype, head_dim,
                                                          tolerance):  # fmt: skip
    path = str(save_hf_model(make_v4(head_dim=head_dim, partial_rotary_factor=8 / head_dim),
                             tmp_path))  # fmt: skip
    _, want = generate(path, backend, dtype, graphs=False)
    engine, got = generate(path, backend, dtype, graphs=True)
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.num_replays >= sum(MAX_TOKENS) // 4
    for a, b in zip(got, want, strict=True):
        # The graph reads max_model_len's compressed entries where the eager step reads the
        # longest request's (hidden ones weigh nothing), so float32 equals eager up to
        # rounding; bf16 compares every logit row up to the first differing token.
        pairs = zip(a.output_token_ids, b.output_token_ids, strict=True)
        same = next((i for i, (x, y) in enumerate(pairs) if x != y), len(a.logits))
        if dtype == "float32":
            assert a.output_token_ids == b.output_token_ids
        assert (a.logits[: same + 1] - b.logits[: same + 1]).abs().max() < tolerance


def test_verification_steps_of_four_tokens_replay_graphs_and_match_eager_steps(tmp_path):
    # ngram drafts of 3: the graphs of 4 tokens per request close a CSA window (rate 4) in
    # every step and an HCA window (rate 8) in every other one, inside the captured graph.
    path = str(save_hf_model(make_v4(), tmp_path))
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12] * 4, [3, 4] * 10, [(5 * j) % 90 + 3 for j in range(17)]]
    params = SamplingParams(max_tokens=24, ignore_eos=True, return_logits=True)
    outputs = []
    for graphs in (False, True):
        engine = LLMEngine(path, backend="triton-deepseek-v4", device="cuda", dtype="float32",
                           block_size=8, max_num_seqs=4, max_model_len=128,
                           kv_cache_memory="64MiB", cuda_graphs=graphs,
                           speculative_method="ngram", num_speculative_tokens=3)  # fmt: skip
        outputs.append(engine.generate(prompts, params))
    assert engine.runner.graphs is not None and engine.runner.graphs.query_lens == (1, 4)
    assert engine.runner.graphs.num_replays > 0 and engine.stats.spec_accepted > 0
    for a, b in zip(*outputs, strict=True):
        assert a.output_token_ids == b.output_token_ids
        assert (a.logits - b.logits).abs().max() < 1e-4
