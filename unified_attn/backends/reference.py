"""The reference backend: plain torch, any device, every feature. The correctness oracle.

Readable rather than fast: attention is computed per request in float32 with an explicit mask.
`prep_forward` turns the batch into index tensors once per step; `forward` only indexes, writes
the cache and computes.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from unified_attn.backend import (
    AttentionBackend,
    AttentionType,
    CommonAttentionMetadata,
    LayerConfig,
)
from unified_attn.selector import SelectorConfig, register_backend


@register_backend(priority={"cpu": 100, "cuda": 10})
class ReferenceAttentionBackend(AttentionBackend):
    name = "reference"

    @classmethod
    def validate_configuration(cls, cfg: SelectorConfig) -> list[str]:
        reasons = []
        if cfg.attn_type == AttentionType.ENCODER_DECODER:
            reasons.append("cross-attention (encoder_decoder) is not supported")
        if cfg.kv_cache_dtype not in ("auto", cfg.dtype):
            reasons.append(f"KV-cache dtype {cfg.kv_cache_dtype} must equal the model dtype")
        return reasons

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        return True  # each request is computed on its own

    def prep_forward(
        self,
        common: CommonAttentionMetadata,
        block_tables: dict[int, torch.Tensor],
        for_cudagraph_capture: bool = False,
    ) -> None:
        self.common = common
        qsl = common.query_start_loc_cpu.tolist()
        self.query_ranges = list(itertools.pairwise(qsl))[: common.num_reqs]
        self.seq_lens = common.seq_lens_cpu.tolist()[: common.num_reqs]
        self.computed = common.num_computed_tokens_cpu.tolist()[: common.num_reqs]
        device = common.positions.device
        self.writes: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.key_index: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for gid in set(self.group_of_layer.values()):
            block_size = self._block_size(gid)
            slots = common.slot_mappings[gid][: common.num_actual_tokens].cpu()
            rows = torch.nonzero(slots >= 0).flatten()
            self.writes[gid] = (
                rows.to(device),
                (slots[rows] // block_size).to(device),
                (slots[rows] % block_size).to(device),
            )
            table = block_tables[gid].cpu()
            keys = []
            for i, seq_len in enumerate(self.seq_lens):
                pos = torch.arange(seq_len)
                blocks = table[i, pos // block_size].long()
                keys.append((blocks.to(device), (pos % block_size).to(device)))
            self.key_index[gid] = keys

    def _block_size(self, gid: int) -> int:
        for name, group in self.group_of_layer.items():
            if group == gid:
                return self.kv_caches[name].shape[2]
        raise KeyError(f"no layer of this backend is in KV-cache group {gid}")

    def forward(
        self,
        layer: LayerConfig,
        output: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        **kwargs: Any,
    ) -> torch.Tensor:
        q, k, v = self.check_forward_inputs(layer, output, query, key, value)
        sinks, alibi = kwargs.get("sinks"), kwargs.get("alibi_slopes")
        out = output.view(q.shape)
        if layer.attn_type in (AttentionType.ENCODER, AttentionType.ENCODER_ONLY):
            for start, end in self.query_ranges:
                out[start:end] = attend(
                    layer, q[start:end], k[start:end], v[start:end], 0, sinks, alibi
                )
            return output
        gid = self.group_of_layer[layer.name]
        cache = self.kv_caches[layer.name]  # [num_blocks, 2, block_size, Hkv, D]
        rows, blocks, offsets = self.writes[gid]
        cache[blocks, 0, offsets] = k[rows]
        cache[blocks, 1, offsets] = v[rows]
        for i, (start, end) in enumerate(self.query_ranges):
            key_blocks, key_offsets = self.key_index[gid][i]
            k_seq = cache[key_blocks, 0, key_offsets]  # [S, Hkv, D]
            v_seq = cache[key_blocks, 1, key_offsets]
            out[start:end] = attend(
                layer, q[start:end], k_seq, v_seq, self.computed[i], sinks, alibi
            )
        return output


def attention_mask(
    layer: LayerConfig, query_pos: torch.Tensor, key_pos: torch.Tensor
) -> torch.Tensor:
    """`[L, S]` True where query i may attend to key j."""
    diff = query_pos[:, None] - key_pos[None, :]
    allowed = diff >= 0 if layer.causal else torch.ones_like(diff, dtype=torch.bool)
    if layer.sliding_window is not None:  # a query sees itself plus W - 1 earlier keys
        allowed &= diff < layer.sliding_window
        if not layer.causal:
            allowed &= diff > -layer.sliding_window
    if layer.chunk_size is not None:
        allowed &= (query_pos[:, None] // layer.chunk_size) == (
            key_pos[None, :] // layer.chunk_size
        )
    return allowed


def attend(
    layer: LayerConfig,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    first_query_pos: int,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of queries `[L, Hq, D]` at positions `first_query_pos + i` over keys/values
    `[S, Hkv, D]` at positions `0..S-1`, in float32. Returns `[L, Hq, D]` in q's dtype."""
    group = layer.num_heads // layer.num_kv_heads
    qf = q.float()
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("lhd,shd->hls", qf, kf) * layer.scale  # [Hq, L, S]
    if layer.logits_soft_cap is not None:
        scores = layer.logits_soft_cap * torch.tanh(scores / layer.logits_soft_cap)
    query_pos = torch.arange(q.shape[0], device=q.device) + first_query_pos
    key_pos = torch.arange(k.shape[0], device=q.device)
    if alibi_slopes is not None:
        scores = scores + alibi_slopes.float()[:, None, None] * (key_pos - query_pos[:, None])
    scores = scores.masked_fill(~attention_mask(layer, query_pos, key_pos), float("-inf"))
    if sinks is not None:  # a learned per-head logit that takes probability mass, no value
        sink_col = sinks.float()[:, None, None].expand(-1, q.shape[0], 1)
        probs = torch.softmax(torch.cat([scores, sink_col], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hls,shd->lhd", probs, vf).to(q.dtype)
