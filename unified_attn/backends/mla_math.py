"""MLA's plain-torch math, the oracles of kernel backends: `absorb_query` (the weight-absorbed
query), `reference_write_latent` and `reference_absorbed_attention` (the two seams of
`MLAReferenceBackend`, which kernel backends replace: device tensors only, no host sync), and
`up_projected_attention` (one request's prefill through per-head keys and values).
`backends/mla.py` states the cache layout and the shapes.
"""

from __future__ import annotations

import torch

from unified_attn.backend import LayerConfig
from unified_attn.backends.reference import attention_mask


def absorb_query(q: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """q `[T, H, N + R]`, W_UK `[H, N, L]` -> q_abs `[T, H, L + R]` = `[q_nope @ W_UK, q_pe]`.

    One batched GEMM over the heads writes q_nope @ W_UK straight into q_abs, in q's dtype (a
    16-bit GEMM accumulates in float32 and its output is rounded to q's dtype anyway):
    converting W_UK to float32 would copy the whole weight on every call, 33 MB per layer at
    DeepSeek-V3's shape."""
    tokens, heads, width = q.shape
    nope, latent = w_uk.shape[1], w_uk.shape[2]
    q_abs = q.new_empty(tokens, heads, latent + width - nope)
    torch.bmm(q[..., :nope].transpose(0, 1), w_uk.to(q.dtype),
              out=q_abs[..., :latent].transpose(0, 1))  # fmt: skip
    q_abs[..., latent:] = q[..., nope:]
    return q_abs


def project_latent_out(latent_out: torch.Tensor, w_uv: torch.Tensor, out: torch.Tensor) -> None:
    """`out [T, H, V]` = the attention's latent output `[T, H, L]` @ W_UV `[H, L, V]` per head:
    one batched GEMM in the latents' dtype (no float32 copy of W_UV per call); `out` may be a
    strided view (the layer's output), written in place."""
    torch.bmm(latent_out.transpose(0, 1), w_uv.to(latent_out.dtype), out=out.transpose(0, 1))


def reference_write_latent(
    latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """`cache [num_blocks, bs, L + R]` at `slot_mapping [T]` int64 <- `latent [T, L + R]`; rows
    with slot -1 leave the cache unchanged. No host sync: padding rows rewrite slot 0 (the null
    block, which no request owns) with its own contents."""
    if latent.shape[0] != slot_mapping.shape[0]:
        raise ValueError(
            f"write_latent: {latent.shape[0]} latent rows for {slot_mapping.shape[0]} slots; "
            "give one slot per row"
        )
    block_size = cache.shape[1]
    padding = (slot_mapping < 0)[:, None]
    slots = slot_mapping.clamp(min=0)
    blocks, offsets = slots // block_size, slots % block_size
    new = latent.to(cache.dtype)
    if cache.element_size() == 1:  # fp8: select on the bytes (no float8 `where` on every device)
        cache, new = cache.view(torch.uint8), new.view(torch.uint8)
    old = cache[blocks, offsets]
    cache[blocks, offsets] = torch.where(padding, old, new)


def reference_absorbed_attention(
    q_abs: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    *,
    sliding_window: int | None = None,
    kv_scale: torch.Tensor | None = None,
) -> None:
    """Paged causal MLA in float32 over the latent cache, device tensors only (no host sync);
    an fp8 cache is dequantized with the 0-dim float32 `kv_scale`.

    Request b owns query rows `[query_start_loc[b], query_start_loc[b + 1])`, the last of them
    at position `seq_lens[b] - 1`, and keys `0..seq_lens[b] - 1` at `block_table[b]`. A query at
    position p sees keys `0..p` (with a window W: `p - W + 1..p`). `out [T, H, L]` gets the
    softmax-weighted sum of the first L values of the visible latents; rows past
    `query_start_loc[B]` get 0."""
    num_tokens, num_reqs = q_abs.shape[0], block_table.shape[0]
    if num_reqs == 0:
        out.zero_()
        return
    rank = out.shape[-1]
    rows = torch.arange(num_tokens, device=q_abs.device, dtype=query_start_loc.dtype)
    request = torch.searchsorted(query_start_loc[1:].contiguous(), rows, right=True)  # [T]
    valid = request < num_reqs
    request = request.clamp(max=num_reqs - 1)
    pos = seq_lens[request] - (query_start_loc[request + 1] - rows)  # [T] absolute positions
    key_pos = torch.arange(block_table.shape[1] * cache.shape[1], device=q_abs.device)  # [S]
    mask = (key_pos <= pos[:, None]) & valid[:, None]  # [T, S]
    if sliding_window is not None:
        mask &= key_pos > pos[:, None] - sliding_window
    latents = cache[block_table.long()].flatten(1, 2)  # [B, S, L + R]
    keys = latents[request].float()
    if kv_scale is not None:
        keys = keys * kv_scale
    # Keys no query sees may be stale or aliased blocks (even NaN bits): zero them.
    keys = keys.masked_fill(~mask[:, :, None], 0.0)  # [T, S, L + R]
    scores = torch.einsum("thd,tsd->ths", q_abs.float(), keys) * scale
    scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).masked_fill(~valid[:, None, None], 0.0)
    out.copy_(torch.einsum("ths,tsl->thl", probs, keys[..., :rank]).to(out.dtype))


def up_projected_attention(
    layer: LayerConfig,
    q: torch.Tensor,
    latents: torch.Tensor,
    first_query_pos: int,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
) -> torch.Tensor:
    """One request, without absorption: its latents `[S, L + R]` (positions 0..S-1) expanded to
    per-head keys `[S, H, N + R]` and values `[S, H, V]`, attended by q `[Lq, H, N + R]` at
    positions `first_query_pos + i` in float32. Returns `[Lq, H, V]` in q's dtype."""
    rank, heads = w_uk.shape[2], q.shape[1]
    query_pos = torch.arange(q.shape[0], device=q.device) + first_query_pos
    key_pos = torch.arange(latents.shape[0], device=q.device)
    mask = attention_mask(layer, query_pos, key_pos)  # [Lq, S]
    visible = mask.any(dim=0)[:, None]  # stale keys (outside every window) may hold NaN bits
    latents = latents.float().masked_fill(~visible, 0.0)
    c, k_pe = latents[:, :rank], latents[:, rank:]
    k_nope = torch.einsum("sl,hnl->shn", c, w_uk.float())
    keys = torch.cat([k_nope, k_pe[:, None].expand(-1, heads, -1)], dim=-1)  # [S, H, N + R]
    values = torch.einsum("sl,hlv->shv", c, w_uv.float())  # [S, H, V]
    scores = torch.einsum("qhd,shd->hqs", q.float(), keys) * layer.scale
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.einsum("hqs,shv->qhv", probs, values).to(q.dtype)
