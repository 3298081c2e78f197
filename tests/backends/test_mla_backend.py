"""The MLA reference backend against torch SDPA on explicitly up-projected keys and values:
absorbed and up-projected rows, mixed batches, sliding windows, cache writes, bad inputs."""

from __future__ import annotations

import attrs
import pytest
import torch
import torch.nn.functional as F

from tests.backends.batch import PagedBatch, make_batch
from unified_attn.backend import LayerConfig
from unified_attn.backends.kv_quant import dequantize_fp8, quantize_fp8
from unified_attn.backends.mla import MLAReferenceBackend
from unified_attn.backends.mla_math import (
    absorb_query,
    reference_absorbed_attention,
    reference_write_latent,
)
from unified_attn.managers import FullAttentionManager, SlidingWindowManager
from unified_attn.selector import SelectorConfig, select_backend
from unified_attn.tensor_specs import LatentKVSpec

H, N, R, L, V = 4, 16, 8, 24, 12  # heads, nope, rope, kv_lora_rank, v_head_dim
WIDTH = L + R
SCALE = (N + R) ** -0.5 * 1.3  # e.g. a YaRN mscale on top
BLOCK_SIZE, NUM_BLOCKS = 4, 48


class AbsorbAll(MLAReferenceBackend):
    absorb_prefill = True


def layer_config(window: int | None = None, name: str = "model.layers.0.self_attn") -> LayerConfig:
    return LayerConfig(name, H, 1, WIDTH, SCALE, sliding_window=window)


def make_backend(cls=MLAReferenceBackend, window: int | None = None) -> MLAReferenceBackend:
    return cls(head_size=WIDTH, dtype=torch.float32, kv_lora_rank=L, sliding_window=window)


def kv_b_proj(seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(H * (N + V), L, generator=gen) * 0.3


def split(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    w = weight.view(H, N + V, L)
    return w[:, :N], w[:, N:].transpose(1, 2)  # W_UK [H, N, L], W_UV [H, L, V]


def queries(num_tokens: int, seed: int = 2) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, H, N + R, generator=gen)


def sdpa_reference(
    batch: PagedBatch, q: torch.Tensor, weight: torch.Tensor, window: int | None = None
) -> torch.Tensor:
    """Per request: keys and values up-projected from its latents, then torch SDPA."""
    w_uk, w_uv = split(weight)
    out = torch.zeros(q.shape[0], H, V)
    qsl = batch.common.query_start_loc_cpu.tolist()
    for i, latents in enumerate(batch.k_full):
        c, k_pe = latents[:, 0, :L], latents[:, 0, L:]  # [S, L], [S, R]
        keys = torch.cat([torch.einsum("sl,hnl->hsn", c, w_uk), k_pe.expand(H, -1, -1)], -1)
        values = torch.einsum("sl,hlv->hsv", c, w_uv)
        rows = q[qsl[i] : qsl[i + 1]].transpose(0, 1)  # [H, Lq, N + R]
        query_pos = torch.arange(rows.shape[1]) + latents.shape[0] - rows.shape[1]
        diff = query_pos[:, None] - torch.arange(latents.shape[0])
        allowed = (diff >= 0) & (diff < (window or 10**9))
        o = F.scaled_dot_product_attention(rows, keys, values, attn_mask=allowed, scale=SCALE)
        out[qsl[i] : qsl[i + 1]] = o.transpose(0, 1)
    return out


def bound(backend: MLAReferenceBackend, name: str = "model.layers.0.self_attn") -> torch.Tensor:
    spec = backend.get_cache_config()[2]
    page = spec.page_size_bytes(BLOCK_SIZE)
    buffer = torch.zeros(NUM_BLOCKS * page * 2, dtype=torch.uint8)  # another layer's page too
    cache = spec.make_view(buffer, page, 2 * page, NUM_BLOCKS, BLOCK_SIZE)
    backend.bind_kv_caches({name: cache}, {name: 0})
    return cache


def fill_cached(cache: torch.Tensor, batch: PagedBatch, computed: list[int]) -> None:
    for i, c in enumerate(computed):
        pos = torch.arange(c)
        blocks = batch.block_table[i, pos // BLOCK_SIZE].long()
        cache[blocks, pos % BLOCK_SIZE] = batch.k_full[i][:c, 0]


def run_backend(cls, computed, new, window=None, seed=0):
    batch = make_batch(computed, new, num_kv_heads=1, head_size=WIDTH, block_size=BLOCK_SIZE,
                       num_blocks=NUM_BLOCKS, seed=seed)  # fmt: skip
    backend = make_backend(cls, window)
    cache = bound(backend)
    fill_cached(cache, batch, computed)
    backend.prep_forward(batch.common, {0: batch.block_table})
    q, latent, weight = queries(len(batch.k_new)), batch.k_new[:, 0], kv_b_proj()
    out = torch.full((len(q), H * V), float("nan"))
    backend.forward(layer_config(window), out, q, latent, latent, kv_b_proj=weight)
    return out.view(-1, H, V), sdpa_reference(batch, q, weight, window), cache, batch


MIXED = [
    ([0, 5, 12, 3], [7, 1, 4, 1]),  # prefill, decode, chunked prefill, decode
    ([9, 0, 30], [1, 1, 1]),  # decode only (one request at position 0)
    ([0], [13]),  # one prefill crossing blocks
]


@pytest.mark.parametrize("computed, new", MIXED)
@pytest.mark.parametrize("cls", [MLAReferenceBackend, AbsorbAll])
def test_forward_matches_sdpa_on_up_projected_keys(cls, computed, new):
    out, expected, _, _ = run_backend(cls, computed, new)
    assert (out - expected).abs().max() < 1e-5


@pytest.mark.parametrize("computed, new", MIXED)
def test_absorbed_and_up_projected_paths_agree(computed, new):
    absorbed, _, _, _ = run_backend(AbsorbAll, computed, new)
    mixed, _, _, _ = run_backend(MLAReferenceBackend, computed, new)
    assert (absorbed - mixed).abs().max() < 1e-5


@pytest.mark.parametrize("cls", [MLAReferenceBackend, AbsorbAll])
def test_sliding_window_hides_keys_outside_it(cls):
    window, computed, new = 5, [0, 14, 9], [11, 1, 3]
    batch = make_batch(computed, new, num_kv_heads=1, head_size=WIDTH, block_size=BLOCK_SIZE,
                       num_blocks=NUM_BLOCKS)  # fmt: skip
    backend = make_backend(cls, window)
    cache = bound(backend)
    fill_cached(cache, batch, computed)
    # blocks wholly outside every window may be stale: NaN must not leak into the output
    cache[batch.block_table[1, 0].long()] = float("nan")
    backend.prep_forward(batch.common, {0: batch.block_table})
    q, latent, weight = queries(15), batch.k_new[:, 0], kv_b_proj()
    out = torch.empty(15, H * V)
    backend.forward(layer_config(window), out, q, latent, latent, kv_b_proj=weight)
    expected = sdpa_reference(batch, q, weight, window)
    assert (out.view(-1, H, V) - expected).abs().max() < 1e-5
    manager, config, _ = backend.get_cache_config()
    assert manager is SlidingWindowManager and config.sliding_window == window


def test_forward_writes_new_latents_and_skips_padding_slots():
    computed, new = [3, 0], [1, 6]
    _, _, cache, batch = run_backend(MLAReferenceBackend, computed, new)
    for i, (c, n) in enumerate(zip(computed, new, strict=True)):
        pos = torch.arange(c + n)
        blocks = batch.block_table[i, pos // BLOCK_SIZE].long()
        assert torch.equal(cache[blocks, pos % BLOCK_SIZE], batch.k_full[i][:, 0])
    latent = torch.randn(3, WIDTH)
    before = cache.clone()
    reference_write_latent(latent, cache, torch.tensor([-1, 9, -1]))
    assert torch.equal(cache[2, 1], latent[1])
    cache[2, 1] = before[2, 1]
    assert torch.equal(cache, before)  # padding rows wrote nothing, the null block included


def test_absorbed_attention_zeroes_padding_rows_and_handles_empty_requests():
    batch = make_batch([2, 5], [3, 1], num_kv_heads=1, head_size=WIDTH, block_size=BLOCK_SIZE,
                       num_blocks=NUM_BLOCKS)  # fmt: skip
    cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, WIDTH)
    fill_cached(cache, batch, [5, 6])
    weight = kv_b_proj()
    q_abs = absorb_query(queries(6), split(weight)[0])  # 4 real rows, 2 of CUDA-graph padding
    # request 1 has no tokens this step (a padding request of length 0)
    qsl = torch.tensor([0, 3, 3, 4], dtype=torch.int32)
    seq_lens = torch.tensor([5, 0, 6], dtype=torch.int32)
    table = torch.stack([batch.block_table[0], batch.block_table[0], batch.block_table[1]])
    out = torch.full((6, H, L), float("nan"))
    reference_absorbed_attention(q_abs, cache, table, qsl, seq_lens, SCALE, out)
    assert torch.isfinite(out).all() and out[4:].abs().max() == 0
    unpadded = torch.empty(4, H, L)
    reference_absorbed_attention(
        q_abs[:4], cache, batch.block_table, batch.common.query_start_loc,
        batch.common.seq_lens, SCALE, unpadded,
    )  # fmt: skip
    assert torch.equal(out[:4], unpadded)


def test_cache_config_is_a_latent_spec_under_the_full_manager():
    backend = make_backend()
    manager, config, spec = backend.get_cache_config()
    assert manager is FullAttentionManager and config == FullAttentionManager.Config()
    assert spec == LatentKVSpec(WIDTH, torch.float32)
    assert backend.get_cache_config() == (manager, config, spec)  # pure
    assert (backend.kv_lora_rank, backend.qk_rope_head_dim) == (L, R)


def test_selection_by_layer_kind():
    mla = SelectorConfig(head_size=WIDTH, dtype="float32", layer_kind="mla")
    assert select_backend(mla) is MLAReferenceBackend
    attention = SelectorConfig(head_size=WIDTH, dtype="float32")
    assert select_backend(attention) is not MLAReferenceBackend
    with pytest.raises(ValueError, match="serves attention layers, not mla"):
        select_backend(mla, override="reference")
    with pytest.raises(ValueError, match="learned sinks"):
        select_backend(attention.__class__(head_size=WIDTH, dtype="float32", layer_kind="mla",
                                           has_sinks=True), override="mla-reference")  # fmt: skip


def good_inputs(num_tokens: int = 3) -> dict:
    latent = torch.randn(num_tokens, WIDTH)
    return dict(
        output=torch.empty(num_tokens, H * V),
        query=torch.randn(num_tokens, H, N + R),
        key=latent,
        value=latent,
        kv_b_proj=kv_b_proj(),
    )


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(kv_b_proj=None), "needs the keyword argument kv_b_proj"),
        (dict(output=torch.empty(2, H * V)), r"output has shape \(2, 48\), expected \(3, 48\)"),
        (dict(key=torch.randn(3, WIDTH + 1)), r"key has shape \(3, 33\), expected \(3, 32\)"),
        (dict(value=torch.randn(3, 2)), r"value has shape \(3, 2\), expected \(3, 32\)"),
        (dict(kv_b_proj=torch.randn(H * (N + V), L + 1)), r"kv_b_proj has shape"),
        (dict(query=torch.randn(3, H, N + R).double()), "query is torch.float64"),
        (dict(query=torch.randn(3, H, R)), "qk_nope_head_dim > 0"),
    ],
)
def test_bad_inputs_name_the_layer(change, message):
    backend = make_backend()
    bound(backend, "model.layers.7.self_attn")
    batch = make_batch([0], [3], num_kv_heads=1, head_size=WIDTH, block_size=BLOCK_SIZE,
                       num_blocks=NUM_BLOCKS)  # fmt: skip
    backend.prep_forward(batch.common, {0: batch.block_table})
    inputs = {**good_inputs(), **change}
    weight = inputs.pop("kv_b_proj")
    with pytest.raises(ValueError, match=r"layer model\.layers\.7\.self_attn: .*" + message):
        backend.forward(layer_config(name="model.layers.7.self_attn"), **inputs, kv_b_proj=weight)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_kv_heads=2), "num_kv_heads=2, expected 1"),
        (dict(kv_lora_rank=WIDTH), r"kv_lora_rank=32, expected an int in \(0, head_size=32\)"),
        (dict(attention_chunk_size=8), "attention_chunk_size=8"),
        (dict(sliding_window=8, num_sink_tokens=4), "num_sink_tokens=4"),
        (
            dict(kv_cache_dtype="float16"),
            "kv_cache_dtype=torch.float16 is neither dtype=torch.float32 nor fp8",
        ),
    ],
)
def test_bad_construction_names_the_argument(kwargs, message):
    args = dict(head_size=WIDTH, dtype=torch.float32, kv_lora_rank=L) | kwargs
    with pytest.raises(ValueError, match="MLAReferenceBackend: .*" + message):
        MLAReferenceBackend(**args)


def test_layers_must_agree_with_the_backend():
    backend = make_backend()
    with pytest.raises(ValueError, match=r"layer x: \(num_kv_heads, head_size\)=\(1, 24\)"):
        backend.check_layer(LayerConfig("x", H, 1, 24, SCALE))
    with pytest.raises(ValueError, match=r"layer x: logits_soft_cap=30\.0 is not supported"):
        backend.check_layer(LayerConfig("x", H, 1, WIDTH, SCALE, logits_soft_cap=30.0))


@pytest.mark.parametrize(("computed", "new"), MIXED)
@pytest.mark.parametrize("absorb_prefill", [False, True])
def test_an_fp8_latent_cache_is_attention_over_its_dequantized_latents(
    computed, new, absorb_prefill, monkeypatch
):
    """fp8 (e4m3) latent cache with the checkpoint's scale: the written bytes are the latents
    quantized with saturation, and both paths (absorbed, up-projected) attend over the cache's
    dequantized values exactly as over a model-dtype cache holding them."""
    monkeypatch.setattr(MLAReferenceBackend, "absorb_prefill", absorb_prefill)
    batch = make_batch(computed, new, num_kv_heads=1, head_size=WIDTH, block_size=BLOCK_SIZE,
                       num_blocks=NUM_BLOCKS, seed=3)  # fmt: skip
    scale = torch.tensor(0.01)  # saturates the largest latents (|x| > 4.48)
    backend = MLAReferenceBackend(head_size=WIDTH, dtype=torch.float32, kv_lora_rank=L,
                                  kv_cache_dtype="fp8")  # fmt: skip
    cache = bound(backend)
    assert cache.dtype == torch.float8_e4m3fn
    for i, c in enumerate(computed):  # the cached tokens, as an earlier step wrote them
        pos = torch.arange(c)
        blocks = batch.block_table[i, pos // BLOCK_SIZE].long()
        cache[blocks, pos % BLOCK_SIZE] = quantize_fp8(batch.k_full[i][:c, 0], scale)
    backend.prep_forward(batch.common, {0: batch.block_table})
    q, latent, weight = queries(len(batch.k_new)), batch.k_new[:, 0], kv_b_proj()
    out = torch.full((len(q), H * V), float("nan"))
    backend.forward(layer_config(), out, q, latent, latent, kv_b_proj=weight,
                    kv_scales=torch.stack([scale, scale]))  # fmt: skip
    seen = [dequantize_fp8(quantize_fp8(k, scale), scale) for k in batch.k_full]
    want = sdpa_reference(attrs.evolve(batch, k_full=seen), q, weight)
    torch.testing.assert_close(out.view(-1, H, V), want, rtol=1e-4, atol=1e-4)
    slots = batch.common.slot_mappings[0]
    stored = cache[slots // BLOCK_SIZE, slots % BLOCK_SIZE]
    assert torch.equal(stored.view(torch.uint8), quantize_fp8(latent, scale).view(torch.uint8))
