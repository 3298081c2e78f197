"""The reference backend over an fp8 (e4m3) KV cache: what it stores, that its attention is
attention over the dequantized cache, when its scales are calibrated, and batch invariance."""

from __future__ import annotations

import pytest
import torch

from tests.backends.batch import make_batch
from unified_attn.backend import LayerConfig
from unified_attn.backends.kv_quant import FP8_MAX, dequantize_fp8, quantize_fp8
from unified_attn.backends.reference import ReferenceAttentionBackend, attend

FP8 = torch.float8_e4m3fn
HQ, HKV, D, BS = 4, 2, 16, 4
LAYER = LayerConfig("l0", HQ, HKV, D, scale=D**-0.5)


def fp8_backend(dtype=torch.float32, **options):
    backend = ReferenceAttentionBackend(
        num_kv_heads=HKV, head_size=D, dtype=dtype, kv_cache_dtype="fp8", **options
    )
    _, _, spec = backend.get_cache_config()
    page = spec.page_size_bytes(BS)
    buffer = torch.randint(0, 255, (64 * page,), dtype=torch.uint8)  # garbage, NaN codes too
    view = spec.make_view(buffer, 0, page, 64, BS)
    backend.bind_kv_caches({"l0": view}, {"l0": 0})
    return backend, view


def step(backend, batch, query, **kwargs):
    """prep_forward + forward of one step; the output `[T, Hq * D]`."""
    out = torch.full_like(query, float("nan"))
    backend.prep_forward(batch.common, {0: batch.block_table})
    backend.forward(
        LAYER, out, query, batch.k_new.flatten(1), batch.v_new.flatten(1), **kwargs
    )  # fmt: skip
    return out


def dequantized(view, batch, request, scales):
    """Request `request`'s keys and values read back from the cache, as `stored * scale`."""
    pos = torch.arange(int(batch.common.seq_lens_cpu[request]))
    blocks = batch.block_table[request, pos // BS].long()
    k = dequantize_fp8(view[blocks, 0, pos % BS], scales[0])
    v = dequantize_fp8(view[blocks, 1, pos % BS], scales[1])
    return k, v


def written(view, batch):
    """The K and V the step's slots hold `[T, Hkv, D]`."""
    slots = batch.common.slot_mappings[0]
    return view[slots // BS, 0, slots % BS], view[slots // BS, 1, slots % BS]


def fill_quantized(view, batch, computed, scales):
    """The already-computed tokens, quantized with `scales`, into the cache."""
    for i, c in enumerate(computed):
        pos = torch.arange(c)
        blocks = batch.block_table[i, pos // BS].long()
        view[blocks, 0, pos % BS] = quantize_fp8(batch.k_full[i][:c], scales[0])
        view[blocks, 1, pos % BS] = quantize_fp8(batch.v_full[i][:c], scales[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_attention_equals_attention_over_the_dequantized_cache(dtype):
    computed, new = [0, 9, 21, 3], [7, 1, 1, 6]  # a prefill, two decodes, a chunk
    batch = make_batch(computed, new, num_kv_heads=HKV, head_size=D, block_size=BS,
                       num_blocks=64, dtype=dtype)  # fmt: skip
    backend, view = fp8_backend(dtype)
    scales = torch.tensor([0.011, 0.007])
    fill_quantized(view, batch, computed, scales)
    query = torch.randn(sum(new), HQ * D, generator=torch.Generator().manual_seed(3)).to(dtype)
    out = step(backend, batch, query, kv_scales=scales)
    k_stored, v_stored = written(view, batch)
    assert torch.equal(
        k_stored.view(torch.uint8), quantize_fp8(batch.k_new, scales[0]).view(torch.uint8)
    )
    assert torch.equal(
        v_stored.view(torch.uint8), quantize_fp8(batch.v_new, scales[1]).view(torch.uint8)
    )
    q = query.view(-1, HQ, D)
    start = 0
    for i, (c, n) in enumerate(zip(computed, new, strict=True)):
        k, v = dequantized(view, batch, i, scales)
        expected = attend(LAYER, q[start : start + n], k, v, c)
        got = out.view(-1, HQ, D)[start : start + n]
        torch.testing.assert_close(got, expected, atol=1e-6 if dtype == torch.float32 else 1e-3,
                                   rtol=0)  # fmt: skip
        start += n


def test_the_first_step_calibrates_and_later_steps_keep_the_scales():
    first = make_batch([0, 0], [9, 5], num_kv_heads=HKV, head_size=D, block_size=BS,
                       num_blocks=64, seed=1)  # fmt: skip
    backend, view = fp8_backend()
    query = torch.randn(14, HQ * D)
    step(backend, first, query)
    scales = backend.kv_scales.tensors["l0"]
    expected = torch.stack([first.k_new.abs().max(), first.v_new.abs().max()]) / FP8_MAX
    assert torch.equal(scales, expected)
    k_stored, _ = written(view, first)
    assert k_stored.float().abs().max() == FP8_MAX  # the amax maps to 448 exactly
    # a second step with keys 10x louder: the scales stay, the cache saturates
    louder = make_batch([0, 0], [9, 5], num_kv_heads=HKV, head_size=D, block_size=BS,
                        num_blocks=64, seed=2)  # fmt: skip
    louder.k_new *= 10
    step(backend, louder, query)
    assert torch.equal(backend.kv_scales.tensors["l0"], expected)
    k_stored, _ = written(view, louder)
    assert torch.isfinite(k_stored.float()).all() and (k_stored.float().abs() == FP8_MAX).sum() > 10


def test_checkpoint_scales_are_used_and_never_calibrated():
    batch = make_batch([0], [12], num_kv_heads=HKV, head_size=D, block_size=BS, num_blocks=64)
    backend, view = fp8_backend()
    given = torch.tensor([0.05, 0.02])
    step(backend, batch, torch.randn(12, HQ * D), kv_scales=given)
    k_stored, v_stored = written(view, batch)
    assert torch.equal(
        k_stored.view(torch.uint8), quantize_fp8(batch.k_new, given[0]).view(torch.uint8)
    )
    assert torch.equal(
        v_stored.view(torch.uint8), quantize_fp8(batch.v_new, given[1]).view(torch.uint8)
    )
    assert backend.kv_scales.tensors["l0"].tolist() == [1.0, 1.0]


def fp8_decode_output(computed, seed, batch_invariant):
    backend, view = fp8_backend(torch.float16, batch_invariant=batch_invariant)
    batch = make_batch(computed, [1] * len(computed), num_kv_heads=HKV, head_size=D,
                       block_size=BS, num_blocks=64, dtype=torch.float16, seed=seed)  # fmt: skip
    fill_quantized(view, batch, computed, torch.ones(2))
    query = torch.randn(len(computed), HQ * D, generator=torch.Generator().manual_seed(9))
    query[0] = torch.randn(HQ * D, generator=torch.Generator().manual_seed(1))
    out = step(backend, batch, query.half())
    return out, backend


def test_batch_invariant_mode_keeps_scale_one_and_is_bitwise_invariant():
    for seed in range(3):
        alone, backend = fp8_decode_output([29], seed, True)
        in_batch, _ = fp8_decode_output([29, 40, 5, 44], seed, True)
        assert torch.equal(alone[0], in_batch[0]), f"seed {seed}"
        assert backend.kv_scales.tensors["l0"].tolist() == [1.0, 1.0]  # never calibrated
    _, plain = fp8_decode_output([29], 0, False)
    assert plain.kv_scales.tensors["l0"].tolist() != [1.0, 1.0]  # outside the mode: calibrated


def test_a_cache_dtype_the_backend_does_not_store_is_refused_at_construction():
    with pytest.raises(ValueError, match="unknown dtype 'fp4'"):
        ReferenceAttentionBackend(
            num_kv_heads=2, head_size=16, dtype="float32", kv_cache_dtype="fp4"
        )
