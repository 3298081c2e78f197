"""The Triton kernels over an fp8 (e4m3) KV cache, against the reference fp8 path.

On CPU they run in Triton's interpreter, which loads float8 and converts it to float16/float32
exactly (its float32 -> float8 cast is wrong, which the cache-write kernel avoids by rounding
first), in float16/float32 model dtypes; the GPU run of this file adds bfloat16.
"""

from __future__ import annotations

import pytest
import torch

from tests.backends.batch import make_batch
from unified_attn.backend import AttentionType, LayerConfig
from unified_attn.backends.kv_quant import dequantize_fp8, quantize_fp8
from unified_attn.backends.reference import ReferenceAttentionBackend, attend
from unified_attn.backends.triton import TritonAttentionBackend
from unified_attn.backends.triton.ops import (
    SplitPlan,
    SplitScratch,
    unified_attention,
    write_kv_cache,
)
from unified_attn.tensor_specs import PagedKVSpec

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
DTYPES = [torch.float16, torch.bfloat16] if GPU else [torch.float16, torch.float32]
TOL = {torch.float32: 2e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
FP8 = torch.float8_e4m3fn
MIXED = ([0, 17, 40, 5], [13, 1, 1, 20])  # prefill, decode, decode, chunked prefill


def fp8_caches(num_blocks, block_size, num_kv_heads, head_size):
    """fp8 K/V views over a byte buffer of garbage, block stride larger than one page."""
    spec = PagedKVSpec(num_kv_heads, head_size, "fp8")
    page = spec.page_size_bytes(block_size)
    gen = torch.Generator().manual_seed(5)
    buffer = torch.randint(0, 255, (num_blocks * 3 * page,), dtype=torch.uint8, generator=gen)
    view = spec.make_view(buffer.to(DEVICE), page, 3 * page, num_blocks, block_size)
    return view[:, 0], view[:, 1]


def bits(x):
    return x.view(torch.uint8).cpu()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("magnitude", [1e-4, 0.02, 1.0, 30.0, 5000.0])
def test_the_cache_write_quantizes_bitwise_as_torch(dtype, magnitude):
    # magnitudes from fp8 subnormals to far past the saturation point (448 * scale)
    k_cache, v_cache = fp8_caches(8, 16, 4, 64)
    gen = torch.Generator().manual_seed(int(magnitude * 10))
    key = (torch.randn(48, 4, 64, generator=gen) * magnitude).to(dtype).to(DEVICE)
    value = (torch.randn(48, 4, 64, generator=gen) * magnitude).to(dtype).to(DEVICE)
    key[0, 0, :4] = torch.tensor([0.0, -0.0, 1e-9, -1e-9])  # signed zeros after rounding
    slots = torch.randperm(8 * 16, generator=gen)[:48].to(DEVICE)
    scales = torch.tensor([0.01, 0.03], device=DEVICE)
    write_kv_cache(key, value, k_cache, v_cache, slots, scales)
    blocks, offsets = slots // 16, slots % 16
    assert torch.equal(bits(k_cache[blocks, offsets]), bits(quantize_fp8(key, scales[0])))
    assert torch.equal(bits(v_cache[blocks, offsets]), bits(quantize_fp8(value, scales[1])))


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_finite_e4m3_value_is_read_exactly(dtype):
    # one key per request: the output is that key's value row, times v_scale, with no rounding
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes[(codes == 0x7F) | (codes == 0xFF)] = 0  # the two NaN codes
    k_cache, v_cache = fp8_caches(4, 16, 1, 128)
    k_cache.view(torch.uint8)[1:3, 0, 0] = 0  # the garbage may hold NaN codes: zero keys
    v_cache.view(torch.uint8)[1, 0, 0] = codes[:128].to(DEVICE)
    v_cache.view(torch.uint8)[2, 0, 0] = codes[128:].to(DEVICE)
    q = torch.randn(2, 1, 128, device=DEVICE).to(dtype)
    out = torch.empty_like(q)
    unified_attention(
        q, k_cache, v_cache, out, query_start_loc=torch.tensor([0, 1, 2], device=DEVICE),
        seq_lens=torch.tensor([1, 1], device=DEVICE),
        block_table=torch.tensor([[1], [2]], dtype=torch.int32, device=DEVICE), num_seqs=2,
        max_query_len=1, scale=0.1, kv_scales=torch.tensor([0.5, 2.0], device=DEVICE),
    )  # fmt: skip
    expected = codes.view(FP8).float().view(2, 1, 128) * 2.0
    assert torch.equal(out.float().cpu(), expected)


def test_the_cache_write_saturates_and_skips_padding():
    k_cache, v_cache = fp8_caches(4, 16, 1, 16)
    k_cache.view(torch.uint8).zero_()
    key = torch.full((3, 1, 16), 1e6, device=DEVICE)
    key[1] = -1e6
    write_kv_cache(key, key, k_cache, v_cache, torch.tensor([5, -1, 17], device=DEVICE),
                   torch.ones(2, device=DEVICE))  # fmt: skip
    assert (k_cache[0, 5].float() == 448).all() and (k_cache[1, 1].float() == 448).all()
    assert (k_cache.float().cpu() != 0).sum() == 32  # row 1 (slot -1) wrote nothing


def run_case(*, hq, hkv, d, bs, computed, new, dtype, window=None, chunk=None, soft_cap=None,
             sinks=False, split=None, seed=0):  # fmt: skip
    """Write the new tokens through the kernel, attend, compare with the reference attention
    over the cache read back and dequantized (and the fp8 output with the unquantized one)."""
    torch.manual_seed(seed)
    num_blocks = sum(-(-(c + n) // bs) for c, n in zip(computed, new, strict=True)) + 8
    batch = make_batch(computed, new, num_kv_heads=hkv, head_size=d, block_size=bs,
                       num_blocks=num_blocks, dtype=dtype, device=DEVICE, seed=seed)  # fmt: skip
    k_cache, v_cache = fp8_caches(num_blocks, bs, hkv, d)
    scales = torch.tensor([0.013, 0.011], device=DEVICE)
    for i, c in enumerate(computed):
        pos = torch.arange(c)
        blocks = batch.block_table[i, pos // bs].long()
        k_cache[blocks, (pos % bs).to(DEVICE)] = quantize_fp8(batch.k_full[i][:c], scales[0])
        v_cache[blocks, (pos % bs).to(DEVICE)] = quantize_fp8(batch.v_full[i][:c], scales[1])
    write_kv_cache(batch.k_new, batch.v_new, k_cache, v_cache, batch.common.slot_mappings[0],
                   scales)  # fmt: skip
    layer = LayerConfig("l", hq, hkv, d, scale=d**-0.5, sliding_window=window,
                        logits_soft_cap=soft_cap, chunk_size=chunk)  # fmt: skip
    q = torch.randn(sum(new), hq, d, device=DEVICE).to(dtype)
    sink_t = torch.randn(hq, device=DEVICE) if sinks else None
    out = torch.full_like(q, float("nan"))
    unified_attention(
        q, k_cache, v_cache, out,
        query_start_loc=batch.common.query_start_loc, seq_lens=batch.common.seq_lens,
        block_table=batch.block_table, num_seqs=len(new), max_query_len=max(new),
        scale=layer.scale, window=window, chunk=chunk, soft_cap=soft_cap, sinks=sink_t,
        split=split, scratch=SplitScratch(), kv_scales=scales,
    )  # fmt: skip
    start = 0
    for i, (c, n) in enumerate(zip(computed, new, strict=True)):
        pos = torch.arange(c + n)
        blocks, offsets = batch.block_table[i, pos // bs].long(), (pos % bs).to(DEVICE)
        k = dequantize_fp8(k_cache[blocks, offsets], scales[0])
        v = dequantize_fp8(v_cache[blocks, offsets], scales[1])
        expected = attend(layer, q[start : start + n].float(), k, v, c, sinks=sink_t)
        got = out[start : start + n].float()
        assert torch.isfinite(got).all(), f"request {i}: unwritten or NaN output"
        err = (got - expected).abs().max().item()
        assert err < TOL[dtype], f"request {i} (computed {c}, new {n}): max error {err}"
        start += n


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv", [(2, 2), (8, 2), (8, 1)])
@pytest.mark.parametrize("d", [64, 128])
def test_gqa_and_head_sizes(dtype, hq, hkv, d):
    run_case(hq=hq, hkv=hkv, d=d, bs=16, computed=MIXED[0], new=MIXED[1], dtype=dtype)


@pytest.mark.parametrize(
    "features",
    [dict(window=7), dict(sinks=True), dict(soft_cap=5.0), dict(chunk=16), dict(bs=32)],
    ids=["window", "sinks", "softcap", "chunked", "block 32"],
)
def test_features(features):
    options = dict(hq=4, hkv=1, d=64, bs=16, computed=MIXED[0], new=MIXED[1], dtype=DTYPES[0])
    run_case(**(options | features))


@pytest.mark.parametrize("sinks", [False, True])
def test_split_kv_decode(sinks):
    run_case(hq=4, hkv=2, d=64, bs=16, computed=[70, 3, 129, 0], new=[1, 1, 1, 1],
             dtype=DTYPES[0], sinks=sinks, split=SplitPlan(num_segments=4, segment=32))  # fmt: skip


def test_fp8_caches_need_scales_and_matching_dtypes():
    k_cache, v_cache = fp8_caches(4, 16, 2, 32)
    q = torch.randn(3, 2, 32, device=DEVICE).to(DTYPES[0])
    meta = dict(query_start_loc=torch.tensor([0, 3], device=DEVICE),
                seq_lens=torch.tensor([3], device=DEVICE),
                block_table=torch.zeros(1, 1, dtype=torch.int32, device=DEVICE), num_seqs=1,
                max_query_len=3, scale=1.0)  # fmt: skip
    with pytest.raises(ValueError, match=r"fp8 caches need kv_scales, a \[2\] float32"):
        unified_attention(q, k_cache, v_cache, torch.empty_like(q), **meta)
    with pytest.raises(ValueError, match="fp8 caches need kv_scales"):
        write_kv_cache(q, q, k_cache, v_cache, torch.zeros(3, dtype=torch.long, device=DEVICE),
                       torch.ones(3, device=DEVICE))  # fmt: skip
    with pytest.raises(ValueError, match=r"k_cache is torch\.float8_e4m3fn but v_cache is"):
        unified_attention(q, k_cache, v_cache.to(q.dtype), torch.empty_like(q), **meta)


# ---- the backend through the contract, against the reference backend -------------------------


def run_backend(cls, dtype, steps, *, batch_invariant=False, attn_type=AttentionType.DECODER):
    """Each step `(computed, new, seed)` through `cls` with an fp8 cache over one shared
    garbage buffer; returns the outputs, the cache view and the backend."""
    kwargs = dict(num_kv_heads=2, head_size=32, dtype=dtype, kv_cache_dtype="fp8",
                  batch_invariant=batch_invariant)  # fmt: skip
    backend = cls(**kwargs)
    _, _, spec = backend.get_cache_config()
    page = spec.page_size_bytes(16)
    buffer = torch.randint(
        0, 255, (40 * page,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    view = spec.make_view(buffer.to(DEVICE), 0, page, 40, 16)
    backend.bind_kv_caches({"l0": view}, {"l0": 0})
    layer = LayerConfig("l0", 8, 2, 32, scale=32**-0.5)
    outputs = []
    for computed, new, seed in steps:
        batch = make_batch(computed, new, num_kv_heads=2, head_size=32, block_size=16,
                           num_blocks=40, dtype=dtype, device=DEVICE, seed=seed)  # fmt: skip
        q = torch.randn(sum(new), 8 * 32, generator=torch.Generator().manual_seed(seed))
        out = torch.full((sum(new), 8 * 32), float("nan"), dtype=dtype, device=DEVICE)
        backend.prep_forward(batch.common, {0: batch.block_table})
        backend.forward(layer, out, q.to(dtype).to(DEVICE), batch.k_new.flatten(1),
                        batch.v_new.flatten(1))  # fmt: skip
        outputs.append(out)
    return outputs, view, backend


# Step 1 (a prefill of two requests) calibrates; step 2 reads it back with new tokens written.
STEPS = [([0, 0], [20, 9], 1), ([20, 9], [1, 6], 1)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_backend_matches_the_reference_backend_bit_for_bit_in_the_cache(dtype):
    got, triton_view, triton = run_backend(TritonAttentionBackend, dtype, STEPS)
    expected, ref_view, reference = run_backend(ReferenceAttentionBackend, dtype, STEPS)
    scales = triton.kv_scales.tensors["l0"].cpu()
    assert torch.equal(scales, reference.kv_scales.tensors["l0"].cpu())
    assert triton.kv_scales.tensors["l0"].tolist() != [1.0, 1.0]
    # the slots both steps wrote (the rest is garbage): requests of 21 and 15 tokens, seed 1
    batch = make_batch(
        [0, 0], [21, 15], num_kv_heads=2, head_size=32, block_size=16, num_blocks=40, seed=1
    )
    slots = batch.common.slot_mappings[0]
    blocks, offsets = slots // 16, slots % 16
    assert torch.equal(
        bits(triton_view[blocks.to(DEVICE), :, offsets.to(DEVICE)]),
        bits(ref_view[blocks, :, offsets]),
    )
    for a, b in zip(got, expected, strict=True):
        assert (a.float().cpu() - b.float().cpu()).abs().max() < TOL[dtype]


def test_batch_invariant_fp8_decode_is_bitwise_the_same_alone_and_in_a_batch():
    history = ([0], [40], 4)  # no calibration in the mode: scales stay 1.0
    alone, _, backend = run_backend(TritonAttentionBackend, DTYPES[0],
                                    [history, ([40], [1], 4)], batch_invariant=True)  # fmt: skip
    assert backend.kv_scales.tensors["l0"].tolist() == [1.0, 1.0]
    in_batch, _, _ = run_backend(TritonAttentionBackend, DTYPES[0],
                                 [history, ([40, 13, 70], [1, 1, 1], 4)],
                                 batch_invariant=True)  # fmt: skip
    assert torch.equal(alone[1][0], in_batch[1][0])


# ---- cross-attention: encoder keys written once, quantized, read back by later steps -----------


def run_fp8_cross(cls, case, steps):
    """`steps` (computed, new, written) through `cls` with an fp8 cross cache; the outputs and
    the cache view."""
    from tests.backends.test_triton_encoder import bind_cross, decoder_step, make_backend

    backend = make_backend(cls, case.layer, case.dtype, max_encoder_len=24, kv_cache_dtype="fp8")
    view = bind_cross(backend, case)
    outputs = []
    for index, (computed, new, written) in enumerate(steps):
        common, key, value = decoder_step(case, computed, new, written)
        backend.prep_forward(common, {0: case.block_table})
        gen = torch.Generator().manual_seed(index)
        query = torch.randn(sum(new), 4 * 32, generator=gen).to(case.dtype).to(DEVICE)
        out = torch.full_like(query, float("nan"))
        backend.forward(case.layer, out, query, key, value)
        outputs.append(out)
    return outputs, view


def test_cross_attention_over_an_fp8_cache_matches_the_reference_backend():
    from tests.backends.test_triton_encoder import encoder_slots, layer_of, make_cross_case

    layer = layer_of(AttentionType.ENCODER_DECODER, 4, 2, 32)
    case = make_cross_case(layer, [11, 5, 17], block_size=4, dtype=DTYPES[0])
    # step 1 writes (and calibrates on) every encoder; step 2 only reads them back (E = 0)
    steps = [([0, 0, 0], [2, 3, 1], [0, 1, 2]), ([2, 3, 1], [1, 1, 1], [])]
    got, triton_view = run_fp8_cross(TritonAttentionBackend, case, steps)
    expected, ref_view = run_fp8_cross(ReferenceAttentionBackend, case, steps)
    for a, b in zip(got, expected, strict=True):
        assert torch.isfinite(a.float()).all()
        assert (a.float() - b.float()).abs().max() < TOL[DTYPES[0]]
    slots = encoder_slots(case, [0, 1, 2])
    blocks, offsets = slots // 4, slots % 4
    keys = torch.cat(case.enc_k)
    scale = keys.abs().max().float() / 448
    assert torch.equal(bits(triton_view[blocks, 0, offsets]), bits(quantize_fp8(keys, scale)))
    assert torch.equal(bits(triton_view[blocks]), bits(ref_view[blocks]))
