"""GPU-only checks of the Triton backend (run through the device tool): batch invariance,
CUDA-graph replay against eager, and the engine against the reference backend."""

import pytest
import torch

from unified_attn import LLMEngine, SamplingParams
from unified_attn.backends.triton.ops import unified_attention
from unified_attn.models import PRESETS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

HQ, HKV, D, BS = 32, 8, 128, 16


def attention_rows(cache, requests, table_rows, q_rows, invariant):
    """Run one batch; returns the output rows of every request."""
    new = [n for _, n in requests]
    qsl = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    seq_lens = torch.tensor([c + n for c, n in requests], dtype=torch.int32, device="cuda")
    width = max(len(r) for r in table_rows)
    table = torch.zeros(len(requests), width, dtype=torch.int32, device="cuda")
    for i, row in enumerate(table_rows):
        table[i, : len(row)] = torch.tensor(row, dtype=torch.int32)
    q = torch.cat(q_rows)
    out = torch.empty_like(q)
    unified_attention(
        q, cache[:, 0], cache[:, 1], out, query_start_loc=qsl, seq_lens=seq_lens,
        block_table=table, num_seqs=len(requests), max_query_len=max(new), scale=D**-0.5,
        batch_invariant=invariant,
    )  # fmt: skip
    return list(out.split(new))


@pytest.mark.parametrize("target", [(3000, 1), (100, 300)], ids=["decode", "prefill"])
def test_batch_invariant_mode_is_bitwise_identical_across_batches(target):
    torch.manual_seed(0)
    cache = torch.randn(4096, 2, BS, HKV, D, device="cuda", dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(1)

    def companion():
        c = int(torch.randint(0, 2000, (1,), generator=gen))
        n = (
            1
            if torch.rand(1, generator=gen) < 0.7
            else int(torch.randint(2, 64, (1,), generator=gen))
        )
        blocks = (torch.randint(300, 4096, (-(-(c + n) // BS),), generator=gen)).tolist()
        return (c, n), blocks, torch.randn(n, HQ, D, device="cuda", dtype=torch.bfloat16)

    t_blocks = list(range(1, -(-sum(target) // BS) + 1))
    t_q = torch.randn(target[1], HQ, D, device="cuda", dtype=torch.bfloat16)
    alone = attention_rows(cache, [target], [t_blocks], [t_q], True)[0]
    for size, position in ((8, 3), (64, 40)):
        others = [companion() for _ in range(size - 1)]
        reqs = [o[0] for o in others]
        rows = [o[1] for o in others]
        qs = [o[2] for o in others]
        reqs.insert(position, target)
        rows.insert(position, t_blocks)
        qs.insert(position, t_q)
        got = attention_rows(cache, reqs, rows, qs, True)[position]
        assert torch.equal(got, alone), f"batch of {size}: not bitwise identical"


def generate(**kwargs):
    engine = LLMEngine("tiny-llama", device="cuda", kv_cache_memory="256MiB", **kwargs)
    prompts = [[(7 * i + j) % 256 for j in range(20 + 13 * i)] for i in range(6)]
    params = SamplingParams(max_tokens=24, ignore_eos=True, return_logits=True)
    return engine, engine.generate(prompts, params)


def test_cuda_graph_replay_equals_eager():
    graphs_engine, with_graphs = generate(dtype="float32", backend="triton")
    _, eager = generate(dtype="float32", backend="triton", cuda_graphs=False)
    assert graphs_engine.runner.graphs is not None and graphs_engine.runner.graphs.num_replays > 0
    for a, b in zip(with_graphs, eager, strict=True):
        assert a.output_token_ids == b.output_token_ids
        assert (a.logits - b.logits).abs().max() < 1e-4


def test_engine_picks_triton_on_cuda_and_matches_the_reference_backend():
    triton_engine, fast = generate(dtype="float32")
    assert triton_engine.backend_cls.name == "triton"
    _, ref = generate(dtype="float32", backend="reference")
    for a, b in zip(fast, ref, strict=True):
        assert a.output_token_ids == b.output_token_ids
        assert (a.logits - b.logits).abs().max() < 1e-3


def test_bf16_engine_first_token_logits_stay_close_to_the_reference():
    _, fast = generate(dtype="bfloat16")
    _, ref = generate(dtype="bfloat16", backend="reference")
    for a, b in zip(fast, ref, strict=True):
        assert (a.logits[0] - b.logits[0]).abs().max() < 0.1  # same prompt, bf16 rounding


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_runs_on_triton_with_the_reference_outputs(preset):
    prompts = [[(11 * i + j) % 256 for j in range(90 + 17 * i)] for i in range(4)]
    params = SamplingParams(max_tokens=16, ignore_eos=True, return_logits=True)
    outputs = {}
    for backend in ("triton", "reference"):
        engine = LLMEngine(preset, device="cuda", dtype="float32", backend=backend,
                           kv_cache_memory="256MiB", max_num_batched_tokens=64)  # fmt: skip
        outputs[backend] = engine.generate(prompts, params)
    for a, b in zip(outputs["triton"], outputs["reference"], strict=True):
        assert a.output_token_ids == b.output_token_ids
        assert (a.logits - b.logits).abs().max() < 1e-3
