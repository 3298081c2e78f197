"""The reference backend's math, plain torch in float32: cache writes and reads (fp8 quantized
with saturation, dequantized on read), the attention mask of a layer (causal, window, chunk,
sink tokens, encoder and cross-attention) and the attention of one request (`attend`) or of a
batch of equal-length requests (`attend_batch`)."""

from __future__ import annotations

import torch

from unified_attn.backend import LayerConfig
from unified_attn.backends.kv_quant import dequantize_fp8, quantize_fp8


def write_cache(
    cache: torch.Tensor,
    blocks: torch.Tensor,
    offsets: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scales: torch.Tensor | None,
) -> None:
    """Keys and values `[W, Hkv, D]` into `cache [num_blocks, 2, block_size, Hkv, D]` at
    `(blocks [W], offsets [W])`; quantized to fp8 with the `[2]` K/V `scales` when given."""
    if scales is not None:
        k, v = quantize_fp8(k, scales[0]), quantize_fp8(v, scales[1])
    cache[blocks, 0, offsets] = k
    cache[blocks, 1, offsets] = v


def read_cache(
    cache: torch.Tensor,
    blocks: torch.Tensor,
    offsets: torch.Tensor,
    which: int,
    scales: torch.Tensor | None,
) -> torch.Tensor:
    """Keys (`which` 0) or values (1) at `cache[blocks, which, offsets]`, dequantized to
    float32 with `scales[which]` when the cache is fp8."""
    x = cache[blocks, which, offsets]
    return x if scales is None else dequantize_fp8(x, scales[which])


def attention_mask(
    layer: LayerConfig, query_pos: torch.Tensor, key_pos: torch.Tensor, sink_tokens: int = 0
) -> torch.Tensor:
    """`[..., L, S]` True where a query at `query_pos [..., L]` may attend to `key_pos [S]`.
    With `sink_tokens` (StreamingLLM), the first keys stay visible outside the window."""
    diff = query_pos[..., :, None] - key_pos
    allowed = diff >= 0 if layer.causal else torch.ones_like(diff, dtype=torch.bool)
    if layer.sliding_window is not None:  # a query sees itself plus W - 1 earlier keys
        in_window = diff < layer.sliding_window
        if not layer.causal:
            in_window &= diff > -layer.sliding_window
        allowed &= in_window | (key_pos < sink_tokens)
    if layer.chunk_size is not None:
        allowed &= query_pos[..., :, None] // layer.chunk_size == key_pos // layer.chunk_size
    return allowed


# Batch-invariant mode attends at least this many query rows at once: with fewer, the CPU
# einsums take MKL's matrix-vector and small-matrix paths, which round a row differently from
# the same row in a longer prompt chunk.
INVARIANT_MIN_ROWS = 4


def attend(
    layer: LayerConfig,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    first_query_pos: int,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    sink_tokens: int = 0,
    min_rows: int = 1,
) -> torch.Tensor:
    """Attention of queries `[L, Hq, D]` at positions `first_query_pos + i` over keys/values
    `[S, Hkv, D]` at positions `0..S-1`. Returns `[L, Hq, D]` in q's dtype. Fewer than
    `min_rows` queries are padded with copies of the last one (same position, so the same
    keys are visible) and the copies dropped."""
    rows = q.shape[0]
    query_pos = torch.arange(rows, device=q.device) + first_query_pos
    if 0 < rows < min_rows:
        q = torch.cat([q, q[-1:].expand(min_rows - rows, *q.shape[1:])])
        query_pos = torch.cat([query_pos, query_pos[-1:].expand(min_rows - rows)])
    valid = torch.ones(1, k.shape[0], dtype=torch.bool, device=q.device)
    return attend_batch(
        layer, q[None], k[None], v[None], query_pos[None], valid, sinks, alibi_slopes, sink_tokens
    )[0, :rows]


def attend_batch(
    layer: LayerConfig,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_pos: torch.Tensor,
    key_valid: torch.Tensor,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    sink_tokens: int = 0,
) -> torch.Tensor:
    """Batched attention in float32: q `[B, L, Hq, D]` at `query_pos [B, L]`, k/v
    `[B, S, Hkv, D]` at positions `0..S-1` where `key_valid [B, S]`. Returns `[B, L, Hq, D]`."""
    group = layer.num_heads // layer.num_kv_heads
    kf = k.float().repeat_interleave(group, dim=2)
    vf = v.float().repeat_interleave(group, dim=2)
    scores = torch.einsum("blhd,bshd->bhls", q.float(), kf) * layer.scale
    if layer.logits_soft_cap is not None:
        scores = layer.logits_soft_cap * torch.tanh(scores / layer.logits_soft_cap)
    key_pos = torch.arange(k.shape[1], device=q.device)
    if alibi_slopes is not None:
        distance = key_pos - query_pos[..., None]  # [B, L, S]
        scores = scores + alibi_slopes.float()[None, :, None, None] * distance[:, None]
    mask = attention_mask(layer, query_pos, key_pos, sink_tokens) & key_valid[:, None, :]
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    # Keys no query may see can hold anything (stale or aliased blocks, even NaN bits), and
    # 0 * NaN = NaN: zero their values.
    visible = mask.any(dim=1)  # [B, S]
    vf = vf.masked_fill(~visible[:, :, None, None], 0.0)
    if sinks is not None:  # a learned per-head logit that takes probability mass, no value
        # first, so its place in the softmax is the same however many keys the step reads
        sink_col = sinks.float()[None, :, None, None].expand(*scores.shape[:3], 1)
        probs = torch.softmax(torch.cat([sink_col, scores], dim=-1), dim=-1)[..., 1:]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.einsum("bhls,bshd->blhd", probs, vf).to(q.dtype)
