"""The MLA kernels over an fp8 (e4m3) latent cache with a scale, against the oracle of
test_mla_triton_ops.py over the dequantized latents; the swapped products (`MLATiles.swap_ab`,
the default of fp8's 16-row tiles) in 16-bit and fp8; fp8 writes and input checks."""

from __future__ import annotations

import attrs
import pytest
import torch

from tests.backends.test_mla_triton_ops import (
    DECODE,
    DEVICE,
    DTYPES,
    GPU,
    Batch,
    check,
    make_batch,
    oracle,
    plan,
    run,
)
from unified_attn.backends.kv_quant import dequantize_fp8, quantize_fp8
from unified_attn.backends.triton.mla_ops import mla_attention, write_latent_cache
from unified_attn.backends.triton.mla_plan import HOPPER_TILES, MLATiles, plan_mla


def fp8_cache(b: Batch, scale: float) -> tuple[Batch, Batch, torch.Tensor]:
    """`b` with its cache quantized to float8 e4m3 (`kv_scale` = `scale`), the same batch with
    the dequantized latents in float32 for the oracle, and the scale tensor."""
    kv_scale = torch.tensor(scale, device=DEVICE)
    quantized = quantize_fp8(b.cache, kv_scale)
    return (attrs.evolve(b, cache=quantized),
            attrs.evolve(b, cache=dequantize_fp8(quantized, kv_scale)), kv_scale)  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("computed", "new", "num_segments"),
    [(*DECODE, 1), (*DECODE, 3), ([0, 9, 30], [13, 1, 5], 1)],
    ids=["decode", "decode-split3", "mixed"],
)
def test_an_fp8_cache_is_attention_over_its_dequantized_latents(dtype, computed, new,
                                                                num_segments):  # fmt: skip
    # scale 0.004: latents beyond 1.8 saturate at 448, so the stored bytes are not a plain cast
    padding = (3,) if computed == DECODE[0] else ()
    b = make_batch(computed, new, heads=16, page=16, dtype=dtype, padding=padding, seed=4)
    quantized, dequantized, kv_scale = fp8_cache(b, 0.004)
    got = check(quantized, dequantized, num_segments=num_segments, kv_scale=kv_scale)
    want = oracle(dequantized)
    assert (got - oracle(b)).abs().max() > 10 * (got - want).abs().max()  # really quantized


@pytest.mark.skipif(not GPU, reason="bf16 queries take float16 dots: needs bf16 on a GPU")
def test_fp8_with_bf16_queries_beyond_float16_range():
    # Query rows above 2^14 are divided by a power of two before their float16 dots.
    b = make_batch(*DECODE, heads=16, page=16, dtype=torch.bfloat16, padding=(3,), seed=5)
    b = attrs.evolve(b, q=b.q * torch.tensor([1.0, 3e4, 1.0, 1.0, 5e5], device=DEVICE)[:, None,
                                                                                       None])
    quantized, dequantized, kv_scale = fp8_cache(b, 0.01)
    got = run(quantized, kv_scale=kv_scale).double().cpu()
    want = oracle(dequantized)
    assert torch.isfinite(got).all()
    assert ((got - want).abs().amax((1, 2)) / want.abs().amax((1, 2)).clamp(min=1e-6)).max() < 0.05


def test_write_latent_cache_writes_fp8_bytes():
    cache = torch.zeros(4, 16, 80, dtype=torch.float8_e4m3fn, device=DEVICE)
    latent = quantize_fp8(torch.randn(3, 80, device=DEVICE), torch.tensor(0.01, device=DEVICE))
    write_latent_cache(latent, cache, torch.tensor([5, -1, 17], device=DEVICE))
    assert torch.equal(cache[0, 5].view(torch.uint8), latent[0].view(torch.uint8))
    assert torch.equal(cache[1, 1].view(torch.uint8), latent[2].view(torch.uint8))


def test_fp8_inputs_are_checked():
    b = make_batch([5], [1], heads=16, page=16, dtype=DTYPES[0])
    quantized, _, kv_scale = fp8_cache(b, 0.01)
    with pytest.raises(ValueError, match="latent_cache: expected dtype"):
        run(quantized)  # an fp8 cache without its scale
    with pytest.raises(ValueError, match="latent_cache: expected dtype"):
        run(b, kv_scale=kv_scale)  # a scale for a cache of the query dtype
    with pytest.raises(ValueError, match="kv_scale: expected a 0-dim float32"):
        run(quantized, kv_scale=kv_scale.reshape(1))
    hopper = plan_mla(num_reqs=1, num_tokens=1, num_heads=16, max_query_len=1, max_seq_len=6,
                      dtype=b.q.dtype, device=b.q.device, tiles=HOPPER_TILES, num_segments=1)
    out = torch.empty(1, 16, 64, dtype=b.q.dtype, device=DEVICE)
    with pytest.raises(ValueError, match="the Hopper MLA kernel cannot run this batch"):
        mla_attention(quantized.q, quantized.cache, b.block_table, b.query_start_loc,
                      b.seq_lens, 0.1, out, 64, plan=hopper, kv_scale=kv_scale)  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fp8", [False, True], ids=["16-bit", "fp8"])
def test_swapped_products(dtype, fp8):
    # swap_ab: scores^T = c q^T and out^T += c^T p^T, for decode and a causal multi-token
    # program (2 queries x 16 heads), split and not; the default for fp8 16-row tiles.
    b = make_batch([40, 3, 0, 17], [1, 1, 4, 3], heads=20, page=16, dtype=dtype, seed=6)
    oracle_batch = b
    kwargs = {}
    if fp8:
        b, oracle_batch, kwargs["kv_scale"] = fp8_cache(b, 0.004)
    for tiles in (MLATiles(16, 1, 32, 4, 2, swap_ab=True), MLATiles(16, 2, 16, 4, 1, swap_ab=True)):
        for segments in (1, 2):
            check(b, oracle_batch, tiles=tiles, num_segments=segments, **kwargs)
    if dtype != torch.float32:
        swapped = plan(num_heads=16, dtype=dtype, fp8_cache=fp8).tiles
        assert swapped.swap_ab == fp8 and swapped.block_n == (32 if fp8 else 64)
    with pytest.raises(ValueError, match="swap_ab is a portable-kernel option"):
        MLATiles(64, 1, 64, 8, 2, hopper=True, swap_ab=True)
