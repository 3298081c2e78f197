"""GPU-only checks of the fp8 (e4m3) KV cache (run through the device tool): the Triton kernels
in bfloat16 at model shapes against the reference math over the dequantized cache, the cache
write bitwise against torch's cast on the GPU, batch invariance, CUDA-graph replay, and the
engine's prompt logits against the reference backend and the unquantized cache.

`tests/backends/test_fp8_triton.py` and `tests/harness/test_conformance_fp8.py` run on the GPU
too (bfloat16 and the CUDA conformance cells); this file adds what only a GPU can check.
"""

from __future__ import annotations

import pytest
import torch

from unified_attn import LLMEngine, SamplingParams
from unified_attn.backend import LayerConfig
from unified_attn.backends.kv_quant import dequantize_fp8, quantize_fp8
from unified_attn.backends.reference import attend
from unified_attn.backends.triton.ops import (
    SplitPlan,
    SplitScratch,
    unified_attention,
    write_kv_cache,
)
from unified_attn.models import PRESETS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

HQ, HKV, D, BS = 32, 8, 128, 16
FP8 = torch.float8_e4m3fn


def fp8_paged(lens: list[int], scales: torch.Tensor, seed: int = 0):
    """A paged fp8 cache `[NB, 2, BS, HKV, D]` holding bf16 keys/values of the given lengths
    on a random permutation of blocks; the cache, the block table and the bf16 K/V."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    nb = sum(-(-n // BS) for n in lens) + 1
    cache = torch.empty(nb, 2, BS, HKV, D, dtype=FP8, device="cuda")
    perm = torch.randperm(nb - 1, device="cuda", generator=gen).to(torch.int32) + 1
    table = torch.zeros(len(lens), max(-(-n // BS) for n in lens), dtype=torch.int32, device="cuda")
    kv, used = [], 0
    for i, n in enumerate(lens):
        blocks = -(-n // BS)
        table[i, :blocks] = perm[used : used + blocks]
        used += blocks
        k, v = (torch.randn(n, HKV, D, device="cuda", generator=gen).bfloat16() for _ in "kv")
        pos = torch.arange(n, device="cuda")
        rows = table[i, pos // BS].long()
        cache[rows, 0, pos % BS] = quantize_fp8(k, scales[0])
        cache[rows, 1, pos % BS] = quantize_fp8(v, scales[1])
        kv.append((k, v))
    return cache, table, kv


def attend_dequantized(cache, table, lens, q_rows, scales, layer, new):
    """The reference math (float32) over each request's cache read back and dequantized."""
    out = []
    for i, (n, q) in enumerate(zip(lens, q_rows, strict=True)):
        pos = torch.arange(n, device="cuda")
        rows = table[i, pos // BS].long()
        k = dequantize_fp8(cache[rows, 0, pos % BS], scales[0])
        v = dequantize_fp8(cache[rows, 1, pos % BS], scales[1])
        out.append(attend(layer, q.float(), k, v, n - new[i]))
    return out


@pytest.mark.parametrize("split", [None, SplitPlan(num_segments=8, segment=1152)])
@pytest.mark.parametrize("window", [None, 1024])
def test_bf16_kernels_over_fp8_match_the_dequantized_reference(split, window):
    lens = [9000, 40] if split else [3000, 17 + 300, 8000, 700]
    new = [1] * len(lens) if split else [1, 300, 1, 700]
    scales = torch.tensor([0.011, 0.009], device="cuda")
    cache, table, _ = fp8_paged(lens, scales)
    q_rows = [torch.randn(n, HQ, D, device="cuda").bfloat16() for n in new]
    q = torch.cat(q_rows)
    out = torch.empty_like(q)
    qsl = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    seq = torch.tensor(lens, dtype=torch.int32, device="cuda")
    layer = LayerConfig("l", HQ, HKV, D, scale=D**-0.5, sliding_window=window)
    unified_attention(
        q, cache[:, 0], cache[:, 1], out, query_start_loc=qsl, seq_lens=seq, block_table=table,
        num_seqs=len(lens), max_query_len=max(new), scale=layer.scale, window=window,
        split=split, scratch=SplitScratch(), kv_scales=scales,
    )  # fmt: skip
    expected = attend_dequantized(cache, table, lens, q_rows, scales, layer, new)
    for got, exp in zip(out.split(new), expected, strict=True):
        assert (got.float() - exp).abs().max() < 1.6e-2


@pytest.mark.parametrize("magnitude", [1e-3, 3e4, 1e6, 1e30])
def test_bf16_queries_beyond_float16_range_are_rescaled_not_overflowed(magnitude):
    # bf16 queries meet an fp8 cache in float16 dots: rows above 2^14 are scaled down exactly
    lens, new = [500, 700], [1, 200]
    scales = torch.tensor([0.011, 0.009], device="cuda")
    cache, table, _ = fp8_paged(lens, scales, seed=5)
    q_rows = [(torch.randn(n, HQ, D, device="cuda") * magnitude).bfloat16() for n in new]
    q_rows[1][::3] /= magnitude  # rows of ordinary size beside the large ones
    q = torch.cat(q_rows)
    out = torch.empty_like(q)
    qsl = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    layer = LayerConfig("l", HQ, HKV, D, scale=D**-0.5 / magnitude)  # logits of ordinary size
    unified_attention(
        q, cache[:, 0], cache[:, 1], out, query_start_loc=qsl,
        seq_lens=torch.tensor(lens, dtype=torch.int32, device="cuda"), block_table=table,
        num_seqs=2, max_query_len=max(new), scale=layer.scale, kv_scales=scales,
    )  # fmt: skip
    assert torch.isfinite(out).all()
    expected = attend_dequantized(cache, table, lens, q_rows, scales, layer, new)
    for got, exp in zip(out.split(new), expected, strict=True):
        assert (got.float() - exp).abs().max() < 1.6e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_gpu_cache_write_is_bitwise_torch_quantization(dtype):
    # the kernel's division (div_rn), clamp and rounding against torch's CUDA cast
    cache = torch.zeros(64, 2, BS, HKV, D, dtype=FP8, device="cuda")
    magnitude = torch.logspace(-6, 4, 512, device="cuda")[:, None, None]  # subnormal..saturated
    key = (torch.randn(512, HKV, D, device="cuda") * magnitude).to(dtype)
    value = -key
    slots = torch.randperm(64 * BS, device="cuda")[:512]
    scales = torch.tensor([0.0173, 0.5], device="cuda")
    write_kv_cache(key, value, cache[:, 0], cache[:, 1], slots, scales)
    stored = cache[slots // BS, :, slots % BS]
    assert torch.equal(
        stored[:, 0].view(torch.uint8), quantize_fp8(key, scales[0]).view(torch.uint8)
    )
    assert torch.equal(
        stored[:, 1].view(torch.uint8), quantize_fp8(value, scales[1]).view(torch.uint8)
    )


@pytest.mark.parametrize("target", [(3000, 1), (100, 300)], ids=["decode", "prefill"])
def test_batch_invariant_fp8_attention_is_bitwise_identical_across_batches(target):
    scales = torch.ones(2, device="cuda")  # batch-invariant mode: 1.0 or checkpoint scales
    lens = [sum(target)] + [int(x) for x in torch.randint(1, 2000, (63,))]
    cache, table, _ = fp8_paged(lens, scales, seed=3)
    t_q = torch.randn(target[1], HQ, D, device="cuda").bfloat16()

    def rows(n):
        new = [target[1]] + [1] * (n - 1)
        q = torch.cat([t_q, torch.randn(n - 1, HQ, D, device="cuda").bfloat16()])
        out = torch.empty_like(q)
        qsl = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], device="cuda").int()
        seq = torch.tensor(lens[:n], dtype=torch.int32, device="cuda")
        unified_attention(
            q, cache[:, 0], cache[:, 1], out, query_start_loc=qsl, seq_lens=seq,
            block_table=table[:n], num_seqs=n, max_query_len=max(new), scale=D**-0.5,
            batch_invariant=True, kv_scales=scales,
        )  # fmt: skip
        return out[: target[1]]

    alone = rows(1)
    for n in (8, 64):
        assert torch.equal(rows(n), alone), f"batch of {n}: not bitwise identical"


def generate(**kwargs):
    engine = LLMEngine("tiny-llama", device="cuda", kv_cache_memory="256MiB", **kwargs)
    prompts = [[(7 * i + j) % 256 for j in range(20 + 13 * i)] for i in range(6)]
    params = SamplingParams(max_tokens=24, ignore_eos=True, return_logits=True)
    return engine, engine.generate(prompts, params)


def test_fp8_cuda_graph_replay_equals_eager():
    # float32: the graph keeps the split-KV plan of max_model_len, so each request spreads its
    # keys over more segments than eagerly; in bf16 that merge order alone moves logits by an ulp
    graphs_engine, with_graphs = generate(kv_cache_dtype="fp8", backend="triton", dtype="float32")
    _, eager = generate(kv_cache_dtype="fp8", backend="triton", cuda_graphs=False,
                        dtype="float32")  # fmt: skip
    assert graphs_engine.runner.graphs is not None and graphs_engine.runner.graphs.num_replays > 0
    for a, b in zip(with_graphs, eager, strict=True):
        assert a.output_token_ids == b.output_token_ids
        assert (a.logits - b.logits).abs().max() < 1e-3


def test_fp8_engine_matches_the_reference_backend():
    fast_engine, fast = generate(kv_cache_dtype="fp8", dtype="float32")
    assert fast_engine.backend_cls.name == "triton"
    _, ref = generate(kv_cache_dtype="fp8", dtype="float32", backend="reference")
    for a, b in zip(fast, ref, strict=True):
        assert a.output_token_ids == b.output_token_ids
        assert (a.logits - b.logits).abs().max() < 1e-3


PROMPTS = [[(11 * i + 3 * j) % 256 for j in range(90 + 17 * i)] for i in range(4)]


@pytest.mark.parametrize("preset", ["tiny-llama", "gemma2-like", "gpt-oss-like"])
def test_bf16_prompt_logits_with_fp8_stay_within_the_documented_tolerance(preset):
    params = SamplingParams(max_tokens=1, prompt_logits=True)
    logits = {}
    for kv in ("auto", "fp8"):
        engine = LLMEngine(preset, device="cuda", dtype="bfloat16", kv_cache_dtype=kv,
                           kv_cache_memory="256MiB")  # fmt: skip
        logits[kv] = torch.cat([o.prompt_logits for o in engine.generate(PROMPTS, params)])
    exact, fp8 = logits["auto"], logits["fp8"]
    largest = exact.abs().max()
    per_token = (fp8 - exact).abs().amax(-1) / largest
    assert (fp8 - exact).abs().mean() / largest <= 0.02  # as on CPU (docs/kv-cache.md)
    assert per_token.quantile(0.9) <= 0.10


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_runs_with_an_fp8_cache_on_triton(preset):
    engine = LLMEngine(preset, device="cuda", kv_cache_dtype="fp8", kv_cache_memory="256MiB")
    out = engine.generate(PROMPTS, SamplingParams(max_tokens=8, ignore_eos=True))
    assert all(len(o.output_token_ids) == 8 for o in out)
