"""The Triton backend's encoder, encoder-only and cross-attention layers against the reference
backend and against `scaled_dot_product_attention` per request (the external oracle).

On CPU the kernels run in Triton's interpreter (float32/float16, small shapes);
`tests/gpu/test_triton_gpu_encoder.py` reuses these helpers on CUDA with larger ones.
"""

from __future__ import annotations

import attrs
import pytest
import torch
import torch.nn.functional as F

from unified_attn.backend import (
    AttentionBackend,
    AttentionType,
    CommonAttentionMetadata,
    LayerConfig,
    require_cache_config,
)
from unified_attn.backends.reference import ReferenceAttentionBackend
from unified_attn.backends.triton import TritonAttentionBackend
from unified_attn.managers import CrossAttentionManager
from unified_attn.runner.step_inputs import encoder_metadata
from unified_attn.selector import SelectorConfig

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
DTYPES = [torch.float32, torch.float16]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
CROSS = AttentionType.ENCODER_DECODER
ENCODER_TYPES = [AttentionType.ENCODER_ONLY, AttentionType.ENCODER]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Non-causal attention of `q [L, Hq, D]` over `k`/`v [S, Hkv, D]` in float32; no keys
    give zeros (what both backends return)."""
    if k.shape[0] == 0:
        return torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    group = q.shape[1] // k.shape[1]
    qh, kh, vh = (
        x.float().repeat_interleave(r, dim=1).transpose(0, 1)[None]  # [1, H, L, D]
        for x, r in ((q, 1), (k, group), (v, group))
    )
    return F.scaled_dot_product_attention(qh, kh, vh, scale=scale)[0].transpose(0, 1)


def assert_close(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert torch.isfinite(got).all(), f"{what}: unwritten or NaN output"
    err = (got.float() - expected.float()).abs().max().item()
    assert err < TOL[got.dtype], f"{what}: max error {err}"


def layer_of(attn_type: AttentionType, hq: int, hkv: int, d: int, **features) -> LayerConfig:
    return LayerConfig("attn", hq, hkv, d, scale=d**-0.5, attn_type=attn_type, **features)


def make_backend(
    cls: type[AttentionBackend], layer: LayerConfig, dtype, **extra
) -> AttentionBackend:
    backend = cls(
        num_kv_heads=layer.num_kv_heads,
        head_size=layer.head_size,
        dtype=dtype,
        attn_type=layer.attn_type,
        sliding_window=layer.sliding_window,
        attention_chunk_size=layer.chunk_size,
        **extra,
    )
    backend.check_layer(layer)
    return backend


# ---- encoder / encoder-only ---------------------------------------------------------------------


def packed_qkv(num_tokens, layer, dtype, device, fused, seed=0):
    """q `[T, Hq * D]`, k and v `[T, Hkv * D]`; `fused`: column slices of one qkv projection
    (K and V share storage and strides, as in the models)."""
    gen = torch.Generator().manual_seed(seed)
    widths = [layer.num_heads * layer.head_size] + [layer.num_kv_heads * layer.head_size] * 2
    if fused:
        qkv = torch.randn(num_tokens, sum(widths), generator=gen).to(dtype).to(device)
        return qkv.split(widths, dim=1)
    return tuple(torch.randn(num_tokens, w, generator=gen).to(dtype).to(device) for w in widths)


def run_encoder(cls, layer, lengths, q, k, v, dtype, **kwargs) -> torch.Tensor:
    """One encoder pass the way the runner makes it: `encoder_metadata`, no cache bound."""
    backend = make_backend(cls, layer, dtype)
    assert backend.get_cache_config() is None
    backend.prep_forward(encoder_metadata(lengths, torch.device(q.device)), {})
    out = torch.full_like(q, float("nan"))
    backend.forward(layer, out, q, k, v, **kwargs)
    return out


def check_encoder(attn_type, lengths, hq, hkv, d, dtype, fused, device=DEVICE, **features):
    layer = layer_of(attn_type, hq, hkv, d, **features)
    q, k, v = packed_qkv(sum(lengths), layer, dtype, device, fused)
    got = run_encoder(TritonAttentionBackend, layer, lengths, q, k, v, dtype)
    ref = run_encoder(ReferenceAttentionBackend, layer, lengths, q, k, v, dtype)
    start = 0
    for i, n in enumerate(lengths):
        rows = slice(start, start + n)
        expected = sdpa(q[rows].view(n, hq, d), k[rows].view(n, hkv, d), v[rows].view(n, hkv, d),
                        layer.scale)  # fmt: skip
        assert_close(got[rows].view(n, hq, d), expected, f"request {i} ({n} tokens) vs SDPA")
        assert_close(got[rows], ref[rows], f"request {i} ({n} tokens) vs the reference backend")
        start += n


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("attn_type", ENCODER_TYPES)
@pytest.mark.parametrize("hq,hkv", [(4, 2), (4, 1)])
def test_encoder_matches_sdpa_and_the_reference(dtype, attn_type, hq, hkv):
    check_encoder(attn_type, [1, 7, 19], hq, hkv, 32, dtype, fused=False)


@pytest.mark.parametrize("dtype", DTYPES)
def test_encoder_reads_keys_from_a_fused_qkv_projection(dtype):
    check_encoder(AttentionType.ENCODER_ONLY, [19, 1, 7], 4, 2, 32, dtype, fused=True)


@pytest.mark.parametrize(
    "features",
    [dict(sliding_window=4), dict(chunk_size=8), dict(logits_soft_cap=2.0)],
    ids=["window", "chunked", "softcap"],
)
def test_encoder_masks_match_the_reference(features):
    layer = layer_of(AttentionType.ENCODER_ONLY, 4, 2, 32, **features)
    lengths = [1, 7, 19]
    q, k, v = packed_qkv(sum(lengths), layer, torch.float32, DEVICE, fused=True)
    got = run_encoder(TritonAttentionBackend, layer, lengths, q, k, v, torch.float32)
    ref = run_encoder(ReferenceAttentionBackend, layer, lengths, q, k, v, torch.float32)
    assert_close(got, ref, f"{features}")


def test_encoder_sinks_and_alibi_match_the_reference():
    layer = layer_of(AttentionType.ENCODER, 4, 2, 32)
    lengths = [5, 12]
    q, k, v = packed_qkv(sum(lengths), layer, torch.float32, DEVICE, fused=False)
    kwargs = dict(
        sinks=torch.randn(4, device=DEVICE), alibi_slopes=torch.rand(4, device=DEVICE) * 0.3
    )
    got = run_encoder(TritonAttentionBackend, layer, lengths, q, k, v, torch.float32, **kwargs)
    ref = run_encoder(ReferenceAttentionBackend, layer, lengths, q, k, v, torch.float32, **kwargs)
    assert_close(got, ref, "sinks + alibi")


def test_encoder_plan_rejects_a_batch_with_cached_tokens():
    layer = layer_of(AttentionType.ENCODER_ONLY, 2, 2, 32)
    backend = make_backend(TritonAttentionBackend, layer, torch.float32)
    common = attrs.evolve(
        encoder_metadata([3, 4], torch.device(DEVICE)),
        num_computed_tokens_cpu=torch.tensor([0, 2], dtype=torch.int32),
    )
    with pytest.raises(ValueError, match=r"num_computed_tokens == 0.*\[0, 2\]"):
        backend.prep_forward(common, {})


# ---- cross-attention ----------------------------------------------------------------------------


@attrs.define
class CrossCase:
    """Requests with encoder outputs in a paged cross cache, and the decoder queries of steps."""

    layer: LayerConfig
    enc_lens: list[int]
    block_size: int
    num_blocks: int
    block_table: torch.Tensor  # device [B, max_blocks] int32
    enc_k: list[torch.Tensor]  # per request [S_i, Hkv, D]
    enc_v: list[torch.Tensor]
    dtype: torch.dtype
    device: str


def make_cross_case(layer, enc_lens, block_size, dtype, device=DEVICE, seed=0) -> CrossCase:
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-s // block_size) for s in enc_lens]
    num_blocks = sum(blocks) + 4
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # never the null block
    table = torch.zeros(len(enc_lens), max(max(blocks), 1), dtype=torch.int32)
    for i, nb in enumerate(blocks):
        table[i, :nb] = torch.tensor(ids[:nb], dtype=torch.int32)
        ids = ids[nb:]
    shape = (layer.num_kv_heads, layer.head_size)
    enc_k, enc_v = (
        [torch.randn(s, *shape, generator=gen).to(dtype).to(device) for s in enc_lens]
        for _ in range(2)
    )
    return CrossCase(layer, enc_lens, block_size, num_blocks, table.to(device), enc_k, enc_v,
                     dtype, device)  # fmt: skip


def bind_cross(backend: AttentionBackend, case: CrossCase) -> torch.Tensor:
    """A strided cross-cache view (block stride two pages) full of NaN: a read of any position
    that is not an encoder key of the request shows in the output."""
    manager, config, spec = require_cache_config(backend)
    assert manager is CrossAttentionManager and config.max_encoder_len == backend.max_encoder_len
    page = spec.page_size_bytes(case.block_size)
    buffer = torch.empty(2 * page * (case.num_blocks + 1), dtype=torch.uint8, device=case.device)
    buffer.view(case.dtype).fill_(float("nan"))
    view = spec.make_view(buffer, page, 2 * page, case.num_blocks, case.block_size)
    assert isinstance(view, torch.Tensor)
    backend.bind_kv_caches({case.layer.name: view}, {case.layer.name: 0})
    return view


def encoder_slots(case: CrossCase, requests: list[int]) -> torch.Tensor:
    """`[E]` cross-cache slots of the encoder tokens of `requests`, in order."""
    bs, table = case.block_size, case.block_table.cpu().long()
    slots = [table[i, (p := torch.arange(case.enc_lens[i])) // bs] * bs + p % bs for i in requests]
    return torch.cat([torch.zeros(0, dtype=torch.long), *slots]).to(case.device)


def prefill_encoders(cache: torch.Tensor, case: CrossCase, requests: list[int]) -> None:
    """Encoder keys written by an earlier step."""
    slots = encoder_slots(case, requests)
    cache[slots // case.block_size, 0, slots % case.block_size] = torch.cat(
        [case.enc_k[i] for i in requests]
    )
    cache[slots // case.block_size, 1, slots % case.block_size] = torch.cat(
        [case.enc_v[i] for i in requests]
    )


def decoder_step(case: CrossCase, computed: list[int], new: list[int], written: list[int]):
    """The step's metadata (decoder queries; cross slots of the encoders in `written`) and the
    key and value rows `[E, Hkv * D]` of those encoders."""
    dev = case.device
    qsl = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    seq = torch.tensor([c + n for c, n in zip(computed, new, strict=True)], dtype=torch.int32)
    enc = torch.tensor(case.enc_lens, dtype=torch.int32)
    positions = torch.cat([torch.arange(c, c + n) for c, n in zip(computed, new, strict=True)])
    common = CommonAttentionMetadata(
        query_start_loc=qsl.to(dev),
        query_start_loc_cpu=qsl,
        seq_lens=seq.to(dev),
        seq_lens_cpu=seq,
        num_computed_tokens_cpu=torch.tensor(computed, dtype=torch.int32),
        positions=positions.to(dev),
        num_reqs=len(new),
        num_actual_tokens=sum(new),
        max_query_len=max(new),
        max_seq_len=int(seq.max()),
        slot_mappings={0: encoder_slots(case, written)},
        block_sizes={0: case.block_size},
        encoder_seq_lens_cpu=enc,
        encoder_seq_lens=enc.to(dev),
    )
    width = case.layer.num_kv_heads * case.layer.head_size
    empty = torch.zeros(0, width, dtype=case.dtype, device=dev)
    key = torch.cat([empty, *(case.enc_k[i].flatten(1) for i in written)])
    value = torch.cat([empty, *(case.enc_v[i].flatten(1) for i in written)])
    return common, key, value


def run_cross_steps(cls, case: CrossCase, steps, max_encoder_len: int, **extra):
    """Run `steps` (computed, new, written) on a fresh backend whose cache already holds the
    encoders no step writes. Returns each step's output and the backends' plans."""
    backend = make_backend(cls, case.layer, case.dtype, max_encoder_len=max_encoder_len, **extra)
    cache = bind_cross(backend, case)
    ever_written = {i for _, _, written in steps for i in written}
    prefill_encoders(cache, case, [i for i in range(len(case.enc_lens)) if i not in ever_written])
    outputs: list[tuple[torch.Tensor, torch.Tensor]] = []
    plans = []
    hq, d = case.layer.num_heads, case.layer.head_size
    for computed, new, written in steps:
        common, key, value = decoder_step(case, computed, new, written)
        backend.prep_forward(common, {0: case.block_table})
        gen = torch.Generator().manual_seed(sum(computed) + len(outputs))
        query = torch.randn(sum(new), hq * d, generator=gen).to(case.dtype).to(case.device)
        out = torch.full_like(query, float("nan"))
        backend.forward(case.layer, out, query, key, value)
        outputs.append((query, out))
        plans.append(backend.plan)
    return outputs, plans


def check_cross(case: CrossCase, steps, max_encoder_len: int, **extra) -> list:
    """Triton against SDPA over each request's encoder K/V and against the reference backend;
    returns the Triton backend's plans."""
    got, plans = run_cross_steps(TritonAttentionBackend, case, steps, max_encoder_len, **extra)
    ref, _ = run_cross_steps(ReferenceAttentionBackend, case, steps, max_encoder_len)
    hq, d = case.layer.num_heads, case.layer.head_size
    for step, ((_, new, _), (query, out), (_, ref_out)) in enumerate(
        zip(steps, got, ref, strict=True)
    ):
        start = 0
        for i, n in enumerate(new):
            rows = slice(start, start + n)
            expected = sdpa(query[rows].view(n, hq, d), case.enc_k[i], case.enc_v[i],
                            case.layer.scale)  # fmt: skip
            what = f"step {step}, request {i} ({n} queries, {case.enc_lens[i]} encoder keys)"
            assert_close(out[rows].view(n, hq, d), expected, f"{what} vs SDPA")
            assert_close(out[rows], ref_out[rows], f"{what} vs the reference backend")
            start += n
    return plans


# step 1 writes the encoders of requests 1 and 2 (request 0's was written before) while all
# three have queries, request 1's chunk longer than its encoder; step 2 writes nothing (E = 0)
CROSS_STEPS = [([3, 0, 0], [1, 9, 4], [1, 2]), ([4, 9, 4], [1, 1, 1], [])]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv", [(4, 2), (2, 2)])
def test_cross_attention_matches_sdpa_and_the_reference(dtype, hq, hkv):
    layer = layer_of(CROSS, hq, hkv, 32)
    case = make_cross_case(layer, [11, 5, 17], block_size=4, dtype=dtype)
    plans = check_cross(case, CROSS_STEPS, max_encoder_len=24)
    assert all(p.split is None for p in plans)


def test_cross_attention_decode_with_split_kv_and_a_request_without_encoder():
    # Long encoders make decode steps split the KV loop (the interpreter reports 4 SMs).
    layer = layer_of(CROSS, 2, 1, 16)
    case = make_cross_case(layer, [1100, 70, 0], block_size=16, dtype=torch.float32)
    plans = check_cross(case, [([5, 2, 1], [1, 1, 1], [])], max_encoder_len=1100)
    assert plans[0].split is not None and plans[0].split.num_segments > 1


def test_batch_invariant_cross_attention_matches():
    layer = layer_of(CROSS, 4, 2, 32)
    case = make_cross_case(layer, [11, 5, 17], block_size=4, dtype=torch.float16)
    check_cross(case, CROSS_STEPS, max_encoder_len=24, batch_invariant=True)


def test_cross_attention_takes_no_sinks():
    layer = layer_of(CROSS, 2, 2, 32)
    case = make_cross_case(layer, [3], block_size=4, dtype=torch.float32)
    backend = make_backend(TritonAttentionBackend, layer, torch.float32, max_encoder_len=8)
    bind_cross(backend, case)
    common, key, value = decoder_step(case, [0], [2], [0])
    backend.prep_forward(common, {0: case.block_table})
    query = torch.randn(2, 64, device=DEVICE)
    with pytest.raises(ValueError, match=r"attn: cross-attention .* no sinks"):
        backend.forward(layer, torch.empty_like(query), query, key, value,
                        sinks=torch.zeros(2, device=DEVICE))  # fmt: skip


# ---- configuration ------------------------------------------------------------------------------


@pytest.mark.parametrize("attn_type", list(AttentionType))
def test_every_attention_type_is_accepted(attn_type):
    cfg = SelectorConfig(head_size=64, dtype="float16", attn_type=attn_type, device=DEVICE)
    assert TritonAttentionBackend.validate_configuration(cfg) == []


def test_windows_and_sinks_on_cross_attention_are_refused_with_the_reason():
    cfg = SelectorConfig(head_size=64, dtype="float16", attn_type=CROSS, device=DEVICE,
                         sliding_window=128, has_sinks=True)  # fmt: skip
    reasons = TritonAttentionBackend.validate_configuration(cfg)
    assert any("sliding_window=128" in r and "every encoder key" in r for r in reasons)
    assert any("sinks on cross-attention" in r for r in reasons)
    with pytest.raises(ValueError, match="sliding_window=16"):
        TritonAttentionBackend(num_kv_heads=2, head_size=64, dtype="float16", attn_type=CROSS,
                               max_encoder_len=64, sliding_window=16)  # fmt: skip


def test_encoder_backends_refuse_streaming_sink_tokens():
    with pytest.raises(ValueError, match="encoder layers keep no cache"):
        TritonAttentionBackend(num_kv_heads=2, head_size=64, dtype="float16",
                               attn_type=AttentionType.ENCODER, sliding_window=8,
                               num_sink_tokens=4)  # fmt: skip
