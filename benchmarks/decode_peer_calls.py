"""How vLLM 0.33 runs a decode batch through its Triton paged attention, for the same-run peer of
`decode_fixed_cost.py`: `unified_attention` of `v1/attention/ops/triton_unified_attention.py`
(copied into the git-ignored `benchmarks/peers/vllm_attn` by `vllm_peers.py`), called with the
arguments `TritonAttentionImpl.forward` passes and the split-K ("3D") scratch and threshold that
`TritonAttentionMetadataBuilder` prepares:

- KV cache in vLLM's default layout (LBNHC; a layer's view `[blocks, page, Hkv, 2 * D]`, each
  head's K and V side by side; `forward` splits the last dim into the `k` and `v` views), or,
  where there is no room for that copy, our `[blocks, 2, page, Hkv, D]` cache's K and V views
  (the op takes any strides);
- `seq_threshold_3D` = the CUDA-graph capture size nearest to `128 // Hkv` (vLLM's default
  full-and-piecewise graphs, default capture sizes): 16 at 8 KV heads, so batches of <= 16
  decode requests take the 3D path, 16 softmax segments, reduced by `reduce_segments`;
- scratch `[min(threshold, max_num_seqs), Hq, 16, next_pow2(D)]` float32 (and the `max` and
  `expsum` rows), allocated once as the builder does (not the SM120-only 64-segment variant);
- `k_descale` / `v_descale`: the layer's unit scales expanded to `[num_reqs, Hkv]`, no sinks,
  ALiBi, soft cap (0), window (-1, -1), output scale or tensor descriptors, `KVQuantMode.NONE`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from attn_bench.timing import free_bytes

MIN_LAUNCH_GRID_SIZE_2D = 128  # vLLM's triton_attn.py
NUM_PAR_SOFTMAX_SEGMENTS = 16
MAX_NUM_SEQS = 256  # vLLM's default scheduler limit on a GPU
# vLLM's default CUDA-graph capture sizes (config/vllm.py, max capture size 512)
CAPTURE_SIZES = [1, 2, 4, *range(8, 256, 8), *range(256, 513, 16)]


def load_vllm_attn() -> Any | None:
    """The copied `triton_unified_attention` module, or None without `benchmarks/peers`."""
    try:
        from peers.vllm_attn import triton_unified_attention
    except ImportError:
        return None
    return triton_unified_attention


def seq_threshold_3d(num_kv_heads: int) -> int:
    """The builder's split-K threshold under CUDA graphs: the capture size nearest to the
    request count whose 2D grid reaches 128 programs."""
    target = MIN_LAUNCH_GRID_SIZE_2D // num_kv_heads
    return min(CAPTURE_SIZES, key=lambda size: abs(size - target))


@dataclasses.dataclass
class VllmScratch:
    """`TritonAttentionMetadataBuilder`'s persistent split-K buffers and thresholds."""

    seq_threshold_3d: int
    segments: int
    output: torch.Tensor  # [rows, Hq, segments, head_pad] float32
    max: torch.Tensor  # [rows, Hq, segments] float32
    expsum: torch.Tensor


def vllm_scratch(
    num_q_heads: int, num_kv_heads: int, head_size: int, device: torch.device
) -> VllmScratch:
    threshold = seq_threshold_3d(num_kv_heads)
    rows = min(threshold, MAX_NUM_SEQS)  # x 1 query token: no speculative decoding
    segments = NUM_PAR_SOFTMAX_SEGMENTS
    pad = 1 << (head_size - 1).bit_length()
    f32 = {"dtype": torch.float32, "device": device}
    return VllmScratch(
        threshold,
        segments,
        torch.empty(rows, num_q_heads, segments, pad, **f32),
        torch.empty(rows, num_q_heads, segments, **f32),
        torch.empty(rows, num_q_heads, segments, **f32),
    )


def uses_3d(num_reqs: int, num_q_heads: int, num_kv_heads: int, scratch: VllmScratch) -> bool:
    """Whether vLLM's op takes its split-K path for `num_reqs` one-token requests (its rule:
    `num_seqs * cdiv(max_seqlen_q, BLOCK_Q) <= seq_threshold_3D`, enough scratch rows)."""
    qpk = num_q_heads // num_kv_heads
    block_m = 16 if qpk <= 16 else 1 << (qpk - 1).bit_length()
    block_q = block_m // qpk
    return num_reqs * -(-1 // block_q) <= scratch.seq_threshold_3d and (
        scratch.max.shape[0] >= num_reqs
    )


def vllm_kv_cache(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The pages of our `[blocks, 2, page, Hkv, D]` cache copied into vLLM's default layout
    `[blocks, page, Hkv, 2 * D]`, as the `k` and `v` views its `forward` passes."""
    blocks, _, page, heads, dim = cache.shape
    kv = torch.empty(blocks, page, heads, 2 * dim, dtype=cache.dtype, device=cache.device)
    kv[..., :dim] = cache[:, 0]
    kv[..., dim:] = cache[:, 1]
    return kv[..., :dim], kv[..., dim:]


def vllm_decode_call(
    op: Any,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    *,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    max_seq_len: int,
    scale: float,
    scratch: VllmScratch,
) -> Callable[[], torch.Tensor]:
    """`op.unified_attention` as `TritonAttentionImpl.forward` calls it for a decode batch
    (`q [B, Hq, D]`, one token per request)."""
    unit = torch.ones(1, dtype=torch.float32, device=q.device)  # layer._k_scale, _v_scale
    descale = unit.expand(seq_lens.shape[0], k.shape[2])

    def call() -> torch.Tensor:
        op.unified_attention(
            q=q, k=k, v=v, out=out, cu_seqlens_q=query_start_loc, max_seqlen_q=1,
            seqused_k=seq_lens, max_seqlen_k=max_seq_len, softmax_scale=scale, causal=True,
            alibi_slopes=None, use_alibi_sqrt=False, window_size=(-1, -1),
            block_table=block_table, softcap=0, q_descale=None, k_descale=descale,
            v_descale=descale, seq_threshold_3D=scratch.seq_threshold_3d,
            num_par_softmax_segments=scratch.segments, softmax_segm_output=scratch.output,
            softmax_segm_max=scratch.max, softmax_segm_expsum=scratch.expsum, sinks=None,
            output_scale=None, mm_prefix_range=None, rswa_prefix_lens=None, rswa_window=None,
            kv_quant_mode=op.KVQuantMode.NONE, k_scale_cache=None, v_scale_cache=None,
            chunk_lookback=-1, use_td=False, mm_prefix_clamp_sliding_window=False,
        )  # fmt: skip
        return out

    return call


def vllm_calls(case: Any, op: Any, layout: str) -> tuple[list[Callable], torch.Tensor, dict]:
    """vLLM's op over the pages of each of `case.caches` (a `decode_fixed_cost.Case`), in its
    own layout (`layout` "vllm") when there is room for the copies, else in ours."""
    p = case.p
    scratch = vllm_scratch(p["heads"], p["kv_heads"], p["head_size"], case.device)
    info = {"path": "3D" if uses_3d(case.batch, p["heads"], p["kv_heads"], scratch) else "2D",
            "seq_threshold_3D": scratch.seq_threshold_3d, "segments": scratch.segments,
            "kv_layout": layout}  # fmt: skip
    kvs: list[tuple[torch.Tensor, torch.Tensor]] = []
    if layout == "vllm":
        need = sum(c.numel() * c.element_size() for c in case.caches) + (1 << 30)
        if case.device.type == "cuda" and free_bytes() < need:
            info["kv_layout"] = "ours (no room for a copy in vLLM's layout)"
        else:
            try:
                kvs = [vllm_kv_cache(c) for c in case.caches]
            except torch.OutOfMemoryError:
                kvs = []
                torch.cuda.empty_cache()
                info["kv_layout"] = "ours (the copy in vLLM's layout ran out of memory)"
    if not kvs:
        kvs = [(c[:, 0], c[:, 1]) for c in case.caches]
    out = torch.empty_like(case.q)
    calls = [vllm_decode_call(op, case.q, k, v, out, query_start_loc=case.qsl,
                              seq_lens=case.seq_lens, block_table=case.table,
                              max_seq_len=case.ctx, scale=case.scale, scratch=scratch)
             for k, v in kvs]  # fmt: skip
    return calls, out, info
