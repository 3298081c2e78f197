"""The Triton kernels against the reference attention math, over a parameter grid.

On CPU the kernels run in Triton's interpreter (float16/float32: its bfloat16 is wrong); the
GPU run of the same file adds bfloat16 and larger shapes.
"""

import random

import pytest
import torch

from tests.backends.batch import fill_cached_tokens, make_batch
from unified_attn.backend import LayerConfig
from unified_attn.backends.reference import attend
from unified_attn.backends.triton.ops import (
    MAX_SEGMENTS,
    SplitPlan,
    SplitScratch,
    max_split_rows,
    plan_split,
    unified_attention,
    write_kv_cache,
)
from unified_attn.tensor_specs import PagedKVSpec

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
DTYPES = [torch.float16, torch.bfloat16] if GPU else [torch.float16, torch.float32]
TOL = {torch.float32: 2e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def strided_caches(num_blocks, block_size, num_kv_heads, head_size, dtype):
    """K/V views over a shared byte buffer whose block stride is larger than one page."""
    spec = PagedKVSpec(num_kv_heads, head_size, dtype)
    page = spec.page_size_bytes(block_size)
    buffer = torch.zeros(num_blocks * 3 * page, dtype=torch.uint8, device=DEVICE)
    view = spec.make_view(buffer, page, 3 * page, num_blocks, block_size)
    return view[:, 0], view[:, 1]


def run_case(
    *, hq, hkv, d, bs, computed, new, dtype, window=None, chunk=None, soft_cap=None,
    sinks=False, split=None, seed=0, sink_tokens=0, batch_invariant=False,
):  # fmt: skip
    torch.manual_seed(seed)
    num_blocks = sum(-(-(c + n) // bs) for c, n in zip(computed, new, strict=True)) + 8
    batch = make_batch(computed, new, num_kv_heads=hkv, head_size=d, block_size=bs,
                       num_blocks=num_blocks, dtype=dtype, device=DEVICE, seed=seed)  # fmt: skip
    k_cache, v_cache = strided_caches(num_blocks, bs, hkv, d, dtype)
    k_cache.normal_()  # garbage everywhere that is not written: never read it
    v_cache.normal_()
    cache = torch.stack([k_cache, v_cache], dim=1)
    fill_cached_tokens(cache, batch, computed)
    k_cache.copy_(cache[:, 0])
    v_cache.copy_(cache[:, 1])
    layer = LayerConfig("l", hq, hkv, d, scale=d**-0.5, sliding_window=window,
                        logits_soft_cap=soft_cap, chunk_size=chunk)  # fmt: skip
    total = sum(new)
    q = torch.randn(total, hq, d, device=DEVICE).to(dtype)
    sink_t = torch.randn(hq, device=DEVICE) if sinks else None
    slots = batch.common.slot_mappings[0]
    write_kv_cache(batch.k_new, batch.v_new, k_cache, v_cache, slots)
    out = torch.full_like(q, float("nan"))
    unified_attention(
        q, k_cache, v_cache, out,
        query_start_loc=batch.common.query_start_loc, seq_lens=batch.common.seq_lens,
        block_table=batch.block_table, num_seqs=len(new), max_query_len=max(new),
        scale=layer.scale, window=window, chunk=chunk, soft_cap=soft_cap, sinks=sink_t,
        split=split, scratch=SplitScratch(), sink_tokens=sink_tokens,
        batch_invariant=batch_invariant,
    )  # fmt: skip
    start = 0
    for i, (c, n) in enumerate(zip(computed, new, strict=True)):
        expected = attend(layer, q[start : start + n].float(), batch.k_full[i].float(),
                          batch.v_full[i].float(), c, sinks=sink_t,
                          sink_tokens=sink_tokens)  # fmt: skip
        got = out[start : start + n].float()
        assert torch.isfinite(got).all(), f"request {i}: unwritten or NaN output"
        err = (got - expected).abs().max().item()
        assert err < TOL[dtype], f"request {i} (computed {c}, new {n}): max error {err}"
        start += n


MIXED = ([0, 17, 40, 5], [13, 1, 1, 20])  # prefill, decode, decode, chunked prefill


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv", [(2, 2), (8, 2), (8, 1)])
@pytest.mark.parametrize("d", [64, 128, 256] if GPU else [64, 128])
def test_gqa_and_head_sizes(dtype, hq, hkv, d):
    run_case(hq=hq, hkv=hkv, d=d, bs=16, computed=MIXED[0], new=MIXED[1], dtype=dtype)


@pytest.mark.parametrize("bs", [16, 32, 64] if GPU else [16, 32])
@pytest.mark.parametrize("window", [None, 5, 33])
def test_block_sizes_and_windows(bs, window):
    run_case(hq=4, hkv=2, d=64, bs=bs, computed=MIXED[0], new=MIXED[1], dtype=DTYPES[0],
             window=window)  # fmt: skip


@pytest.mark.parametrize(
    "features",
    [
        dict(sinks=True),
        dict(soft_cap=5.0),
        dict(chunk=16),
        dict(window=7, sinks=True, soft_cap=3.0),
    ],
    ids=["sinks", "softcap", "chunked", "window+sinks+softcap"],
)
def test_features(features):
    run_case(hq=4, hkv=1, d=64, bs=16, computed=MIXED[0], new=MIXED[1], dtype=DTYPES[0],
             **features)  # fmt: skip


@pytest.mark.parametrize("split", [None, SplitPlan(num_segments=4, segment=32)])
def test_streaming_sink_tokens(split):
    computed, new = ([70, 3, 129, 0], [1, 1, 1, 1]) if split else MIXED
    run_case(hq=4, hkv=2, d=64, bs=16, computed=computed, new=new, dtype=DTYPES[0], window=20,
             sink_tokens=20, split=split)  # fmt: skip
    run_case(hq=4, hkv=2, d=64, bs=16, computed=computed, new=new, dtype=DTYPES[0], window=8,
             sink_tokens=5, split=split)  # fmt: skip


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("window", [None, 20])
def test_split_kv_decode_matches(sinks, window):
    computed, new = [70, 3, 129, 0], [1, 1, 1, 1]
    run_case(hq=4, hkv=2, d=64, bs=16, computed=computed, new=new, dtype=DTYPES[0],
             sinks=sinks, window=window, split=SplitPlan(num_segments=4, segment=32))  # fmt: skip


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("window", [None, 20])
def test_a_plan_sized_for_long_requests_spreads_short_ones(sinks, window):
    """A decode graph keeps the split plan of `max_model_len`: each request splits its own keys
    (those its window leaves) into the plan's segments (whole tiles, at most the plan's length),
    here 1 to 130 keys over 8 segments planned at 512 keys each."""
    computed, new = [70, 3, 129, 0], [1, 1, 1, 1]
    run_case(hq=4, hkv=2, d=64, bs=16, computed=computed, new=new, dtype=DTYPES[0],
             sinks=sinks, window=window, split=SplitPlan(num_segments=8, segment=512))  # fmt: skip


@pytest.mark.parametrize("bounds", [dict(chunk=32), dict(window=37, sink_tokens=5)],
                         ids=["chunk", "window+sink_tokens"])  # fmt: skip
def test_split_kv_spreads_the_keys_a_chunk_or_window_leaves(bounds):
    """The segments start at the tile of the first key a chunk (Llama 4) or window leaves;
    segment 0 also takes the sink tokens."""
    computed, new = [100, 3, 129, 40, 0], [1, 1, 1, 1, 1]
    run_case(hq=4, hkv=2, d=64, bs=16, computed=computed, new=new, dtype=DTYPES[0],
             split=SplitPlan(num_segments=4, segment=512), **bounds)  # fmt: skip


@pytest.mark.skipif(not GPU, reason="long contexts are too slow for the CPU interpreter")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 1024])
def test_long_contexts_on_the_gpu(dtype, window):
    computed, new = [3000, 17, 8000, 0], [1, 300, 1, 700]
    run_case(hq=32, hkv=8, d=128, bs=16, computed=computed, new=new, dtype=dtype, window=window)
    run_case(hq=32, hkv=8, d=128, bs=16, computed=[9000, 40], new=[1, 1], dtype=dtype,
             window=window, sinks=True, split=SplitPlan(num_segments=8, segment=1152))  # fmt: skip


def test_random_ragged_batches():
    rng = random.Random(0)
    for seed in range(3):
        b = rng.randint(1, 6)
        computed = [rng.choice([0, rng.randint(1, 60)]) for _ in range(b)]
        new = [rng.choice([1, rng.randint(1, 24)]) for _ in range(b)]
        window = rng.choice([None, rng.randint(1, 40)])
        run_case(hq=4, hkv=2, d=32, bs=16, computed=computed, new=new, dtype=DTYPES[0],
                 window=window, seed=seed)  # fmt: skip


def test_padding_slots_are_skipped_by_the_cache_write():
    k_cache, v_cache = strided_caches(4, 16, 2, 32, DTYPES[0])
    key = torch.randn(3, 2, 32, device=DEVICE).to(DTYPES[0])
    slots = torch.tensor([5, -1, 17], device=DEVICE)
    write_kv_cache(key, key, k_cache, v_cache, slots)
    assert torch.equal(k_cache[0, 5], key[0]) and torch.equal(k_cache[1, 1], key[2])
    written = torch.zeros(4, 16, dtype=torch.bool)
    written[0, 5] = written[1, 1] = True
    assert (k_cache.cpu()[~written] == 0).all()


def test_bad_inputs_are_rejected():
    k_cache, v_cache = strided_caches(4, 16, 2, 32, DTYPES[0])
    q = torch.randn(3, 3, 32, device=DEVICE).to(DTYPES[0])
    meta = dict(query_start_loc=torch.tensor([0, 3]), seq_lens=torch.tensor([3]),
                block_table=torch.zeros(1, 1, dtype=torch.int32), num_seqs=1, max_query_len=3,
                scale=1.0)  # fmt: skip
    with pytest.raises(ValueError, match="not a multiple"):
        unified_attention(q, k_cache, v_cache, torch.empty_like(q), **meta)
    with pytest.raises(ValueError, match="must be"):
        unified_attention(q[:, :2, :16], k_cache, v_cache, torch.empty_like(q[:, :2, :16]), **meta)


def test_separate_k_and_v_tensors_give_the_same_output():
    # Shared storage lets V reuse K's address math; separate tensors take the general path.
    batch = make_batch([9, 0], [1, 12], num_kv_heads=2, head_size=32, block_size=16,
                       num_blocks=8, dtype=DTYPES[0], device=DEVICE)  # fmt: skip
    k_cache, v_cache = strided_caches(8, 16, 2, 32, DTYPES[0])
    k_cache.normal_()
    v_cache.normal_()
    q = torch.randn(13, 4, 32, device=DEVICE).to(DTYPES[0])
    meta = dict(query_start_loc=batch.common.query_start_loc, seq_lens=batch.common.seq_lens,
                block_table=batch.block_table, num_seqs=2, max_query_len=12, scale=0.2)  # fmt: skip
    shared = unified_attention(q, k_cache, v_cache, torch.empty_like(q), **meta)
    separate = unified_attention(q, k_cache.clone(), v_cache.clone(), torch.empty_like(q), **meta)
    torch.testing.assert_close(shared, separate, atol=0, rtol=0)


@pytest.mark.parametrize("device", ["cpu", "cuda"] if GPU else ["cpu"])
def test_split_plans_fit_the_scratch_sized_for_captured_graphs(device):
    # A captured graph keeps the scratch's address: no later plan may need more rows.
    dev = torch.device(device)
    for hq, hkv in [(32, 8), (64, 8), (8, 1), (16, 16)]:
        worst = max_split_rows(hq, hkv, dev)
        for reqs in range(1, 300):
            plan = plan_split(max_query_len=1, max_seq_len=40_000, num_reqs=reqs,
                              num_kv_heads=hkv, device=dev)  # fmt: skip
            if plan is None:
                continue
            assert reqs * hq * plan.num_segments <= worst, (hq, hkv, reqs, plan)
            assert plan.segment % 128 == 0 and plan.segment * plan.num_segments >= 40_000
            assert plan.num_segments <= MAX_SEGMENTS


def test_only_short_decode_batches_split():
    cpu = torch.device("cpu")  # 4 "SMs" under the interpreter: 8 programs fill it
    assert plan_split(max_query_len=2, max_seq_len=9000, num_reqs=1, num_kv_heads=1,
                      device=cpu) is None  # fmt: skip
    assert plan_split(max_query_len=1, max_seq_len=1000, num_reqs=1, num_kv_heads=1,
                      device=cpu) is None  # fmt: skip
    assert plan_split(max_query_len=1, max_seq_len=9000, num_reqs=8, num_kv_heads=1,
                      device=cpu) is None  # fmt: skip
    assert plan_split(max_query_len=1, max_seq_len=9000, num_reqs=1, num_kv_heads=1,
                      device=cpu) == SplitPlan(8, 1152)
